"""Hopper MoE experts at decode on MXFP4 weights (gpt-oss's experts, 1..16 tokens).

The grouped stream kernel (experts' rows from device offsets, an expert without tokens
costs nothing but a CTA that exits) on packed MXFP4 expert stacks; BF16 activations. Its
ring holds one K unit per batch (``stages=1``: two units in flight per warp, 18,432 bytes
of shared memory): a CTA streams one 64-row block (45 units at K = 2880, about 11 per
warp), so a deeper ring mostly delays each warp's first decode and keeps fewer CTAs
resident while the GEMM before drains (programmatic dependent launch).

H100, 2026-12-06, both GEMMs of a gpt-oss layer back to back (perf/tools/gpt_oss_sweep.py,
same run; perf/results/2026-12-06-h100-stream-stages.md): one unit per batch 0.76x the
two-unit ring's time at 1 token, 0.86-0.99x at 4 tokens and 0.90-0.93x at 16, with 32 and
128 experts; 0.92x the eight-warp variant's at 1 token.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, stages=1)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
