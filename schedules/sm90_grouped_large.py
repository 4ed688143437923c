"""Hopper MoE experts (W4A16, W4A4), large prefill (hundreds of tokens per expert):
grouped rs_packed with 256 token rows x 128 weight rows, the dense sm90_rs_packed tile.

With many tokens per expert the GEMM is compute-bound and the weight decode in registers
is paid once per token tile: 256 token rows (WGMMA N = 256, the widest) halve that cost per
MMA against sm90_grouped's 128, at the price of more ragged-tail waste, which is small when
an expert averages 512+ rows. Measured on the H200 (perf/grouped_tiles.py, 2026-12-01,
16384 tokens x top-8): 0.88-0.95x torch BF16 grouped_mm on Qwen3-30B-A3B / DeepSeek-V3
expert shapes, against 0.84-0.89x for 128 x 256; at 4096 tokens sm90_grouped is as fast or
faster.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(256, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
