"""Hopper MoE experts (W4A16) at decode with a long K: the grouped stream kernel of
schedules/sm90_stream_grouped_decode.py with two K units per batch of each warp's ring.

With K = 7168 (DeepSeek-V3's gate_up) a warp streams 28 units of a block, and the deeper
ring keeps more bytes in flight: H100, 2026-12-06
(perf/results/2026-12-06-h100-nvfp4-stream-stages.md), one unit per batch took 1.08x this
ring's time on DeepSeek-V3's gate_up at 4 tokens. "auto" takes it past the short kernel's
K (cute_fp4.tuning, ``GroupedAuto.stream_long_k``).
"""

from cute_fp4.planning.stream import stream_schedule

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, stages=2)
