"""What the GPU tests run on the present GPU: every schedule, A format and mode they choose
comes from here, by the detected target's family and what ``plan()`` accepts there, never
by a position in the catalogue or a compute-capability test of their own.

``tests/test_gpu_selection.py`` (CPU) runs these functions with the detected device forced
to each target (sm_120a, sm_121a, sm_90a: ``cute_fp4.targets.detect_device`` patched) and
checks that ``plan()`` accepts every kernel the GPU tests would build there, so a test that
cannot run on a family it claims fails in CI, not on that GPU.

Not a test module (no ``test_`` prefix); imported as ``gpu.selection``.
"""

from __future__ import annotations

import pytest

from cute_fp4 import api, catalogue, targets, tuning
from cute_fp4.compile import retarget
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem, Schedule
from cute_fp4.targets import Target


def bindings_available() -> bool:
    """Whether launches are bound (``bindings.bind``): the DSL's TVM-FFI entry is on."""
    from cute_fp4.compile import tvm_ffi_enabled

    return tvm_ffi_enabled()


# bound launches (``bindings.bind``) take the DSL's TVM-FFI entry: without apache-tvm-ffi
# every call takes the full path, correct but not bound (a GPU host without the wheel)
needs_bindings = pytest.mark.skipif(
    not bindings_available(),
    reason="bound launches need the DSL's TVM-FFI entry (apache-tvm-ffi is not installed)")

NO_GPU_TARGET = "sm_120a"  # what collection plans for without a supported GPU
FORMATS = ("nvfp4", "bf16", "fp16")

# shapes of tests/gpu/test_kernels.py (every dense catalogue schedule runs each)
DENSE_SHAPES = [(1, 264, 320), (7, 136, 4096), (16, 512, 8256), (127, 136, 320),
                (128, 256, 448), (129, 264, 832), (1000, 136, 4096), (256, 392, 8256),
                (4096, 256, 4096)]
# every (M, N, K) a GPU test runs through schedule="auto" (test_api, test_pdl,
# test_launch_path, test_nn), with the formats of gemm_formats()
AUTO_SHAPES = [(16, 512, 4096), (33, 256, 640), (16, 256, 640), (10, 256, 640),
               (129, 264, 832), (1, 136, 320), (1, 8192, 8192), (16, 1024, 4096),
               (4096, 1024, 4096), (16, 2048, 4096), (16, 1024, 8192), (1, 1024, 4096),
               (3, 1024, 4096), (16, 512, 2048)]


def target() -> Target:
    """The present GPU's target, or :data:`NO_GPU_TARGET` without a supported GPU (the
    tests then skip; their parameters are still collected)."""
    dev = targets.detect_device()
    if dev is None or dev.target is None:
        return targets.get_target(NO_GPU_TARGET)
    return dev.target


def family() -> str:
    return str(target().family)


def here(s: Schedule) -> Schedule:
    """``s`` for the present target (a schedule of its family: what ``compile`` builds)."""
    return retarget(s, target().name)


def supports(a_format: str) -> bool:
    """Whether the family's dense kernels take A in ``a_format`` (plan() of its default
    schedule: SM120 takes NVFP4 A only)."""
    return plan(default_schedule(), Problem(a_format=a_format)).ok


def w4a16() -> bool:
    return supports("bf16")


def skip_unless_w4a16() -> None:
    if not w4a16():
        pytest.skip(f"W4A16 (16-bit A) kernels do not exist for {family()}")


def packed_weights() -> bool:
    """Whether fragment-order weights (``PackedNVFP4Weight``) run here (sm_90a only)."""
    return family() == "sm90"


def skip_unless_packed() -> None:
    if not packed_weights():
        pytest.skip(f"fragment-order (packed) weights run on sm_90a only, not {family()}")


def gemm_formats() -> list[str]:
    """A formats of the dense GEMM calls the tests make: NVFP4, and BF16 where supported."""
    return ["nvfp4", "bf16"] if w4a16() else ["nvfp4"]


def modes() -> list[str]:
    """``NVFP4Linear`` / MoE modes that run here."""
    return ["w4a16", "w4a4"] if w4a16() else ["w4a4"]


def default_schedule() -> Schedule:
    """The family's default dense schedule (by name, never by catalogue position)."""
    return here(catalogue.get(f"{family()}_default"))


def dense_cases() -> list[tuple[Schedule, str]]:
    """(schedule, A format) of every dense catalogue schedule of the family that plan()
    accepts for that format (the catalogue keeps refused schedules on purpose)."""
    out = []
    for s in catalogue.all_schedules(family(), grouped=False):
        s = here(s)
        for fmt in FORMATS[:2]:
            if plan(s, Problem(a_format=fmt)).ok:
                out.append((s, fmt))
    return out


def dense_shapes(s: Schedule, a_format: str) -> list[tuple[int, int, int]]:
    """The :data:`DENSE_SHAPES` plan() accepts for ``s``: all of them, except for a split-K
    schedule the shapes with fewer K tiles than splits (refused up front, as the API does;
    tests/test_gpu_selection.py checks that nothing else is refused)."""
    return [(m, n, k) for m, n, k in DENSE_SHAPES if plan(s, Problem(m, n, k, a_format)).ok]


def split_k_schedules() -> list[Schedule]:
    """The family's dense split-K catalogue schedules that plan() accepts (NVFP4 A)."""
    return [s for s, fmt in dense_cases() if s.split_k > 1 and fmt == "nvfp4"]


def split_k_bases() -> list[tuple[str, str]]:
    """(catalogue name, A format) the split-K tests vary ``split_k`` on."""
    if family() == "sm120":
        return [("sm120_decode_splitk4", "nvfp4"), ("sm120_default", "nvfp4")]
    return [("sm90_rs_packed_decode", "bf16"), ("sm90_rs_packed_m64", "bf16"),
            ("sm90_rs_packed_m64", "nvfp4"), ("sm90_decode_swapab", "bf16"),
            ("sm90_decode_swapab", "nvfp4"), ("sm90_decode", "nvfp4")]


def decode_schedule() -> str:
    """The family's decode schedule (catalogue name) of the launch-path tests."""
    return "sm90_decode_swapab" if family() == "sm90" else "sm120_decode_splitk4"


def auto_schedule(m: int, n: int, k: int, a_format: str, packed: bool = False) -> Schedule:
    """What ``schedule="auto"`` runs for this call when nothing is tuned (the heuristic)."""
    return here(api.heuristic(family(), m, n, k, packed, a_format))


def grouped_formats(s: Schedule) -> list[str]:
    """A formats the grouped tests try on ``s`` (each still subject to plan())."""
    if s.mainloop.value == "stream":  # the weight-streaming kernel: 16-bit A, both families
        return ["bf16", "fp16"]
    return ["bf16", "fp16", "nvfp4"] if s.arch.family == "sm90" else ["nvfp4"]


def grouped_auto() -> tuple[Schedule, str]:
    """The grouped schedule "auto" names on this family and its first A format."""

    s = catalogue.get(tuning.AUTO[family()].grouped.default)
    return s, grouped_formats(s)[0]
