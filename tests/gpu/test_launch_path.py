"""The low-overhead call path on a GPU: the TVM-FFI entry is used when apache-tvm-ffi is
importable and gives the DSL call path's bits; the disk cache loads it back; gemm runs
on torch's current stream, captures into CUDA graphs (output given or allocated, split-K,
W4A4, a Python alpha) whose replays equal eager, and syncs with the GPU on no call.
Host time itself is measured (never asserted) by perf/host_overhead.py."""

from __future__ import annotations

import importlib

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import bindings, catalogue, reference, run
from cute_fp4.api import make_operands
from cute_fp4.bench import capture_graph
from gpu import selection

host = importlib.import_module("cute_fp4.compile")
pytestmark = pytest.mark.gpu("sm90", "sm120")
HAVE_TVM_FFI = host.tvm_ffi_enabled()  # apache-tvm-ffi importable, CUTE_FP4_TVM_FFI not "0"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def poisoned(m: int, n: int) -> torch.Tensor:
    """A BF16 output filled with NaN, so a launch that writes nothing fails."""
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")


def decode_schedule():
    return selection.decode_schedule()


def one_format() -> str:
    """The A format of tests that need some GEMM: BF16 where W4A16 runs, else NVFP4."""
    return selection.gemm_formats()[-1]


@pytest.fixture
def fresh_kernels():
    """Memos emptied before and after (the test changes how kernels are compiled)."""
    host.clear_cache()
    yield
    host.clear_cache()


@pytest.mark.skipif(not HAVE_TVM_FFI, reason="the TVM-FFI entry is off (apache-tvm-ffi "
                    "absent or CUTE_FP4_TVM_FFI=0)")
def test_tvm_ffi_path_is_used_and_matches_the_dsl_path(monkeypatch, fresh_kernels):
    fmt = one_format()
    a, b = make_operands(16, 1024, 4096, fmt)
    y = cf.gemm(a, b, out=poisoned(16, 1024))
    kern = run.kernel("auto", (16, 1024, 4096, fmt), torch.bfloat16, b.data.get_device())
    assert kern.call_path == "tvm-ffi"
    monkeypatch.setenv(host.TVM_FFI_ENV, "0")
    host.clear_cache()
    y_dsl = cf.gemm(a, b, out=poisoned(16, 1024))
    kern_dsl = run.kernel("auto", (16, 1024, 4096, fmt), torch.bfloat16,
                          b.data.get_device())
    assert kern_dsl.call_path == "dsl" and kern_dsl is not kern
    torch.cuda.synchronize()
    assert torch.equal(bits(y), bits(y_dsl))
    assert reference.check(y, a, b).passed


def test_a_disk_cache_load_launches(monkeypatch, tmp_path, fresh_kernels):
    monkeypatch.setenv("CUTE_FP4_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_FP4_CACHE", "1")
    s = catalogue.get(decode_schedule())
    a, b = make_operands(16, 512, 2048, "nvfp4")
    host.clear_cache()
    built = host.compile(s, host.Signature("nvfp4"))
    y1 = run.run_compiled(built, a, b, out=poisoned(16, 512))
    host.clear_cache()
    loaded = host.compile(s, host.Signature("nvfp4"))
    assert built.source == "built" and loaded.source == "loaded"
    assert loaded.call_path == ("tvm-ffi" if HAVE_TVM_FFI else "dsl")
    y2 = run.run_compiled(loaded, a, b, out=poisoned(16, 512))
    torch.cuda.synchronize()
    assert torch.equal(bits(y1), bits(y2)) and reference.check(y2, a, b).passed


def test_gemm_runs_on_the_current_stream():
    a, b = make_operands(16, 2048, 4096, one_format())
    ref = cf.gemm(a, b)
    out = torch.empty_like(ref)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # holds the side stream back
        out.fill_(float("nan"))  # a gemm issued on another stream would run before this
        cf.gemm(a, b, out=out)
        got = out.clone()
    side.synchronize()
    assert torch.equal(bits(got), bits(ref))


CASES = [("bf16", None, None), ("nvfp4", None, None), ("bf16", 0.375, None),
         ("nvfp4", 0.375, None), ("nvfp4", None, "split")]


