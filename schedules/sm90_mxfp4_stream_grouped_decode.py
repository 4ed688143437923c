"""Hopper MoE experts at decode on MXFP4 weights (gpt-oss's experts, 1..16 tokens).

The grouped stream kernel (experts' rows from device offsets, an expert without tokens
costs nothing but a CTA that exits) on packed MXFP4 expert stacks; BF16 activations.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
