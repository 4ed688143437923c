"""Hopper MoE experts at decode on MXFP4 weights with eight warps per CTA over the K units
(gpt-oss at one token: 4 experts x 90 or 45 weight blocks).

The grouped stream kernel of schedules/sm90_mxfp4_stream_grouped_decode.py with eight warps
taking a block's K units in turn instead of four (the first four sum the eight partials
and store): twice the decode work per CTA (118 registers per thread, two CTAs per SM), one
K unit per batch of each warp's ring as there. Profile on the H200
(perf/results/2026-12-06-h200-gpt-oss.md): at one token the four-warp kernel with two
units per batch kept 5.6 warps per SM busy on the down GEMM and read at 23% of the DRAM
peak.

H100, 2026-12-06, both GEMMs of a gpt-oss layer back to back at one token
(perf/tools/gpt_oss_sweep.py, same run; perf/results/2026-12-06-h100-stream-stages.md):
0.95x its own time with two units per batch, but 1.08x the four-warp kernel with one;
each GEMM alone it is the faster of the two. Inside the experts layer, where the gate_up
GEMM follows the gather (perf/results/2026-12-06-h100-gpt-oss-pairs.md): for the down GEMM
alone at one token (180 CTAs) the layer takes 0.96x its time with the four-warp kernel,
for both GEMMs 1.05x. "auto" takes it for grids of at most 200 CTAs
(``GroupedAuto.stream_few``, cute_fp4.tuning): the down GEMM at one token.
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, warps=8, stages=1)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
