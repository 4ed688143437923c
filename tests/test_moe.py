"""cute_fp4.moe on the CPU: routing against a Python loop (empty experts, one expert for
every token, top_k 1 and 8), the NVFP4MoE forward with the grouped GEMM replaced by the
exact reference (every stage within the error rule, close to the float64 layer and to the
BF16 MoE of the dequantized weights), the gate/up and top-k weight conventions against an
independent loop (with mutants that must fail), and the layer's checks failing on wrong
stages. perf/moe_bench.py's pure-Python parts (routing generation, formulas, bars, table)
are tested at the end. The kernels themselves run on a GPU (perf/moe_bench.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cute_fp4 import moe, reference
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.layers import experts as cex
from cute_fp4.nvfp4 import quantize
from cute_fp4.operands import check_grouped_operands
from cute_fp4.packed import PackedNVFP4Weight

ROOT = Path(__file__).resolve().parent.parent
E, H, INTER = 8, 64, 128  # experts, hidden, intermediate (multiples of 64: packable)


# ----------------------------------------------------------------------------- routing

def loop_route(ids: list[list[int]], num_experts: int):
    """The definition: pairs t*k+j in expert order, pair order within an expert."""
    k = len(ids[0]) if ids else 1
    order = [t * k + j for e in range(num_experts) for t in range(len(ids))
             for j in range(k) if ids[t][j] == e]
    counts = [sum(row.count(e) for row in ids) for e in range(num_experts)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return order, offsets


def _random_ids(t: int, k: int, num_experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])


ROUTING_CASES = {
    "random_top2": (_random_ids(7, 2, 6, 0), 6),
    "top1": (_random_ids(9, 1, 5, 1), 5),
    "top8_of_8": (_random_ids(4, 8, 8, 2), 8),  # every token uses every expert
    "top8_of_32": (_random_ids(6, 8, 32, 3), 32),
    "empty_experts": (torch.tensor([[0, 3], [3, 0], [5, 3]]), 16),  # 13 of 16 empty
    "one_expert_top1": (torch.full((11, 1), 4), 7),  # every token to expert 4
    "one_expert_repeated": (torch.full((3, 4), 2), 4),  # duplicates: still a stable order
    "single_token": (torch.tensor([[1, 0, 2]]), 3),
}


@pytest.mark.parametrize("name", sorted(ROUTING_CASES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_route_matches_the_loop(name, dtype):
    ids, num_experts = ROUTING_CASES[name]
    ids = ids.to(dtype)
    r = moe.route(ids, num_experts, validate=True)
    order, offsets = loop_route(ids.tolist(), num_experts)
    k = ids.shape[1]
    assert r.order.tolist() == order
    assert r.offsets.dtype == torch.int32 and r.offsets.tolist() == offsets
    assert r.token.tolist() == [p // k for p in order]
    assert r.inverse[r.order].tolist() == list(range(ids.numel()))
    assert r.order.dtype == r.inverse.dtype == r.token.dtype == torch.int64


def test_route_of_no_tokens():
    r = moe.route(torch.empty(0, 8, dtype=torch.long), 4)
    assert r.offsets.tolist() == [0] * 5 and r.order.numel() == r.token.numel() == 0


@pytest.mark.parametrize("args, exc, match", [
    ((torch.tensor([[0, 4]]), 4), InputError, r"expert ids in \[0, 4\], the layer has 4"),
    ((torch.tensor([[-1, 2]]), 4), InputError, r"expert ids in \[-1, 2\]"),
    ((torch.tensor([0, 1]), 4), InputError, "topk_ids must be \\[T, top_k\\]"),
    ((torch.empty(3, 0, dtype=torch.long), 4), InputError, "top_k >= 1"),
    ((torch.tensor([[0.0, 1.0]]), 4), InputError, "int32 or int64, got torch.float32"),
    ((torch.tensor([[0, 1]]), 0), InputError, "num_experts must be a positive int, got 0"),
    (([[0, 1]], 4), InputTypeError, "topk_ids must be a torch.Tensor, got list"),
])
def test_route_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        moe.route(*args, validate=True)


def test_route_traces_in_one_graph_without_host_reads():
    """fullgraph=True fails on anything reading a tensor value on the host (.item(),
    .tolist(), data-dependent shapes): the same property that keeps it sync-free."""
    ids = _random_ids(5, 2, 6, 4)
    f = torch.compile(lambda t: moe.route(t, 6), backend="eager", fullgraph=True)
    r = f(ids)
    assert r.order.tolist() == loop_route(ids.tolist(), 6)[0]
    assert r.offsets.tolist() == loop_route(ids.tolist(), 6)[1]
    with pytest.raises(Exception):  # noqa: B017 - the test of the test: a sync breaks it
        torch.compile(lambda t: moe.route(t, 6, validate=True), backend="eager",
                      fullgraph=True)(ids)


# ----------------------------------------------------------------------------- the layer

def _exact_grouped(a, b, offsets, schedule, out_dtype, alpha):
    """The grouped GEMM on the CPU: the operands pass grouped_gemm's own checks (metadata),
    then the exact reference (float64, rounded once)."""
    check_grouped_operands(a, b, offsets, None, alpha, out_dtype, require_cuda=False)
    return reference.grouped_gemm(a, b, offsets, alpha, out_dtype)


@pytest.fixture
def exact(monkeypatch):
    """The GPU kernels replaced: the grouped GEMM by the exact reference, the fused
    activation quantizer by cute_fp4.quantize (bit-identical to it, tests/gpu). Records
    the calls."""
    calls = []

    def grouped(a, b, offsets, schedule, out_dtype, alpha):
        calls.append(("gemm", type(a).__name__, tuple(b.shape), schedule, out_dtype, alpha))
        return _exact_grouped(a, b, offsets, schedule, out_dtype, alpha)

    def quant(x, global_scale):
        calls.append(("quantize", tuple(x.shape), global_scale))
        return quantize(x, global_scale)

    monkeypatch.setattr(cex, "_grouped_gemm", grouped)
    monkeypatch.setattr(cex, "_quantize", quant)
    return calls


def _weights(seed: int = 0, e: int = E, h: int = H, i: int = INTER):
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.5, 2.0, e).view(e, 1, 1)  # per-expert global scales differ
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1 * spread
    w2 = torch.randn(e, h, i, generator=g) * 0.1 * spread.flip(0)
    return w13, w2


def _inputs(t: int, k: int, e: int = E, seed: int = 1, h: int = H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = _random_ids(t, k, e, seed)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return x, ids, w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _stages_pass(layer, x, ids, w, **kw):
    checks = moe.check_stages(layer, layer.stages(x, ids, w), x, ids, w, **kw)
    assert [c.stage for c in checks] == ["routing", "gather", "gate_up", "act", "down", "out"]
    assert all(c.passed for c in checks), "\n".join(map(str, checks))
    return checks


TOL = {"w4a16": 2.0**-6, "w4a4": 2.0**-3}  # relative (Frobenius) vs the float64 layer


@pytest.mark.parametrize("mode, static", [("w4a16", False), ("w4a4", False),
                                          ("w4a4", True)])
def test_forward_stages_within_the_rule_and_close_to_float64(exact, mode, static):
    w13, w2 = _weights()
    x, ids, w = _inputs(13, 3)
    scales = (float(x.float().abs().max()) / 2688, 0.02) if static else (None, None)
    layer = moe.NVFP4MoE.from_float(w13, w2, mode=mode, input_scales=scales)
    _stages_pass(layer, x, ids, w)
    exact.clear()
    y = layer(x, ids, w)
    calls = list(exact)
    assert y.shape == (13, H) and y.dtype == torch.bfloat16
    assert torch.equal(y, layer.stages(x, ids, w).out)
    assert _rel(y, layer.reference_forward(x, ids, w)) < TOL[mode]
    if mode == "w4a16":  # the same weights in BF16 through torch: the same layer
        d13, d2 = layer.dequantized()
        assert _rel(y, moe.moe_bf16(x, d13, d2, ids, w)) < 2.0**-6
    gemms = [c for c in calls if c[0] == "gemm"]
    assert [c[2] for c in gemms] == [(E, 2 * INTER, H), (E, H, INTER)]
    assert gemms[0][1] == ("NVFP4Tensor" if mode == "w4a4" else "Tensor")
    if static:  # alpha = input scale x the experts' global scales, made at construction
        assert gemms[0][5] is layer.w13_alpha and gemms[1][5] is layer.w2_alpha
        torch.testing.assert_close(layer.w13_alpha, layer.w13_weight_scale_2 * scales[0])
        quants = [c for c in calls if c[0] == "quantize"]
        assert quants[0][2] is layer.w13_input_scale and quants[1][2] is layer.w2_input_scale
    else:
        assert gemms[0][5] is None and gemms[1][5] is None


@pytest.mark.parametrize("case", ["empty_experts", "one_expert", "top1", "top8_all"])
def test_forward_routing_edge_cases(exact, case):
    w13, w2 = _weights(seed=2)
    x, ids, w = _inputs(6, 2, seed=3)
    if case == "empty_experts":
        ids = torch.tensor([[1, 6]] * 3 + [[6, 1]] * 3)
    elif case == "one_expert":
        x, ids, w = x, torch.full((6, 1), 5), torch.ones(6, 1)
    elif case == "top1":
        x, ids, w = _inputs(6, 1, seed=4)
    else:
        x, ids, w = _inputs(6, 8, seed=5)  # every expert, every token
    layer = moe.NVFP4MoE.from_float(w13, w2)
    _stages_pass(layer, x, ids, w)
    assert _rel(layer(x, ids, w), layer.reference_forward(x, ids, w)) < TOL["w4a16"]


def _loop_layer(x, ids, w, w13, w2):
    """The layer by its definition, token by token (gate = first INTER rows of w13)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    i = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :i] @ x[t].double(), w13[e, i:] @ x[t].double()
            out[t] += float(w[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


def _deq(w: torch.Tensor) -> torch.Tensor:
    """Each expert quantized on its own and dequantized (float64): what the layer holds."""
    return torch.stack([quantize(w[e]).dequantize(torch.float64) for e in range(w.shape[0])])


def test_gate_up_halves_and_weights_follow_the_convention(exact):
    w13, w2 = _weights(seed=6)
    x, ids, w = _inputs(9, 3, seed=7)
    want = _loop_layer(x, ids, w, _deq(w13), _deq(w2))
    layer = moe.NVFP4MoE.from_float(w13, w2)
    assert _rel(layer(x, ids, w), want) < 2.0**-6
    assert _rel(layer.reference_forward(x, ids, w), want) < 1e-12  # the same definition
    # the same comparison fails when gate and up are swapped, or weights go to other slots
    swapped = torch.cat((w13[:, INTER:], w13[:, :INTER]), dim=1)
    assert _rel(moe.NVFP4MoE.from_float(swapped, w2)(x, ids, w), want) > 0.2
    assert _rel(layer(x, ids, w.roll(1, dims=1)), want) > 0.1
    # slots are interchangeable as long as ids and weights move together
    perm = torch.tensor([2, 0, 1])
    assert _rel(layer(x, ids[:, perm], w[:, perm]), want) < 2.0**-6


def test_checks_fail_on_wrong_stages(exact, monkeypatch):
    w13, w2 = _weights(seed=8)
    x, ids, w = _inputs(10, 2, seed=9)
    layer = moe.NVFP4MoE.from_float(w13, w2)
    good = layer.stages(x, ids, w)

    def failed(st):
        return {c.stage for c in moe.check_stages(layer, st, x, ids, w) if not c.passed}

    assert failed(good) == set()
    bad_gu = good.gate_up.clone()
    bad_gu[0, 0] += 0.5 * bad_gu[0].abs().max()
    assert failed(good._replace(gate_up=bad_gu)) == {"gate_up", "act"}
    assert "act" in failed(good._replace(act=good.act.roll(1, dims=1)))
    assert failed(good._replace(down=good.down.roll(1, dims=0))) == {"down", "out"}
    assert failed(good._replace(out=good.out.roll(1, dims=0))) == {"out"}
    bad_off = good.routing._replace(offsets=good.routing.offsets.roll(1))
    assert failed(good._replace(routing=bad_off)) == {"routing"}
    bad_inv = good.routing._replace(inverse=good.routing.inverse.flip(0))
    assert "routing" in failed(good._replace(routing=bad_inv))
    assert "gather" in failed(good._replace(x_sorted=good.x_sorted.flip(0)))
    # a layer whose activation swaps gate and up, or whose combine misplaces the weights
    monkeypatch.setattr(cex, "silu_and_mul", lambda g: F.silu(g[:, INTER:]) * g[:, :INTER])
    assert failed(layer.stages(x, ids, w)) == {"act"}


def test_checks_fail_on_misplaced_weights(exact, monkeypatch):
    w13, w2 = _weights(seed=10)
    x, ids, w = _inputs(8, 2, seed=11)
    layer = moe.NVFP4MoE.from_float(w13, w2)
    real = moe.combine
    monkeypatch.setattr(cex, "combine", lambda d, r, tw: real(d, r, tw.roll(1, dims=1)))
    checks = moe.check_stages(layer, layer.stages(x, ids, w), x, ids, w)
    assert {c.stage for c in checks if not c.passed} == {"out"}


def test_sampled_checks_cover_what_they_are_asked(exact):
    w13, w2 = _weights(seed=12)
    x, ids, w = _inputs(40, 4, seed=13)
    layer = moe.NVFP4MoE.from_float(w13, w2)
    st = layer.stages(x, ids, w)
    bad = st.down.clone()
    lo = int(st.routing.offsets[3])
    bad[lo] = float("nan")  # the first row of expert 3
    checks = {c.stage: c for c in moe.check_stages(layer, st._replace(down=bad), x, ids, w,
                                                   experts=[3], max_rows=4, tokens=[0])}
    assert not checks["down"].passed and "expert 3" in checks["down"].detail
    checks = {c.stage: c for c in moe.check_stages(layer, st._replace(down=bad), x, ids, w,
                                                   experts=[0, 1], max_rows=4, tokens=[])}
    assert checks["down"].passed  # expert 3 not sampled


def test_empty_batch_and_input_errors(exact):
    layer = moe.NVFP4MoE.from_float(*_weights())
    y = layer(torch.empty(0, H, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.long),
              torch.empty(0, 2))
    assert y.shape == (0, H) and exact == []
    x, ids, w = _inputs(3, 2)
    for args, exc, match in [
        ((x.float(), ids, w), InputError, "bfloat16 or float16, got torch.float32"),
        ((x[:, :32], ids, w), InputError, r"x must be \[T, 64\]"),
        ((x, ids[:2], w[:2]), InputError, "x has 3 tokens"),
        ((x, ids, w[:, :1]), InputError, "topk_weights"),
        ((x, ids, w.long()), InputError, "floating point"),
        ((x, ids.float(), w), InputError, "int32 or int64"),
        ((x, ids, [1.0]), InputTypeError, "must be torch.Tensors"),
    ]:
        with pytest.raises(exc, match=match):
            layer(*args)


def test_construction_errors():
    w13, w2 = _weights()
    q13, q2 = quantize(w13), quantize(w2)
    with pytest.raises(InputError, match="mode must be"):
        moe.NVFP4MoE(q13, q2, mode="w8a8")
    with pytest.raises(InputError, match="layout must be"):
        moe.NVFP4MoE(q13, q2, layout="tiled")
    with pytest.raises(FormatError, match=r"must be \[E, 2I, H\] and \[E, H, I\]"):
        moe.NVFP4MoE(q2, q13)
    with pytest.raises(InputTypeError, match="must be an NVFP4Tensor expert stack"):
        moe.NVFP4MoE(quantize(w13[0]), q2)
    with pytest.raises(FormatError, match="input scale must be finite and > 0, got -1"):
        moe.NVFP4MoE(q13, q2, mode="w4a4", input_scales=(-1.0, None))
    with pytest.raises(InputError, match="input_scales must be a pair"):
        moe.NVFP4MoE(q13, q2, input_scales=0.1)
    h32 = quantize(torch.randn(2, 64, 32)), quantize(torch.randn(2, 32, 32))
    with pytest.raises(FormatError, match="packed layout needs hidden"):
        moe.NVFP4MoE(*h32, layout="packed")
    assert moe.NVFP4MoE(*h32).layout == "plain"  # auto on the CPU


def test_packed_layout_holds_the_same_weight(exact):
    w13, w2 = _weights(seed=14)
    x, ids, w = _inputs(7, 2, seed=15)
    plain = moe.NVFP4MoE.from_float(w13, w2, layout="plain")
    packed = moe.NVFP4MoE.from_float(w13, w2, layout="packed")
    assert isinstance(packed.w13, PackedNVFP4Weight) and packed.layout == "packed"
    assert packed.w13.shape == (E, 2 * INTER, H)
    assert packed.w13_weight.shape == (E, 2 * INTER, H // 2)
    assert not torch.equal(packed.w13_weight, plain.w13_weight)  # reordered bytes
    for e in (0, E - 1):
        assert torch.equal(moe.expert(packed.w13, e).data, plain.w13_weight[e])
        assert torch.equal(moe.expert(packed.w2, e).data, plain.w2_weight[e])
    assert torch.equal(packed(x, ids, w), plain(x, ids, w))
    again = moe.NVFP4MoE(packed.w13, packed.w2)  # stored as given, no copy
    assert again.layout == "packed" and again.w13_weight is packed.w13_weight
    with pytest.raises(InputError, match="both be plain or both be packed"):
        moe.NVFP4MoE(packed.w13, plain.w2)


def test_views_are_built_once_and_dtype_conversion_keeps_the_format(exact):
    layer = moe.NVFP4MoE.from_float(*_weights(), mode="w4a4", input_scales=(0.01, 0.02))
    assert layer.w13 is layer.w13 and layer.w13.data is layer.w13_weight
    layer.to(torch.bfloat16)
    assert layer.w13_weight.dtype == torch.uint8
    assert layer.w13_weight_scale.dtype == torch.float8_e4m3fn
    assert layer.w13_weight_scale_2.dtype == layer.w2_alpha.dtype == torch.float32
    assert layer.w13.global_scale is layer.w13_weight_scale_2
    assert "mode=w4a4, input_scales=static" in repr(layer)


def test_moe_bf16_matches_the_loop():
    w13, w2 = _weights(seed=16)
    x, ids, w = _inputs(6, 3, seed=17)
    got = moe.moe_bf16(x, w13.bfloat16(), w2.bfloat16(), ids, w)
    want = _loop_layer(x, ids, w, w13.bfloat16().double(), w2.bfloat16().double())
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 2.0**-6


def test_forward_traces_in_one_graph(monkeypatch):
    """The whole forward under torch.compile(fullgraph=True) with a traceable stand-in for
    the grouped GEMM op (torch._grouped_mm on the dequantized weights): routing, gather,
    activation and combine read nothing on the host."""
    w13, w2 = _weights(seed=18)
    layer = moe.NVFP4MoE.from_float(w13, w2)
    d = dict(zip(("w13", "w2"), layer.dequantized(), strict=True))

    def grouped(a, b, offsets, schedule, out_dtype, alpha):
        w = d["w13"] if b.shape[1] == 2 * INTER else d["w2"]
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets[1:])

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    monkeypatch.setattr(cex, "_grouped_gemm", grouped)
    x, ids, w = _inputs(5, 2, seed=19)
    f = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(f(x, ids, w), layer(x, ids, w), rtol=0, atol=0)
    torch.testing.assert_close(layer(x, ids, w), moe.moe_bf16(x, d["w13"], d["w2"], ids, w),
                               rtol=0, atol=0)


@pytest.mark.parametrize("mode, layout", [("w4a16", "plain"), ("w4a16", "packed"),
                                          ("w4a4", "plain")])
def test_compile_captures_the_grouped_op(mode, layout):
    """With the real grouped_gemm: one graph holding two cute_fp4::grouped_mm nodes (W4A4:
    and two quantize nodes); running it needs a GPU."""
    from cute_fp4.errors import DeviceError

    layer = moe.NVFP4MoE.from_float(*_weights(seed=20), mode=mode, layout=layout)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, ids, w = _inputs(4, 2, seed=21)
    f = torch.compile(layer, backend=backend, fullgraph=True)
    with pytest.raises(DeviceError):
        f(x, ids, w)
    assert len(graphs) == 1
    code = graphs[0].code
    assert code.count("cute_fp4.grouped_mm") == 2
    assert code.count("cute_fp4.quantize_dynamic") == (2 if mode == "w4a4" else 0)


# ----------------------------------------------------------------------------- the bench

@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "perf" / "moe_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_bench_shapes_are_the_issues(bench):
    qwen, ds = bench.MODELS
    assert (qwen.hidden, qwen.inter, qwen.experts, qwen.top_k) == (2048, 768, 128, 8)
    assert (ds.hidden, ds.inter, ds.experts, ds.top_k) == (7168, 2048, 256, 8)
    assert bench.DECODE_TOKENS == (1, 4, 16, 64) and bench.PREFILL_TOKENS == (4096, 16384)
    args = bench.parse_args([])
    assert args.tokens == [1, 4, 16, 64, 4096, 16384]
    assert args.routings == ["uniform", "skewed"]
    assert args.models == ["qwen3-30b-a3b", "deepseek-v3"] and args.reps == 20
    quick = bench.parse_args(["--quick"])
    assert quick.models == ["qwen3-30b-a3b"] and quick.tokens == [16, 4096]
    assert quick.routings == ["uniform"] and quick.reps == 10
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "llama"])


