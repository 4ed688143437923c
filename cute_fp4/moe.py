"""Mixture-of-experts layers on the grouped NVFP4 GEMM: the module :class:`NVFP4MoE` over
a prepared :class:`cute_fp4.layers.Experts` (its docstring gives the conventions: gate/up
split, routing, combine, activation, fused), the BF16 torch MoE :func:`moe_bf16`, the
float64 :func:`moe_reference`, and :func:`check_stages`, which holds each stage of a call
(:meth:`NVFP4MoE.stages`) to the exact reference's error rule on that stage's own inputs:
the routing against an independent per-expert count, both grouped GEMMs per expert
against ``cute_fp4.reference.check``, the activation and the combine within their
roundings. :meth:`NVFP4MoE.reference_forward` is the whole layer in float64 on the exact
block values (no intermediate rounding), for closeness measures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cute_fp4.bench import torch_combine
from cute_fp4.fused import deinterleave_gate_up
from cute_fp4.layers.common import LAYOUTS, mode_of
from cute_fp4.layers.experts import (
    Experts,
    Routing,
    Stages,
    combine,
    expert,
    route,
    silu_and_mul,
)
from cute_fp4.nn import MODES, keep_format_dtypes
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, swizzle_scales

__all__ = ["LAYOUTS", "MODES", "MXFP4MoE", "MoEStages", "NVFP4MoE", "Routing", "StageCheck",
           "check_stages", "combine", "expert", "moe_bf16", "moe_reference", "route",
           "silu_and_mul"]

MoEStages = Stages  # every intermediate of one call (cute_fp4.layers.Stages)
_FORMAT_BUFFERS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                   "w13_alpha", "w2_weight", "w2_weight_scale", "w2_weight_scale_2",
                   "w2_input_scale", "w2_alpha", "up_ratio", "w13_bias", "w2_bias")
_GEMMS = ("w13", "w2")


class NVFP4MoE(torch.nn.Module):
    """A MoE layer's experts on NVFP4 weights: ``forward(x, topk_ids, topk_weights)``, a
    module over a :class:`cute_fp4.layers.Experts` (``self.experts``; arguments as its).
    The module registers the layer's tensors as buffers (``w13_weight``,
    ``w13_weight_scale``, ``w13_weight_scale_2``, ``w13_input_scale``, ``w13_alpha``, the
    same for ``w2``, ``up_ratio``; ``w13_bias``/``w2_bias``, float32, for experts with
    biases), so moving it (``.to``) moves them and keeps the layout and dtypes. Its
    experts' format is its weights' (:class:`MXFP4MoE` names the MXFP4 one).
    """

    def __init__(self, w13, w2, mode: str = "w4a16", schedule="auto",
                 input_scales=(None, None), layout: str = "auto", fused="auto", *,
                 experts: Experts | None = None):
        super().__init__()
        if experts is None:
            mode = mode_of(mode, MODES)
            experts = Experts(w13, w2, mode, schedule, input_scales, layout, fused)
        self.experts = experts
        for i, name in enumerate(_GEMMS):
            w = getattr(experts, name)
            self.register_buffer(f"{name}_weight", w.data, persistent=False)
            self.register_buffer(f"{name}_weight_scale", w.scale, persistent=False)
            self.register_buffer(f"{name}_weight_scale_2", w.global_scale, persistent=False)
            self.register_buffer(f"{name}_input_scale", experts.input_scales[i],
                                 persistent=False)
            self.register_buffer(f"{name}_alpha", experts.alphas[i], persistent=False)
        self.register_buffer("up_ratio", experts.up_ratio, persistent=False)
        for name, bias in zip(_GEMMS, experts.biases):
            self.register_buffer(f"{name}_bias", bias, persistent=False)

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, mode: str = "w4a16",
                   schedule="auto", input_scales=(None, None), layout: str = "auto",
                   fused="auto") -> NVFP4MoE:
        """Quantize BF16/FP32 expert weights ``w13 [E, 2I, H]`` (gate rows, then up) and
        ``w2 [E, H, I]``, one global scale per expert (on their device: a GPU is faster)."""
        return cls(None, None, experts=Experts.from_float(w13, w2, mode, schedule,
                                                          input_scales, layout, fused))

    @classmethod
    def from_modelopt(cls, w13: tuple, w2: tuple, mode: str = "w4a16", schedule="auto",
                      input_scales=(None, None), layout: str = "auto",
                      fused="auto") -> NVFP4MoE:
        """From already-quantized expert stacks in ModelOpt's checkpoint form
        (:meth:`cute_fp4.layers.Experts.from_modelopt`)."""
        return cls(None, None, experts=Experts.from_modelopt(
            w13, w2, input_scales=input_scales, mode=mode, layout=layout, fused=fused,
            schedule=schedule))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in _FORMAT_BUFFERS and "experts" in self.__dict__ and "w2_bias" in self._buffers:
            self._give_experts()  # a buffer replaced by assignment: the layer runs on it

    def _apply(self, fn, recurse=True):
        keep_format_dtypes(self, super()._apply, fn, recurse, _FORMAT_BUFFERS)
        self._give_experts()
        return self

    def _give_experts(self) -> None:
        """The prepared layer holds the module's buffers (after they were moved)."""
        b = self._buffers
        self.experts.adopt(*((b[f"{n}_weight"], b[f"{n}_weight_scale"],
                              b[f"{n}_weight_scale_2"]) for n in _GEMMS),
                           tuple(b[f"{n}_input_scale"] for n in _GEMMS),
                           tuple(b[f"{n}_alpha"] for n in _GEMMS), b["up_ratio"],
                           tuple(b[f"{n}_bias"] for n in _GEMMS))

    def __getattr__(self, name: str):
        """The prepared layer's attributes (``num_experts``, ``hidden``, ``intermediate``,
        ``mode``, ``layout``, ``schedule``, ``gate_up_group``, ``w13``, ``w2``)."""
        if name in _DELEGATED and "experts" in self.__dict__:
            return getattr(self.__dict__["experts"], name)
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return self.experts.describe()

    # ------------------------------------------------------------------ forward

    def stages(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
               ) -> MoEStages:
        """The forward with every intermediate kept (:class:`MoEStages`)."""
        return self.experts.stages(x, topk_ids, topk_weights)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """``x`` bf16/fp16 ``[T, H]``, ``topk_ids`` int ``[T, top_k]``, ``topk_weights``
        ``[T, top_k]`` -> ``[T, H]`` in x's dtype. No host sync; T = 0 launches nothing."""
        return self.experts(x, topk_ids, topk_weights)

    def gate_up_expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e``'s gate_up weight ``[2I, H]`` in the natural order (gate rows, then
        up), plain layout (a copy when stored packed or interleaved: references, saving)."""
        return self.experts.gate_up_expert(e)

    # ------------------------------------------------------------------ references

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` dequantized to ``dtype`` (for
        :func:`moe_bf16` on the same weights)."""
        return self.experts.dequantized(dtype)

    def reference_forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer in float64 on the exact block values (:func:`moe_reference`); W4A4
        quantizes the activations as the layer does (``cute_fp4.quantize`` with the
        static scale, or the amax of the call's activations)."""
        ex = self.experts
        act_quant = None
        if ex.mode == "w4a4":
            scales = [None if s is None else float(s) for s in ex.input_scales]

            def act_quant(t: torch.Tensor, which: int) -> torch.Tensor:
                return quantize(t.float(), scales[which]).dequantize(torch.float64)

        def w13_of(e: int) -> torch.Tensor:
            w = ex.gate_up_expert(e).dequantize(torch.float64)
            if ex.up_ratio is not None:
                w[ex.intermediate:] *= ex.up_ratio[e].double().to(w.device)
            return w

        return moe_reference(x, topk_ids, topk_weights, w13_of,
                             lambda e: expert(ex.w2, e).dequantize(torch.float64), act_quant)


class MXFP4MoE(NVFP4MoE):
    """gpt-oss's MXFP4 experts as a module (:class:`NVFP4MoE`'s code over
    :meth:`cute_fp4.layers.Experts.from_gpt_oss`): ``forward(x, topk_ids, topk_weights)``;
    what ``cute_fp4.hf`` loads a gpt-oss MXFP4 checkpoint's experts into."""

    @classmethod
    def from_gpt_oss(cls, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks,
                     down_scales, down_bias, *, layout: str = "auto", fused="auto",
                     schedule="auto", name: str = "") -> MXFP4MoE:
        """From gpt-oss's checkpoint tensors (:meth:`cute_fp4.layers.Experts.from_gpt_oss`)."""
        return cls(None, None, experts=Experts.from_gpt_oss(
            gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
            layout=layout, fused=fused, schedule=schedule, name=name))

    def gpt_oss_checkpoint(self, bias_dtype: torch.dtype = torch.bfloat16) -> dict:
        """The checkpoint tensors back, bit for bit (``Experts.gpt_oss_checkpoint``)."""
        return self.experts.gpt_oss_checkpoint(bias_dtype)


_DELEGATED = frozenset({"num_experts", "hidden", "intermediate", "mode", "layout", "schedule",
                        "gate_up_group", "w13", "w2", "fmt", "activation", "biases"})


# ----------------------------------------------------------------------------- references

def _bf16_grouped(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a`` sorted rows ``[M, K]`` times each expert's ``w[e]^T`` (``w`` ``[E, N, K]``)."""
    if a.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets[1:])
    out = a.new_empty((a.shape[0], w.shape[1]))
    bounds = offsets.tolist()  # host loop: reads the offsets (a sync on a GPU)
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w[e].T
    return out


def moe_bf16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> torch.Tensor:
    """The MoE layer in torch BF16 (x's dtype) with the same conventions as
    :class:`NVFP4MoE`: ``torch._grouped_mm`` on CUDA (no sync), a per-expert loop elsewhere;
    the torch peer's combine (``bench.torch_combine``: a gather and a batched matmul)."""
    r = route(topk_ids, w13.shape[0])
    xs = x.index_select(0, r.token)
    act = silu_and_mul(_bf16_grouped(xs, w13, r.offsets))
    return torch_combine(_bf16_grouped(act, w2, r.offsets), r, topk_weights)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13_of: Callable[[int], torch.Tensor], w2_of: Callable[[int], torch.Tensor],
                  act_quant: Callable[[torch.Tensor, int], torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """The layer in float64, written independently of :func:`route` and :func:`combine`:
    per expert, the pairs routed to it (a mask), ``w13_of(e)`` ``[2I, H]`` and ``w2_of(e)``
    ``[H, I]`` the expert's float64 weights, no intermediate rounding; the top-k weights
    as given. ``act_quant(t, 0 or 1)``: how the activations of the gate_up (0) and down (1)
    GEMM are quantized (W4A4), None for none. Returns float64 ``[T, H]``."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).cpu()
    tok = torch.arange(t).repeat_interleave(k)
    x64 = x.double()
    if act_quant is not None:
        x64 = act_quant(x64, 0)
    experts = torch.unique(flat).tolist()
    h = None
    for e in experts:
        sel = (flat == e).nonzero().squeeze(1)
        g = x64[tok[sel].to(x64.device)] @ w13_of(e).to(x64.device).T
        i = g.shape[1] // 2
        if h is None:
            h = x64.new_zeros((t * k, i))
        h[sel.to(x64.device)] = F.silu(g[:, :i]) * g[:, i:]
    if h is None:
        return x64.new_zeros((0, x.shape[1]))
    if act_quant is not None:
        h = act_quant(h, 1)
    y = None
    for e in experts:
        sel = (flat == e).nonzero().squeeze(1).to(x64.device)
        d = h[sel] @ w2_of(e).to(x64.device).T
        if y is None:
            y = x64.new_zeros((t * k, d.shape[1]))
        y[sel] = d
    return (y.view(t, k, -1) * topk_weights.double().to(x64.device).unsqueeze(-1)).sum(1)


# ----------------------------------------------------------------------------- checks

@dataclasses.dataclass(frozen=True)
class StageCheck:
    """One stage of :func:`check_stages`: worst error over its bound (<= 1 passes)."""

    stage: str
    err_over_bound: float
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        return (f"{self.stage}: err/bound {self.err_over_bound:.3g} -> "
                f"{'ok' if self.passed else 'FAIL'}" + (f" ({self.detail})" if self.detail
                                                       else ""))


def _pair_rows(flat: torch.Tensor, offsets: list[int], num_experts: int):
    """Sorted row of every pair from a per-expert count (independent of the sort), or the
    reason the offsets are wrong."""
    rows = torch.full((flat.numel(),), -1, dtype=torch.long)
    for e in range(num_experts):
        pairs = (flat == e).nonzero().squeeze(1)
        if offsets[e + 1] - offsets[e] != pairs.numel():
            return None, (f"expert {e} has {pairs.numel()} pairs, offsets give "
                          f"{offsets[e + 1] - offsets[e]}")
        rows[pairs] = offsets[e] + torch.arange(pairs.numel())
    if offsets[0] != 0 or offsets[-1] != flat.numel() or (rows < 0).any():
        return None, f"offsets span {offsets[0]}..{offsets[-1]}, {flat.numel()} pairs"
    return rows, ""


def _rows(a, sel: torch.Tensor, linear_scales=None):
    """Rows ``sel`` of an activation: a tensor, or an NVFP4Tensor (same codes and scales)."""
    if isinstance(a, torch.Tensor):
        return a[sel.to(a.device)]
    sf = (a.scale_linear() if linear_scales is None else linear_scales)[sel.to(a.device)]
    return NVFP4Tensor(a.data[sel.to(a.device)], swizzle_scales(sf), a.global_scale,
                       (sel.numel(), a.shape[1]))


def _sample(lo: int, hi: int, max_rows: int | None) -> torch.Tensor:
    if max_rows is None or hi - lo <= max_rows:
        return torch.arange(lo, hi)
    half = max(1, max_rows // 2)
    return torch.cat((torch.arange(lo, lo + half), torch.arange(hi - half, hi)))


def _elementwise(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    got = got.double().to(ref.device)
    err = torch.where(torch.isfinite(got), (got - ref).abs(), torch.full_like(ref, math.inf))
    return float((err / bound).max()) if err.numel() else 0.0


def _gemm_stage(name, out, a, w, sel_by_expert, linear) -> StageCheck:
    from cute_fp4 import reference

    worst, bad = 0.0, []
    for e, sel in sel_by_expert:
        res = reference.check(out[sel.to(out.device)], _rows(a, sel, linear), expert(w, e))
        worst = max(worst, res.max_err_over_bound)
        if not res.passed:
            bad.append(f"expert {e}: {res}")
    return StageCheck(name, worst, not bad, "; ".join(bad[:3]))


def check_stages(layer: NVFP4MoE, st: MoEStages, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, *, experts=None, max_rows: int | None = None,
                 tokens=None) -> tuple[StageCheck, ...]:
    """Each stage of a forward against its exact definition, on that stage's own inputs
    (host work, reads the GPU). ``experts``: the experts whose rows are checked (default
    every non-empty one), ``max_rows``: at most this many rows per expert (first and last
    half), ``tokens``: the tokens whose combine is checked (default all).

    * routing: offsets equal an independent per-expert count, ``inverse`` the pair rows;
    * gather: the sorted activations are ``x`` of each row's token (exactly);
    * gate_up / down: ``cute_fp4.reference.check`` per expert (the error rule);
    * act: ``silu(gate) * up`` of the stage's gate_up within two roundings;
    * out: the weighted sum of the stage's down rows within FP32 accumulation and one
      rounding.
    """
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).cpu().long()
    off = st.routing.offsets.cpu().tolist()
    rows, why = _pair_rows(flat, off, layer.num_experts)
    if rows is None:
        return (StageCheck("routing", math.inf, False, why),)
    ok = torch.equal(st.routing.inverse.cpu(), rows)
    checks = [StageCheck("routing", 0.0 if ok else math.inf, ok,
                         "" if ok else "inverse is not the pairs' sorted rows")]
    token_of_row = torch.empty_like(rows)
    token_of_row[rows] = torch.arange(t * k) // k
    same = torch.equal(st.x_sorted, x.index_select(0, token_of_row.to(x.device)))
    checks.append(StageCheck("gather", 0.0 if same else math.inf, same))
    if experts is None:
        experts = [e for e in range(layer.num_experts) if off[e + 1] > off[e]]
    sel_by_expert = [(e, _sample(off[e], off[e + 1], max_rows)) for e in experts
                     if off[e + 1] > off[e]]
    lin13 = None if isinstance(st.a13, torch.Tensor) else st.a13.scale_linear()
    lin2 = None if isinstance(st.a2, torch.Tensor) else st.a2.scale_linear()
    checks.append(_gemm_stage("gate_up", st.gate_up, st.a13, layer.w13, sel_by_expert, lin13))
    checks.append(_act_stage(st, sel_by_expert, layer.gate_up_group))
    checks.append(_gemm_stage("down", st.down, st.a2, layer.w2, sel_by_expert, lin2))
    checks.append(_out_stage(st, rows, topk_weights, tokens))
    return tuple(checks)


def _act_stage(st: MoEStages, sel_by_expert, group: int | None = None) -> StageCheck:
    if not sel_by_expert:
        return StageCheck("act", 0.0, True)
    sel = torch.cat([s for _, s in sel_by_expert]).to(st.gate_up.device)
    g = st.gate_up[sel].double()
    if group:  # interleaved gate/up columns (a fused layer's w13) -> [gate, up]
        g = torch.cat(deinterleave_gate_up(g, group), dim=1)
    i = g.shape[1] // 2
    ref = F.silu(g[:, :i]) * g[:, i:]
    tiny = 2.0**-133 if st.act.dtype == torch.bfloat16 else 2.0**-24
    u = 2.0**-8 if st.act.dtype == torch.bfloat16 else 2.0**-11
    bound = ref.abs() * (2 * u + u * u + 2.0**-20) + tiny * (1 + g[:, i:].abs())
    ratio = _elementwise(st.act[sel], ref, bound)
    return StageCheck("act", ratio, ratio <= 1.0)


def _out_stage(st: MoEStages, rows: torch.Tensor, topk_weights: torch.Tensor, tokens
               ) -> StageCheck:
    t, k = topk_weights.shape
    tok = torch.arange(t) if tokens is None else torch.as_tensor(tokens).long().cpu()
    pair_rows = rows.view(t, k)[tok].to(st.down.device)
    y = st.down[pair_rows.reshape(-1)].double().view(tok.numel(), k, st.down.shape[1])
    w = topk_weights[tok.to(topk_weights.device)].to(st.down.dtype).double().to(y.device)
    terms = y * w.unsqueeze(-1)
    ref = terms.sum(1)
    u = 2.0**-8 if st.out.dtype == torch.bfloat16 else 2.0**-11
    tiny = 2.0**-133 if st.out.dtype == torch.bfloat16 else 2.0**-24
    bound = ref.abs() * u + terms.abs().sum(1) * (k + 1) * 2.0**-23 + tiny
    ratio = _elementwise(st.out[tok.to(st.out.device)], ref, bound)
    return StageCheck("out", ratio, ratio <= 1.0)
