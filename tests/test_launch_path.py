"""The low-overhead call path, on the CPU: the TVM-FFI arguments (ints) against the DSL's
objects, the TVM-FFI entry of a real kernel decoding them, the fallback when apache-tvm-ffi
is absent or disabled, the memo of the operand checks (every refusal still raised), the
memo of gemm's schedule resolution, the plan check per kernel, and alpha as a Python
number. What needs a GPU (launches, CUDA graphs, host time) is tests/gpu/test_launch_path.py
and perf/host_overhead.py."""

from __future__ import annotations

import importlib
import importlib.util
import math
import time

import cutlass
import cutlass.cute as cute
import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import api, bindings, catalogue, operands, run, tuning, workspaces
from cute_fp4.errors import InputError, ScheduleError
from cute_fp4.kernels.launch import NoopLaunch
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import Operands
from cute_fp4.schedule import Problem

host = importlib.import_module("cute_fp4.compile")
M, N, K = 16, 256, 512


def w4a16():
    a = torch.randn(M, K).to(torch.bfloat16)
    return a, cf.quantize(torch.randn(N, K))


@pytest.fixture(scope="module")
def kernel():
    return host._make_kernel(catalogue.get("sm90_decode_swapab"), Problem(a_format="bf16"))


@pytest.fixture(autouse=True)
def fresh_memos():
    operands._PASSED.clear()
    host.clear_cache()
    yield
    operands._PASSED.clear()
    host.clear_cache()


def check(a, b, out=None, alpha=None):
    return operands.check_operands(a, b, out, alpha, torch.bfloat16, require_cuda=False)


def on_any_device(*args, **kwargs):
    """``operands.check_call`` without its device-type check (the CPU stands in)."""
    return operands.check_call(*args, **{**kwargs, "require_cuda": False})


# ----------------------------------------------------------------------------- arguments

@pytest.mark.parametrize("split_k", [1, 2])
def test_raw_args_are_the_dsl_arguments_as_ints(kernel, split_k):
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    alpha = torch.ones(1)
    ws = (torch.zeros(68, dtype=torch.int32), torch.empty(split_k, M, N)) if split_k > 1 \
        else None
    kern = kernel if split_k == 1 else host._make_kernel(
        catalogue.get("sm90_decode_swapab").replace(split_k=2), Problem(a_format="bf16"))
    ops = Operands(a, None, b.data, b.scale, out, alpha, ws)
    raw = kern.raw_args(ops, 132, 0xABC0)
    dsl = kern.runtime_args(ops, "stream")
    assert len(raw) == len(dsl) == 17 and all(type(x) is int for x in raw)
    assert [int(p.__tvm_ffi_opaque_ptr__()) for p in dsl[:11]] == list(raw[:11])
    assert [int(x) for x in dsl[11:14]] == list(raw[11:14]) == [M, N, K]
    assert raw[14:] == (132, 0, 0xABC0) and dsl[16] == "stream"  # max_ctas, early, stream
    assert kern.raw_args(ops._replace(early=True), 132, 0xABC0)[15] == 1
    sfb, pal = b.scale.data_ptr(), alpha.data_ptr()
    assert raw[:6] == (a.data_ptr(), sfb, b.data.data_ptr(), sfb, out.data_ptr(), pal)
    # pWork = the partials, pCount = the header and counters; pBias: alpha (no bias)
    assert raw[6:8] == ((ws[1].data_ptr(), ws[0].data_ptr()) if split_k > 1 else (pal, pal))
    assert raw[8] == pal
    assert raw[9:11] == (pal, pal)  # pSFOut, pGSOut: alpha (no nvfp4_out)