def test_router_is_seeded_and_valid(bench):
    ids, w = bench.router(300, 128, 8, seed=5)
    again, w2 = bench.router(300, 128, 8, seed=5)
    assert torch.equal(ids, again) and torch.equal(w, w2)
    assert not torch.equal(ids, bench.router(300, 128, 8, seed=6)[0])
    assert ids.shape == (300, 8) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 128
    assert all(len(set(row)) == 8 for row in ids.tolist())  # top-k: distinct experts
    torch.testing.assert_close(w.sum(-1), torch.ones(300))
    assert bool((w[:, :-1] >= w[:, 1:]).all())  # sorted like topk
    flat = bench.routing_stats(ids, 128)
    skew = bench.routing_stats(bench.router(300, 128, 8, seed=5, skew=1.5)[0], 128)
    assert flat["pairs"] == skew["pairs"] == 2400
    assert skew["top10pct_share"] > 2 * flat["top10pct_share"]  # hot experts
    assert skew["max_pairs"] > 2 * flat["max_pairs"]
    assert skew["empty_experts"] > flat["empty_experts"]
    seeds = {bench.routing_seed(m, t, r) for m in (0, 1) for t in (16, 64, 4096, 16384)
             for r in bench.ROUTINGS}
    assert len(seeds) == 16


