"""Issue 13's MoE table: cute_fp4's grouped NVFP4 GEMM against torch BF16
``torch._grouped_mm`` and a per-expert loop of the dense ``cute_fp4.gemm``, per GEMM
(gate_up, down) and for the whole layer (``cute_fp4.moe.NVFP4MoE`` vs ``moe_bf16``), in one
process, on the same weights and routing.

    python perf/moe_bench.py [--out perf/results/] [--quick] [--budget-s 200] [--reps 20]
        [--models qwen3-30b-a3b,deepseek-v3] [--tokens 1,4,16,64,4096,16384]
        [--routings uniform,skewed] [--ops gate_up,down,layer]
        [--providers torch_bf16,cute_w4a16,cute_w4a4,loop] [--warm] [--stem NAME]

Shapes: a Qwen3-30B-A3B-like layer (hidden 2048, expert intermediate 768, 128 experts,
top-8) and a DeepSeek-V3-like layer (hidden 7168, intermediate 2048, 256 experts, top-8);
tokens 1, 4, 16 and 64 (decode), 4096 and 16384 (prefill). Routing: a seeded random router
(:func:`router`: N(0, 1) logits, top-k, softmax over the chosen), "uniform", and "skewed"
(a Zipf-like popularity bias: a few hot experts, many empty ones at decode); the seed of
every case is in the JSON. Weights: N(0, std_e) per expert (std_e in 0.01..0.03, seeded),
quantized per expert with a power-of-two global scale, so the BF16 weights torch gets
(the dequantized NVFP4 values) are exact and every provider computes the same products.

Providers per GEMM: ``cute_w4a16[<schedule>]`` (``grouped_gemm`` on BF16 activations;
``auto`` and, at decode, each of the family's decode schedules: the grouped rs_packed
decode tile and the grouped stream kernel), ``cute_w4a4[auto]`` (activations
quantized beforehand, outside the timing), ``torch_bf16`` (``torch._grouped_mm``), and at
decode ``loop_w4a16`` (``cute_fp4.gemm`` per non-empty expert, one fixed decode schedule;
the loop needs the offsets on the host, read once before timing). Per layer: the same four
as ``NVFP4MoE``/``moe_bf16``/a loop layer, routing included in every one.

Timing: ``cute_fp4.bench.Timer`` (the call captured in a CUDA graph, its replay timed with
CUDA events, L2 flushed before each repetition, median); ``--warm`` also times every row
without the flush (``us_warm``: the weights may sit in L2 from the replay before).
Checks, in the same run, on the output the last replay wrote (NaN-poisoned beforehand for
the GEMMs): every GEMM output on a sample of experts (first, last, largest, one seeded; at
most 64 rows each) against the exact reference (``cute_fp4.reference.check``, the error
rule); every layer against the float64 layer (``moe.moe_reference``) on 8 sampled tokens
(relative Frobenius error within :data:`LAYER_TOL`), and each cute_fp4 layer's stages of
one eager call against the rule (``moe.check_stages``) with the graph's output equal to
that eager output bit for bit.

Order (so that ``--budget-s``, wall clock including compiles, cuts the least useful part):
1. uniform routing: torch, W4A16 ``auto`` and the loop (decode), GEMMs and layers;
2. the decode schedule at decode; 3. W4A4; 4. skewed routing (torch, W4A16 ``auto``);
5. the loop layer at decode. What the budget skipped is listed. Writes
``<out>/<stem>.json`` and ``.md`` after every measurement (stem: ``<date>-<gpu>-moe``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    inter: int  # expert intermediate size
    experts: int
    top_k: int


MODELS = (MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8),
          MoEShape("deepseek-v3", 7168, 2048, 256, 8))
DECODE_TOKENS = (1, 4, 16, 64)
PREFILL_TOKENS = (4096, 16384)
ROUTINGS = {"uniform": 0.0, "skewed": 1.5}  # skew: popularity bias -skew * ln(1 + rank)
WEIGHT_SEED, X_SEED, ROUTING_SEED = 0, 1, 2
DECODE_MAX = 128  # tokens up to which a case is "decode" (loop, decode schedule, bars)
DECODE_SCHEDULES = {"sm90": ("sm90_grouped_decode", "sm90_stream_grouped_decode"),
                    "sm120": ("sm120_grouped_decode", "sm120_stream_grouped_decode")}
OPS = ("gate_up", "down", "layer")
CHECK_ROWS = 64  # rows per sampled expert checked against the exact reference
CHECK_TOKENS = 8  # tokens of the layer checks (8 x top-8 pairs: up to 64 experts)
LAYER_TOL = {"bf16": 2.0**-6, "w4a16": 2.0**-6, "w4a4": 2.0**-3}
BARS = {"decode_vs_torch": 2.0, "prefill_vs_torch": 0.95, "decode_vs_loop": 3.0}
# issue 27 (grouped decode at HBM speed): at 1, 4 and 16 tokens x top-8
STREAM_BARS = {"tokens": (1, 4, 16), "w4a16_vs_torch": 3.5, "w4a4_vs_w4a16": 0.9}
FUSED_BARS = {16: 1.15, 64: 1.15, 4096: 1.05}  # layer fused vs unfused, by tokens

METHOD = ("each call captured in a CUDA graph (cute_fp4.bench.Timer), its replay timed with "
          "CUDA events (device time), L2 flushed before each repetition by reading 256 MiB, "
          "median; every provider prepared once outside the timed region from the same "
          "weights, activations and routing (W4A4 GEMMs: activations quantized beforehand; "
          "the layers route, gather, quantize and combine inside the timed call)")
FORMULAS = {
    "pairs": "P = tokens * top_k (rows of both grouped GEMMs); A = experts with >= 1 pair",
    "gemm": {"gate_up": "N = 2*I, K = H", "down": "N = H, K = I"},
    "flop": "GEMM: 2*P*N*K; layer: the two GEMMs' sum (activation, routing, combine not "
            "counted)",
    "weight_bytes": {"NVFP4": "A*(N*K/2 + N*K/16) (codes + UE4M3 scales of the routed "
                              "experts)", "BF16": "A*N*K*2"},
    "bytes": {"W4A16 / torch": "weight bytes + P*K*2 (A) + P*N*2 (out)",
              "W4A4": "weight bytes + P*K/2 + P*K/16 (A) + P*N*2 (out)",
              "layer": "both GEMMs' weight bytes + T*H*2 (x) + T*H*2 (out); intermediates "
                       "not counted"},
    "rates": "TFLOP/s = flop / time; weight TB/s = weight bytes / time; GB/s = bytes / time",
}


# ----------------------------------------------------------------------------- routing

def router(tokens: int, experts: int, top_k: int, seed: int, skew: float = 0.0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights float32 [T, k]) of a seeded random router on
    the CPU (the same routing on any machine): logits N(0, 1) ``[T, E]``, plus, when
    ``skew`` > 0, ``-skew * ln(1 + rank)`` with each expert's rank a seeded permutation
    (rank 0 the most popular); top-k of the logits, weights the softmax of the chosen ones
    (renormalised top-k, as Qwen3 and DeepSeek-V3 do)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    if skew:
        rank = torch.randperm(experts, generator=g)
        logits = logits - skew * torch.log1p(rank.float())
    top, ids = logits.topk(top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def routing_seed(model_index: int, tokens: int, routing: str) -> int:
    return ROUTING_SEED * 1_000_003 + model_index * 100_003 + tokens * 7 + \
        list(ROUTINGS).index(routing)


def routing_stats(ids: torch.Tensor, experts: int) -> dict:
    """Pairs per expert: active experts, empty ones, largest, mean over active, and the
    share of all pairs held by the busiest tenth of the experts."""
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=experts)
    active = counts[counts > 0]
    top = counts.sort(descending=True).values[:max(1, experts // 10)]
    total = int(counts.sum())
    return {"pairs": total, "active_experts": int(active.numel()),
            "empty_experts": experts - int(active.numel()),
            "max_pairs": int(counts.max()), "mean_pairs_active":
            round(float(active.float().mean()), 2) if active.numel() else 0.0,
            "top10pct_share": round(int(top.sum()) / total, 3) if total else 0.0}


def sample_experts(offsets: list[int], seed: int) -> list[int]:
    """The experts whose rows are checked: first and last non-empty, the largest, and one
    seeded random non-empty one (distinct, ascending)."""
    active = [e for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e]]
    if not active:
        return []
    largest = max(active, key=lambda e: (offsets[e + 1] - offsets[e], -e))
    pick = active[torch.randint(len(active), (1,),
                                generator=torch.Generator().manual_seed(seed)).item()]
    return sorted({active[0], active[-1], largest, pick})


# ----------------------------------------------------------------------------- formulas

def gemm_nk(shape: MoEShape, op: str) -> tuple[int, int]:
    return (2 * shape.inter, shape.hidden) if op == "gate_up" else (shape.hidden, shape.inter)


def flop(shape: MoEShape, op: str, pairs: int) -> int:
    if op == "layer":
        return flop(shape, "gate_up", pairs) + flop(shape, "down", pairs)
    n, k = gemm_nk(shape, op)
    return 2 * pairs * n * k


def weight_bytes(shape: MoEShape, op: str, active: int, fmt: str) -> int:
    """Bytes of the routed experts' weights: ``fmt`` "nvfp4" or "bf16"."""
    if op == "layer":
        return sum(weight_bytes(shape, o, active, fmt) for o in ("gate_up", "down"))
    n, k = gemm_nk(shape, op)
    return active * (n * k // 2 + n * k // 16 if fmt == "nvfp4" else 2 * n * k)


def nbytes(shape: MoEShape, op: str, tokens: int, active: int, fmt: str, a_fmt: str) -> int:
    """Bytes that must move (:data:`FORMULAS`): weights ``fmt``, activations ``a_fmt``."""
    pairs = tokens * shape.top_k
    if op == "layer":
        return weight_bytes(shape, op, active, fmt) + 4 * tokens * shape.hidden
    n, k = gemm_nk(shape, op)
    a = pairs * k // 2 + pairs * k // 16 if a_fmt == "nvfp4" else 2 * pairs * k
    return weight_bytes(shape, op, active, fmt) + a + 2 * pairs * n


def rates(shape: MoEShape, op: str, tokens: int, active: int, fmt: str, a_fmt: str,
          us: float) -> dict:
    wb = weight_bytes(shape, op, active, fmt)
    return {"TFLOP/s": round(flop(shape, op, tokens * shape.top_k) / us / 1e6, 2),
            "weight_TB/s": round(wb / us / 1e6, 3),
            "GB/s": round(nbytes(shape, op, tokens, active, fmt, a_fmt) / us / 1e3, 1)}


# ----------------------------------------------------------------------------- weights

def pow2_scale(amax: float) -> float:
    """The power of two at or above ``amax / 2688`` (so block scales stay <= 448 and the
    dequantized values are exact in BF16)."""
    return 2.0 ** math.ceil(math.log2(amax / 2688)) if amax > 0 else 1.0


@dataclasses.dataclass
class Weights:
    """One model's experts: plain NVFP4 stacks (references, the loop), the stacks the
    grouped kernels read (packed on sm_90a, else the plain ones), exact BF16 copies."""

    shape: MoEShape
    q13: object
    q2: object
    k13: object
    k2: object
    b13: torch.Tensor
    b2: torch.Tensor
    seconds: float = 0.0

    def plain(self, op: str):
        return self.q13 if op == "gate_up" else self.q2

    def kernel(self, op: str):
        return self.k13 if op == "gate_up" else self.k2

    def bf16(self, op: str) -> torch.Tensor:
        return self.b13 if op == "gate_up" else self.b2


def _expert_stack(n: int, k: int, stds: torch.Tensor, gen, device):
    """(plain NVFP4 stack [E, n, k], its exact BF16 values): expert by expert."""
    from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape

    e = stds.numel()
    data = torch.empty((e, n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((e, *scale_shape(n, k)), dtype=torch.float8_e4m3fn, device=device)
    gs = torch.empty(e, dtype=torch.float32, device=device)
    bf = torch.empty((e, n, k), dtype=torch.bfloat16, device=device)
    for i in range(e):
        w = torch.randn(n, k, generator=gen, device=device) * float(stds[i])
        q = quantize(w, pow2_scale(float(w.abs().max())))
        data[i], scale[i], gs[i] = q.data, q.scale, q.global_scale
        bf[i] = q.dequantize(torch.bfloat16)
    return NVFP4Tensor._unchecked(data, scale, gs, (e, n, k)), bf


def build_weights(shape: MoEShape, seed: int, device, packed: bool) -> Weights:
    """Seeded N(0, std_e) experts (std_e = 0.01 + 0.02 * U(0, 1)), NVFP4 with power-of-two
    global scales, exact BF16 copies; ``packed``: the fragment-order stacks too."""
    from cute_fp4.packed import repack

    t0 = time.perf_counter()
    stds = 0.01 + 0.02 * torch.rand(shape.experts, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator(device=device).manual_seed(seed)
    q13, b13 = _expert_stack(2 * shape.inter, shape.hidden, stds, gen, device)
    q2, b2 = _expert_stack(shape.hidden, shape.inter, stds.flip(0), gen, device)
    k13, k2 = (repack(q13), repack(q2)) if packed else (q13, q2)
    return Weights(shape, q13, q2, k13, k2, b13, b2, round(time.perf_counter() - t0, 1))


# ----------------------------------------------------------------------------- a case

@dataclasses.dataclass
class Case:
    """One (model, tokens, routing): inputs on the device and what the checks need."""

    shape: MoEShape
    tokens: int
    routing: str
    seed: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    route: object  # moe.Routing on the device
    offsets: list[int]  # host copy, read once (loop providers, checks)
    xs: torch.Tensor  # gathered activations [P, H]
    h: torch.Tensor  # silu_and_mul of torch's gate_up: the down GEMM's input [P, I]
    experts_checked: list[int]
    tokens_checked: torch.Tensor
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def active(self) -> int:
        return sum(1 for e in range(self.shape.experts) if self.offsets[e + 1] > self.offsets[e])

    @property
    def decode(self) -> bool:
        return self.tokens <= DECODE_MAX

    def activation(self, op: str, fmt: str):
        """The GEMM's A: ``xs`` (gate_up) or ``h`` (down), BF16 or NVFP4 (quantized once,
        dynamic amax, ``cute_fp4.quantize``: what the fused kernel computes)."""
        a = self.xs if op == "gate_up" else self.h
        if fmt == "bf16":
            return a
        key = ("nvfp4", op)
        if key not in self.memo:
            from cute_fp4.nvfp4 import quantize

            self.memo[key] = quantize(a)
        return self.memo[key]


def make_case(shape: MoEShape, model_index: int, tokens: int, routing: str, wts: Weights,
              device) -> Case:
    from cute_fp4.moe import route, silu_and_mul

    seed = routing_seed(model_index, tokens, routing)
    ids, w = router(tokens, shape.experts, shape.top_k, seed, ROUTINGS[routing])
    g = torch.Generator().manual_seed(X_SEED * 1_000_003 + tokens)
    x = torch.randn(tokens, shape.hidden, generator=g).to(device, torch.bfloat16)
    ids, w = ids.to(device), w.to(device)
    r = route(ids, shape.experts)
    offsets = r.offsets.tolist()
    xs = x.index_select(0, r.token)
    h = silu_and_mul(_torch_grouped(xs, wts.b13, r.offsets))
    sample_tok = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))
    return Case(shape, tokens, routing, seed, x, ids, w, r, offsets, xs, h,
                sample_experts(offsets, seed), sample_tok[:CHECK_TOKENS].sort().values)


def _torch_grouped(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if hasattr(torch, "_grouped_mm") and a.is_cuda:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets[1:])
    from cute_fp4.moe import _bf16_grouped

    return _bf16_grouped(a, w, offsets)


# ----------------------------------------------------------------------------- checks

def _sel(lo: int, hi: int) -> torch.Tensor:
    if hi - lo <= CHECK_ROWS:
        return torch.arange(lo, hi)
    half = CHECK_ROWS // 2
    return torch.cat((torch.arange(lo, lo + half), torch.arange(hi - half, hi)))


def check_gemm(out: torch.Tensor, a, w_plain, case: Case) -> dict:
    """The error rule on the sampled experts' rows of a grouped GEMM output."""
    from cute_fp4 import reference
    from cute_fp4.moe import _rows, expert

    worst, bad, nonfinite = 0.0, [], 0
    linear = None if isinstance(a, torch.Tensor) else a.scale_linear()
    for e in case.experts_checked:
        sel = _sel(case.offsets[e], case.offsets[e + 1])
        res = reference.check(out[sel.to(out.device)], _rows(a, sel, linear), expert(w_plain, e))
        worst, nonfinite = max(worst, res.max_err_over_bound), nonfinite + res.nonfinite
        if not res.passed:
            bad.append(e)
    return {"check": "FAIL" if bad else "ok", "err_over_bound": float(f"{worst:.4g}"),
            "nonfinite": nonfinite, "experts_checked": case.experts_checked,
            **({"failed_experts": bad} if bad else {})}


def layer_reference(case: Case, wts: Weights, mode: str, scales=(None, None)) -> torch.Tensor:
    """The float64 layer on the sampled tokens (memoised per mode)."""
    key = ("ref", mode)
    if key not in case.memo:
        from cute_fp4.moe import moe_reference
        from cute_fp4.nvfp4 import quantize

        tok = case.tokens_checked.to(case.x.device)

        def act_quant(t, which):
            return quantize(t.float(), scales[which]).dequantize(torch.float64)

        case.memo[key] = moe_reference(
            case.x[tok], case.ids[tok], case.weights[tok], lambda e: wts.b13[e].double(),
            lambda e: wts.b2[e].double(), act_quant if mode == "w4a4" else None)
    return case.memo[key]


def check_layer(out: torch.Tensor, case: Case, wts: Weights, mode: str, scales=(None, None)
                ) -> dict:
    ref = layer_reference(case, wts, mode, scales)
    got = out[case.tokens_checked.to(out.device)].double()
    rel = float((got - ref).norm() / ref.norm()) if ref.numel() else 0.0
    finite = bool(torch.isfinite(got).all())
    ok = finite and rel <= LAYER_TOL[mode]
    return {"check": "ok" if ok else "FAIL", "rel_err": float(f"{rel:.3g}"),
            "tol": LAYER_TOL[mode], "tokens_checked": int(ref.shape[0])}


# ----------------------------------------------------------------------------- providers

class Unavailable(Exception):
    """A provider cannot run here or for this case (the message says why)."""


class Prepared(NamedTuple):
    call: Callable[[], torch.Tensor]
    check: Callable[[torch.Tensor], dict]
    info: dict


def _poisoned(rows: int, cols: int, device) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)


def _grouped_schedule(schedule, a_fmt: str, case: Case, op: str):
    """The resolved grouped schedule, refused (Unavailable) when plan() refuses it."""
    from cute_fp4.operands import GroupedDims
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem
    from cute_fp4.tuning import resolve_grouped

    n0, k0 = gemm_nk(case.shape, "gate_up" if op == "layer" else op)
    # what grouped_gemm's "auto" sees: it picks by the rows per expert
    s = resolve_grouped(schedule, dims=GroupedDims(len(case.xs), n0, k0, case.shape.experts,
                                                   a_fmt, True))
    for o in ("gate_up", "down") if op == "layer" else (op,):
        n, k = gemm_nk(case.shape, o)
        pl = plan(s, Problem(len(case.xs), n, k, a_fmt, groups=case.shape.experts))
        if not pl.ok:
            raise Unavailable(f"plan() refuses {s.name or s.label()} for {a_fmt} N={n} "
                              f"K={k}: {'; '.join(pl.reasons)[:300]}")
    return s


def prep_cute_gemm(case: Case, wts: Weights, op: str, a_fmt: str, schedule) -> Prepared:
    from cute_fp4.grouped import grouped_gemm
    from cute_fp4.operands import grouped_alpha
    from cute_fp4.packed import PackedNVFP4Weight

    s = _grouped_schedule(schedule, a_fmt, case, op)
    a, w = case.activation(op, a_fmt), wts.kernel(op)
    alpha = grouped_alpha(a, w, None, case.shape.experts)  # once, as static scales allow
    out = _poisoned(len(case.xs), gemm_nk(case.shape, op)[0], case.x.device)
    offs = case.route.offsets
    # "auto" itself, as a model calls it: W4A4 on a packed stack then takes the values
    # route (grouped.via_values), which a resolved Schedule would bypass
    run = schedule if schedule == "auto" else s
    label = s.name or s.label()
    if run == "auto" and a_fmt == "nvfp4" and isinstance(w, PackedNVFP4Weight):
        v = _grouped_schedule("auto", "bf16", case, op)
        label = f"values + {v.name or v.label()}"
    return Prepared(lambda: grouped_gemm(a, w, offs, schedule=run, out=out, alpha=alpha),
                    lambda o: check_gemm(o, a, wts.plain(op), case), {"schedule": label})


def prep_torch_gemm(case: Case, wts: Weights, op: str) -> Prepared:
    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    a, wt, offs = case.activation(op, "bf16"), wts.bf16(op).transpose(-2, -1), \
        case.route.offsets[1:]
    return Prepared(lambda: torch._grouped_mm(a, wt, offs=offs),
                    lambda o: check_gemm(o, a, wts.plain(op), case), {})


def loop_schedule(family: str, n: int, k: int):
    """One dense schedule for every expert of a loop (one compile): the heuristic's pick
    for 16 rows (sm_90a: swap-AB with 16-row tiles)."""
    from cute_fp4.api import heuristic

    return heuristic(family, 16, n, k)


def _loop_fmt(family: str) -> str:
    return "bf16" if family == "sm90" else "nvfp4"


def _loop_calls(case: Case, wts: Weights, op: str, a, out, family: str):
    """The per-expert dense GEMM calls into ``out``'s row blocks (host-known offsets)."""
    from cute_fp4.api import gemm

    n, k = gemm_nk(case.shape, op)
    s = loop_schedule(family, n, k)
    blocks = []
    for e in range(case.shape.experts):
        lo, hi = case.offsets[e], case.offsets[e + 1]
        if hi > lo:
            blocks.append((a[lo:hi], wts.plain(op).expert(e), out[lo:hi]))

    def run():
        for a_e, w_e, o_e in blocks:
            gemm(a_e, w_e, schedule=s, out=o_e)
        return out

    return run, s


def prep_loop_gemm(case: Case, wts: Weights, op: str, family: str) -> Prepared:
    fmt = _loop_fmt(family)
    if fmt != "bf16":
        raise Unavailable(f"the per-expert loop is W4A16 (sm_90a); {family} has no W4A16 "
                          "dense kernels")
    a = case.activation(op, fmt)
    out = _poisoned(len(case.xs), gemm_nk(case.shape, op)[0], case.x.device)
    run, s = _loop_calls(case, wts, op, a, out, family)
    return Prepared(run, lambda o: check_gemm(o, a, wts.plain(op), case),
                    {"schedule": s.name or s.label(), "launches": case.active})


def layer_scales(case: Case) -> tuple[float, float]:
    """W4A4's static input scales, calibrated on this case (amax of x and of torch's h)."""
    return (float(case.x.float().abs().max()) / 2688, float(case.h.float().abs().max()) / 2688)


def prep_cute_layer(case: Case, wts: Weights, mode: str, schedule,
                    fused="auto") -> Prepared:
    from cute_fp4.moe import NVFP4MoE, check_stages

    a_fmt = "nvfp4" if mode == "w4a4" else "bf16"
    s = _grouped_schedule(schedule, a_fmt, case, "layer")
    scales = layer_scales(case) if mode == "w4a4" else (None, None)
    layer = NVFP4MoE(wts.k13, wts.k2, mode=mode, schedule=schedule if schedule == "auto"
                     else s, input_scales=scales, fused=fused)
    x, ids, w = case.x, case.ids, case.weights

    def check(out: torch.Tensor) -> dict:
        res = check_layer(out, case, wts, mode, scales)
        st = layer.stages(x, ids, w)
        stages = check_stages(layer, st, x, ids, w, experts=case.experts_checked,
                              max_rows=CHECK_ROWS, tokens=case.tokens_checked)
        failed = [c.stage for c in stages if not c.passed]
        same = torch.equal(st.out, out)
        res.update(stages="ok" if not failed else "FAIL: " + ", ".join(failed),
                   stage_err_over_bound={c.stage: float(f"{c.err_over_bound:.4g}")
                                         for c in stages},
                   graph_equals_eager=same, host_syncs=_host_syncs(lambda: layer(x, ids, w)))
        if failed or not same:
            res["check"] = "FAIL"
        return res

    return Prepared(lambda: layer(x, ids, w), check,
                    {"schedule": s.name or s.label(), "layout": layer.layout,
                     "fused": bool(layer.gate_up_group),
                     **({"input_scales": [float(f"{v:.4g}") for v in scales]}
                        if mode == "w4a4" else {})})


def _host_syncs(fn) -> str:
    """'none' when an eager call of ``fn`` makes no host-device synchronisation
    (``torch.cuda.set_sync_debug_mode("error")``), else the error; '-' without CUDA."""
    if not torch.cuda.is_available():
        return "-"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return f"sync: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def prep_torch_layer(case: Case, wts: Weights) -> Prepared:
    from cute_fp4.moe import moe_bf16

    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    x, ids, w = case.x, case.ids, case.weights
    return Prepared(lambda: moe_bf16(x, wts.b13, wts.b2, ids, w),
                    lambda o: check_layer(o, case, wts, "bf16"), {})


def prep_loop_layer(case: Case, wts: Weights, family: str) -> Prepared:
    from cute_fp4.moe import combine, route, silu_and_mul

    if _loop_fmt(family) != "bf16":
        raise Unavailable(f"the per-expert loop is W4A16 (sm_90a), not {family}")
    p, dev = len(case.xs), case.x.device
    xs = torch.empty_like(case.xs)
    gu = torch.empty((p, 2 * case.shape.inter), dtype=torch.bfloat16, device=dev)
    act = torch.empty((p, case.shape.inter), dtype=torch.bfloat16, device=dev)
    dn = torch.empty((p, case.shape.hidden), dtype=torch.bfloat16, device=dev)
    run13, _ = _loop_calls(case, wts, "gate_up", xs, gu, family)
    run2, s = _loop_calls(case, wts, "down", act, dn, family)
    x, ids, w = case.x, case.ids, case.weights

    def run() -> torch.Tensor:
        r = route(ids, case.shape.experts)  # device side; the offsets are the host copy's
        torch.index_select(x, 0, r.token, out=xs)
        run13()
        act.copy_(silu_and_mul(gu))
        run2()
        return combine(dn, r, w)

    return Prepared(run, lambda o: check_layer(o, case, wts, "w4a16"),
                    {"schedule": s.name or s.label(), "launches": 2 * case.active})


# ----------------------------------------------------------------------------- measuring

class Budget:
    """Wall clock of the run: measurements after the deadline are skipped."""

    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(prepare: Callable[[], Prepared], timer, budget: Budget, warm=None) -> dict:
    """One row: prepared and called once (``setup_s``: compiles included), timed, its output
    checked (``warm``: a Timer without the L2 flush, timed too: ``us_warm``). Unavailable,
    an exception or the budget give a row saying so, never a crash."""
    if budget.left() <= 0:
        return {"status": "skipped: time budget"}
    t0 = time.perf_counter()
    try:
        prep = prepare()
        prep.call()
        _sync()
        setup = time.perf_counter() - t0
        us, out = timer.timed(prep.call)
        row = {"status": "ok", "us": round(us, 2), "setup_s": round(setup, 1), **prep.info}
        row.update(prep.check(out))
        if warm is not None:
            row["us_warm"] = round(warm.timed(prep.call)[0], 2)
        return row
    except Unavailable as e:
        return {"status": f"unavailable: {e}"}
    except Exception as e:  # record what broke and go on
        try:
            _sync()
        except Exception:  # noqa: S110 - the context may be gone; the row says why
            pass
        tail = traceback.format_exc().strip().splitlines()[-3:]
        return {"status": f"error: {type(e).__name__}: {str(e)[:300]}", "trace": tail}


def record(case_res: dict, op: str, provider: str, row: dict, case: Case, fmt: str,
           a_fmt: str) -> dict:
    row = {"op": op, "provider": provider, **row}
    if "us" in row:
        row.update(rates(case.shape, op, case.tokens, case.active, fmt, a_fmt, row["us"]))
    case_res["rows"].append(row)
    return row


# ----------------------------------------------------------------------------- report

def _ok_us(rows: list[dict], op: str, prefix: str) -> tuple[float | None, dict | None]:
    """The fastest row of ``op`` whose provider starts with ``prefix`` and passed."""
    good = [r for r in rows if r["op"] == op and r["provider"].startswith(prefix)
            and ("unfused" in prefix or "unfused" not in r["provider"])
            and r.get("status") == "ok" and r.get("check") == "ok"]
    best = min(good, key=lambda r: r["us"], default=None)
    return (best["us"], best) if best else (None, None)


def summary(case_res: dict) -> list[dict]:
    """Per op: best passing W4A16 / W4A4 / torch / loop times and the ratios."""
    out = []
    for op in OPS:
        t, tr = _ok_us(case_res["rows"], op, "torch_bf16")
        w16, w16r = _ok_us(case_res["rows"], op, "cute_w4a16")
        w4, _ = _ok_us(case_res["rows"], op, "cute_w4a4")
        lp, _ = _ok_us(case_res["rows"], op, "loop_w4a16")
        auto, _ = _ok_us(case_res["rows"], op, "cute_w4a16[auto]")
        rs, _ = _ok_us(case_res["rows"], op, "cute_w4a16[sm90_grouped_decode]")
        unf16, _ = _ok_us(case_res["rows"], op, "cute_w4a16_unfused[auto]")
        w4auto, _ = _ok_us(case_res["rows"], op, "cute_w4a4[auto]")
        unf4, _ = _ok_us(case_res["rows"], op, "cute_w4a4_unfused[auto]")
        out.append({"op": op, "torch_us": t, "w4a16_us": w16,
                    "w4a16_schedule": w16r.get("schedule") if w16r else None,
                    "w4a4_us": w4, "loop_us": lp, "auto_us": auto, "rs_decode_us": rs,
                    "w4a16_x_torch": _ratio(t, w16), "w4a4_x_torch": _ratio(t, w4),
                    "w4a16_x_loop": _ratio(lp, w16), "auto_x_torch": _ratio(t, auto),
                    "auto_x_rs_decode": _ratio(rs, auto), "w4a4_x_auto": _ratio(auto, w4),
                    "unfused_w4a16_us": unf16, "fused_x_unfused_w4a16": _ratio(unf16, auto),
                    "unfused_w4a4_us": unf4, "fused_x_unfused_w4a4": _ratio(unf4, w4auto),
                    "w4a16_weight_TB/s": w16r.get("weight_TB/s") if w16r else None,
                    "torch_weight_TB/s": tr.get("weight_TB/s") if tr else None})
    return out


def _ratio(num, den) -> float | None:
    return None if num is None or den is None else round(num / den, 3)


def bars(cases: list[dict]) -> list[dict]:
    """Issue 13's bars on the uniform routing, per model, tokens and GEMM."""
    out = []
    for c in cases:
        if c["routing"] != "uniform":
            continue
        for s in summary(c):
            if s["op"] == "layer":
                where = {"model": c["model"], "tokens": c["tokens"], "op": "layer"}
                need = FUSED_BARS.get(c["tokens"])
                if need is not None:
                    out.append(_bar(f"fused layer >= {need}x unfused, W4A16 (issue 28)",
                                    where, s["fused_x_unfused_w4a16"], need))
                continue
            where = {"model": c["model"], "tokens": c["tokens"], "op": s["op"]}
            if c["tokens"] <= DECODE_MAX:
                out.append(_bar("W4A16 >= 2x torch._grouped_mm (decode)", where,
                                s["w4a16_x_torch"], BARS["decode_vs_torch"]))
                out.append(_bar("W4A16 >= 3x the per-expert loop (decode)", where,
                                s["w4a16_x_loop"], BARS["decode_vs_loop"]))
            else:
                out.append(_bar("W4A16 >= 0.95x torch._grouped_mm (prefill)", where,
                                s["w4a16_x_torch"], BARS["prefill_vs_torch"]))
            if c["tokens"] in STREAM_BARS["tokens"]:
                out.append(_bar("W4A16 auto >= 3.5x torch._grouped_mm (decode, issue 27)",
                                where, s["auto_x_torch"], STREAM_BARS["w4a16_vs_torch"]))
                out.append(_bar("W4A4 auto >= 0.9x W4A16 auto (decode, issue 27)", where,
                                s["w4a4_x_auto"], STREAM_BARS["w4a4_vs_w4a16"]))
    return out


def _bar(name: str, where: dict, value, need: float) -> dict:
    status = "missing" if value is None else "PASS" if value >= need else "FAIL"
    return {"bar": name, **where, "value": value, "need": need, "status": status}


def _f(v, fmt=".1f", suffix="") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def _cell_status(rows: list[dict], op: str) -> str:
    """'ok', or the providers of ``op`` that failed their check, raised or were skipped."""
    bad = []
    for r in rows:
        if r["op"] != op:
            continue
        st = r.get("status", "")
        if st != "ok":
            bad.append(f"{r['provider']}: {st.split(':')[0]}")
        elif r.get("check") != "ok":
            bad.append(f"{r['provider']}: {r.get('check')}")
    return "ok" if not bad else "; ".join(bad)


def render_md(res: dict) -> str:
    env, cfg = res["env"], res["config"]
    lines = [f"# MoE layers: cute_fp4 grouped NVFP4 GEMM vs torch BF16, {env.get('gpu', '?')}",
             "", f"{env.get('date')}; driver {env.get('driver')}, torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}), CuTe DSL {env.get('cute_dsl')}, git "
             f"{env.get('git_commit')}; {cfg['reps']} reps, CUDA-graph device time, L2 "
             "flushed, median, microseconds. Ratios: torch (or loop) time / cute_fp4 time "
             "(> 1: cute_fp4 faster); only outputs that passed their check count.", ""]
    for model in cfg["models"]:
        m = next(s for s in MODELS if s.name == model)
        lines += [f"## {m.name}: hidden {m.hidden}, intermediate {m.inter}, {m.experts} "
                  f"experts, top-{m.top_k}", "",
                  "| routing | tokens | active | op | torch BF16 | W4A16 | schedule | x torch "
                  "| W4A4 | x torch | loop | x loop | W4A16 wTB/s | torch wTB/s | auto | auto "
                  "x torch | rs decode | auto x rs decode | W4A4 / auto | checks |",
                  "|" + "---|" * 20]
        for c in res["cases"]:
            if c["model"] != model:
                continue
            for s in summary(c):
                lines.append(
                    f"| {c['routing']} | {c['tokens']} | {c['stats']['active_experts']} | "
                    f"{s['op']} | {_f(s['torch_us'])} | {_f(s['w4a16_us'])} | "
                    f"{s['w4a16_schedule'] or '-'} | {_f(s['w4a16_x_torch'], '.2f', 'x')} | "
                    f"{_f(s['w4a4_us'])} | {_f(s['w4a4_x_torch'], '.2f', 'x')} | "
                    f"{_f(s['loop_us'])} | {_f(s['w4a16_x_loop'], '.2f', 'x')} | "
                    f"{_f(s['w4a16_weight_TB/s'], '.2f')} | {_f(s['torch_weight_TB/s'], '.2f')}"
                    f" | {_f(s['auto_us'])} | {_f(s['auto_x_torch'], '.2f', 'x')} | "
                    f"{_f(s['rs_decode_us'])} | {_f(s['auto_x_rs_decode'], '.2f', 'x')} | "
                    f"{_f(s['w4a4_x_auto'], '.2f', 'x')} | {_cell_status(c['rows'], s['op'])} |")
        lines.append("")
    lines += ["## Bars (issue 13, uniform routing)", ""]
    lines += [f"* {b['bar']}: {b['model']} {b['tokens']} tokens {b['op']}: "
              f"{_f(b['value'], '.2f', 'x')} -> {b['status']}" for b in res["bars"]] or \
        ["* none measured"]
    lines += ["", "## Routing", "", "| model | routing | tokens | seed | active | empty | "
              "max pairs | mean pairs (active) | top-10% share |", "|" + "---|" * 9]
    for c in res["cases"]:
        st = c["stats"]
        lines.append(f"| {c['model']} | {c['routing']} | {c['tokens']} | {c['seed']} | "
                     f"{st['active_experts']} | {st['empty_experts']} | {st['max_pairs']} | "
                     f"{st['mean_pairs_active']} | {st['top10pct_share']} |")
    lines += ["", "## Formulas", "", "```", json.dumps(FORMULAS, indent=1), "```", "",
              f"Weights: seed {cfg['weight_seed']}; activations x ~ N(0, 1), seed "
              f"{cfg['x_seed']} * 1000003 + tokens; routing seeds per case above. Built in "
              f"{res.get('build_s', {})} s. Wall time {res.get('elapsed_s')} s of the "
              f"{cfg['budget_s']} s budget."]
    syncs = [f"{c['model']} {c['tokens']} {c['routing']} {r['provider']}: {r['host_syncs']}"
             for c in res["cases"] for r in c["rows"]
             if r.get("host_syncs") not in (None, "none", "-")]
    n_layers = sum(1 for c in res["cases"] for r in c["rows"] if r.get("host_syncs") == "none")
    lines += ["", f"Host syncs of an eager NVFP4MoE forward (torch.cuda.set_sync_debug_mode"
              f"('error')): none in {n_layers} layer rows"
              + (f"; syncs in {len(syncs)}: " + "; ".join(syncs[:10]) if syncs else ".")]
    if res["skipped"]:
        lines += ["", f"Skipped (time budget): {len(res['skipped'])} measurements: "
                  + ", ".join(res["skipped"][:40])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--stem", default=None, help="file name stem (default <date>-<gpu>-moe)")
    ap.add_argument("--quick", action="store_true", help="qwen3 only, tokens 16 and 4096, "
                    "uniform routing, 10 reps")
    ap.add_argument("--models", default=None)
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--routings", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--ops", default=None, help="GEMMs / layer to run (default all)")
    ap.add_argument("--providers", default=None,
                    help="provider name prefixes to run (default all)")
    ap.add_argument("--warm", action="store_true",
                    help="also time every row with L2 warm (no flush): us_warm")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="wall-clock budget, compiles included; later measurements are "
                         "skipped (default 200)")
    args = ap.parse_args(argv)
    args.models = (args.models.split(",") if args.models else
                   [MODELS[0].name] if args.quick else [m.name for m in MODELS])
    args.tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens else
                   [16, 4096] if args.quick else [*DECODE_TOKENS, *PREFILL_TOKENS])
    args.routings = (args.routings.split(",") if args.routings else
                     ["uniform"] if args.quick else list(ROUTINGS))
    args.reps = args.reps or (10 if args.quick else 20)
    args.ops = args.ops.split(",") if args.ops else list(OPS)
    args.providers = args.providers.split(",") if args.providers else None
    unknown = set(args.models) - {m.name for m in MODELS}
    if unknown or set(args.routings) - set(ROUTINGS):
        ap.error(f"unknown models/routings: {sorted(unknown)} {args.routings}")
    return args


