"""Programmatic dependent launch (``kernels.roles.PDL``): every kernel of the package is
launched so that it may start while the kernel before it on the stream drains, and the
quantize and dequantize kernels release their dependents as they start. These tests make
the kernel just before each launch rewrite that launch's input, with values that differ on
every round, so that a kernel that read its input before the previous grid's memory was
visible would return the previous round's answer: eagerly, in a chain of the package's own
kernels (quantize -> dequantize -> GEMM, each triggering the next early), and under a CUDA
graph replayed on new inputs. Outputs are poisoned before every round.

Weights before the wait (the stream kernel's ``early`` flag): a kernel that releases its
dependents at once, then waits 5 ms, then rewrites the weight of the GEMM launched right
after it (the GEMM's host launch must come inside the wait: 200 us was too short once, on
2026-12-06, with eleven other test processes on the host and the GPU). With the flag off
the GEMM must compute with the new weight; with the flag on and a kernel launched without
PDL in between (what ends the writer's flight: the rule of kernels/stream.py) too; with the
flag on straight after the writer the rule is broken on purpose, and the GEMM must be seen
computing with the old weight, which shows that the two tests above could fail (the early
read does happen before the writer's bytes land)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import quant, reference
from cute_fp4.kernels import roles
from cute_fp4.operands import make_operands
from cute_fp4.packed import repack
from gpu import selection
from gpu.test_stream import launch_stream

pytestmark = pytest.mark.gpu("sm90", "sm120")
ROUNDS = 4


def _sm90():
    selection.skip_unless_packed()  # the fragment-order weight and its W4A4 route


def test_pdl_is_on():
    assert roles.PDL  # what the rest of this file exercises


@pytest.mark.parametrize("m, n, k", [(1, 8192, 8192), (16, 1024, 4096), (4096, 1024, 4096)])
@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_gemm_reads_the_activation_written_just_before(m, n, k, layout, fmt):
    if layout == "packed":
        _sm90()
    if fmt not in selection.gemm_formats():
        selection.skip_unless_w4a16()
    a, b = make_operands(m, n, k, fmt, seed=m + n)
    w = repack(b) if layout == "packed" else b
    x = _writable_copy(a)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    for r in range(ROUNDS):
        src = _new_activation(a, r, g)  # a different activation every round
        out.fill_(float("nan"))
        _overwrite(x, src)  # the kernels right before the GEMM write its input
        cf.gemm(x, w, out=out)
        res = reference.check(out, src, b)
        assert res.passed, (r, str(res))


def _writable_copy(a):
    if isinstance(a, cf.NVFP4Tensor):
        return cf.NVFP4Tensor(a.data.clone(), a.scale.clone(), a.global_scale.clone())
    return torch.empty_like(a)


def _new_activation(a, r: int, g):
    """Round ``r``'s activation: 16-bit, a rescaled ``a``; NVFP4, fresh values quantized
    with ``a``'s global scale (so that only the codes and block scales change)."""
    if not isinstance(a, cf.NVFP4Tensor):
        return a * (r + 1) if r % 2 else -a / (r + 1)
    x = torch.randn(a.shape, generator=g, device="cuda") * (r + 1)
    return cf.quantize(x, a.global_scale)


def _overwrite(x, src) -> None:
    if isinstance(x, cf.NVFP4Tensor):
        x.data.copy_(src.data)
        x.scale.copy_(src.scale)
    else:
        x.copy_(src)


@pytest.mark.parametrize("m, k", [(1, 4096), (16, 8192), (4096, 4096)])
def test_quantize_then_dequantize_read_what_came_just_before(m, k):
    x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    gs = torch.tensor(2.0 / 2688, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    for r in range(ROUNDS):
        src = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) * (r + 1)
        x.copy_(src)
        q = quant.quantize_activation(x, gs)  # launched right after the copy
        values = quant.dequantize_activation(q)  # right after the quantizer (released early)
        ref = cf.quantize(src, gs)
        assert torch.equal(q.data, ref.data), r
        assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8)), r
        assert torch.equal(values.view(torch.int16),
                           ref.block_values(torch.bfloat16).view(torch.int16)), r


