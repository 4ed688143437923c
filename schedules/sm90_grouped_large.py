"""Hopper MoE experts (W4A16, W4A4), large prefill (192+ rows per expert): grouped
rs_packed with 256 token rows x 128 weight rows, the dense sm90_rs_packed tile.

With many tokens per expert the GEMM is compute-bound and the weight decode in registers
is paid once per token tile: 256 token rows (WGMMA N = 256, the widest) spread that cost
over the most MMAs, at the price of more ragged-tail waste, which is small when an expert
averages hundreds of rows. Measured on the H200 (perf/tools/grouped_tiles.py, 2026-12-01):
Qwen3-30B-A3B experts at 4096 tokens x top-8 (256 rows each) 0.93-0.97x torch BF16
grouped_mm (192 x 128: 0.86-0.90x); 16384 tokens on Qwen3 / DeepSeek-V3 experts 0.88-0.95x
(128 x 256: 0.84-0.89x).
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(256, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
