"""One quantization rule on a GPU: CPU ``quantize``, CUDA ``quantize`` (the torch path) and
the fused kernel (``quant.quantize_activation``) give the same bytes (codes, scales with
their padding, global scale) for over 10M random blocks and for every E2M1 and UE4M3
rounding boundary and tie (``tests/quantize_model.py``'s sets, which CI compares with the
kernel's CPU model). Kernel outputs are poisoned first. Skipped without SM90 / SM12x."""

from __future__ import annotations

import pytest
import torch
from quantize_model import e2m1_tie_blocks, random_blocks, ue4m3_boundary_cases

from cute_fp4 import quant
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape

pytestmark = pytest.mark.gpu("sm90", "sm120")

DTYPES = [torch.bfloat16, torch.float16]
CHUNK = 2**20  # blocks per random chunk: [4096, 4096]
# (dtype, global scale) of each random chunk: 11 chunks, 11.5M blocks; None: dynamic
CHUNKS = [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, 3e-3),
          (torch.float16, 3e-3), (torch.bfloat16, 2.0**-7), (torch.float16, 0.37),
          (torch.bfloat16, 1e-30), (torch.float16, 300.0), (torch.bfloat16, 300.0),
          (torch.bfloat16, 7.1e-6), (torch.float16, 1.0)]


def _bytes(t: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (t.data.cpu(), t.scale.view(torch.uint8).reshape(-1).cpu(),
            t.global_scale.reshape(1).cpu().view(torch.int32))


def _kernel(x: torch.Tensor, gs) -> NVFP4Tensor:
    """The fused kernel into poisoned outputs."""
    m, k = x.shape
    data = torch.full((m, k // 2), 0xA5, dtype=torch.uint8, device="cuda")
    scale = torch.full(scale_shape(m, k), 0x5A, dtype=torch.uint8, device="cuda")
    gs_out = torch.full((), float("nan"), dtype=torch.float32, device="cuda")
    out = NVFP4Tensor._unchecked(data, scale.view(torch.float8_e4m3fn), gs_out, (m, k))
    gs_t = None if gs is None else torch.full((1,), gs, dtype=torch.float32, device="cuda")
    return quant.quantize_activation(x, gs_t, out=out)


def differences(x: torch.Tensor, gs) -> dict[str, int]:
    """Bytes where CUDA quantize and the fused kernel differ from CPU quantize."""
    cpu = _bytes(quantize(x, gs))
    xc = x.cuda()
    out = {}
    for name, got in (("cuda", quantize(xc, gs)), ("kernel", _kernel(xc, gs))):
        torch.cuda.synchronize()
        out[name] = sum(int((a != b).sum()) for a, b in zip(cpu, _bytes(got)))
    return out


def test_over_ten_million_random_blocks():
    total = 0
    for i, (dtype, gs) in enumerate(CHUNKS):
        x = random_blocks(CHUNK, dtype, seed=100 + i)
        diff = differences(x, gs)
        assert diff == {"cuda": 0, "kernel": 0}, (i, dtype, gs, diff)
        total += x.numel() // 16
    assert total >= 10_000_000


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_boundary_and_tie(dtype):
    scales = (1.0, 2.0**-7, 2.0**7) + ((2.0**-100,) if dtype == torch.bfloat16 else ())
    cases = [(e2m1_tie_blocks(dtype, gs), gs) for gs in scales]
    cases += ue4m3_boundary_cases(dtype)
    for x, gs in cases:
        diff = differences(x, gs)
        assert diff == {"cuda": 0, "kernel": 0}, (gs, diff)


def test_the_comparison_can_fail():
    x = random_blocks(2**12, torch.bfloat16, seed=1)
    cpu = quantize(x, 3e-3)
    got = quantize(x.cuda(), 3e-3)
    got.data[5, 7] ^= 1
    assert sum(int((a != b).sum()) for a, b in zip(_bytes(cpu), _bytes(got))) == 1
