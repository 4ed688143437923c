"""The GPU tests' selection (``tests/gpu/selection.py``) with the detected GPU forced to each
target: every kernel ``tests/gpu`` would build on an RTX 5090 / PRO 6000 (sm_120a), a GB10
(sm_121a) or an H200 (sm_90a) is accepted by ``plan()`` there, for the A formats and the
problem sizes the tests run, and W4A16 cases are gated by the family's support. No GPU and
no compile: plan() only."""

from __future__ import annotations

import pytest
from gpu import selection

from cute_fp4 import catalogue, targets
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem

FORCED = ["sm_120a", "sm_121a", "sm_90a"]


@pytest.fixture(params=FORCED)
def forced(request, monkeypatch) -> targets.Target:
    """The detected device patched to one of each target's GPUs."""
    t = targets.get_target(request.param)
    dev = targets.Device(0, t.gpus[0], t.cc, t.sm_count, t, t.mem_bw_gbs)
    monkeypatch.setattr(targets, "detect_device", lambda index=None: dev)
    return t


def accepted(s, m: int = 0, n: int = 0, k: int = 0, a_format: str = "nvfp4",
             groups: int = 0) -> None:
    p = plan(s, Problem(m, n, k, a_format, groups))
    assert p.ok, f"{s.name} ({s.target}) {a_format} {m}x{n}x{k}: {'; '.join(p.reasons)}"


def test_the_forced_target_is_what_the_tests_see(forced):
    assert selection.target() is forced
    assert selection.family() == forced.family
    assert selection.default_schedule().target == forced.name


def test_w4a16_is_gated_by_the_family(forced):
    sm90 = forced.family == "sm90"
    assert selection.w4a16() is sm90 and selection.packed_weights() is sm90
    assert selection.gemm_formats() == (["nvfp4", "bf16"] if sm90 else ["nvfp4"])
    assert selection.modes() == (["w4a16", "w4a4"] if sm90 else ["w4a4"])
    if not sm90:
        with pytest.raises(pytest.skip.Exception, match="W4A16"):
            selection.skip_unless_w4a16()
        with pytest.raises(pytest.skip.Exception, match="sm_90a only"):
            selection.skip_unless_packed()


def test_every_dense_case_on_its_shapes(forced):
    """tests/gpu/test_kernels.py: each dense case runs the shapes plan() accepts; a shape is
    left out only for a split-K schedule with fewer K tiles than splits."""
    cases = selection.dense_cases()
    assert len(cases) >= 4
    assert not any(s.name.startswith("sm100_style") for s, _ in cases)  # refused on purpose
    for s, fmt in cases:
        assert s.target == forced.name
        shapes = selection.dense_shapes(s, fmt)
        assert len(shapes) >= len(selection.DENSE_SHAPES) - 2, (s.name, shapes)
        for m, n, k in selection.DENSE_SHAPES:
            if (m, n, k) in shapes:
                accepted(s, m, n, k, fmt)
                continue
            reasons = plan(s, Problem(m, n, k, fmt)).reasons
            assert s.split_k > 1 and all("K tiles" in r for r in reasons), (s.name, reasons)


def test_default_split_k_and_decode_schedules(forced):
    s = selection.default_schedule()
    for out_dtype in ("fp16", "fp32"):  # test_kernels' other output dtypes
        accepted(s.replace(out_dtype=out_dtype), 129, 264, 832)
    for m, n, k in [(1, 136, 320), (129, 264, 832)]:  # test_api's validate report
        accepted(s, m, n, k)
    splits = selection.split_k_schedules()
    assert splits
    for s in splits:  # test_kernels' determinism
        accepted(s, 16, 1024, 8192)
    for i, (name, fmt) in enumerate(selection.split_k_bases()):  # test_split_k
        assert fmt in selection.gemm_formats()
        base = selection.here(catalogue.get(name))
        for split_k in (2, 3, 4, 8):  # (its shapes with fewer K tiles are skipped)
            accepted(base.replace(split_k=split_k), a_format=fmt)
        if i < 2:  # determinism and graph replay; the workspace per stream
            accepted(base.replace(split_k=4), 16, 2048, 8192, fmt)
            accepted(base.replace(split_k=2), 16, 1024, 4096, fmt)
    decode = selection.here(catalogue.get(selection.decode_schedule()))
    for fmt in selection.gemm_formats():  # test_launch_path's graphs and disk cache
        accepted(decode, 16, 1024, 8192, fmt)
        accepted(decode if decode.split_k > 1 else decode.replace(split_k=2), 16, 1024, 8192,
                 fmt)
        accepted(decode, 16, 512, 2048, fmt)


def test_every_auto_pick(forced):
    """What schedule="auto" builds for every shape the GPU tests call it with."""
    for m, n, k in selection.AUTO_SHAPES:
        for fmt in selection.gemm_formats():
            accepted(selection.auto_schedule(m, n, k, fmt), m, n, k, fmt)
            if selection.packed_weights():
                accepted(selection.auto_schedule(m, n, k, fmt, packed=True), m, n, k, fmt)


def test_grouped_auto_and_formats(forced):
    s, fmt = selection.grouped_auto()
    assert s.arch.family == forced.family and fmt in selection.grouped_formats(s)
    accepted(selection.here(s), 300, 136, 256, fmt, groups=3)


def test_a_refused_kernel_is_caught(forced):
    """The checks can fail: picking by catalogue position (as the GPU tests once did) gives
    a schedule plan() refuses on SM120, and a 16-bit A is refused there."""
    first = selection.here(catalogue.all_schedules(selection.family(), grouped=False)[0])
    w4a16 = plan(selection.default_schedule(), Problem(a_format="bf16")).ok
    if forced.family == "sm120":
        assert not plan(first).ok and not w4a16
    else:
        assert w4a16
