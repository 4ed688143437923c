"""Whole models on an SM12x target's kernels without an SM12x GPU: :func:`emulate`.

The SM120 GEMMs run on the present SM90 GPU with the block-scaled MMA emulated
(``compile.EMULATION_NOTE``: what such a run checks and what not): a data-path check of
everything above the MMA (schedule resolution, weight layouts, gate/up groups, the W4A4
route, fused epilogues, the grouped experts) through the same layers and checkpoints a user
runs on SM12x. Never for speed: the emulated MMA is four BF16 MMAs per block-scaled one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cute_fp4 import targets
from cute_fp4.errors import InputError

__all__ = ["emulate"]


@contextlib.contextmanager
def emulate(target: str | targets.Target = "sm_120a") -> Iterator[targets.Target]:
    """Inside, the GEMM side sees ``target`` (an SM120 one): ``"auto"`` resolves to its
    schedules, weights take its layouts and gate/up groups, ``mode="auto"`` its W4A4, and
    ``compile.compile`` builds its block-scaled kernels with the MMA emulated and its
    stream kernels for the present GPU (one kernel for both families). The activation
    quantizer and the dequantizer stay the present GPU's (the same bytes on both).
    Process-wide, not per thread; the launch caches are cleared on entry and exit, so
    layers built inside are for use inside. A DeviceError without an SM90 GPU."""
    t = targets.get_target(target)
    if t.family != targets.Family.SM120:
        raise InputError(f"emulate() stands in for an SM120 target, got {t.name}")
    targets.require_device(targets.Family.SM90)
    _clear_launch_caches()
    targets._EMULATING.append(t)
    try:
        yield t
    finally:
        targets._EMULATING.pop()
        _clear_launch_caches()


def _clear_launch_caches() -> None:
    """Schedule resolutions, compiled-kernel memos and launch bindings made for the other
    target (compiled kernels stay on disk and in their own cache keys)."""
    from cute_fp4.compile import clear_cache

    clear_cache()
