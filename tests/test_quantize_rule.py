"""One quantization rule (``cute_fp4.nvfp4``): CPU ``quantize`` against the fused kernel's
CPU model (``tests/quantize_model.py``, both of its E2M1 encoders: SM90's software one and
SM120's hardware ``cvt``) at every E2M1 and UE4M3 rounding boundary and tie, and over random
blocks. The GPU side (CPU vs CUDA torch vs the fused kernel, >= 10M blocks) is
``tests/gpu/test_quantize_rule.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quantize_model import (
    e2m1_tie_blocks,
    quantize_model,
    random_blocks,
    tie_case,
    ue4m3_boundary_cases,
)

from cute_fp4.nvfp4 import quantize

DTYPES = [torch.bfloat16, torch.float16]
# power-of-two global scales: the fast path (1, 2^-7), the general one (2^7 > 64; bf16 also
# 2^-100 < 2^-80)
TIE_SCALES = {torch.bfloat16: (1.0, 2.0**-7, 2.0**7, 2.0**-100),
              torch.float16: (1.0, 2.0**-7, 2.0**7)}


def mismatches(x: torch.Tensor, gs) -> int:
    """Bytes (codes and scales, padding included) where CPU quantize and the kernel's model
    (either encoder) differ."""
    ref = quantize(x, gs)
    data, scale = ref.data.numpy(), ref.scale.view(torch.uint8).reshape(-1).numpy()
    bad = 0
    for hw in (False, True):
        d, s, _ = quantize_model(x, gs, hw=hw)
        bad += int((d != data).sum()) + int((s != scale).sum())
    return bad


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_e2m1_tie_and_neighbour(dtype):
    for gs in TIE_SCALES[dtype]:
        x = e2m1_tie_blocks(dtype, gs)
        assert mismatches(x, gs) == 0, gs
        codes = quantize(x, gs).data
        assert codes.unique().numel() > 8  # the ties really spread over the codes


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_ue4m3_boundary(dtype):
    cases = ue4m3_boundary_cases(dtype)
    scales = set()
    for x, gs in cases:
        assert mismatches(x, gs) == 0, gs
        scales.update(quantize(x, gs).scale_linear().view(torch.uint8).unique().tolist())
    assert len(scales) >= 100  # most UE4M3 codes were produced (subnormal ones included)
    assert {1, 126} <= scales  # the smallest subnormal and the saturated 448


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_random_blocks(dtype):
    x = random_blocks(2**18, dtype, seed=3 if dtype == torch.bfloat16 else 4)
    for i, gs in enumerate((None, 3e-3, 1e-30, 300.0)):  # dynamic, fast, general x 2
        part = x[i * 256:(i + 1) * 256]
        assert mismatches(part, gs) == 0, gs


def test_the_comparison_can_fail():
    """A model that divides by 6 (the CPU rule before) differs on this block."""
    x, gs = tie_case()
    d, s, _ = quantize_model(x, gs, div6="true")
    ref = quantize(x, gs)
    assert not np.array_equal(s, ref.scale.view(torch.uint8).reshape(-1).numpy())
