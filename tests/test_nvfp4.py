"""The NVFP4 format on the CPU: code tables, rounding, scales, layout, errors."""

from __future__ import annotations

import math

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import nvfp4
from cute_fp4.errors import FormatError, InputError


def test_e2m1_code_table():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    table = nvfp4.e2m1_table().tolist()
    assert table == want
    assert math.copysign(1, table[8]) == -1  # code 8 is -0
    codes = torch.arange(16, dtype=torch.uint8)
    # encoding every representable value gives its code back (except -0 -> +0)
    enc = nvfp4.e2m1_encode(nvfp4.e2m1_table())
    assert enc.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]
    assert nvfp4.e2m1_decode(codes).tolist() == want


def test_e4m3_code_table_matches_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    torch_vals = codes.view(torch.float8_e4m3fn).float().tolist()
    for c in range(256):
        mine = nvfp4.e4m3_decode(c)
        if math.isnan(mine):
            assert c in (0x7F, 0xFF) and math.isnan(torch_vals[c])
        else:
            assert mine == torch_vals[c], c
    assert nvfp4.e4m3_decode(0x7E) == 448.0
    assert nvfp4.e4m3_decode(0x01) == 2.0**-9


@pytest.mark.parametrize("x, code", [
    (0.25, 0), (0.26, 1), (0.75, 2), (0.74, 1), (1.25, 2), (1.75, 4), (2.5, 4),
    (3.5, 6), (5.0, 6), (5.01, 7), (7.0, 7), (1e9, 7), (-0.25, 8), (-0.75, 10), (-5.0, 14),
])
def test_e2m1_round_nearest_even(x, code):
    assert int(nvfp4.e2m1_encode(torch.tensor([x]))[0]) == code


def test_e2m1_rounding_is_nearest():
    x = torch.linspace(-7, 7, 20001)
    q = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x))
    grid = nvfp4.e2m1_table()
    best = (x[:, None] - grid[None, :]).abs().min(dim=1).values
    sat = x.abs() > 6
    assert torch.equal((q - x).abs()[~sat], best[~sat])
    assert torch.equal(q[sat].abs(), torch.full_like(q[sat], 6.0))


def test_pack_low_nibble_is_even_k():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert nvfp4.pack_e2m1(codes).tolist() == [[0x21, 0x43]]
    assert torch.equal(nvfp4.unpack_e2m1(nvfp4.pack_e2m1(codes)), codes)


def _blockwise_bound(x, t):
    """|x - dq| <= half the E2M1 spacing at the block's top (2 * scale * gs / 2 = s*gs)."""
    sf = t.scale_linear().float().repeat_interleave(16, dim=1)
    return sf * float(t.global_scale) * 1.0 + 1e-30


@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (129, 64), (300, 272)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_quantize_error_bound(shape, scale, rng):
    x = torch.randn(shape, generator=rng) * scale
    t = cf.quantize(x)
    err = (t.dequantize() - x).abs()
    assert (err <= _blockwise_bound(x, t) * (1 + 1e-6)).all()
    # the largest element of the tensor is represented within 1/12 relative error
    i = x.abs().argmax()
    assert err.view(-1)[i] <= x.abs().max() / 12 * (1 + 1e-6)


def test_quantize_uses_decode_global_scale():
    x = torch.randn(4, 32)
    t = cf.quantize(x)
    assert float(t.global_scale) == pytest.approx(float(x.abs().max()) / 2688, rel=1e-6)
    t2 = cf.quantize(x, global_scale=0.01)
    assert float(t2.global_scale) == pytest.approx(0.01)


def test_zero_blocks_tiny_and_huge_values():
    x = torch.zeros(2, 64)
    x[0, 16:32] = 1e-30  # tiny next to a large block: subnormal / minimum scale
    x[0, 32:48] = 1e30
    x[1] = 0.0
    t = cf.quantize(x)
    dq = t.dequantize()
    assert torch.equal(dq[1], torch.zeros(64))
    assert torch.equal(dq[0, :16], torch.zeros(16))
    assert torch.allclose(dq[0, 32:48], x[0, 32:48], rtol=1e-6)
    sf = t.scale_linear().float()
    assert sf[0, 0] == 0 and sf[0, 2] == 448.0
    assert sf[0, 1] == 2.0**-9  # non-zero block gets the smallest subnormal scale


