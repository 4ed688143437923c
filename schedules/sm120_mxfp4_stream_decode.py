"""SM12x W4A16 decode on MXFP4 weights (BF16 activations): the weight-streaming kernel.

The packed MXFP4 weight (``cute_fp4.packed.repack``) streamed and decoded in registers as
NVFP4's, with its UE8M0 scale decode (tables of v / 2, the scale byte plus one on BF16's
exponent: ``v * 2^(e - 127)`` exactly); one scale word serves two 64-K units. MXFP4's
scale range is beyond FP16's, so the activations are BF16.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_120a", tile_m=8, split_k=4)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
