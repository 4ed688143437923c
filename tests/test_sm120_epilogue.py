"""The SM120 epilogue stores every accumulator element at its own (m, n), on the CPU.

Traces (no GPU) the kernel's tiled MMA and register -> shared copy, and follows each
thread's accumulator values through the epilogue's index arithmetic
(``kernels/epilogue.store_smem_tma``) to the epilogue-tile coordinate the copy writes them to.
A one-value copy atom (FP32 output, split-K partials) once misplaced 3/4 of the tile.
"""

from __future__ import annotations

import pytest

from cute_fp4.errors import ScheduleError
from cute_fp4.schedule import Epilogue, OutDtype, Schedule, Tile, WarpRoles, Warps

pytestmark = pytest.mark.compile

CASES = {
    "default_bf16": Schedule(tile=Tile(128, 128, 128)),
    "epi64x32_fp16": Schedule(epilogue=Epilogue(out_dtype=OutDtype.FP16, tile=(64, 32))),
    "decode_splitk_fp32": Schedule(tile=Tile(64, 128, 128), warps=Warps(mma=(2, 4)),
                                   split_k=4),
    "pingpong_fp32": Schedule(warps=Warps(roles=WarpRoles.PINGPONG, mma=(2, 2)),
                              epilogue=Epilogue(out_dtype=OutDtype.FP32, tile=(64, 32))),
    "128x64": Schedule(tile=Tile(128, 64, 128)),
}


def _misplaced(schedule):
    import cutlass.cute as cute

    from cute_fp4.kernels.sm120 import Sm120Gemm

    k = Sm120Gemm(schedule)
    out = {}

    def walk():
        k._setup()
        tm, tn, _ = k.tile_mnk
        em, en = k.epi_tile
        r2s = k._r2s_copy()
        bad, seen = 0, set()
        for t in range(k.group_threads):
            acc = r2s.retile(k.tiled_mma.get_slice(t).partition_C(
                cute.make_identity_tensor((tm, tn))))
            epi = r2s.get_slice(t).partition_S(cute.make_identity_tensor((em, en)))
            per_m = em // (tm // cute.size(acc, mode=[1]))
            per_n = en // (tn // cute.size(acc, mode=[2]))
            for bm in range(tm // em):
                for bn in range(tn // en):
                    for i in range(per_m):
                        for j in range(per_n):
                            src = acc[(None, bm * per_m + i, bn * per_n + j)]
                            dst = epi[(None, i, j)]
                            for e in range(cute.size(dst)):
                                want = (bm * em + dst[e][0], bn * en + dst[e][1])
                                seen.add(want)
                                bad += tuple(src[e]) != want
        out["bad"], out["missing"] = bad, tm * tn - len(seen)

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options="--gpu-arch sm_120a")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_epilogue_places_every_accumulator(name):
    assert _misplaced(CASES[name]) == {"bad": 0, "missing": 0}


@pytest.mark.parametrize("s", [
    Schedule(tile=Tile(96, 128, 128), warps=Warps(mma=(2, 2))),  # straddles scale atoms
    Schedule(warps=Warps(mma=(8, 1))),  # one warp along N: permuted columns
    Schedule(epilogue=Epilogue(tile=(32, 64))),  # fewer rows than one MMA sub-tile
    Schedule(epilogue=Epilogue(tile=(64, 16))),  # splits the 2 x 16 column interleave
])
def test_silently_wrong_shapes_are_refused(s):
    from cute_fp4.kernels.sm120 import Sm120Gemm
    from cute_fp4.plan import plan

    assert not plan(s).ok  # refused up front, for the CLI, the tuner and the API alike
    with pytest.raises(ScheduleError):
        Sm120Gemm(s)