def test_routing_stats_and_sampled_experts(bench):
    ids = torch.tensor([[0, 3], [3, 0], [3, 5]])
    st = bench.routing_stats(ids, 8)
    assert st == {"pairs": 6, "active_experts": 3, "empty_experts": 5, "max_pairs": 3,
                  "mean_pairs_active": 2.0, "top10pct_share": 0.5}
    offsets = [0, 2, 2, 2, 5, 5, 6, 6, 6]  # experts 0, 3 (largest), 5
    assert bench.sample_experts(offsets, seed=1) == [0, 3, 5]  # first, largest, last
    many = [0, *range(1, 21)]  # 20 experts of one pair each
    got = bench.sample_experts(many, seed=4)
    assert got[0] == 0 and got[-1] == 19 and len(got) in (2, 3) and got == sorted(got)
    assert bench.sample_experts([0] * 9, seed=1) == []


def test_formulas_by_hand(bench):
    qwen = bench.MODELS[0]
    assert bench.gemm_nk(qwen, "gate_up") == (1536, 2048)
    assert bench.gemm_nk(qwen, "down") == (2048, 768)
    pairs = 16 * 8
    assert bench.flop(qwen, "gate_up", pairs) == 2 * 128 * 1536 * 2048
    assert bench.flop(qwen, "layer", pairs) == 2 * 128 * (1536 * 2048 + 2048 * 768)
    nk = 1536 * 2048
    assert bench.weight_bytes(qwen, "gate_up", 100, "nvfp4") == 100 * (nk // 2 + nk // 16)
    assert bench.weight_bytes(qwen, "gate_up", 100, "bf16") == 100 * 2 * nk
    assert bench.nbytes(qwen, "gate_up", 16, 100, "nvfp4", "bf16") == \
        100 * (nk // 2 + nk // 16) + 2 * pairs * 2048 + 2 * pairs * 1536
    assert bench.nbytes(qwen, "down", 16, 100, "nvfp4", "nvfp4") == \
        100 * (2048 * 768 * 9 // 16) + pairs * 768 // 2 + pairs * 768 // 16 + 2 * pairs * 2048
    assert bench.nbytes(qwen, "layer", 16, 100, "bf16", "bf16") == \
        bench.weight_bytes(qwen, "layer", 100, "bf16") + 4 * 16 * 2048
    r = bench.rates(qwen, "gate_up", 16, 100, "nvfp4", "bf16", us=10.0)
    assert r["weight_TB/s"] == round(100 * nk * 9 / 16 / 10.0 / 1e6, 3)
    assert r["TFLOP/s"] == round(2 * 128 * nk / 10.0 / 1e6, 2)


def test_power_of_two_scales_make_the_bf16_weights_exact(bench):
    assert bench.pow2_scale(2688.0) == 1.0 and bench.pow2_scale(2689.0) == 2.0
    assert bench.pow2_scale(0.0) == 1.0
    tiny = bench.MoEShape("tiny", 64, 64, 4, 2)
    wts = bench.build_weights(tiny, 0, "cpu", packed=True)
    assert wts.q13.shape == (4, 128, 64) and wts.q2.shape == (4, 64, 64)
    assert isinstance(wts.k13, PackedNVFP4Weight)
    for e in range(4):
        gs = float(wts.q13.global_scale[e])
        assert gs == 2.0 ** round(math.log2(gs))
        exact = wts.q13.expert(e).dequantize(torch.float64)
        assert torch.equal(wts.b13[e].double(), exact)  # torch computes the same products
        assert torch.equal(wts.b2[e].double(), wts.q2.expert(e).dequantize(torch.float64))
    assert len({float(g) for g in wts.q13.global_scale}) > 1  # per-expert scales differ


def test_passes_put_the_bars_first(bench):
    args = bench.parse_args([])
    plan = bench.plan_passes(args, "sm90")
    assert [p[0] for p in plan] == sorted(p[0] for p in plan)
    first = {(p[2], p[3]) for p in plan if p[0] == 1}
    assert {("gate_up", "torch_bf16"), ("down", "cute_w4a16[auto]"),
            ("gate_up", "loop_w4a16"), ("layer", "torch_bf16")} <= first
    assert any(p[3] == "cute_w4a16[sm90_grouped_decode]" for p in plan if p[0] == 2)
    assert {p[1] for p in plan if p[0] == 4} == {"skewed"}
    quick = bench.plan_passes(bench.parse_args(["--quick"]), "sm90")
    assert all(p[1] == "uniform" for p in quick)


class OnceTimer:
    """Stands in for cute_fp4.bench.Timer on the CPU: one call, a fixed time."""

    def __init__(self, us: float = 10.0):
        self.us = us

    def timed(self, fn):
        return self.us, fn()


@pytest.fixture
def cpu_bench(bench, monkeypatch):
    """A tiny model and case on the CPU with the GPU pieces replaced by the exact
    reference: grouped_gemm (honouring out=), the dense gemm of the loop, the schedule
    resolution; the fused quantizer by cute_fp4.quantize."""
    import types

    import cute_fp4.api
    import cute_fp4.grouped

    def grouped(a, b, offsets, *, schedule="auto", out=None, out_dtype=torch.bfloat16,
                alpha=None, check=False):
        res = _exact_grouped(a, b, offsets, schedule, out_dtype, alpha)
        return res if out is None else out.copy_(res)

    def dense(a, b, *, schedule="auto", out=None, out_dtype=torch.bfloat16, alpha=None,
              check=False):
        res = reference.gemm(a, b, alpha, out_dtype=out_dtype)
        return res if out is None else out.copy_(res)

    sched = types.SimpleNamespace(name="fake_grouped", label=lambda: "fake_grouped")
    monkeypatch.setattr(cute_fp4.grouped, "grouped_gemm", grouped)
    monkeypatch.setattr(cute_fp4.api, "gemm", dense)
    monkeypatch.setattr(bench, "_grouped_schedule", lambda *args: sched)
    monkeypatch.setattr(cex, "_grouped_gemm", _exact_grouped)
    monkeypatch.setattr(cex, "_quantize", lambda x, gs: quantize(x, gs))
    tiny = bench.MoEShape("tiny", 64, 64, 6, 2)
    wts = bench.build_weights(tiny, 3, "cpu", packed=False)
    case = bench.make_case(tiny, 0, 10, "uniform", wts, "cpu")
    return types.SimpleNamespace(shape=tiny, wts=wts, case=case)


def test_bench_providers_on_the_cpu(bench, cpu_bench):
    case, wts = cpu_bench.case, cpu_bench.wts
    assert case.decode and case.xs.shape == (20, 64) and case.h.shape == (20, 64)
    assert case.experts_checked and len(case.tokens_checked) == bench.CHECK_TOKENS == 8
    budget = bench.Budget(60)
    preps = {
        ("gate_up", "cute_w4a16"): lambda: bench.prep_cute_gemm(case, wts, "gate_up", "bf16",
                                                                 "auto"),
        ("down", "cute_w4a4"): lambda: bench.prep_cute_gemm(case, wts, "down", "nvfp4", "auto"),
        ("down", "torch_bf16"): lambda: bench.prep_torch_gemm(case, wts, "down"),
        ("gate_up", "loop_w4a16"): lambda: bench.prep_loop_gemm(case, wts, "gate_up", "sm90"),
        ("layer", "cute_w4a16"): lambda: bench.prep_cute_layer(case, wts, "w4a16", "auto"),
        ("layer", "cute_w4a4"): lambda: bench.prep_cute_layer(case, wts, "w4a4", "auto"),
        ("layer", "torch_bf16"): lambda: bench.prep_torch_layer(case, wts),
        ("layer", "loop_w4a16"): lambda: bench.prep_loop_layer(case, wts, "sm90"),
    }
    res = {"model": "tiny", "tokens": 10, "routing": "uniform", "rows": []}
    for (op, name), prep in preps.items():
        row = bench.measure(prep, OnceTimer(), budget)
        assert row["status"] == "ok", (op, name, row)
        assert row["check"] == "ok", (op, name, row)
        bench.record(res, op, name, row, case, "nvfp4", "bf16")
    layer_rows = [r for r in res["rows"] if r["op"] == "layer" and "cute" in r["provider"]]
    assert all(r["stages"] == "ok" and r["graph_equals_eager"] for r in layer_rows)
    assert res["rows"][0]["weight_TB/s"] > 0 and res["rows"][0]["schedule"] == "fake_grouped"
    s = {x["op"]: x for x in bench.summary(res)}
    assert s["gate_up"]["w4a16_x_loop"] is not None and s["down"]["w4a4_x_torch"] == 1.0


def test_bench_checks_fail_wrong_outputs(bench, cpu_bench, monkeypatch):
    case, wts = cpu_bench.case, cpu_bench.wts
    prep = bench.prep_torch_gemm(case, wts, "gate_up")
    good = prep.call()
    assert prep.check(good)["check"] == "ok"
    bad = good.clone()
    e = case.experts_checked[-1]
    bad[case.offsets[e]] *= 1.5
    res = prep.check(bad)
    assert res["check"] == "FAIL" and res["failed_experts"] == [e]
    lp = bench.prep_torch_layer(case, wts)
    out = lp.call()
    assert lp.check(out)["check"] == "ok"
    assert lp.check(out.roll(1, dims=0))["check"] == "FAIL"
    cute = bench.prep_cute_layer(case, wts, "w4a16", "auto")
    out = cute.call()
    assert cute.check(out)["check"] == "ok"
    tweaked = out.clone()
    tweaked[0, 0] = tweaked[0, 0] * (1 + 2.0**-7)  # within the layer tolerance ...
    res = cute.check(tweaked)
    assert not res["graph_equals_eager"] and res["check"] == "FAIL"  # ... but not eager's


def test_measure_records_errors_unavailable_and_the_budget(bench):
    def broken():
        raise RuntimeError("kernel exploded")

    def absent():
        raise bench.Unavailable("no such kernel here")

    row = bench.measure(broken, OnceTimer(), bench.Budget(60))
    assert row["status"] == "error: RuntimeError: kernel exploded" and row["trace"]
    assert bench.measure(absent, OnceTimer(), bench.Budget(60))["status"] == \
        "unavailable: no such kernel here"
    assert bench.measure(broken, OnceTimer(), bench.Budget(-1))["status"] == \
        "skipped: time budget"


def _synthetic(bench, tokens, ratio_torch, ratio_loop=None, check="ok"):
    rows = []
    for op in bench.OPS:
        rows.append({"op": op, "provider": "torch_bf16", "status": "ok", "us": 100.0,
                     "check": "ok", "weight_TB/s": 1.0})
        rows.append({"op": op, "provider": "cute_w4a16[auto]", "status": "ok",
                     "us": 100.0 / ratio_torch, "check": check, "schedule": "sm90_grouped",
                     "weight_TB/s": 3.0})
        rows.append({"op": op, "provider": "cute_w4a16[sm90_grouped_decode]", "status": "ok",
                     "us": 1.0, "check": "FAIL", "schedule": "sm90_grouped_decode"})
        rows.append({"op": op, "provider": "cute_w4a4[auto]", "status": "error: boom"})
        if ratio_loop:
            rows.append({"op": op, "provider": "loop_w4a16", "status": "ok",
                         "us": 100.0 / ratio_torch * ratio_loop, "check": "ok"})
    return {"model": "qwen3-30b-a3b", "tokens": tokens, "routing": "uniform", "seed": 7,
            "stats": {"active_experts": 90, "empty_experts": 38, "max_pairs": 5,
                      "mean_pairs_active": 1.4, "top10pct_share": 0.2}, "rows": rows}


def test_summary_bars_and_markdown(bench):
    cases = [_synthetic(bench, 16, 2.5, 4.0), _synthetic(bench, 64, 1.5, 2.0),
             _synthetic(bench, 4096, 0.9), _synthetic(bench, 16384, 1.0, check="FAIL")]
    s = {x["op"]: x for x in bench.summary(cases[0])}
    # the 1 us FAIL row never counts; the passing auto row does
    assert s["gate_up"]["w4a16_us"] == 40.0
    assert s["gate_up"]["w4a16_schedule"] == "sm90_grouped"
    assert s["gate_up"]["w4a16_x_torch"] == 2.5 and s["gate_up"]["w4a16_x_loop"] == 4.0
    assert s["gate_up"]["w4a4_us"] is None and s["gate_up"]["w4a16_weight_TB/s"] == 3.0
    got = {(b["tokens"], b["op"], "loop" if "loop" in b["bar"] else "torch"): b["status"]
           for b in bench.bars(cases) if "auto" not in b["bar"]}  # the stream bars apart
    assert got[(16, "gate_up", "torch")] == got[(16, "down", "loop")] == "PASS"
    assert got[(64, "gate_up", "torch")] == got[(64, "gate_up", "loop")] == "FAIL"
    assert got[(4096, "down", "torch")] == "FAIL"  # 0.9x < 0.95x
    assert got[(16384, "down", "torch")] == "missing"  # its output failed the check
    assert (4096, "down", "loop") not in got  # no loop bar at prefill
    layer = [b for b in bench.bars(cases) if b["op"] == "layer"]  # fused vs unfused only
    assert layer and all("fused layer" in b["bar"] for b in layer)
    skewed = dict(cases[0], routing="skewed")
    assert len(bench.bars([skewed])) == 0
    res = {"env": {"gpu": "NVIDIA H200", "date": "2026-12-01", "driver": "580",
                   "torch": "2.11", "cuda": "13.0", "cute_dsl": "4.8.1", "git_commit": "x"},
           "config": {"models": ["qwen3-30b-a3b"], "reps": 20, "budget_s": 220,
                      "weight_seed": 0, "x_seed": 1},
           "cases": cases, "bars": bench.bars(cases), "skipped": ["a b c"], "elapsed_s": 12}
    md = bench.render_md(res)
    assert "| uniform | 16 | 90 | gate_up | 100.0 | 40.0 | sm90_grouped | 2.50x |" in md
    assert "cute_w4a16[sm90_grouped_decode]: FAIL" in md and "cute_w4a4[auto]: error" in md
    assert "W4A16 >= 2x torch._grouped_mm (decode): qwen3-30b-a3b 16 tokens gate_up: 2.50x"\
        " -> PASS" in md
    assert '"flop"' in md and "2*P*N*K" in md and "Skipped (time budget): 1" in md
    assert bench._stem({"gpu": "NVIDIA H200"}).endswith("-h200-moe")


def test_bench_without_a_gpu_says_so(bench, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["--quick", "--out", "/nonexistent/never-written"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------- fused

def test_fused_layer_is_the_unfused_layer_bit_for_bit(monkeypatch):
    """A fused layer (w13 stored with gate/up interleaved, SiLU-and-mul in the gate_up
    GEMM's epilogue) gives the unfused layer's bits; its stages check, and its references
    see the natural order. The GEMMs are the exact reference (the kernels' own
    bit-identity is tests/gpu/test_fused_epilogue.py)."""
    from cute_fp4.fused import interleave_gate_up, silu_mul_unfused

    calls = []

    def grouped(a, b, offsets, schedule, out_dtype, alpha, silu_mul=False):
        calls.append(silu_mul)
        out = _exact_grouped(a, b, offsets, schedule, out_dtype, alpha)
        return silu_mul_unfused(out, 8) if silu_mul else out

    monkeypatch.setattr(cex, "_grouped_gemm", grouped)
    w13, w2 = _weights(seed=31)
    q13, q2 = quantize(w13), quantize(w2)
    plain = moe.NVFP4MoE(q13, q2, layout="plain", fused=False)
    fused = moe.NVFP4MoE(None, None, experts=cex.Experts(interleave_gate_up(q13, 8), q2,
                                                         layout="plain", gate_up_group=8))
    assert (plain.gate_up_group, fused.gate_up_group) == (None, 8)
    x, ids, w = _inputs(9, 2, seed=32)
    want = plain(x, ids, w)
    calls.clear()
    got = fused(x, ids, w)
    assert calls == [True, False]  # gate_up with the activation fused, then down
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert all(c.passed for c in moe.check_stages(fused, fused.stages(x, ids, w), x, ids, w))
    for e in (0, E - 1):
        assert torch.equal(fused.gate_up_expert(e).data, moe.expert(q13, e).data)
    assert all(torch.equal(a, b) for a, b in zip(fused.dequantized(), plain.dequantized()))


def test_fused_needs_a_gpu_to_pick_its_order():
    w13, w2 = _weights(seed=33)
    with pytest.raises(DeviceError, match="fused=True needs the weights on a CUDA GPU"):
        moe.NVFP4MoE.from_float(w13, w2, layout="plain", fused=True)
    assert moe.NVFP4MoE.from_float(w13, w2, layout="plain").gate_up_group is None
    with pytest.raises(InputError, match="fused must be"):
        moe.NVFP4MoE.from_float(w13, w2, layout="plain", fused="yes")
