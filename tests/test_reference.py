"""The exact reference GEMM and the error rule."""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import reference
from cute_fp4.errors import InputError, ValidationError


def _pair(m, n, k, rng, scale=1.0):
    a = cf.quantize(torch.randn(m, k, generator=rng) * scale)
    b = cf.quantize(torch.randn(n, k, generator=rng))
    return a, b


@pytest.mark.parametrize("m, n, k", [(1, 8, 16), (7, 24, 48), (129, 40, 320)])
def test_w4a4_matches_float64_dequant_matmul(m, n, k, rng):
    a, b = _pair(m, n, k, rng)
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64).T
    got = reference.gemm(a, b, out_dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_alpha_overrides_global_scales(rng):
    a, b = _pair(4, 8, 32, rng)
    raw = a.block_values() @ b.block_values().T
    assert torch.allclose(reference.gemm(a, b, alpha=2.0, out_dtype=torch.float64), 2 * raw)


def test_w4a16(rng):
    x = torch.randn(5, 64, generator=rng).to(torch.bfloat16)
    b = cf.quantize(torch.randn(16, 64, generator=rng))
    want = x.double() @ b.dequantize(torch.float64).T
    got = reference.gemm(x, b, out_dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12)


def test_out_dtype(rng):
    a, b = _pair(3, 8, 32, rng)
    assert reference.gemm(a, b, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_error_rule_accepts_fp32_accumulation_and_rejects_real_errors(rng):
    a, b = _pair(64, 48, 4096, rng)
    # an FP32 accumulation in a different order is within the rule
    fp32 = (a.block_values().float() @ b.block_values().float().T) * float(
        a.global_scale * b.global_scale)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert reference.check(fp32.to(dt), a, b).passed
    # one wrong element, an unwritten (poisoned) element, or a dropped K block fail
    bad = fp32.clone()
    bad[3, 5] *= 1.01
    assert not reference.check(bad, a, b).passed
    poisoned = fp32.clone()
    poisoned[10, 10] = float("nan")
    res = reference.check(poisoned, a, b)
    assert not res.passed and res.nonfinite == 1
    # a dropped K block (the classic tail bug) fails
    a2, b2 = _pair(16, 16, 272, rng)
    short = (a2.block_values()[:, :-16].float() @ b2.block_values()[:, :-16].float().T) * float(
        a2.global_scale * b2.global_scale)
    assert not reference.check(short, a2, b2).passed
    with pytest.raises(ValidationError, match="M=64 N=48 K=4096"):
        reference.assert_close(bad, a, b)


def test_reference_errors(rng):
    a, b = _pair(2, 8, 32, rng)
    c = cf.quantize(torch.randn(8, 64))
    with pytest.raises(InputError, match="K mismatch"):
        reference.gemm(a, c)
    with pytest.raises(InputError, match="float32"):
        reference.gemm(torch.ones(2, 32), b)
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        reference.gemm(a, torch.ones(8, 32))


def test_awkward_operands_have_the_hard_cases():
    from cute_fp4.api import make_operands

    a, b = make_operands(64, 128, 1024, device="cpu", seed=3)
    sf = b.scale_linear().float()
    assert (sf == 0).any()  # zero blocks
    assert sf[sf > 0].max() / sf[sf > 0].min() > 2.0**12  # scales spanning many binades
    assert (sf[sf > 0] < 2.0**-6).any()  # subnormal UE4M3 scales
    x, _ = make_operands(8, 128, 64, "bf16", device="cpu")
    assert x.dtype == torch.bfloat16 and x.shape == (8, 64)
    # the same seed gives the same operands (validation runs are reproducible)
    a2, _ = make_operands(64, 128, 1024, device="cpu", seed=3)
    assert torch.equal(a.data, a2.data)


def test_overflow_to_inf_is_accepted_only_where_the_exact_result_overflows(rng):
    a = cf.quantize(torch.full((2, 64), 6.0))
    b = cf.quantize(torch.full((3, 64), 6.0))
    gs = float(a.global_scale * b.global_scale)
    big, one = 30.0 * gs, gs  # results 30 * 64 * 36 = 69,120 (> FP16 max) and 2,304
    ref = reference.gemm(a, b, alpha=big, out_dtype=torch.float64)
    assert float(ref.min()) > 65504
    out = ref.to(torch.float16)  # IEEE: +inf
    assert torch.isinf(out).all() and reference.check(out, a, b, alpha=big).passed
    assert not reference.check(-out, a, b, alpha=big).passed  # wrong sign
    nan = out.clone()
    nan[0, 0] = float("nan")
    assert not reference.check(nan, a, b, alpha=big).passed
    small = reference.gemm(a, b, alpha=one, out_dtype=torch.float16)
    assert reference.check(small, a, b, alpha=one).passed
    small[1, 1] = float("inf")  # an infinity where the result fits fails
    assert not reference.check(small, a, b, alpha=one).passed
