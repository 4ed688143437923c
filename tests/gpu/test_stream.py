"""The weight-streaming decode kernel (``mainloop=stream``) on the GPU it runs on: sm_90a
(H100/H200) and, unchanged, sm_120a/sm_121a (the same kernel; warp-level ``mma.sync``).

Against the exact reference with NaN-poisoned outputs over M = 1..33 (one and two
activation tiles, both tile heights), N tails (multiples of 8 not of 64), K from 64 to
16384, every split-K from 1 to 16 and more than the units of a small K, batches of 1..8
units in flight, BF16 and FP16 activations, BF16/FP16/FP32 outputs; split-K reruns
bit-identical; through ``gemm`` with a PackedNVFP4Weight and "auto".

Weights before the wait (the launch's ``early`` flag, kernels/stream.py): every variant
above again with the flag on, bit-identical to the flag off (the same arithmetic), M =
1..16 over tails, split-K, and in a CUDA graph of several GEMMs in a row (each reading
its weight while the one before runs).

Grouped (MoE experts at decode): M = 1..16 rows over random routings (empty experts, all
rows on one expert), N and K tails, BF16/FP16 activations, FP16/FP32 outputs and a given
alpha, reruns bit-identical; ``grouped_gemm`` "auto" on a packed stack (W4A16 and W4A4
through the activation's block values) and ``NVFP4MoE`` at decode in CUDA graphs replayed
with new routings. The catalogue's grouped stream schedules also run through
tests/gpu/test_grouped.py (routings, bad offsets with guard rows, graphs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import operands, packed, reference, run, tuning
from cute_fp4.api import make_operands, poisoned_check
from cute_fp4.bench import capture_graph
from cute_fp4.compile import Signature, compile
from cute_fp4.planning.stream import stream_schedule
from cute_fp4.targets import detect_device
from gpu import selection

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from decode_bench import stream_launch as launch_stream  # noqa: E402  (the early flag)

WATCHDOG_S = 600

SHAPES = [(1, 8, 64), (1, 136, 192), (2, 72, 4160), (5, 1000, 832), (8, 4096, 4096),
          (9, 264, 16384), (16, 520, 1024), (17, 136, 2048), (33, 1000, 320)]
VARIANTS = [dict(tile_m=16), dict(tile_m=8), dict(tile_m=16, stages=1),
            dict(tile_m=16, stages=4), dict(tile_m=8, split_k=3, stages=3),
            dict(tile_m=16, split_k=4), dict(tile_m=8, split_k=16, stages=1),
            dict(tile_m=8, warps=8), dict(tile_m=16, split_k=3, warps=8, stages=1)]


def _schedule(**kw):
    return stream_schedule(detect_device().target.name, **kw)


def _early_and_late(kern, a, w, pw):
    """(flag on, flag off) outputs of one problem, each poisoned first, the first checked."""
    outs = []
    for early in (True, False):
        out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=kern.out_dtype,
                         device="cuda")
        launch_stream(kern, a, pw, out, early)
        torch.cuda.synchronize()
        outs.append(out)
    return outs


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
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in
                                                                  kw.items()))
def test_stream_early_weights_match_reference_and_the_late_read(kw):
    """The flag on: the same shapes against the exact reference, bit-identical to the
    flag off, and again (reruns bit-identical)."""
    s = _schedule(**kw)
    kern = compile(s, Signature("bf16"))
    for i, (m, n, k) in enumerate(SHAPES):
        if s.split_k > k // 64:
            continue
        a, w = make_operands(m, n, k, "bf16", seed=100 + i)
        pw = packed.repack(w)
        early, late = _early_and_late(kern, a, w, pw)
        res = reference.check(early, a, w)
        assert res.passed, f"{s.label()} {(m, n, k)} early: {res}"
        assert torch.equal(early.view(torch.uint8), late.view(torch.uint8)), (m, n, k)
        again, _ = _early_and_late(kern, a, w, pw)
        assert torch.equal(again.view(torch.uint8), early.view(torch.uint8)), (m, n, k)


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("split", [1, 4])
def test_stream_early_weights_every_decode_size(split):
    """M = 1..16 (both tile heights), N and K tails, the flag on and off."""
    for tm in (8, 16):
        kern = compile(_schedule(tile_m=tm, split_k=split), Signature("bf16"))
        for m in range(1, 17):
            if m > tm and tm == 8 and m % 3:
                continue  # two 8-row tiles: a few M are enough
            n, k = (136, 4160) if m % 2 else (1000, 832)
            a, w = make_operands(m, n, k, "bf16", seed=200 + m + tm)
            early, late = _early_and_late(kern, a, w, packed.repack(w))
            assert reference.check(early, a, w).passed, (tm, split, m, n, k)
            assert torch.equal(early.view(torch.uint8), late.view(torch.uint8)), (tm, m)


@pytest.mark.gpu("sm90", "sm120")
def test_a_chain_of_early_reads_in_a_graph():
    """Four GEMMs in a row on one stream, each reading its weight before its wait (and the
    activation the one before wrote after it): captured once, replayed on new inputs."""
    kern = compile(_schedule(tile_m=8, split_k=2), Signature("bf16"))
    n = k = 1024
    ws = [make_operands(1, n, k, "bf16", seed=300 + i)[1] for i in range(4)]
    pws = [packed.repack(w) for w in ws]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    hs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(4)]

    def chain():
        src = x
        for pw, h in zip(pws, hs):
            launch_stream(kern, src, pw, h, True)
            src = h

    g, _ = capture_graph(chain, warmups=2)
    for r in range(3):
        x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16) * (r + 1))
        for h in hs:
            h.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        src = x
        for w, h in zip(ws, hs):
            assert reference.check(h, src, w).passed, r
            src = h


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


# ----------------------------------------------------------------------------- grouped

def _grouped_case(counts, n: int, k: int, seed: int, fmt: str = "bf16"):
    """(a [M, K] 16-bit, the plain expert stack, its packed form, offsets) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = cf.quantize(torch.randn(len(counts), n, k, generator=g, device="cuda"))
    total = sum(counts)
    x = torch.randn(max(total, 1), k, generator=g, device="cuda")[:total]
    a = x.to(torch.bfloat16 if fmt == "bf16" else torch.float16)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    return a, w, packed.repack(w), offs