def test_w4a4_chain_under_a_graph_replayed_on_new_inputs():
    """BF16 input -> quantize -> dequantize -> W4A16 GEMM, all the package's kernels, each
    releasing the next early, captured once and replayed on new inputs."""
    _sm90()
    m, n, k = 16, 1024, 4096
    _, b = make_operands(m, n, k, "nvfp4", seed=5)
    packed = repack(b)
    gs = torch.tensor(3.0 / 2688, device="cuda")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")

    def chain():
        cf.gemm(quant.quantize_activation(x, gs), packed, out=out)

    chain()  # warm: compile, workspaces
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    g = torch.Generator(device="cuda").manual_seed(11)
    for r in range(ROUNDS):
        x.copy_(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) * (r + 1))
        out.fill_(float("nan"))
        graph.replay()
        a_ref = cf.quantize(x, gs)
        res = reference.check(out, a_ref, b)
        assert res.passed, (r, str(res))


# ----------------------------------------------------------------------------- early weights

class _Writer:
    """A PDL kernel that lets the next launch start at once (``launch_dependents`` first),
    spins ``ns`` nanoseconds on the global timer, then copies ``src`` over ``dst`` (int32
    words): a weight being rewritten while the GEMM after it may already run."""

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, ns: cutlass.Int64,
                 stream: cuda.CUstream):
        self.kernel(src, dst, ns).launch(grid=[2, 1, 1], block=[128, 1, 1], stream=stream,
                                         use_pdl=True)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, ns: cutlass.Int64):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        t0 = cute.arch.globaltimer()
        t = t0
        while t - t0 < ns:
            t = cute.arch.globaltimer()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        for i in cutlass.range(bidx * 128 + tidx, cute.size(dst), 256):
            dst[i] = src[i]


def _writer(src_words, dst_words):
    from cutlass.cute.runtime import from_dlpack

    def tensor(t):
        return from_dlpack(t).mark_layout_dynamic()

    fn = cute.compile(_Writer(), tensor(src_words), tensor(dst_words), cutlass.Int64(0),
                      cuda.CUstream(0))

    def launch(ns: int):
        fn(tensor(src_words), tensor(dst_words), cutlass.Int64(ns),
           cuda.CUstream(torch.cuda.current_stream().cuda_stream))

    return launch


@pytest.mark.parametrize("case", ["late", "early-after-a-full-dependency", "early-broken"])
def test_a_weight_written_just_before_the_gemm(case):
    """K = 512: each warp's whole K range fits the ring, so with the flag on the GEMM reads
    all of its weight before its wait."""
    from cute_fp4.compile import Signature, compile
    from cute_fp4.planning.stream import stream_schedule
    from cute_fp4.targets import detect_device

    m, n, k = 1, 4096, 512
    kern = compile(stream_schedule(detect_device().target.name, 8), Signature("bf16"))
    a, b_old = make_operands(m, n, k, "bf16", seed=3)
    b_new = cf.NVFP4Tensor(b_old.data ^ 0x77, b_old.scale, b_old.global_scale)  # new codes
    w, w_new = repack(b_old), repack(b_new)
    src = w_new.data.view(torch.int32).flatten()
    write = _writer(src, w.data.view(torch.int32).flatten())
    scratch = torch.zeros(1, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    for r in range(ROUNDS):
        w.data.copy_(repack(b_old).data)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        write(5_000_000)  # releases its dependents, then writes the new codes 5 ms later
        if case == "early-after-a-full-dependency":
            scratch.add_(1)  # launched without PDL: starts once the writer has completed
        launch_stream(kern, a, w, out, early=case != "late")
        torch.cuda.synchronize()
        assert torch.equal(w.data, w_new.data), r  # the writer did write
        if case == "early-broken":
            res = reference.check(out, a, b_old)
            assert res.passed, ("the GEMM launched right after the writer did not compute "
                                f"with the old weight: the early read was not forced ({res})")
        else:
            res = reference.check(out, a, b_new)
            assert res.passed, (r, str(res))
