"""Hopper MoE experts at decode on MXFP4 weights with a deep ring: the grouped stream kernel
of schedules/sm90_mxfp4_stream_grouped_decode.py with four K units per batch of a warp's
ring instead of one: 2 x 4 x 4 x 2,304 = 73,728 bytes of shared memory, three CTAs per
SM, up to 16 KiB of weight in flight per warp.

H200, 2026-12-06, both GEMMs of a gpt-oss experts layer: 0.89-0.90x the time of a
two-unit ring at one token, 1.06-1.14x at 4 and 16 tokens. On an H100 at one token it
gained 4-6% on the two-unit ring, which one unit per batch beats by 24%
(perf/results/2026-12-06-h100-stream-stages.md); "auto" does not take it.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, stages=4)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
