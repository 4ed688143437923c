"""Hopper MoE experts at decode on MXFP4 weights when the routed experts' CTAs are few
(gpt-oss at one token: 4 experts x 90 or 45 weight blocks).

The grouped stream kernel of schedules/sm90_mxfp4_stream_grouped_decode.py with four K units
per batch of a warp's ring instead of two: 2 x 4 x 4 x 2,304 = 73,728 bytes of shared
memory, three CTAs per SM, up to 16 KiB of weight in flight per warp. With at most three
CTAs per SM to run, more bytes in flight per warp beat more resident CTAs: H200, 2026-12-06,
both GEMMs of a gpt-oss experts layer at one token 0.89-0.90x the two-unit ring's time;
1.06-1.14x at 4 and 16 tokens, where the CTAs are many. On an H100 at one token it gained
4-6% where eight warps per CTA gained 10-14% (sm90_mxfp4_stream_grouped_decode_w8, what
"auto" takes there: cute_fp4.tuning, ``GroupedAuto.stream_few``).
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, stages=4)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