def test_subnormal_scales_are_used():
    x = torch.ones(1, 32)
    x[0, 16:] = 1e-3  # scale 1e-3/6/gs with gs = 1/2688 -> ~0.45: normal
    t = cf.quantize(x, global_scale=1.0)  # forces tiny scales: 1/6 and 1.7e-4
    sf = t.scale_linear().float()[0]
    assert 0 < float(sf[1]) < 2.0**-6  # subnormal E4M3
    assert torch.allclose(t.dequantize()[0, 16:], x[0, 16:], rtol=0.3)


def test_scale_saturates_at_448():
    x = torch.full((1, 16), 100.0)
    t = cf.quantize(x, global_scale=1e-3)
    assert float(t.scale_linear().float()[0, 0]) == 448.0
    assert torch.allclose(t.dequantize(), torch.full((1, 16), 448 * 6 * 1e-3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rejected(bad):
    x = torch.ones(2, 16)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        cf.quantize(x)


def test_k_not_multiple_of_16_rejected():
    with pytest.raises(ValueError, match="K = 24 is not a multiple of 16"):
        cf.quantize(torch.ones(2, 24))


@pytest.mark.parametrize("rows, k", [(1, 16), (127, 48), (128, 64), (129, 80), (300, 1040)])
def test_swizzle_offsets_match_formula(rows, k):
    cols = k // 16
    lin = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    blocked = cf.swizzle_scales(lin)
    rp, cp = nvfp4.scale_shape(rows, k)
    assert blocked.shape == (rp, cp)
    flat = blocked.reshape(-1)
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    off = nvfp4.scale_offset(r, c, k)
    assert torch.equal(flat[off], lin)
    written = torch.zeros(rp * cp, dtype=torch.bool)
    written[off.reshape(-1)] = True
    assert int(flat[~written].count_nonzero()) == 0  # padding is zero
    assert torch.equal(cf.unswizzle_scales(blocked, rows, k), lin)


def test_swizzle_keeps_fp8_dtype():
    lin = torch.rand(5, 3).to(torch.float8_e4m3fn)
    b = cf.swizzle_scales(lin)
    assert b.dtype == torch.float8_e4m3fn
    assert torch.equal(cf.unswizzle_scales(b, 5, 48).view(torch.uint8), lin.view(torch.uint8))


def test_tensor_accessors_and_modelopt_round_trip(rng):
    x = torch.randn(130, 96, generator=rng)
    t = cf.quantize(x)
    assert t.data.shape == (130, 48) and t.data.dtype == torch.uint8
    assert t.scale.dtype == torch.float8_e4m3fn and t.scale.shape == (256, 8)
    assert t.shape == (130, 96)
    assert t.global_scale.dtype == torch.float32 and t.global_scale.dim() == 0
    lin = t.scale_linear()
    assert lin.shape == (130, 6)
    t2 = cf.NVFP4Tensor.from_modelopt(t.data, lin, t.global_scale)
    assert torch.equal(t2.dequantize(), t.dequantize())
    assert torch.equal(t2.scale.view(torch.uint8), t.scale.view(torch.uint8))


def test_modelopt_wrong_scale_shape():
    with pytest.raises(FormatError, match=r"\[4, 2\]"):
        cf.NVFP4Tensor.from_modelopt(torch.zeros(4, 16, dtype=torch.uint8),
                                     torch.zeros(4, 3, dtype=torch.float8_e4m3fn), 1.0)


def test_wrong_blocked_scale_size():
    with pytest.raises(FormatError, match="need 128 x 4 = 512 bytes, got 16"):
        cf.NVFP4Tensor(torch.zeros(4, 16, dtype=torch.uint8),
                       torch.zeros(4, 4, dtype=torch.float8_e4m3fn), 1.0)


def test_quantize_rejects_int_and_4d():
    with pytest.raises(InputError, match="int64"):
        cf.quantize(torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(InputError, match="2-D"):
        cf.quantize(torch.ones(2, 2, 2, 16))  # 3-D is an expert stack
