"""Hopper MoE experts (W4A16) at decode: grouped rs_packed, 16 tokens x 256 weight rows over
four consumer warpgroups.

At decode an expert gets a few tokens (16 tokens x top-8 over 128 experts: about one each),
so the work is streaming every routed expert's weight once, and decoding it (E2M1 x UE4M3
table lookups in registers) is what limits the SM: four consumer warpgroups of 64 weight
rows (16 warps) keep more decode chains in flight than two (2.4-2.7x torch BF16 grouped_mm
against 2.2-2.4x for 16x128x128 on Qwen3-30B-A3B / DeepSeek-V3 expert shapes, 16 and 64
tokens, H200, 2026-12-01, perf/tools/grouped_tiles.py). A 16-row token tile (WGMMA N = 16) keeps
the MMA work per weight byte and the accumulators small (81 registers, 0 spills under the
104-register split of 640 threads).
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(16, 256, 128), warps=Warps(mma=(4, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))