def _routing(m: int, experts: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.randint(0, experts, (m,), generator=g),
                          minlength=experts).tolist()


def _grouped_kernel(fmt: str = "bf16", out: str = "bf16"):
    s = stream_schedule(detect_device().target.name, 8, grouped=True).replace(out_dtype=out)
    return compile(s, Signature(fmt))


def _run(kern, a, pw, offs, n: int, alpha=None):

    out = torch.full((a.shape[0], n), float("nan"), dtype=kern.out_dtype, device="cuda")
    run.run_grouped(kern, a, pw, offs, out=out, alpha=alpha)
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_stream_grouped_every_decode_size(fmt):
    """M = 1..16 rows over 16 experts (random routings: empty experts, several rows on
    one), then one expert holding all 16 (two row tiles), N and K tails; NaN-poisoned
    outputs against the exact reference, reruns bit-identical."""
    kern = _grouped_kernel(fmt)
    cases = [(_routing(m, 16, m), 200, 320) for m in range(1, 17)]
    cases += [([0, 0, 16, 0], 136, 64), ([0] * 7 + [1], 8, 192), ([9, 0, 7], 1000, 4160),
              (_routing(16, 128, 99), 1536, 2048)]
    for i, (counts, n, k) in enumerate(cases):
        a, w, pw, offs = _grouped_case(counts, n, k, seed=40 + i, fmt=fmt)
        out = _run(kern, a, pw, offs, n)
        res = reference.check_grouped(out, a, w, offs)
        assert res.passed, f"{counts} N={n} K={k}: {res}"
        assert torch.equal(out.view(torch.uint8), _run(kern, a, pw, offs, n).view(torch.uint8))


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("out", ["fp16", "fp32"])
def test_stream_grouped_outputs_and_alpha(out):
    kern = _grouped_kernel("bf16", out)
    counts, n, k = [0, 3, 1, 0, 8, 2, 0, 1], 264, 512
    a, w, pw, offs = _grouped_case(counts, n, k, seed=61)
    alpha = torch.linspace(0.25, 4.0, len(counts), device="cuda")
    res = reference.check_grouped(_run(kern, a, pw, offs, n, alpha), a, w, offs, alpha)
    assert res.passed, res


@pytest.mark.gpu("sm90", "sm120")
def test_auto_runs_the_grouped_stream_kernel_at_decode_w4a16_and_w4a4():
    """grouped_gemm "auto" on a packed stack at a few rows per expert runs the stream
    kernel, W4A16 and W4A4 (the activation's BF16 block values), in a CUDA graph replayed
    with new offsets as eagerly."""

    counts, n, k = _routing(16, 64, 71), 1536, 1024
    a, w, pw, offs = _grouped_case(counts, n, k, seed=71)
    dims = operands.check_grouped_operands(a, pw, offs, None, None)
    assert "stream" in tuning.grouped_auto_name(selection.family(), dims)
    for act in (a, cf.quantize(a.float())):
        out = torch.full((16, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = cf.grouped_gemm(act, pw, offs, out=out)
        res = reference.check_grouped(y, act, w, offs)
        assert res.passed, res
        g, got = capture_graph(lambda act=act, out=out: cf.grouped_gemm(act, pw, offs, out=out),
                               warmups=2)
        for seed in (72, 73):
            offs.copy_(torch.tensor([0, *torch.tensor(_routing(16, 64, seed)).cumsum(0)
                                     .tolist()], dtype=torch.int32))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert reference.check_grouped(out, act, w, offs).passed, seed
            assert torch.equal(out, cf.grouped_gemm(act, pw, offs))


@pytest.mark.gpu("sm90", "sm120")
def test_nvfp4moe_at_decode_replays_in_a_graph():
    """NVFP4MoE at one and four tokens (the stream kernel through "auto"): close to the
    float64 layer, a CUDA graph replayed with a new routing equal to eager."""
    from cute_fp4 import moe

    e, h, inter, top_k = 64, 512, 256, 8
    g = torch.Generator(device="cuda").manual_seed(5)
    layer = moe.NVFP4MoE.from_float(torch.randn(e, 2 * inter, h, generator=g, device="cuda")
                                    * 0.05, torch.randn(e, h, inter, generator=g,
                                                        device="cuda") * 0.05)
    for tokens in (1, 4):
        x = torch.randn(tokens, h, generator=g, device="cuda").to(torch.bfloat16)
        w, ids = torch.randn(tokens, e, generator=g, device="cuda").softmax(-1).topk(top_k)
        y = layer(x, ids, w)
        ref = layer.reference_forward(x, ids, w)
        assert float((y.double() - ref).norm() / ref.norm()) < 2.0**-6
        graph, out = capture_graph(lambda x=x, ids=ids, w=w: layer(x, ids, w), warmups=2)
        ids.copy_(torch.randn(tokens, e, generator=g, device="cuda").topk(top_k).indices)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer(x, ids, w))

