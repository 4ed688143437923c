"""The torch API on a GPU: gemm, check=True, torch.compile, NVFP4Linear, alpha, errors."""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import reference
from cute_fp4.api import make_operands
from cute_fp4.errors import InputError
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")


def test_gemm_auto_and_check():
    a, b = make_operands(16, 512, 4096)
    y = cf.gemm(a, b, check=True)
    assert y.dtype == torch.bfloat16 and reference.check(y, a, b).passed


def test_alpha_and_out():
    a, b = make_operands(33, 256, 640)
    out = torch.full((33, 256), float("nan"), dtype=torch.float32, device="cuda")
    y = cf.gemm(a, b, out=out, out_dtype=torch.float32, alpha=0.5)
    assert y.data_ptr() == out.data_ptr()
    assert reference.check(out, a, b, alpha=0.5).passed


def test_bad_out_is_untouched():
    a, b = make_operands(8, 256, 640)
    out = torch.full((8, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(InputError, match=r"out must have shape \(8, 256\)"):
        cf.gemm(a, b, out=out)
    assert bool((out == 3.0).all())


def test_torch_compile_fullgraph():
    from cute_fp4 import gemm

    a, b = make_operands(16, 256, 640)

    @torch.compile(fullgraph=True)
    def f(x, w):
        return gemm(x, w) * 2

    assert reference.check(f(a, b) / 2, a, b).passed


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_linear(mode):
    if mode == "w4a16":
        selection.skip_unless_w4a16()
    lin = torch.nn.Linear(640, 256, bias=True).cuda()
    q = cf.NVFP4Linear.from_linear(lin, mode=mode)
    x = torch.randn(2, 5, 640, device="cuda", dtype=torch.bfloat16)
    y = q(x)
    assert y.shape == (2, 5, 256) and y.dtype == torch.bfloat16
    w = q.weight
    xa = cf.quantize(x.reshape(-1, 640).float()) if mode == "w4a4" else x.reshape(-1, 640)
    ref = reference.gemm(xa, w).float() + lin.bias.detach().float()
    assert torch.allclose(y.reshape(-1, 256).float(), ref, rtol=2e-2, atol=2e-2)


def test_validate_report():
    s = selection.default_schedule()
    rep = cf.validate(s, shapes=[(1, 136, 320), (129, 264, 832)])
    assert rep.passed and rep.poison_detected and len(rep.results) == 2
