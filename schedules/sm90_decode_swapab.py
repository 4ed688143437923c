"""Hopper decode, swap-AB: the NVFP4 weight is WGMMA's A operand, converted in registers.

At M <= 64 the GEMM streams the weight. sm90_decode (64x256x64, split-K 4) converts the
weight through shared memory and reduces split-K partials on the host. Here the weight plays
WGMMA's M: each CTA owns 64 weight rows (N = 8192 -> 128 CTAs, one per SM, no split-K), a
deep TMA pipeline of 256-wide K tiles keeps ~100 KB of packed weight in flight, each thread
loads its packed bytes from shared memory into registers and converts them straight into
the RS A-fragment (the 16-bit weight never touches shared memory), and only the few
activation rows (WGMMA's N = tile M = 16 here) are converted into shared memory, in the
permuted K order the register fragments imply. Two consumer warpgroups take alternate K
tiles and sum their accumulators at the end. The D^T tile is stored transposed.
api.heuristic() uses it for M <= 32 with tile M 8/16/32 (split-K 2 when N/64 leaves over
half the SMs idle and K >= 8192). Measured on H200, kernel only, L2 flushed, M = 1,
N = K = 8192: 28.6 us (W4A4) / 29.1 us (W4A16) vs 41.4 / 40.3 for sm90_decode (with its
reduction) and 44.6 for torch BF16. Tile M 64 spills and is slower than sm90_decode.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile, Warps

SCHEDULE = Schedule(target="sm_90a", tile=Tile(16, 64, 256), warps=Warps(mma=(1, 2)),
                    scheduler=Scheduler(persistent=False), swap_ab=True)
