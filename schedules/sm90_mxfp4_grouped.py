"""Hopper MoE experts on MXFP4 weights (gpt-oss prefill): the grouped rs_packed kernel.

sm90_grouped's grouped scheduler and register-sourced mainloop on packed MXFP4 expert
stacks with BF16 activations; tile K 128 (whole MXFP4 scale atoms) and 128 activation rows:
with K 128 a 192-row tile spills once the fused bias + swiglu_oai epilogue is added (29
words on sm_90a, 2026-12-06), 128 rows keep every variant at 0 spills; five stages.
"""

from cute_fp4.schedule import Problem, Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 128, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
