"""Hopper MoE experts (W4A16, W4A4), prefill-sized groups (17-191 rows per expert):
grouped rs_packed, 192 token rows x 128 weight rows.

Grouped: the persistent CTAs walk every expert's tiles from the device-side offsets of the
tokens sorted by expert (kernels/scheduler.py GroupedScheduler: no host sync, CUDA-graph
capturable). Each unit is 192 tokens of one expert against 128 rows of that expert's
fragment-order packed weight (two consumer warpgroups of 64 rows, the weight decoded in
registers as in sm90_rs_packed); D^T is stored from registers, masked at the expert's last
token (the tile's rows past it belong to the next expert). 192 token rows (WGMMA N = 192)
amortise the decode over more MMAs than 128 while wasting less of a ragged expert than
256. Measured on the H200 (perf/tools/grouped_tiles.py, 2026-12-01, 4096 tokens x top-8 over
DeepSeek-V3's 256 experts, ~128 rows each): 1.36x torch BF16 grouped_mm, against 1.32-1.36x
for 128 x 256 (which spills 24 registers with the grouped scheduler) and 1.13x for 256 x 128.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(192, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
