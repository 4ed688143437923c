"""The staged epilogue stores every accumulator element at its own (m, n), on the CPU.

Traces (no GPU) each kernel family's tiled MMA and register -> shared copy, and follows
every thread's accumulator values through the shared epilogue's own sub-tile plan
(``kernels/epilogue.subtile_sources``, what ``store_smem_tma`` unrolls) to the
epilogue-tile coordinate the copy writes them to. A one-value copy atom (SM120 FP32
output, split-K partials) once misplaced 3/4 of the tile.
"""

from __future__ import annotations

import pytest

from cute_fp4.errors import ScheduleError
from cute_fp4.schedule import Epilogue, OutDtype, Schedule, Tile, WarpRoles, Warps

pytestmark = pytest.mark.compile

SM90_CASES = {
    "sm90_default_bf16": (Schedule(target="sm_90a", tile=Tile(128, 256, 64),
                                   warps=Warps(mma=(2, 1))), "bf16"),
    "sm90_128x128_w4a4": (Schedule(target="sm_90a", tile=Tile(128, 128, 64),
                                   warps=Warps(mma=(2, 1))), "nvfp4"),
    "sm90_epi128x32_fp16": (Schedule(target="sm_90a", tile=Tile(128, 128, 64),
                                    warps=Warps(mma=(2, 1)),
                                    epilogue=Epilogue(out_dtype=OutDtype.FP16, tile=(128, 32))),
                           "nvfp4"),
}

CASES = {
    "default_bf16": Schedule(tile=Tile(128, 128, 128)),
    "epi64x32_fp16": Schedule(epilogue=Epilogue(out_dtype=OutDtype.FP16, tile=(64, 32))),
    "decode_splitk_fp32": Schedule(tile=Tile(64, 128, 128), warps=Warps(mma=(2, 4)),
                                   split_k=4),
    "pingpong_fp32": Schedule(warps=Warps(roles=WarpRoles.PINGPONG, mma=(2, 2)),
                              epilogue=Epilogue(out_dtype=OutDtype.FP32, tile=(64, 32))),
    "128x64": Schedule(tile=Tile(128, 64, 128)),
}


def _misplaced(schedule, a_format="nvfp4"):
    import cutlass.cute as cute

    from cute_fp4.compile import kernel_class
    from cute_fp4.kernels.epilogue import subtile_sources
    from cute_fp4.schedule import Problem

    k = kernel_class(schedule)(schedule, Problem(a_format=a_format))
    out = {}

    def walk():
        k._setup()
        tm, tn = schedule.tile.m, schedule.tile.n
        em, en = k.epi_tile
        r2s = k._r2s_copy()
        threads = k.warps.mma_threads // schedule.warps.groups
        plan = subtile_sources(r2s, k.tiled_mma, (tm, tn), (em, en))
        bad, seen = 0, set()
        for t in range(threads):
            acc = r2s.retile(k.tiled_mma.get_slice(t).partition_C(
                cute.make_identity_tensor((tm, tn))))
            epi = r2s.get_slice(t).partition_S(cute.make_identity_tensor((em, en)))
            for (bm, bn), pairs in plan:
                for d, a in pairs:
                    want = (bm * em + epi[d][0], bn * en + epi[d][1])
                    seen.add(want)
                    bad += tuple(acc[a]) != want
        out["bad"], out["missing"] = bad, tm * tn - len(seen)

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options=f"--gpu-arch {schedule.target}")
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_epilogue_places_every_accumulator(name):
    assert _misplaced(CASES[name]) == {"bad": 0, "missing": 0}


@pytest.mark.parametrize("name", list(SM90_CASES))
def test_sm90_epilogue_places_every_accumulator(name):
    s, fmt = SM90_CASES[name]
    assert _misplaced(s, fmt) == {"bad": 0, "missing": 0}


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
