"""The weight-streaming decode kernel (``mainloop=stream``) on the GPU it runs on: sm_90a
(H100/H200) and, unchanged, sm_120a/sm_121a (the same kernel; warp-level ``mma.sync``).

Against the exact reference with NaN-poisoned outputs over M = 1..33 (one and two
activation tiles, both tile heights), N tails (multiples of 8 not of 64), K from 64 to
16384, every split-K from 1 to 16 and more than the units of a small K, batches of 1..8
units in flight, BF16 and FP16 activations, BF16/FP16/FP32 outputs; split-K reruns
bit-identical; through ``gemm`` with a PackedNVFP4Weight and "auto".
"""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import packed, reference
from cute_fp4.api import make_operands, poisoned_check
from cute_fp4.compile import Signature, compile
from cute_fp4.planning.stream import stream_schedule
from cute_fp4.targets import detect_device

WATCHDOG_S = 600

SHAPES = [(1, 8, 64), (1, 136, 192), (2, 72, 4160), (5, 1000, 832), (8, 4096, 4096),
          (9, 264, 16384), (16, 520, 1024), (17, 136, 2048), (33, 1000, 320)]
VARIANTS = [dict(tile_m=16), dict(tile_m=8), dict(tile_m=16, stages=1),
            dict(tile_m=16, stages=4), dict(tile_m=8, split_k=3, stages=3),
            dict(tile_m=16, split_k=4), dict(tile_m=8, split_k=16, stages=1)]


def _schedule(**kw):
    return stream_schedule(detect_device().target.name, **kw)


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in
                                                                  kw.items()))
def test_stream_matches_reference(kw):
    s = _schedule(**kw)
    kern = compile(s, Signature("bf16"))
    for i, (m, n, k) in enumerate(SHAPES):
        if s.split_k > k // 64:
            continue  # plan() refuses more splits than K units (tested on the CPU)
        a, b = make_operands(m, n, k, "bf16", seed=i)
        res = poisoned_check(kern, a, b)  # run_compiled packs b for the stream kernel
        assert res.passed, f"{s.label()} {(m, n, k)}: {res}"


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("fmt, out", [("fp16", "bf16"), ("bf16", "fp16"), ("bf16", "fp32"),
                                      ("fp16", "fp32")])
def test_stream_formats(fmt, out):
    s = _schedule(split_k=2).replace(out_dtype=out)
    kern = compile(s, Signature(fmt))
    for i, (m, n, k) in enumerate([(1, 136, 4096), (11, 264, 832), (16, 4096, 8192)]):
        a, b = make_operands(m, n, k, fmt, seed=20 + i)
        assert poisoned_check(kern, a, b).passed, (s.label(), fmt, m, n, k)


@pytest.mark.gpu("sm90", "sm120")
def test_stream_split_k_is_deterministic():
    s = _schedule(split_k=8)
    a, w = make_operands(4, 4096, 8192, "bf16", seed=7)
    pw = packed.repack(w)
    outs = [cf.gemm(a, pw, schedule=s) for _ in range(5)]
    assert reference.check(outs[0], a, w).passed
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gemm_auto_on_a_packed_weight_at_decode(m):
    a, w = make_operands(m, 2048, 4096, "bf16", seed=30 + m)
    pw = packed.repack(w)
    out = torch.full((m, 2048), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = cf.gemm(a, pw, out=out)
    assert reference.check(y, a, w).passed
