"""SM120 W4A16 decode (M <= 8): the weight-streaming kernel with 16-bit activations, so a
decode step needs no activation quantize.

SM120's block-scaled MMA takes FP4 activations only; this kernel decodes the packed NVFP4
weight to BF16/FP16 in registers and multiplies it with warp-level mma.sync (HMMA), the
same kernel as sm_90a's (schedules/sm90_stream_decode.py): 64 weight rows x 8 activation
rows per CTA, K split over 4 CTAs, 37 KiB of shared memory (cp.async rings), well inside
the 99 KiB of a block.
"""

from cute_fp4.planning.stream import stream_schedule

SCHEDULE = stream_schedule("sm_120a", tile_m=8, split_k=4)
