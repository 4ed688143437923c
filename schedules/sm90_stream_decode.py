"""Hopper W4A16 decode (M <= 8): the weight-streaming kernel, 64 weight rows x 8 activation
rows per CTA, K split over 4 CTAs.

At decode a GEMM's time is the time to read its weight. This kernel has no producer warp
and no WGMMA pipeline: each of four warps streams its own 2 KiB K units of the packed
weight through a cp.async ring and decodes them into warp-level mma.sync fragments, so
every SM has many small CTAs' worth of bytes in flight. "auto" picks the activation tile
(8 or 16 rows) and the split by M and the weight's shape (cute_fp4.api
.stream_decode_schedule). The same kernel runs on sm_120a (schedules/sm120_stream_decode.py).
"""

from cute_fp4.planning.stream import stream_schedule

SCHEDULE = stream_schedule("sm_90a", tile_m=8, split_k=4)
