"""Hopper MoE experts at decode on MXFP4 weights with eight warps per CTA over the K units,
for grids of few CTAs (gpt-oss at one token: 4 experts x 90 or 45 weight blocks).

The grouped stream kernel of schedules/sm90_mxfp4_stream_grouped_decode.py with eight warps
taking a block's K units in turn instead of four (the first four sum the eight partials
and store): twice the decode work and loads in flight per CTA (128 registers per thread
against 107, so two CTAs per SM). Profile on the H200
(perf/results/2026-12-06-h200-gpt-oss.md): at one token the four-warp kernel keeps 5.6
warps per SM busy on the down GEMM and reads at 23% of the DRAM peak.

H100, 2026-12-06 (perf/results/2026-12-06-h100-w8-route.md): both GEMMs of a gpt-oss layer
at one token take 0.86-0.90x the four-warp kernel's time; each GEMM timed alone was not
faster, so the gain shows only with the two back to back, as a layer runs them (not
profiled yet). "auto" takes it for MXFP4 experts while the CTAs number at most three per
SM (cute_fp4.tuning, ``GroupedAuto.stream_few``).
"""

from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

SCHEDULE = stream_schedule("sm_90a", tile_m=8, grouped=True, warps=8)
PROBLEM = Problem(a_format="bf16", b_format="mxfp4")  # W4A16: BF16 activations
