"""Programmatic dependent launch (``kernels.roles.PDL``): every kernel of the package is
launched so that it may start while the kernel before it on the stream drains, and the
quantize and dequantize kernels release their dependents as they start. These tests make
the kernel just before each launch rewrite that launch's input, with values that differ on
every round, so that a kernel that read its input before the previous grid's memory was
visible would return the previous round's answer: eagerly, in a chain of the package's own
kernels (quantize -> dequantize -> GEMM, each triggering the next early), and under a CUDA
graph replayed on new inputs. Outputs are poisoned before every round."""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import quant, reference
from cute_fp4.kernels import roles
from cute_fp4.operands import make_operands
from cute_fp4.packed import repack
from gpu import selection

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
