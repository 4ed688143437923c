"""Hopper MoE experts on MXFP4 weights (gpt-oss prefill): the grouped rs_packed kernel.

sm90_grouped's grouped scheduler and register-sourced mainloop (192 activation rows per
tile) on packed MXFP4 expert stacks with BF16 activations; tile K 128 (whole MXFP4 scale
atoms), four stages.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(192, 128, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