@pytest.mark.parametrize("fmt, alpha, split", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("given_out", [True, False], ids=["out", "alloc"])
def test_cuda_graph_replays_equal_eager(fmt, alpha, split, given_out):
    if fmt not in selection.gemm_formats():
        selection.skip_unless_w4a16()
    a, b = make_operands(16, 1024, 8192, fmt)
    sched = decode_schedule()
    if split:
        s = catalogue.get(sched)
        sched = s.replace(split_k=2) if s.split_k == 1 else s
    ref = cf.gemm(a, b, alpha=alpha, schedule=sched).clone()
    out = torch.empty_like(ref)

    def call():
        if given_out:
            return cf.gemm(a, b, out=out, alpha=alpha, schedule=sched)
        return cf.gemm(a, b, alpha=alpha, schedule=sched)

    g, got = capture_graph(call, warmups=3)
    for _ in range(2):
        got.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(got), bits(ref))


def test_no_call_syncs_with_the_gpu():
    _, b = make_operands(16, 1024, 4096, "nvfp4")
    acts = [make_operands(16, 1024, 4096, fmt)[0] for fmt in selection.gemm_formats()]
    out = torch.empty(16, 1024, dtype=torch.bfloat16, device="cuda")
    for a in acts:  # warm: compile, memos
        cf.gemm(a, b, out=out, alpha=0.5)
        cf.gemm(a, b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for a in acts:
                cf.gemm(a, b)
                cf.gemm(a, b, out=out)
                cf.gemm(a, b, out=out, alpha=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@selection.needs_bindings
def test_bound_gemm_calls_follow_new_inputs_and_weights():
    """W4A16 calls after the first on a weight launch through its binding: each call's new
    activations (new tensors, new values), given or allocated outputs, several M, a weight
    whose data and scales are rewritten in place, and a weight whose scale buffer is
    replaced all give the reference's result; outputs are poisoned first."""

    selection.skip_unless_w4a16()
    bindings.clear_bindings()
    _, b = make_operands(16, 1024, 4096, "bf16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(8):
        m = (1, 16, 3)[step % 3]
        a = torch.randn(m, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.full((m, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = cf.gemm(a, b, out=out) if step % 2 else cf.gemm(a, b)
        assert reference.check(y, a, b).passed, step
        if step == 3:  # in place: the binding holds the buffers, not their contents
            b.data.copy_(torch.roll(b.data, 1, dims=0))
            sf = b.scale.view(torch.uint8)
            sf.copy_(torch.roll(sf, 1, dims=0))
        if step == 5:  # a new scale buffer: the binding no longer applies
            b.scale = b.scale.clone()
    assert len(bindings._GEMM_BOUND[b]) >= 2  # the calls did bind (per M and dtype)
    bindings.clear_bindings()


@selection.needs_bindings
def test_bound_w4a4_gemm_calls_follow_new_activations(monkeypatch):
    """W4A4 calls after the first on a weight launch through its binding with each call's
    codes, block scales and (alpha not given) the product of the two global scales: new
    activations of other magnitudes (new global scales), one rewritten in place, given or
    allocated outputs, several M, and a given alpha tensor all give the reference's
    result; outputs are poisoned first."""
    if not selection.supports("nvfp4"):
        pytest.skip(f"W4A4 does not run on {selection.family()} here")
    bindings.clear_bindings()
    full, checked = [], run.run_checked
    monkeypatch.setattr(run, "run_checked", lambda *args: full.append(1) or checked(*args))
    _, b = make_operands(16, 1024, 4096, "nvfp4")
    gen = torch.Generator(device="cuda").manual_seed(1)
    alpha = torch.tensor(0.75, device="cuda")
    for step in range(9):
        m = (1, 16, 3)[step % 3] if step < 6 else 16
        x = torch.randn(m, 4096, device="cuda", generator=gen) * (step + 1)
        a = cf.quantize(x)
        if step == 4:  # the same tensors rewritten: the binding reads them per call
            a.data.copy_(torch.roll(a.data, 1, dims=0))
        out = torch.full((m, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        given = alpha if step >= 6 else None
        y = cf.gemm(a, b, out=out, alpha=given) if step % 2 else cf.gemm(a, b, alpha=given)
        assert reference.check(y, a, b, given).passed, step
    # the full path: the first call at each M, and the first with the given alpha
    assert len(full) == 4 and (16, "nvfp4", torch.bfloat16) in bindings._GEMM_BOUND[b]
    bindings.clear_bindings()
