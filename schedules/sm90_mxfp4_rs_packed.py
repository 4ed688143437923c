"""Hopper W4A16 on MXFP4 weights, mid and large M: the register-sourced packed mainloop.

The packed MXFP4 weight is WGMMA's A operand, decoded in registers (UE8M0 scales: tables of
v / 2 times the BF16 ``2^(e - 126)``); BF16 activations TMA'd into WGMMA's B layout. A
512-byte scale atom covers 128 K of MXFP4, so the K tile is 128 (each row's scale word
serves two 64-K units); 256 weight rows over two warpgroups, four stages.
"""

from cute_fp4.schedule import Problem, Schedule, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(128, 256, 128), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed")
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
