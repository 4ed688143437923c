"""The exact reference GEMM and the error rule."""

from __future__ import annotations

import math

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import reference
from cute_fp4.errors import InputError, ValidationError
from cute_fp4.nvfp4 import NVFP4Tensor, e2m1_table, e4m3_decode


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


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_bound_is_the_bound_check_applies(out_dtype, rng):
    """``error_bound`` (the rule's public form) is the rule's formula and the per-element
    tolerance ``check`` holds an output of that dtype to: the same error ratio; the exact
    result moved by 0.99 of it passes, by 1.01 of it at one element fails."""
    a, b = _pair(5, 24, 96, rng)
    ref = reference.gemm(a, b, out_dtype=torch.float64)
    bound = reference.error_bound(a, b, out_dtype=out_dtype)
    assert bound.shape == ref.shape and bound.dtype == torch.float64 and (bound > 0).all()
    absdot = (a.block_values(torch.float64).abs() @ b.block_values(torch.float64).abs().T
              * float(a.global_scale) * float(b.global_scale))
    p, tiny = {torch.float32: (24, 2.0**-149), torch.bfloat16: (8, 2.0**-133),
               torch.float16: (11, 2.0**-24)}[out_dtype]  # precision, smallest subnormal
    acc = absdot * (-(-96 // 16) + 16) * 2.0**-23
    assert torch.allclose(bound, ref.abs() * 2.0**-p + acc * (1 + 2.0**-p) + tiny, rtol=1e-12)
    assert torch.equal(bound, reference.error_bound(a, b, out_dtype=out_dtype, ref=ref))
    out = (ref * (1 + 2.0**-6 * torch.randn(ref.shape, generator=rng, dtype=torch.float64))
           ).to(out_dtype)  # some elements outside the bound, some inside
    ratio = float(((out.double() - ref).abs() / bound).max())
    assert reference.check(out, a, b).max_err_over_bound == pytest.approx(ratio, rel=1e-9)
    if out_dtype is torch.float32:  # float32 holds these moves exactly enough
        inside = ref + 0.99 * bound * torch.sign(torch.randn(ref.shape, generator=rng))
        assert reference.check(inside.float(), a, b).passed
        inside[2, 7] = ref[2, 7] + 1.01 * bound[2, 7]
        assert not reference.check(inside.float(), a, b).passed


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


# ----------------------------------------------------------------------------- spec vectors
# Hand-written from the format's definition (shared/notes/nvfp4-format.md), independent of
# the package's decoders: a bug in e2m1_decode, the UE4M3 decode, the scale layout or
# block_values fails these, where comparing the reference with dequantize cannot.

E2M1_SPEC = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,  # codes 0..7: sign 0, 2 exponent bits,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # 1 mantissa bit; 8..15 negated
# UE4M3 code -> value: bias 7, exponent 0 subnormal (m/8 * 2^-6), 0x7E the largest (448)
UE4M3_SPEC = {0x00: 0.0, 0x01: 2.0**-9, 0x02: 2.0**-8, 0x03: 3 * 2.0**-9, 0x07: 7 * 2.0**-9,
              0x08: 2.0**-6, 0x09: 1.125 * 2.0**-6, 0x30: 0.5, 0x38: 1.0, 0x39: 1.125,
              0x3F: 1.875, 0x40: 2.0, 0x77: 240.0, 0x7E: 448.0}


def _packed(codes_per_row: list[list[int]]) -> torch.Tensor:
    """uint8 [R, K/2] from E2M1 codes, the even K index in the low nibble."""
    return torch.tensor([[row[2 * j] | (row[2 * j + 1] << 4) for j in range(len(row) // 2)]
                         for row in codes_per_row], dtype=torch.uint8)


def _scales(rows: int, codes: dict[tuple[int, int], int]) -> torch.Tensor:
    """One 128x4 scale atom (rows <= 128, K <= 64): row r, block c at byte
    16 (r % 32) + 4 (r // 32) + c (the cuBLAS / CUTLASS 128x4 layout), padding zero."""
    flat = torch.zeros(512, dtype=torch.uint8)
    for (r, c), code in codes.items():
        flat[16 * (r % 32) + 4 * (r // 32) + c] = code
    return flat.view(torch.float8_e4m3fn).view(128, 4)


def test_spec_every_e2m1_code():
    codes = list(range(16)) + list(range(15, -1, -1))  # block 0: 0..15, block 1: 15..0
    t = NVFP4Tensor(_packed([codes]), _scales(1, {(0, 0): 0x38, (0, 1): 0x40}), 0.5)
    want = E2M1_SPEC + [2.0 * v for v in reversed(E2M1_SPEC)]  # block 1's scale is 2
    got = t.block_values(torch.float64)[0].tolist()
    assert got == want
    assert [math.copysign(1.0, v) for v in got] == [math.copysign(1.0, v) for v in want]
    assert t.dequantize(torch.float64)[0].tolist() == [0.5 * v for v in want]
    assert e2m1_table(torch.float64).tolist() == E2M1_SPEC


def test_spec_ue4m3_codes_subnormals_and_max():
    items = sorted(UE4M3_SPEC.items())
    rows = len(items)
    data = _packed([[2] * 16] * rows)  # every element 1.0: a block's value is its scale
    t = NVFP4Tensor(data, _scales(rows, {(r, 0): c for r, (c, _) in enumerate(items)}), 1.0)
    got = t.block_values(torch.float64)
    for r, (code, value) in enumerate(items):
        assert got[r].tolist() == [value] * 16, hex(code)
        assert e4m3_decode(code) == value, hex(code)
    assert math.isnan(e4m3_decode(0x7F))


def test_spec_gemm_2x32x2_by_hand():
    """D = alpha A B^T for A [2, 32], B [2, 32], each row two 16-element blocks of one code
    and one scale; every product worked out below."""
    # A row 0: 1.0 (code 2, scale 1.0) then 3.0 (code 5, scale 1.0)
    # A row 1: -0.5 (code 9, scale 1.0) then 2.0 (code 4, scale 1.0)
    a = NVFP4Tensor(_packed([[2] * 16 + [5] * 16, [9] * 16 + [4] * 16]),
                    _scales(2, {(0, 0): 0x38, (0, 1): 0x38, (1, 0): 0x38, (1, 1): 0x38}), 0.5)
    # B row 0: 0.5 (code 1, scale 1.0) then -1.0 (code 10, scale 1.0)
    # B row 1: 6 * 2^-9 (code 7, the smallest subnormal scale 0x01) then 1.5 * 448 = 672
    #          (code 3, the largest scale 0x7E)
    b = NVFP4Tensor(_packed([[1] * 16 + [10] * 16, [7] * 16 + [3] * 16]),
                    _scales(2, {(0, 0): 0x38, (0, 1): 0x38, (1, 0): 0x01, (1, 1): 0x7E}), 0.25)
    alpha = 0.5 * 0.25  # the global scales' product
    d00 = 16 * (1.0 * 0.5) + 16 * (3.0 * -1.0)  # 8 - 48 = -40
    d01 = 16 * (1.0 * 6 * 2.0**-9) + 16 * (3.0 * 672)  # 0.1875 + 32256
    d10 = 16 * (-0.5 * 0.5) + 16 * (2.0 * -1.0)  # -4 - 32 = -36
    d11 = 16 * (-0.5 * 6 * 2.0**-9) + 16 * (2.0 * 672)  # -0.09375 + 21504
    want = [[alpha * d00, alpha * d01], [alpha * d10, alpha * d11]]
    assert want == [[-5.0, 4032.0234375], [-4.5, 2687.98828125]]  # the arithmetic above
    assert reference.gemm(a, b, out_dtype=torch.float64).tolist() == want
    assert reference.gemm(a, b, alpha=1.0, out_dtype=torch.float64).tolist() == \
        [[d00, d01], [d10, d11]]