def _stem(env: dict) -> str:
    gpu = str(env.get("gpu", "gpu"))
    short = "h200" if "H200" in gpu else "".join(ch for ch in gpu.lower().split()[-1]
                                                 if ch.isalnum()) or "gpu"
    return f"{datetime.date.today().isoformat()}-{short}-moe"


def plan_passes(args, family: str) -> list[tuple]:
    """(pass, routing, op, provider, fmt, a_fmt, what) in run order (module docstring)."""
    decode_s = DECODE_SCHEDULES.get(family, ())
    out = []
    for op in OPS:
        out += [(1, "uniform", op, "torch_bf16", "bf16", "bf16", None),
                (1, "uniform", op, "cute_w4a16[auto]", "nvfp4", "bf16", "auto")]
        if op != "layer":
            out.append((1, "uniform", op, "loop_w4a16", "nvfp4", "bf16", "decode"))
        else:  # the layer without its fused activation (NVFP4MoE(fused=False))
            out.append((1, "uniform", op, "cute_w4a16_unfused[auto]", "nvfp4", "bf16",
                        "auto"))
    out += [(2, "uniform", op, f"cute_w4a16[{d}]", "nvfp4", "bf16", d)
            for d in decode_s for op in OPS]
    out += [(3, "uniform", op, "cute_w4a4[auto]", "nvfp4", "nvfp4", "auto") for op in OPS]
    out.append((3, "uniform", "layer", "cute_w4a4_unfused[auto]", "nvfp4", "nvfp4", "auto"))
    for op in OPS:
        out += [(4, "skewed", op, "torch_bf16", "bf16", "bf16", None),
                (4, "skewed", op, "cute_w4a16[auto]", "nvfp4", "bf16", "auto")]
    out.append((5, "uniform", "layer", "loop_w4a16", "nvfp4", "bf16", "decode"))
    keep = args.providers
    return [p for p in out if p[1] in args.routings and p[2] in args.ops
            and (keep is None or any(p[3].startswith(k) for k in keep))]


