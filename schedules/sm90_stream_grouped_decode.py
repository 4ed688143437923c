"""Hopper MoE experts (W4A16) at decode: the weight-streaming kernel, grouped; one CTA per
(routed expert, 64 rows of its weight), 8 activation rows.

At decode each routed expert gets one to a few tokens (1-16 tokens x top-8 over 128-256
experts), so a grouped GEMM is the time to read the routed experts' weights. The grouped
stream kernel reads an expert's rows by the device offsets, gives every expert that has
rows its 64-row weight blocks (an expert without rows costs no CTA that reads anything),
and streams each block through the four warps' cp.async rings as the dense decode kernel
does (schedules/sm90_stream_decode.py), instead of the 16-row WGMMA tile the grouped
rs_packed decode schedule pads a one-token expert to. K is not split (the grouped launch
has no split-K workspace): a routed expert has at least as many blocks as N / 64 (24 for
Qwen3-30B-A3B's gate_up, 64 for DeepSeek-V3's). "auto" picks it while the experts average
few rows (cute_fp4.tuning, ``GroupedAuto``); the same kernel runs on sm_120a
(schedules/sm120_stream_grouped_decode.py).

One K unit per batch of each warp's ring (``stages=1``): with K up to 4096 a warp has at
most 16 units of a block to stream, and a deeper ring mostly delays its first decode.
H100, 2026-12-06 (perf/results/2026-12-06-h100-nvfp4-stream-stages.md): Qwen3-30B-A3B's
gate_up at 4 tokens 0.83x the two-unit ring's time, 1.0x at one token. A long K keeps two
units (schedules/sm90_stream_grouped_decode_long_k.py).
"""

from cute_fp4.planning.stream import stream_schedule

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, stages=1)
