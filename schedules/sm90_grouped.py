"""Hopper MoE experts (W4A16, W4A4), prefill-sized groups: grouped rs_packed, 128 x 256.

Grouped: the persistent CTAs walk every expert's tiles from the device-side offsets of the
tokens sorted by expert (kernels/scheduler.py GroupedScheduler: no host sync, CUDA-graph
capturable). Each unit is 128 tokens of one expert against 256 rows of that expert's
fragment-order packed weight (two consumer warpgroups of 128 rows, the weight decoded in
registers as in sm90_rs_packed); D^T is stored from registers, masked at the expert's last
token (the tile's rows past it belong to the next expert). 128 token rows (not 256) bound
the waste of ragged experts, 256 weight rows double the MMA work per activation load.
Measured on the H200 (2026-12-01, perf/grouped_tiles.py, 4096 tokens x top-8): 0.94-1.28x
torch BF16 grouped_mm on Qwen3-30B-A3B and DeepSeek-V3 expert shapes, ahead of 128x128
(0.89-1.22x) and 256x128 (0.93-1.13x).
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 256, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
