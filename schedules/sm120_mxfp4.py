"""SM12x W4A4 on MXFP4 (gpt-oss's format): the block-scaled MMA's ``kind::mxf4``.

OCP MXFP4 operands (E2M1, one UE8M0 scale per 32 elements, no global scale) run the same
warp-specialized kernel as NVFP4 with the MMA ``mma.sync ... kind::mxf4.block_scale
.scale_vec::2X ... ue8m0`` (SASS ``OMMA.SF.16864.F32.E2M1.E2M1.E8``): the format is the
problem's (``Problem(a_format="mxfp4", b_format="mxfp4")``), the kernel reads it from the
format descriptor. A 512-byte scale atom covers 128 K of MXFP4, so the K tile is a
multiple of 128; a stage's scales are half NVFP4's (87,040 B for three stages here).
"""

from cute_fp4.schedule import Problem, Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128))
PROBLEM = Problem(a_format="mxfp4", b_format="mxfp4")  # W4A4: MXFP4 activations
