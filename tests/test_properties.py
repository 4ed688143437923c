"""Property tests (hypothesis) of quantize, dequantize and the scale layout helpers."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cute_fp4 as cf
from cute_fp4 import nvfp4

dims = st.tuples(st.integers(1, 300), st.integers(1, 20).map(lambda b: 16 * b))
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw):
    rows, k = draw(dims)
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.integers(-30, 30))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0**log_scale
    if draw(st.booleans()):  # zero some blocks
        x.view(rows, k // 16, 16)[torch.rand(rows, k // 16, generator=g) < 0.3] = 0
    return x


@settings(max_examples=60, deadline=None)
@given(matrices())
def test_dequantize_error_within_half_step(x):
    t = cf.quantize(x)
    dq = t.dequantize(torch.float64)
    sf = t.scale_linear().double().repeat_interleave(16, dim=1) * t.global_scale.double()
    # within one block the E2M1 grid step is at most 2 * scale: error <= scale, except where
    # the block scale saturated or underflowed (then the scale itself is off)
    bamax = x.double().abs().view(x.shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=1)
    ideal = bamax / 6 / t.global_scale.double()
    normal = (ideal <= 448) & (ideal >= 2.0**-6)
    err = (dq - x.double()).abs()
    assert bool((err[normal] <= sf[normal] * (1 + 1e-6) + 1e-30).all())


@settings(max_examples=60, deadline=None)
@given(matrices())
def test_quantize_is_idempotent_on_its_own_output(x):
    t = cf.quantize(x)
    t2 = cf.quantize(t.dequantize(), global_scale=t.global_scale)
    assert torch.equal(t2.dequantize(), t.dequantize())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 600), st.integers(1, 40))
def test_swizzle_round_trip_and_offsets(rows, cols):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    lin = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    blocked = cf.swizzle_scales(lin)
    k = cols * 16
    assert torch.equal(cf.unswizzle_scales(blocked, rows, k), lin)
    r, c = rows - 1, cols - 1
    assert int(blocked.reshape(-1)[nvfp4.scale_offset(r, c, k)]) == int(lin[r, c])
    assert blocked.numel() == math.ceil(rows / 128) * 128 * math.ceil(cols / 4) * 4


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=16, max_size=16))
def test_e2m1_encode_decode_monotone(vals):
    x = torch.tensor(sorted(vals))
    q = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x))
    assert bool((q[1:] >= q[:-1]).all())  # rounding never reorders values