def test_raw_args_of_an_n_d_input_and_output(kernel):
    """NVFP4Linear passes a contiguous [..., K] input and its [..., N] output as they are:
    the kernel reads and writes their memory as [M, K] and [M, N]."""
    a, b = w4a16()
    lead = (M // 2, 2) if M % 2 == 0 else (M, 1)
    a3, out3 = a.reshape(*lead, K), torch.empty(*lead, N, dtype=torch.bfloat16)
    raw = kernel.raw_args(Operands(a3, None, b.data, b.scale, out3, torch.ones(1)), 8, 0)
    assert raw[11:14] == (M, N, K) and raw[0] == a3.data_ptr() and raw[4] == out3.data_ptr()


def test_w4a4_raw_args_carry_both_scales(kernel):
    a, b = cf.quantize(torch.randn(M, K)), cf.quantize(torch.randn(N, K))
    out, alpha = torch.empty(M, N, dtype=torch.bfloat16), torch.ones(1)
    raw = kernel.raw_args(Operands(a.data, a.scale, b.data, b.scale, out, alpha), 8, 0)
    assert raw[:4] == (a.data.data_ptr(), a.scale.data_ptr(), b.data.data_ptr(),
                       b.scale.data_ptr())


class Recorder:
    """A stand-in for a compiled kernel: records what it is called with."""

    def __init__(self, fail=0):
        self.calls, self.fail = [], fail

    def __call__(self, *args):
        self.calls.append(args)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("launch failed")


def compiled_gemm(kernel, fn, **kw):
    s = catalogue.get("sm90_decode_swapab")
    kern = host.CompiledGemm(s, host.Signature("bf16"), fn, kernel, 0.0, max_ctas=7, **kw)
    kern._stream_of = lambda index: 0x5000  # torch's raw stream getter needs CUDA
    return kern


def launch(kern):
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    kern.launch(Operands(a, None, b.data, b.scale, out, torch.ones(1)))
    return a, b, out


def test_without_tvm_ffi_the_dsl_call_path_gets_its_objects(kernel):
    rec = Recorder()
    kern = compiled_gemm(kernel, rec)
    assert kern.call_path == "dsl" and host.ffi_function(rec) is None
    a, b, out = launch(kern)
    (args,) = rec.calls
    from cuda.bindings import driver

    assert int(args[0].__tvm_ffi_opaque_ptr__()) == a.data_ptr()
    assert int(args[4].__tvm_ffi_opaque_ptr__()) == out.data_ptr()
    assert isinstance(args[16], driver.CUstream) and int(args[16]) == 0x5000
    assert [int(x) for x in args[11:16]] == [M, N, K, 7, 0]  # max_ctas of compiled_gemm, early
    # the same types and alignments as runtime_args makes (what fake_args compiled)
    ref = kernel.runtime_args(Operands(a, None, b.data, b.scale, out, torch.ones(1)), None)
    for got, want in zip(args[:11], ref[:11]):
        assert (got.dtype, got._assumed_align) == (want.dtype, want._assumed_align)
    kern.launch(Operands(a, None, b.data, b.scale, out, torch.ones(1)))
    assert rec.calls[1][:5] == args[:5]  # made once per address, then reused
    assert all(x is y for x, y in zip(rec.calls[1][:5], args[:5]))


def test_absent_or_disabled_tvm_ffi_builds_plain(monkeypatch, kernel):
    seen = []
    monkeypatch.setattr(host, "_build_with",
                        lambda s, sig, k, tag, ffi: seen.append(ffi) or "built")
    s = catalogue.get("sm90_decode_swapab")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tvm_ffi" else real(name, *a))
    assert not host.tvm_ffi_enabled()
    host._build(s, host.Signature("bf16"), kernel)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setenv(host.TVM_FFI_ENV, "0")
    assert not host.tvm_ffi_enabled()
    host._build(s, host.Signature("bf16"), kernel)
    assert seen == [False, False]


def test_a_failing_tvm_ffi_build_falls_back_once_with_a_warning(monkeypatch, kernel):
    seen = []

    def build_with(s, sig, k, tag, ffi):
        seen.append(ffi)
        if ffi:
            raise host.CompileError("no TVM-FFI here")
        return "plain"

    monkeypatch.setattr(host, "_build_with", build_with)
    monkeypatch.setattr(host, "tvm_ffi_enabled", lambda: True)
    with pytest.warns(RuntimeWarning, match="TVM-FFI build failed .*no TVM-FFI here"):
        got = host._build(catalogue.get("sm90_decode_swapab"), host.Signature("bf16"), kernel)
    assert got == "plain" and seen == [True, False]


def test_a_loaded_kernel_that_fails_is_rebuilt_once(kernel):
    from cute_fp4.cache import CacheWarning

    bad, good = Recorder(fail=1), Recorder()
    kern = compiled_gemm(kernel, bad, source="loaded", rebuild=lambda: good)
    with pytest.warns(CacheWarning, match="recompiling"):
        launch(kern)
    assert len(bad.calls) == 1 and len(good.calls) == 1 and kern.source == "built"
    kern2 = compiled_gemm(kernel, Recorder(fail=5), source="built", rebuild=lambda: good)
    with pytest.raises(RuntimeError, match="launch failed"):  # only disk-cache loads retry
        launch(kern2)


@pytest.fixture(scope="module")
def ffi_kernel(tmp_path_factory, kernel):
    """The real decode kernel compiled for sm_90a with the TVM-FFI entry, exported and
    loaded back as the disk cache does (works without a GPU up to the CUDA calls)."""
    pytest.importorskip("tvm_ffi")
    s = catalogue.get("sm90_decode_swapab")
    compiled = host._dsl_compile(kernel, s, "--gpu-arch sm_90a --enable-tvm-ffi")
    export, load = host._exporter("cute_fp4_test_entry", ffi=True)
    d = tmp_path_factory.mktemp("ffi")
    export(compiled, d)
    return compiled, load(d / "kernel.o")


def test_ffi_function_of_a_built_and_a_plain_entry(kernel):
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from cute_fp4.kernels.launch import PointerTypes, fake_args

    fake = fake_args(PointerTypes(cutlass.BFloat16, cutlass.BFloat16), 1, 132)
    built = cute.compile(NoopLaunch(), *fake, options="--enable-tvm-ffi")
    fn = host.ffi_function(built)
    assert isinstance(fn, tvm_ffi.Function)
    kern = compiled_gemm(kernel, built)
    assert kern.call_path == "tvm-ffi"
    launch(kern)  # the entry decodes the ints and returns (nothing to launch)
    plain = cute.compile(NoopLaunch(), *fake)
    assert host.ffi_function(plain) is None
    kern = compiled_gemm(kernel, plain)
    assert kern.call_path == "dsl"
    launch(kern)  # the DSL's own call path with its objects


def test_the_tvm_ffi_entry_takes_the_raw_args(ffi_kernel, kernel):
    import tvm_ffi

    _, loaded = ffi_kernel
    assert isinstance(host.ffi_function(loaded), tvm_ffi.Function)
    kern = compiled_gemm(kernel, loaded)
    assert kern.call_path == "tvm-ffi"
    # the arguments decode; what fails is the first CUDA call (no driver here)
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        launch(kern)
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    args = list(kernel.raw_args(Operands(a, None, b.data, b.scale, out, torch.ones(1)), 8, 0))
    with pytest.raises(TypeError, match="Expects 15 parameters"):
        loaded(*args[:-1])
    args[11] = 1.5  # m must be an int
    with pytest.raises(TypeError, match="argument #11"):
        loaded(*args)


# ----------------------------------------------------------------------------- checks

def test_a_passing_signature_is_memoised_and_skips_the_full_checks(monkeypatch):
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert check(a, b, out) == (M, N, K, "bf16")
    assert len(operands._PASSED) == 1
    monkeypatch.setattr(operands, "check_all", lambda *a, **k: pytest.fail("full checks ran"))
    a2 = torch.randn(M, K).to(torch.bfloat16)  # another tensor, the same signature
    assert check(a2, b, torch.empty(M, N, dtype=torch.bfloat16)) == (M, N, K, "bf16")


def test_refusals_are_never_memoised():
    a, b = w4a16()
    bad_out = torch.empty(M, N // 2, dtype=torch.bfloat16)
    for _ in range(2):
        with pytest.raises(InputError, match=r"out must have shape \(16, 256\)"):
            check(a, b, bad_out)
    assert not operands._PASSED


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape whose data pointer is off by 2 bytes."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)[1:1 + t.numel()]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("what", ["a", "out", "b.data", "b.scale"])
def test_a_misaligned_pointer_is_refused_after_the_signature_passed(what):
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    check(a, b, out)
    if what == "a":
        a = misaligned(a)
    elif what == "out":
        out = misaligned(out)
    else:
        data, scale = b.data, b.scale
        if what == "b.data":
            data = misaligned(data)
        else:
            scale = misaligned(scale.view(torch.uint8)).view(torch.float8_e4m3fn)
        b = NVFP4Tensor._unchecked(data, scale, b.global_scale, b.shape)
    with pytest.raises(InputError, match=f"{what}'s data pointer 0x[0-9a-f]+ is not 16-byte"):
        check(a, b, out)


def test_metadata_changes_after_a_pass_are_caught():
    a, b = w4a16()
    check(a, b)
    b.shape = (N, 2 * K)  # the container no longer matches its bytes
    with pytest.raises(InputError):
        check(a, b)
    a2, b2 = w4a16()
    check(a2, b2)
    with pytest.raises(InputError, match="a must be contiguous"):
        check(torch.randn(K, M).to(torch.bfloat16).T, b2)
    with pytest.raises(InputError, match="alpha must be a scalar, got 3"):
        check(a2, b2, alpha=torch.ones(3))  # alpha is checked on a memo hit too


def test_w4a4_and_w4a16_signatures_differ():
    a16, b = w4a16()
    a4 = cf.quantize(torch.randn(M, K))
    assert operands.signature(a16, b, None, torch.bfloat16) != \
        operands.signature(a4, b, None, torch.bfloat16)
    assert operands.signature([1], b, None, torch.bfloat16) is None
    assert operands.signature(a16, torch.zeros(N, K), None, torch.bfloat16) is None
    assert check(a4, b) == (M, N, K, "nvfp4")


def test_a_python_alpha_is_made_once_per_value():
    a, b = w4a16()
    t1 = operands.alpha_tensor(a, b, 0.1)
    assert operands.alpha_tensor(a, b, 0.1) is t1
    assert t1.dtype == torch.float32 and t1.shape == (1,)
    assert torch.equal(t1, torch.as_tensor(0.1, dtype=torch.float32).reshape(1))
    assert operands.alpha_tensor(a, b, 2) is not t1
    assert float(operands.alpha_tensor(a, b, 2)) == 2.0
    assert operands.alpha_tensor(a, b, None) is b.global_scale  # no copy


# ----------------------------------------------------------------------------- resolution

def test_kernel_for_memoises_resolution(monkeypatch):
    calls = []
    s = catalogue.get("sm90_decode_swapab")

    def kernel_for(schedule, key, device):
        def resolve():
            calls.append(schedule)
            return s

        return host.kernel_for(schedule, key, "bf16", device, resolve)

    monkeypatch.setattr(host, "compile", lambda sched, sig: ("kernel", sched, sig))
    key = (M, N, K, "bf16", torch.bfloat16)
    first = kernel_for("auto", key, 0)
    assert kernel_for("auto", key, 0) is first
    assert len(calls) == 1
    kernel_for("auto", (M + 1, *key[1:]), 0)  # another M
    kernel_for("auto", key, 1)  # another device
    assert len(calls) == 3
    twin = s.replace(stages=s.stages)  # equal, but another object: keyed by identity
    kernel_for(s, key, 0)
    kernel_for(s, key, 0)
    kernel_for(twin, key, 0)
    assert calls[3:] == [s, twin]
    monkeypatch.setattr(tuning, "AUTO_RECHECK_S", -1.0)  # "auto" resolved again when stale
    host.clear_cache()
    kernel_for("auto", key, 0)
    kernel_for("auto", key, 0)
    kernel_for("sm90_decode_swapab", key, 0)
    kernel_for("sm90_decode_swapab", key, 0)
    assert calls[5:] == ["auto", "auto", "sm90_decode_swapab"]


def test_resolution_errors_are_not_memoised(monkeypatch):
    def resolve():
        raise InputError("no schedule named 'x'")

    host.clear_cache()
    for _ in range(2):
        with pytest.raises(InputError, match="no schedule named"):
            host.kernel_for("x", (M, N, K, "bf16"), "bf16", 0, resolve)
    assert not host._RESOLVED


def test_plan_check_per_kernel_and_shape(kernel):
    kern = compiled_gemm(kernel, Recorder())
    kern.check_plan((M, N, K, "bf16"))
    assert (M, N, K, "bf16") in kern._planned
    for _ in range(2):  # a refusal is raised every time
        with pytest.raises(ScheduleError):
            kern.check_plan((M, N, 40, "bf16"))
    assert len(kern._planned) == 1


def test_gemm_on_the_stubbed_path_still_checks(monkeypatch, kernel):
    """``gemm`` end to end on the CPU with the device and the launch stubbed: repeated
    calls reuse the memos, a bad call after good ones still raises before launching."""
    from cute_fp4 import targets

    h200 = targets.Device(0, "H200 (stub)", (9, 0), 132, targets.get_target("sm_90a"), 4800.)
    monkeypatch.setattr(targets, "require_device", lambda family=None: h200)
    monkeypatch.setattr(run, "check_call", on_any_device)
    rec = Recorder()
    monkeypatch.setattr(host, "_build", lambda s, sig, k=None, tag="": compiled_gemm(
        host._make_kernel(s, Problem(a_format=sig.a_format)), rec))
    a, b = w4a16()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    for _ in range(3):
        assert cf.gemm(a, b, out=out) is out
    assert len(rec.calls) == 3 and len(host._RESOLVED) == 1
    with pytest.raises(InputError, match="out must be torch.bfloat16"):
        cf.gemm(a, b, out=out.float())
    with pytest.raises(InputError, match="a's data pointer"):
        cf.gemm(misaligned(a), b, out=out)
    assert len(rec.calls) == 3


def test_alpha_tensor_passes_a_float32_scalar_through_and_converts_the_rest():
    """A one-element float32 alpha on the weight's device is used as it is (the kernels
    read its data pointer; no per-call conversion op); any other alpha is converted."""
    a, b = w4a16()
    gs = torch.tensor(0.5)
    assert operands.alpha_tensor(a, b, gs) is gs
    one = torch.tensor([0.25])
    assert operands.alpha_tensor(a, b, one) is one
    f64 = operands.alpha_tensor(a, b, torch.tensor(0.5, dtype=torch.float64))
    assert f64.dtype == torch.float32 and f64.shape == (1,) and float(f64) == 0.5


# ----------------------------------------------------------------------------- bound launch

@pytest.fixture
def stub_layer_path(monkeypatch):
    """NVFP4Linear on the CPU with the device and the launch stubbed: every kernel is a
    CompiledGemm of its own schedule whose TVM-FFI entry is a Recorder (so forward binds);
    returns (recorder, built kernels, [current stream handle])."""
    from cute_fp4 import targets

    h200 = targets.Device(0, "H200 (stub)", (9, 0), 132, targets.get_target("sm_90a"), 4800.)
    monkeypatch.setattr(targets, "require_device", lambda family=None: h200)
    monkeypatch.setattr(workspaces, "capturing_now", lambda: False)
    monkeypatch.setattr(run, "check_call", on_any_device)  # a layer's first call checks
    rec, built, stream = Recorder(), [], [0x5000]

    def build(s, sig, kernel=None, tag=""):
        kern = host.CompiledGemm(s, sig, rec, host._make_kernel(s, Problem(
            a_format=sig.a_format)), 0.0, max_ctas=7)
        kern._stream_of = lambda index: stream[0]
        kern._ffi, kern.call_path = rec, "tvm-ffi"
        built.append(kern)
        return kern

    monkeypatch.setattr(host, "_build", build)
    workspaces._WORKSPACES.clear()
    workspaces._EAGER.clear()
    yield rec, built, stream
    workspaces._WORKSPACES.clear()
    workspaces._EAGER.clear()


def _layer(schedule):
    from cute_fp4.nn import NVFP4Linear

    return NVFP4Linear(cf.quantize(torch.randn(N, K)), mode="w4a16", schedule=schedule,
                       layout="plain")


def test_a_layer_prefetching_its_weight_launches_with_the_early_flag(stub_layer_path):
    """set_prefetch_weights: the full launch and its binding carry Operands.early (the raw
    argument after max_ctas), which every launch of the layer keeps; off again, it is 0."""
    rec, _, _ = stub_layer_path
    layer = _layer("sm90_decode_swapab")
    x = torch.randn(2, K).to(torch.bfloat16)
    layer(x)
    layer.layer.set_prefetch_weights()
    layer(x)  # the bound launch was made without the flag: a new binding with it
    layer(x)
    layer.layer.set_prefetch_weights(False)
    layer(x)
    assert [args[15] for args in rec.calls] == [0, 1, 1, 0]


@pytest.mark.parametrize("schedule", ["sm90_decode_swapab", "sm90_decode_64x128_splitk2"])
@pytest.mark.parametrize("shape", [(3, K), (2, 1, K)])
def test_forward_binds_its_launch_and_passes_the_same_arguments(stub_layer_path, schedule,
                                                                 shape):
    """The first forward at an M launches through run_checked and binds; the next ones
    launch through the binding with the arguments run_checked would build (only A's and
    the output's addresses differ), for plain and split-K kernels and N-D inputs."""
    rec, built, _ = stub_layer_path
    layer = _layer(schedule)
    xs = [torch.randn(*shape).to(torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    assert len(built) == 1 and len(rec.calls) == 3
    assert list(layer.layer.launches.bound) == [(xs[0].numel() // K, torch.bfloat16)]
    first, *rest = rec.calls
    for x, y, args in zip(xs[1:], ys[1:], rest):
        assert y.shape == (*shape[:-1], N) and y.dtype == torch.bfloat16
        assert args[0] == x.data_ptr() and args[4] == y.data_ptr()
        assert args[1:4] + args[5:] == first[1:4] + first[5:]
    if built[0].schedule.split_k > 1:  # the stream's workspace, as run_checked found it
        assert first[6] == first[7] != first[5]


def test_a_binding_is_dropped_when_what_it_fixed_changes(stub_layer_path, monkeypatch):
    """Each condition the binding holds on sends the call back to the full path (which
    binds again): new weight buffers, another schedule, time up, another stream or a new
    workspace (split-K), a capture; a deep copy never launches on the original's weight."""
    import copy


    rec, built, stream = stub_layer_path
    layer = _layer("sm90_decode_64x128_splitk2")
    x = torch.randn(2, K).to(torch.bfloat16)

    def bound_after_call():
        layer(x)
        return layer.layer.launches.bound[(2, torch.bfloat16)]

    b0 = bound_after_call()
    assert bound_after_call() is b0
    layer.weight_packed = layer.weight_packed.clone()  # new buffer: a new view, rebound
    b1 = bound_after_call()
    assert b1 is not b0 and rec.calls[-1][2] == layer.weight_packed.data_ptr()
    workspaces._GENERATION[0] += 1  # the stream's workspace replaced (or a reserve drawn)
    assert bound_after_call() is not b1
    b2 = layer.layer.launches.bound[(2, torch.bfloat16)]
    stream[0] = 0x6000  # another stream: its own workspace
    b3 = bound_after_call()
    assert b3 is not b2 and rec.calls[-1][-1] == 0x6000
    with monkeypatch.context() as capture:
        capture.setattr(workspaces, "capturing_now", lambda: True)
        capture.setattr(workspaces, "capturing", lambda device: True)
        n = len(rec.calls)
        layer(x)  # a capture takes the full path (a workspace of its own), binds nothing
        assert len(rec.calls) == n + 1 and layer.layer.launches.bound[(2, torch.bfloat16)] is b3
        assert rec.calls[-1][7] != rec.calls[-2][7]
    b3._expires = 0.0  # time up ("auto" is resolved again)
    assert bound_after_call() is not b3
    layer.schedule = "sm90_decode_swapab"
    assert bound_after_call().kernel.schedule.name == "sm90_decode_swapab"
    twin = copy.deepcopy(layer)
    assert twin.layer.launches.bound == {}
    twin(x)
    assert rec.calls[-1][2] == twin.weight_packed.data_ptr() != layer.weight_packed.data_ptr()


def test_bind_refuses_what_it_cannot_fix(stub_layer_path):
    """No binding for the DSL call path, W4A4 (A's scales change per call) or an alpha
    that had to be converted (the copy would not follow the original)."""

    _, built, _ = stub_layer_path
    layer = _layer("sm90_decode_swapab")
    x = torch.randn(2, K).to(torch.bfloat16)
    y = layer(x)
    kern, w = built[0], layer.stored_weight
    dims = (2, N, K, "bf16")
    assert bindings.bind(kern, x, w, y, layer.weight_scale_2, dims, None, math.inf) is not None
    assert bindings.bind(kern, x, w, y, torch.tensor(1.0, dtype=torch.float64), dims, None,
                    math.inf) is None
    assert bindings.bind(kern, x, w, y, layer.weight_scale_2, (2, N, K, "nvfp4"), None,
                         math.inf) is None
    kern._ffi = None
    assert bindings.bind(kern, x, w, y, layer.weight_scale_2, dims, None, math.inf) is None


# ----------------------------------------------------------------------------- gemm's binding

@pytest.fixture
def stub_gemm_path(stub_layer_path, monkeypatch):
    """``gemm`` on the CPU through the stubbed path of :func:`stub_layer_path` (operand
    checks without the device-type check)."""
    from cute_fp4 import run

    monkeypatch.setattr(run, "check_call", on_any_device)
    bindings._GEMM_BOUND.clear()
    yield stub_layer_path
    bindings._GEMM_BOUND.clear()


@pytest.mark.parametrize("schedule", ["sm90_decode_swapab", "sm90_decode_64x128_splitk2"])
@pytest.mark.parametrize("given_out", [False, True])
def test_gemm_binds_and_passes_the_arguments_of_the_full_path(stub_gemm_path, monkeypatch,
                                                              schedule, given_out):
    """The first W4A16 call on a weight takes the full path and binds; the next calls with
    the same M and dtypes launch through the binding with the same arguments (only A's and
    the output's addresses differ)."""
    from cute_fp4 import run
    from cute_fp4.run import run_checked

    rec, built, _ = stub_gemm_path
    full = []
    monkeypatch.setattr(run, "run_checked", lambda *args: full.append(1) or run_checked(*args))
    b = cf.quantize(torch.randn(N, K))
    xs = [torch.randn(3, K).to(torch.bfloat16) for _ in range(3)]
    outs = [torch.empty(3, N, dtype=torch.bfloat16) if given_out else None for _ in xs]
    ys = [cf.gemm(x, b, schedule=schedule, out=o) for x, o in zip(xs, outs)]
    assert len(built) == 1 and len(rec.calls) == 3 and len(full) == 1  # then bound
    assert list(bindings._GEMM_BOUND[b]) == [(3, torch.bfloat16, torch.bfloat16)]
    first, *rest = rec.calls
    for x, y, o, args in zip(xs[1:], ys[1:], outs[1:], rest):
        assert y.shape == (3, N) and y.dtype == torch.bfloat16 and (o is None or y is o)
        assert args[0] == x.data_ptr() and args[4] == y.data_ptr()
        assert args[1:4] + args[5:] == first[1:4] + first[5:]


def test_gemm_binding_yields_to_anything_it_did_not_fix(stub_gemm_path):
    """A new scale or global-scale buffer, another alpha, schedule, dtype or M: the full
    path (which binds again); bad input after a binding still raises the full path's error,
    before any launch; a Python alpha never binds; W4A4 binds apart from W4A16; a deep copy
    has no binding."""
    import copy


    rec, _, _ = stub_gemm_path
    b = cf.quantize(torch.randn(N, K))
    x = torch.randn(2, K).to(torch.bfloat16)

    def bound_after(*args, **kw):
        cf.gemm(*args, **kw)
        return bindings._GEMM_BOUND[b].get((args[0].shape[0], args[0].dtype, torch.bfloat16))

    s = "sm90_decode_swapab"
    b0 = bound_after(x, b, schedule=s)
    assert bound_after(x, b, schedule=s) is b0
    b.scale = b.scale.clone()
    b1 = bound_after(x, b, schedule=s)
    assert b1 is not b0 and rec.calls[-1][3] == b.scale.data_ptr()
    b.global_scale = b.global_scale.clone()
    b2 = bound_after(x, b, schedule=s)
    assert b2 is not b1 and rec.calls[-1][5] == b.global_scale.data_ptr()
    alpha = torch.tensor(0.5)
    b3 = bound_after(x, b, schedule=s, alpha=alpha)
    assert b3 is not b2 and rec.calls[-1][5] == alpha.data_ptr()
    assert bound_after(x, b, schedule=s) is not b3  # alpha None again: the global scale
    assert rec.calls[-1][5] == b.global_scale.data_ptr()
    b4 = bound_after(x, b, schedule="sm90_decode_64x128_splitk2")
    assert b4.kernel.schedule.name == "sm90_decode_64x128_splitk2"
    n = len(rec.calls)
    with pytest.raises(InputError, match="a's data pointer"):
        cf.gemm(misaligned(x), b, schedule="sm90_decode_64x128_splitk2")
    with pytest.raises(InputError, match="out must be torch.bfloat16"):
        cf.gemm(x, b, schedule="sm90_decode_64x128_splitk2",
                out=torch.empty(2, N, dtype=torch.float32))
    with pytest.raises(InputError, match="K mismatch"):
        cf.gemm(torch.randn(2, K // 2).to(torch.bfloat16), b,
                schedule="sm90_decode_64x128_splitk2")
    shape, b.shape = b.shape, (N - 8, K)  # a weight object made to lie about its shape
    with pytest.raises(InputError, match="b.data"):
        cf.gemm(x, b, schedule="sm90_decode_64x128_splitk2")  # not the old N's binding
    b.shape = shape
    assert len(rec.calls) == n
    cf.gemm(x, b, schedule=s, alpha=0.25)  # converted to a tensor per value: not bound
    assert rec.calls[-1][5] != alpha.data_ptr()
    a4 = cf.quantize(torch.randn(2, K))
    cf.gemm(a4, b, schedule="sm90_128x128x64")
    assert {(2, torch.bfloat16, torch.bfloat16), (2, "nvfp4", torch.bfloat16)} <= set(
        bindings._GEMM_BOUND[b])  # W4A16's and W4A4's, apart
    assert copy.deepcopy(b) not in bindings._GEMM_BOUND


def test_a_w4a4_gemm_binds_with_its_activation_scales_and_alpha_per_call(stub_gemm_path,
                                                                       monkeypatch):
    """W4A4 ``gemm`` on NVFP4 activations: the first call takes the full path and binds;
    the next ones launch through the binding with each call's codes, block scales, output
    and (no ``alpha`` given) the product of the two global scales made per call, every other
    argument the first call's; a given alpha tensor is the bound one. Scales of another
    shape or a misaligned buffer take the full path (which raises on bad input)."""
    from cute_fp4 import run
    from cute_fp4.run import run_checked

    rec, built, _ = stub_gemm_path
    full = []
    monkeypatch.setattr(run, "run_checked", lambda *args: full.append(1) or run_checked(*args))
    b = cf.quantize(torch.randn(N, K))
    s = "sm90_128x128x64"
    xs = [cf.quantize(torch.randn(3, K) * (i + 1)) for i in range(3)]
    ys = [cf.gemm(x, b, schedule=s) for x in xs]
    assert len(built) == 1 and len(rec.calls) == 3 and len(full) == 1  # then bound
    assert list(bindings._GEMM_BOUND[b]) == [(3, "nvfp4", torch.bfloat16)]
    first, *rest = rec.calls
    for x, y, args in zip(xs[1:], ys[1:], rest):
        assert args[:2] == (x.data.data_ptr(), x.scale.data_ptr()) and args[4] == y.data_ptr()
        assert args[2:4] + args[11:] == first[2:4] + first[11:]  # B, sizes, stream
        # alpha made per call, in its slot and the unsplit launch's workspace slots (the
        # absent bias and NVFP4-output slots, 8-10, hold an address never read)
        assert args[5] == args[6] == args[7] != b.global_scale.data_ptr()
    alpha = torch.tensor(0.5)
    cf.gemm(xs[0], b, schedule=s, alpha=alpha)
    cf.gemm(xs[1], b, schedule=s, alpha=alpha)
    assert len(full) == 2 and rec.calls[-1][5] == alpha.data_ptr()  # bound, its alpha
    odd = cf.quantize(torch.randn(3, K))
    odd.scale = odd.scale[:-1]  # blocked scales of another shape: the full path's error
    n = len(rec.calls)
    with pytest.raises(InputError):
        cf.gemm(odd, b, schedule=s)
    assert len(rec.calls) == n


def test_gemm_binding_matches_a_schedule_object_by_identity(stub_gemm_path):
    """A Schedule argument binds as the object it is: the same object launches through
    the binding, an equal copy takes the full path (and binds anew); a binding made for
    "auto" expires when "auto" is resolved again (run's period is the kernel memo's)."""
    rec, _, _ = stub_gemm_path
    b = cf.quantize(torch.randn(N, K))
    x = torch.randn(2, K).to(torch.bfloat16)
    s = catalogue.get("sm90_decode_swapab")
    key = (2, torch.bfloat16, torch.bfloat16)
    cf.gemm(x, b, schedule=s)
    b0 = bindings._GEMM_BOUND[b][key]
    cf.gemm(x, b, schedule=s)
    assert bindings._GEMM_BOUND[b][key] is b0 and len(rec.calls) == 2
    twin = s.replace(stages=s.stages)
    assert twin == s and twin is not s
    cf.gemm(x, b, schedule=twin)
    assert bindings._GEMM_BOUND[b][key] is not b0
    assert bindings.gemm_key(s, None, b) != bindings.gemm_key(twin, None, b)
    assert bindings.gemm_key("auto", 0.5, b) is None  # a Python alpha: never bound
    assert tuning.resolution_deadline(s) == math.inf
    assert tuning.resolution_deadline("auto") <= time.monotonic() + tuning.AUTO_RECHECK_S


def test_the_custom_op_bodies_do_not_bind(stub_gemm_path):
    """The ops' bodies wrap a fresh weight object per call: a binding there would never be
    used again, so they keep none."""

    rec, _, _ = stub_gemm_path
    b = cf.quantize(torch.randn(N, K))
    x = torch.randn(2, K).to(torch.bfloat16)
    for _ in range(2):
        bindings.mm(x, None, b.data, b.scale, b.global_scale, N, K, torch.bfloat16,
                    "sm90_decode_swapab", False)
    assert len(rec.calls) == 2 and len(bindings._GEMM_BOUND) == 0
    cf.gemm(x, b, schedule="sm90_decode_swapab")  # gemm itself does
    assert len(bindings._GEMM_BOUND) == 1


def test_clearing_the_kernel_cache_drops_gemm_bindings(stub_gemm_path):
    """After ``compile.clear_cache`` a gemm call builds (or loads) its kernel again rather
    than launching an old kernel through a binding (tests of the DSL path and of the disk
    cache rely on it)."""

    _, built, _ = stub_gemm_path
    b = cf.quantize(torch.randn(N, K))
    x = torch.randn(2, K).to(torch.bfloat16)
    cf.gemm(x, b, schedule="sm90_decode_swapab")
    assert len(bindings._GEMM_BOUND) == 1
    host.clear_cache()
    assert len(bindings._GEMM_BOUND) == 0
    cf.gemm(x, b, schedule="sm90_decode_swapab")
    assert len(built) == 2


# ----------------------------------------------------------------------------- the ops' bindings

def _op_calls(kind, xs, b, schedule, **kw):
    """The custom op bodies as torch.compile's code calls them (fresh tensors of the same
    buffers every call: views of the weight's tensors)."""
    outs = []
    for x in xs:
        if kind == "mm":
            outs.append(api._mm_op(x, None, b.data.view(b.data.shape), b.scale.view(
                torch.uint8), b.global_scale.view(()), K, torch.bfloat16, schedule, **kw))
        else:
            outs.append(api._mm_packed_op(x, None, b.weight_packed.view(-1, K // 2),
                                          b.weight_scale, b.weight_scale_2.view(()), N, K,
                                          torch.bfloat16, schedule, **kw))
    return outs


@pytest.mark.parametrize("kind, schedule", [
    ("mm", "sm90_decode_swapab"), ("mm", "sm90_decode_64x128_splitk2"),
    ("mm_packed", "sm90_rs_packed_decode_128"), ("mm_packed", "auto")])
@pytest.mark.parametrize("stream_handle", [0, 0x5000])
def test_op_bodies_bind_by_the_weight_buffers(stub_gemm_path, monkeypatch, kind, schedule,
                                              stream_handle):
    """The ops' bodies get new wrapper tensors every call: they bind by the buffers'
    addresses. After the first W4A16 call, calls with new activations launch through the
    binding with the full path's arguments (only A's and the output's addresses differ).
    Split-K kernels bind only on the default stream (handle 0): off it an op body may be a
    CUDA-graph tree's warm-up, whose allocations belong to the graphs' pool."""
    from cute_fp4 import run
    from cute_fp4.nn import NVFP4Linear
    from cute_fp4.run import run_checked

    rec, built, stream = stub_gemm_path
    stream[0] = stream_handle
    full = []
    monkeypatch.setattr(run, "run_checked", lambda *args: full.append(1) or run_checked(*args))
    bindings._OP_BOUND.clear()
    w = cf.quantize(torch.randn(N, K))
    b = w if kind == "mm" else NVFP4Linear(w, mode="w4a16", layout="packed")
    xs = [torch.randn(3, K).to(torch.bfloat16) for _ in range(3)]
    ys = _op_calls(kind, xs, b, schedule)
    split = built[0].schedule.split_k > 1
    binds = not split or stream_handle == 0
    assert len(rec.calls) == 3 and len(full) == (1 if binds else 3)
    assert len(bindings._OP_BOUND) == (1 if binds else 0)
    first, *rest = rec.calls
    for x, y, args in zip(xs[1:], ys[1:], rest):
        assert y.shape == (3, N) and y.dtype == torch.bfloat16
        assert args[0] == x.data_ptr() and args[4] == y.data_ptr()
        if not split or binds:  # a split-K full path off the default stream: own workspace
            assert args[1:4] + args[5:] == first[1:4] + first[5:]
    bindings._OP_BOUND.clear()


def test_op_bindings_yield_to_anything_they_did_not_fix(stub_gemm_path, monkeypatch):
    """A new scale, alpha or weight buffer, another M, dtype or schedule: the full path
    (which binds again); bad input after a binding still raises the full path's error; W4A4
    never binds; clear_gemm_bindings drops them."""
    from cute_fp4 import run
    from cute_fp4.run import run_checked

    full = []
    monkeypatch.setattr(run, "run_checked", lambda *args: full.append(1) or run_checked(*args))
    bindings._OP_BOUND.clear()
    b = cf.quantize(torch.randn(N, K))
    x = torch.randn(2, K).to(torch.bfloat16)
    s = "sm90_decode_swapab"

    def call(x=x, data=None, scale=None, alpha=None, schedule=s):
        return api._mm_op(x, None, b.data if data is None else data,
                          b.scale if scale is None else scale,
                          b.global_scale if alpha is None else alpha, K, torch.bfloat16,
                          schedule)

    call(), call()
    assert len(full) == 1
    for changes in ({"scale": b.scale.clone()}, {"alpha": b.global_scale.clone()},
                    {"data": b.data.clone()}, {"x": torch.randn(5, K).to(torch.bfloat16)},
                    {"x": torch.randn(2, K).to(torch.float16)},
                    {"schedule": "sm90_decode_64x128_splitk2"}):
        before = len(full)
        call(**changes)
        assert len(full) == before + 1, changes
    with pytest.raises(InputError):
        call(x=torch.randn(2, K + 32).to(torch.bfloat16))  # K mismatch: the full path's error
    with pytest.raises(InputError):
        call(x=torch.randn(2, 2 * K).to(torch.bfloat16)[:, ::2])  # not contiguous
    a4 = cf.quantize(torch.randn(2, K))
    n_bound = len(bindings._OP_BOUND)
    for _ in range(2):
        api._mm_op(a4.data, a4.scale, b.data, b.scale, (a4.global_scale * b.global_scale)
                   .reshape(()), K, torch.bfloat16, s)
    assert len(bindings._OP_BOUND) == n_bound  # W4A4: A's scales change per call
    bindings.clear_bindings()
    assert not bindings._OP_BOUND


def test_may_keep_buffers_outside_op_bodies_and_on_the_default_stream():

    assert workspaces.may_keep(0) and workspaces.may_keep(0x5000)
    with workspaces.private_workspaces():
        assert workspaces.may_keep(0) and not workspaces.may_keep(0x5000)
    assert workspaces.may_keep(0x5000)


def test_validate_holds_the_gemm_and_the_fused_bits_once(monkeypatch):
    """check=True (run.validate_call): without ops the result itself is held to the
    reference; with ops the unfused pipeline's FP32 GEMM (the same schedule without them)
    is, and the result must have that pipeline's bits; a kernel is validated once."""
    from cute_fp4 import reference
    from cute_fp4.nvfp4 import quantize

    calls = []
    monkeypatch.setattr(run, "run_checked", lambda kern, *args: calls.append(("run", kern))
                        or "gemm")
    monkeypatch.setattr(reference, "assert_close", lambda got, *args: calls.append(
        ("close", got)))
    monkeypatch.setattr(reference, "assert_fused", lambda result, raw, bias, ops, *args:
                        calls.append(("fused", result, raw, bias, ops)))
    monkeypatch.setattr(run, "kernel", lambda s, dims, dt, dev, packed=False, ops=(), **_:
                        calls.append(("kernel", s, dt)) or "unfused")

    class Kern:
        validated = False
        unfused_schedule = "without ops"
        silu_group = 8

        def __init__(self, ops):
            self.schedule = catalogue.get("sm90_default").replace(ops=ops)

    w, dims = quantize(torch.randn(64, 64)), (1, 64, 64, "bf16")
    fused = Kern(("bias",))
    run.validate_call(fused, "result", "a", w, None, dims, "bias")
    assert calls == [("kernel", "without ops", torch.float32), ("run", "unfused"),
                     ("close", "gemm"), ("fused", "result", "gemm", "bias", ("bias",))]
    assert fused.validated
    calls.clear()
    run.validate_call(fused, "result", "a", w, None, dims, "bias")
    assert calls == []  # once per kernel
    plain = Kern(())
    run.validate_call(plain, "result", "a", w, None, dims)
    assert calls == [("close", "result")] and plain.validated


def test_a_gemm_call_record_is_bound_only_when_a_binding_can_repeat_it(monkeypatch):
    """``GemmCall.bindable``: a plain call on a 16-bit tensor or an NVFP4Tensor; a call that
    quantizes its activation, is validated, has a fused operation or another activation
    type takes the full path every time (``bindings.gemm`` never looks for a binding)."""
    b = cf.quantize(torch.randn(16, 64))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    plain = operands.GemmCall(x, b)
    assert plain.bindable and not plain.packed and plain.ops == ()
    assert plain.replace(a=cf.quantize(x.float())).bindable  # W4A4
    others = [plain.replace(quantize_a=True), plain.replace(check=True),
              plain.replace(bias=torch.zeros(16)), plain.replace(silu_mul=True),
              plain.replace(nvfp4_out=1.0),
              plain.replace(a=torch.nn.Parameter(x, requires_grad=False))]
    assert not any(c.bindable for c in others)
    assert others[2].ops == ("bias",) and others[4].ops == ("nvfp4_out",)
    seen = []
    monkeypatch.setattr(bindings, "bound_gemm", lambda call: seen.append(call))
    monkeypatch.setattr(run, "gemm_call", lambda call, keep=None: (call, keep))
    for c in others:
        assert bindings.gemm(c) == (c, None)
    assert not seen
    call, keep = bindings.gemm(plain)
    assert seen == [plain] and call is plain and keep is not None
