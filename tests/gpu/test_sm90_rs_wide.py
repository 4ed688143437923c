"""The sm_90a ``rs_packed`` kernels (packed-weight register-sourced WGMMA) on an H100/H200.

Against the exact reference with NaN-poisoned outputs: every rs_packed catalogue schedule
with BF16 activations, one with FP16 and one with NVFP4 (W4A4) activations, over M = 1..8192
(tails around the activation tile), N tails (multiples of 8 not of 64 or 128) and K from 64
to 8256; through ``gemm`` with a PackedNVFP4Weight ("auto" and named schedules), split-K,
non-persistent, FP32 output, bit-identical reruns, and the refusals of a layout mismatch.
"""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import catalogue, packed, reference
from cute_fp4.api import make_operands, out_dtype_of, poisoned_check
from cute_fp4.compile import Signature, compile
from cute_fp4.errors import InputError
from cute_fp4.schedule import Mainloop

SHAPES = [(1, 136, 192), (7, 8, 64), (16, 4096, 4096), (63, 264, 320), (64, 1000, 832),
          (65, 392, 4160), (200, 136, 448), (255, 256, 8256), (257, 520, 1024),
          (1027, 1000, 832), (4096, 4096, 4096), (8192, 264, 1024)]
RS = [s for s in catalogue.all_schedules("sm90", grouped=False)
      if s.mainloop is Mainloop.RS_PACKED]


def _cases():
    out = [pytest.param(s, "bf16", id=f"{s.name}-bf16") for s in RS]
    if RS:
        out.append(pytest.param(RS[0], "fp16", id=f"{RS[0].name}-fp16"))
        out.append(pytest.param(RS[-1], "nvfp4", id=f"{RS[-1].name}-nvfp4"))
    return out


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("s, fmt", _cases())
def test_rs_packed_matches_reference(s, fmt):
    kern = compile(s, Signature(fmt))
    for i, (m, n, k) in enumerate(SHAPES):
        a, b = make_operands(m, n, k, fmt, seed=i)
        poison = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
        assert not reference.check(poison, a, b).passed  # the poison is detectable
        res = poisoned_check(kern, a, b)  # run_compiled packs b for rs_packed kernels
        assert res.passed, f"{s.name} {fmt} {(m, n, k)}: {res}"


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("change", [dict(split_k=2), dict(persistent=False),
                                    dict(out_dtype="fp32"), dict(stages=2)])
def test_rs_packed_variants(change):
    s = catalogue.get("sm90_rs_packed_m64").replace(**change)
    kern = compile(s, Signature("bf16"))
    for i, (m, n, k) in enumerate([(1, 136, 4096), (100, 264, 832), (1027, 520, 1024)]):
        a, b = make_operands(m, n, k, "bf16", seed=10 + i)
        assert poisoned_check(kern, a, b).passed, (s.name, m, n, k)


@pytest.mark.gpu("sm90")
def test_gemm_with_a_packed_weight():
    a, w = make_operands(300, 1000, 2048, "bf16", seed=3)
    pw = packed.repack(w)
    for schedule in ("auto", "sm90_rs_packed", "sm90_rs_packed_w256"):
        out = torch.full((300, 1000), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = cf.gemm(a, pw, schedule=schedule, out=out)
        assert reference.check(y, a, w).passed, schedule
    y1 = cf.gemm(a, pw, schedule="sm90_rs_packed")
    y2 = cf.gemm(a, pw, schedule="sm90_rs_packed")
    assert torch.equal(y1, y2)  # deterministic
    plain = cf.gemm(a, w)  # the plain weight keeps today's kernels
    assert reference.check(plain, a, w).passed
    with pytest.raises(InputError, match="plain weight layout"):
        cf.gemm(a, pw, schedule="sm90_default")
    with pytest.raises(InputError, match="rs_packed schedules take"):
        cf.gemm(a, w, schedule="sm90_rs_packed")


@pytest.mark.gpu("sm90")
def test_packed_weight_unpacks_on_the_gpu():
    _, w = make_operands(1, 520, 1024, "bf16", seed=5)
    back = packed.repack(w).unpack()
    assert torch.equal(back.data, w.data)
    assert torch.equal(back.scale.view(torch.uint8), w.scale.view(torch.uint8))