def _prepare(case: Case, wts: Weights, op: str, provider: str, what, family: str):
    """The preparer of one planned measurement (None: not run for this case)."""
    decode_only = provider.startswith("loop") or (what not in (None, "auto"))
    if decode_only and not case.decode:
        return None
    if provider == "torch_bf16":
        return (lambda: prep_torch_layer(case, wts)) if op == "layer" else \
            (lambda: prep_torch_gemm(case, wts, op))
    if provider.startswith("loop"):
        return (lambda: prep_loop_layer(case, wts, family)) if op == "layer" else \
            (lambda: prep_loop_gemm(case, wts, op, family))
    mode = "w4a4" if provider.startswith("cute_w4a4") else "w4a16"
    a_fmt = "nvfp4" if mode == "w4a4" else "bf16"
    fused = False if "unfused" in provider else "auto"
    return (lambda: prep_cute_layer(case, wts, mode, what, fused)) if op == "layer" else \
        (lambda: prep_cute_gemm(case, wts, op, a_fmt, what))


def _write(out: Path, stem: str, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res["bars"] = bars(res["cases"])
    for c in res["cases"]:
        c["summary"] = summary(c)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(render_md(res))


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    if not torch.cuda.is_available():
        print("moe_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from cute_fp4.bench import Timer, environment
    from cute_fp4.targets import require_device

    family = str(require_device().target.family)
    env = environment()
    stem = args.stem or _stem(env)
    out = Path(args.out)
    res = {"env": env, "config": {"models": args.models, "tokens": args.tokens,
                                  "routings": args.routings, "reps": args.reps,
                                  "quick": args.quick, "budget_s": args.budget_s,
                                  "ops": args.ops, "providers": args.providers,
                                  "warm": args.warm,
                                  "weight_seed": WEIGHT_SEED, "x_seed": X_SEED,
                                  "routing_seed": ROUTING_SEED, "family": family,
                                  "layer_tol": LAYER_TOL, "check_rows": CHECK_ROWS,
                                  "check_tokens": CHECK_TOKENS},
           "method": METHOD, "formulas": FORMULAS, "cases": [],
           "skipped": [], "build_s": {}}
    timer = Timer(args.reps)
    warm = Timer(args.reps, flush=False) if args.warm else None
    dev = torch.device("cuda")
    weights, cases = {}, {}
    for i, name in enumerate(args.models):
        shape = next(m for m in MODELS if m.name == name)
        weights[name] = build_weights(shape, WEIGHT_SEED + i, dev, packed=family == "sm90")
        res["build_s"][name] = weights[name].seconds
        print(f"built {name} in {weights[name].seconds} s", file=sys.stderr, flush=True)
        for routing in args.routings:
            for t in args.tokens:
                c = make_case(shape, i, t, routing, weights[name], dev)
                cases[(name, t, routing)] = c
                res["cases"].append({"model": name, "tokens": t, "routing": routing,
                                     "seed": c.seed, "stats": routing_stats(c.ids, shape.experts),
                                     "experts_checked": c.experts_checked, "rows": []})
    by_key = {(c["model"], c["tokens"], c["routing"]): c for c in res["cases"]}
    for _, routing, op, provider, fmt, a_fmt, what in plan_passes(args, family):
        for (name, t, r), case in cases.items():
            if r != routing:
                continue
            prep = _prepare(case, weights[name], op, provider, what, family)
            if prep is None:
                continue
            label = f"{name} {t} {routing} {op} {provider}"
            row = measure(prep, timer, budget, warm)
            if row["status"].startswith("skipped"):
                res["skipped"].append(label)
            record(by_key[(name, t, routing)], op, provider, row, case, fmt, a_fmt)
            print(f"[{budget.elapsed():6.1f} s] {label}: {row.get('us', row['status'])} "
                  f"{row.get('check', '')}", file=sys.stderr, flush=True)
            res["elapsed_s"] = budget.elapsed()
            _write(out, stem, res)
    res["elapsed_s"] = budget.elapsed()
    _write(out, stem, res)
    print(render_md(res))
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
