"""Hopper W4A16 decode on MXFP4 weights (gpt-oss's dense layers at batch 1..8).

The stream kernel of sm90_stream_decode on a packed MXFP4 weight: the same bytes of codes
per weight element and half the scale bytes of NVFP4 (one UE8M0 per 32), decoded to BF16
by the same table lookup with MXFP4's scale decode.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, split_k=4)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
