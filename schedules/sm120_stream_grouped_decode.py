"""SM120 MoE experts (W4A16) at decode: the grouped weight-streaming kernel, so a decode
step's expert GEMMs need no activation quantize.

SM120's block-scaled grouped kernels take FP4 activations only; this one decodes each
routed expert's packed NVFP4 weight to BF16/FP16 in registers and multiplies with
warp-level mma.sync (HMMA): the sm_90a kernel itself (schedules/sm90_stream_grouped_decode.py),
one CTA per (routed expert, 64 weight rows), 8 activation rows, 37 KiB of shared memory
(cp.async rings), well inside the 99 KiB of a block.
"""

from cute_fp4.planning.stream import stream_schedule

SCHEDULE = stream_schedule("sm_120a", tile_m=8, grouped=True)
