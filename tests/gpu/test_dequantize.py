"""NVFP4 -> BF16 dequantization on a GPU (``quant.dequantize_activation``) and the W4A4
route built on it (``gemm`` of an NVFP4 activation and a fragment-order SM90 weight with
``schedule="auto"``: the activation decoded once, then the W4A16 kernel).

The dequantizer writes into an output poisoned with NaN, compared bit for bit with
``NVFP4Tensor.block_values(torch.bfloat16)`` (exact: e2m1 x scale fits BF16) on awkward
operands (scales over ~14 binades, subnormal scales, zero blocks), M = 1, odd M, M around
128, K = 16 x odd. The W4A4 route is checked against the exact reference into poisoned
outputs, for BF16 and FP16 outputs, a given alpha, and under CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import quant, reference
from cute_fp4.errors import InputError
from cute_fp4.operands import make_operands
from cute_fp4.packed import repack
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

SHAPES = [(1, 16), (1, 4096), (2, 48), (7, 1040), (127, 64), (128, 112), (129, 2080),
          (300, 4096), (4096, 1024)]


@pytest.mark.parametrize("m, k", SHAPES)
@pytest.mark.parametrize("dist", ["awkward", "normal"])
def test_block_values_bit_for_bit(m, k, dist):
    a, _ = make_operands(m, 8, k, "nvfp4", seed=m + k, dist=dist)
    out = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert quant.dequantize_activation(a, out=out) is out
    want = a.block_values(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.equal(quant.dequantize_activation(a).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("seed", range(4))
def test_the_scales_product_comes_from_the_same_launch_bit_for_bit(seed):
    a, b = make_operands(16 + seed, 8, 4096, "nvfp4", seed=seed)
    gb = b.global_scale.to(torch.float32).reshape(())
    vals, alpha = quant.dequantize_with_alpha(a, gb)
    want = a.global_scale.to(torch.float32) * gb  # what alpha_tensor computes
    assert alpha.shape == () and torch.equal(alpha.view(torch.int32), want.view(torch.int32))
    assert torch.equal(vals.view(torch.int16), a.block_values(torch.bfloat16).view(torch.int16))


def test_bad_out_is_refused_before_writing():
    a, _ = make_operands(4, 8, 64, "nvfp4")
    out = torch.full((4, 64), 7.0, dtype=torch.float16, device="cuda")
    with pytest.raises(InputError, match="bfloat16"):
        quant.dequantize_activation(a, out=out)
    assert bool((out == 7).all())


def _sm90():
    selection.skip_unless_packed()


@pytest.mark.parametrize("m, n, k", [(1, 256, 4096), (16, 1024, 4096), (64, 512, 1024),
                                     (129, 264, 640), (256, 1024, 8192), (1000, 512, 512)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_w4a4_on_a_packed_weight_matches_the_reference(m, n, k, out_dtype):
    _sm90()
    a, b = make_operands(m, n, k, "nvfp4", seed=m * n)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    assert cf.gemm(a, repack(b), out=out, out_dtype=out_dtype) is out
    res = reference.check(out, a, b)
    assert res.passed, str(res)
    alpha = torch.tensor(0.375, device="cuda")  # a given alpha replaces the scales' product
    y = cf.gemm(a, repack(b), alpha=alpha)
    res = reference.check(y, a, b, alpha)
    assert res.passed, str(res)


def test_w4a4_route_under_cuda_graph_capture():
    _sm90()
    a, b = make_operands(16, 1024, 4096, "nvfp4", seed=3)
    packed = repack(b)
    out = torch.full((16, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    cf.gemm(a, packed, out=out)  # warm: compile, workspaces
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cf.gemm(a, packed, out=out)
    g.replay()
    torch.cuda.synchronize()
    res = reference.check(out, a, b)
    assert res.passed, str(res)
