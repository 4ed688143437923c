"""Hopper MoE experts (W4A16), prefill-sized groups: grouped rs_packed, 128 token rows.

Grouped: the persistent CTAs walk every expert's tiles from the device-side offsets of the
tokens sorted by expert (kernels/scheduler.py GroupedScheduler: no host sync, CUDA-graph
capturable). Each unit is 128 tokens of one expert against 128 rows of that expert's
fragment-order packed weight, the weight decoded in registers as in sm90_rs_packed; its D^T
is stored from registers, masked at the expert's last token (the tile's rows past it belong
to the next expert). 128 token rows (not 256) bound the waste of ragged experts: with 128
experts and 32k routed tokens an expert averages 256 rows.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
