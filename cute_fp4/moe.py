"""Mixture-of-experts layers on the grouped NVFP4 GEMM: :func:`route`, :class:`NVFP4MoE`,
the BF16 torch MoE :func:`moe_bf16` and the float64 :func:`moe_reference`.

A MoE layer (routing given) computes, for every token ``t`` and each of its ``top_k``
slots ``j`` with expert ``e = topk_ids[t, j]`` and weight ``w = topk_weights[t, j]``::

    gate_up = x[t] @ W13[e]^T                   # [2I]; W13 = the fused w13 of vLLM
    h       = silu(gate_up[:I]) * gate_up[I:]   # first I columns gate, last I up
    out[t] += w * (h @ W2[e]^T)                 # [H]

Conventions:

* **gate/up split**: ``w13 [E, 2I, H]`` holds the gate projection in rows ``0 .. I-1``
  and the up projection in rows ``I .. 2I-1`` (vLLM's ``w13_weight``; Qwen3's
  ``gate_proj`` then ``up_proj`` concatenated along the output features);
  ``w2 [E, H, I]`` is the down projection.
* **routing** (:func:`route`): the ``T * top_k`` (token, slot) pairs, flattened as
  ``pair = t * top_k + j``, sorted by expert with a *stable* sort (within an expert, in
  pair order); ``offsets`` int32 ``[E + 1]`` on the device. Only torch ops that never
  read a GPU value on the host (sort, scatter, searchsorted), so a call is CUDA-graph
  capturable and traces into one ``torch.compile`` graph.
* **combine**: the down projection's rows are put back in pair order (``inverse``) and
  reduced per token by one batched matmul ``[1, top_k] @ [top_k, H]`` (FP32 accumulation,
  one rounding to the activation dtype), so the result is deterministic (no atomics,
  fixed summation order). The top-k weights are rounded to the activation dtype first.
* **activation**: ``silu`` and the product in the activation dtype
  (:func:`silu_and_mul`: two roundings), the same function in :func:`moe_bf16`.
* **fused** (``NVFP4MoE(fused="auto")``, where the GPU's grouped kernels take it): the
  gate_up GEMM computes the activation in its epilogue (``grouped_gemm(silu_mul=True)``,
  the same bits as the unfused GEMM then :func:`silu_and_mul`), so a forward is two
  grouped GEMMs and no activation kernel. ``w13`` is then stored with its gate and up rows
  interleaved in groups of ``gate_up_group`` rows (``cute_fp4.fused``; converted once, at
  construction); :meth:`NVFP4MoE.gate_up_expert` gives an expert's weight in the natural
  order.

:class:`NVFP4MoE` stores both weights once, quantized (one global scale per expert), in
the layout the present GPU's grouped kernels read: the fragment-order packed bytes of
``cute_fp4.packed`` on sm_90a (``mainloop=rs_packed`` and ``stream``) and for W4A16 on
SM12x (``stream``), otherwise the plain ``[E, N, K/2]`` bytes.
A forward reads no GPU value on the host and allocates only its intermediate and final
outputs; modes "w4a16" (BF16/FP16 activations) and "w4a4" (activations quantized by the
fused kernel, ``cute_fp4.quant``, with a calibrated static scale per GEMM or a dynamic
per-call one).

Validation: :func:`check_stages` holds each stage of a forward (:meth:`NVFP4MoE.stages`)
to the exact reference's error rule on that stage's own inputs: the routing against an
independent per-expert count, both grouped GEMMs per expert against
``cute_fp4.reference.check``, the activation and the combine within their roundings.
:meth:`NVFP4MoE.reference_forward` is the whole layer in float64 on the exact block values
(no intermediate rounding), for closeness measures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cute_fp4.api import quantize_op
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.fused import (
    deinterleave_gate_up,
    device_group,
    interleave_gate_up,
    natural_gate_up,
    silu_mul_unfused,
)
from cute_fp4.grouped import grouped_gemm
from cute_fp4.nn import keep_format_dtypes
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape, swizzle_scales
from cute_fp4.packed import PackedNVFP4Weight, pack, packed_rows, repack
from cute_fp4.targets import capability_major

__all__ = ["LAYOUTS", "MODES", "MoEStages", "NVFP4MoE", "Routing", "StageCheck",
           "check_stages", "combine", "expert", "moe_bf16", "moe_reference", "route",
           "silu_and_mul"]

MODES = ("w4a16", "w4a4")
LAYOUTS = ("auto", "plain", "packed")
_ACT_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_FORMAT_BUFFERS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w13_input_scale",
                   "w13_alpha", "w2_weight", "w2_weight_scale", "w2_weight_scale_2",
                   "w2_input_scale", "w2_alpha")


# ----------------------------------------------------------------------------- routing

class Routing(NamedTuple):
    """The (token, slot) pairs of one call sorted by expert.

    ``order`` int64 ``[T*k]``: sorted row ``p`` holds pair ``order[p]`` (pair = t * k + j);
    ``inverse`` int64 ``[T*k]``: pair ``i`` sits at sorted row ``inverse[i]``;
    ``token`` int64 ``[T*k]``: the token of sorted row ``p`` (``order // k``);
    ``offsets`` int32 ``[E + 1]``: expert ``e``'s rows are ``offsets[e] .. offsets[e+1]-1``.
    """

    order: torch.Tensor
    inverse: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor


def _check_ids(topk_ids, num_experts) -> tuple[int, int]:
    if not isinstance(topk_ids, torch.Tensor):
        raise InputTypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] == 0:
        raise InputError(f"topk_ids must be [T, top_k] with top_k >= 1, got shape "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise InputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    return topk_ids.shape[0], topk_ids.shape[1]


def route(topk_ids: torch.Tensor, num_experts: int, *, validate: bool = False) -> Routing:
    """Sort the (token, slot) pairs of ``topk_ids`` ``[T, top_k]`` by expert (stable).

    Sync-free and CUDA-graph capturable: one sort, one scatter (the inverse), one division
    (the tokens) and one ``searchsorted`` (the offsets), all on ``topk_ids``' device.
    Expert ids must lie in ``[0, num_experts)``; that is not checked (it would read a GPU
    value) unless ``validate=True`` (tests, debugging: one host sync). An id out of range
    leaves ``offsets`` short of ``T * top_k`` (or ``offsets[0] > 0``): the layer's output is
    then undefined.
    """
    _, k = _check_ids(topk_ids, num_experts)
    flat = topk_ids.reshape(-1)
    if validate and flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_experts:
            raise InputError(f"topk_ids hold expert ids in [{lo}, {hi}], the layer has "
                             f"{num_experts} experts (ids 0..{num_experts - 1})")
    sorted_ids, order = torch.sort(flat, stable=True)
    n = flat.numel()
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(n, device=flat.device, dtype=order.dtype))
    token = torch.div(order, k, rounding_mode="floor")
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return Routing(order, inverse, token, offsets)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` (first half gate, second half up), in
    ``gate_up``'s dtype."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]


def combine(down: torch.Tensor, routing: Routing, topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * down[inverse[t*k + j]]``: ``down`` ``[T*k, H]``
    in sorted order -> ``[T, H]``. One gather and one batched matmul (FP32 accumulation,
    fixed order: deterministic); the weights are rounded to ``down``'s dtype."""
    t, k = topk_weights.shape
    pairs = down.index_select(0, routing.inverse).view(t, k, down.shape[-1])
    return torch.bmm(topk_weights.to(down.dtype).unsqueeze(1), pairs).squeeze(1)


# ----------------------------------------------------------------------------- weights

def expert(w, e: int) -> NVFP4Tensor:
    """Expert ``e`` of an expert stack (NVFP4Tensor or PackedNVFP4Weight) as a plain 2-D
    NVFP4Tensor ``[N, K]``: views of a plain stack; a packed one is unpacked (a copy, and
    its checked constructor reads the global scale: references and loops only)."""
    one = w.expert(e)
    return one.unpack() if isinstance(one, PackedNVFP4Weight) else one


def _scalar(value, name: str, device) -> torch.Tensor:
    """A positive finite FP32 scale as a 0-d tensor (checked once, at construction)."""
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.numel() != 1:
        raise FormatError(f"{name} must be a scalar, got {t.numel()} elements")
    v = float(t)
    if not (v > 0 and math.isfinite(v)):
        raise FormatError(f"{name} must be finite and > 0, got {v:g}")
    return t.reshape(()).to(device)


# ----------------------------------------------------------------------------- kernels

def _grouped_gemm(a, b, offsets, schedule, out_dtype, alpha, silu_mul: bool = False
                  ) -> torch.Tensor:
    """The grouped GEMM of a forward (``cute_fp4.grouped.grouped_gemm``: one
    ``cute_fp4::grouped_mm`` node under torch.compile; tests replace it with the exact
    reference)."""
    return grouped_gemm(a, b, offsets, schedule=schedule, out_dtype=out_dtype, alpha=alpha,
                        silu_mul=silu_mul)


def _quantize(x: torch.Tensor, global_scale) -> NVFP4Tensor:
    """W4A4 activations: the fused quantization kernel (one ``cute_fp4::quantize`` node
    under torch.compile); ``global_scale`` a 0-d tensor (static) or None (dynamic)."""
    data, scale, gs = quantize_op(x, global_scale)
    return NVFP4Tensor._unchecked(data, scale, gs.reshape(()), tuple(x.shape))


# ----------------------------------------------------------------------------- the layer

class MoEStages(NamedTuple):
    """Every intermediate of one forward, in sorted (expert) order except ``out``."""

    routing: Routing
    x_sorted: torch.Tensor  # [T*k, H] the gathered activations
    a13: object  # x_sorted, or its NVFP4 quantization (w4a4)
    gate_up: torch.Tensor  # [T*k, 2I], in w13's row order (interleaved when fused)
    act: torch.Tensor  # [T*k, I]
    a2: object  # act, or its NVFP4 quantization (w4a4)
    down: torch.Tensor  # [T*k, H]
    out: torch.Tensor  # [T, H]


class NVFP4MoE(torch.nn.Module):
    """A MoE layer's experts on NVFP4 weights: ``forward(x, topk_ids, topk_weights)``.

    ``w13``: an NVFP4Tensor expert stack ``[E, 2I, H]`` (gate rows first, then up), ``w2``:
    ``[E, H, I]`` (``cute_fp4.quantize`` of a 3-D tensor; PackedNVFP4Weight stacks from
    ``cute_fp4.packed.repack`` are stored as given, shared); ``mode``: "w4a16" or "w4a4";
    ``schedule``: passed to the grouped GEMM ("auto", a catalogue name); ``input_scales``:
    W4A4's calibrated activation global scales ``(gate_up, down)`` (decode form,
    ``amax / 2688``; None: dynamic, per call); ``layout``: "packed" (the rs_packed and
    stream grouped kernels), "plain", or "auto" (packed when the weights are on an SM90 GPU,
    or on SM12x for W4A16, and H and I are multiples of 64). Moving the layer (``.to``)
    keeps its layout. ``fused``: SiLU-and-mul in the gate_up GEMM's epilogue ("auto": where
    the weights are on a GPU and I splits into its gate/up groups; True, False); the
    module docstring says what it changes.
    """

    def __init__(self, w13, w2, mode: str = "w4a16", schedule="auto",
                 input_scales=(None, None), layout: str = "auto", fused="auto", *,
                 _gate_up_group: int | None = None):
        super().__init__()
        if mode not in MODES:
            raise InputError(f"mode must be 'w4a4' or 'w4a16', got {mode!r}")
        if layout not in LAYOUTS:
            raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.num_experts, self.hidden, self.intermediate = _check_weights(w13, w2)
        dev = w13.data.device
        self.layout = _pick_layout(layout, w13, w2, self.hidden, self.intermediate, dev,
                                   mode)
        self.gate_up_group = _gate_up_group or _pick_group(fused, self.layout, dev,
                                                           self.intermediate)
        if self.gate_up_group and not _gate_up_group:  # w13 in the natural order
            if isinstance(w13, PackedNVFP4Weight):
                w13 = w13.unpack()
            w13 = interleave_gate_up(w13, self.gate_up_group)
        if self.layout == "packed":
            w13 = w13 if isinstance(w13, PackedNVFP4Weight) else repack(w13)
            w2 = w2 if isinstance(w2, PackedNVFP4Weight) else repack(w2)
        self.mode, self.schedule = mode, schedule
        if not isinstance(input_scales, (tuple, list)) or len(input_scales) != 2:
            raise InputError("input_scales must be a pair (gate_up, down) of scales or None")
        for name, w, s in (("w13", w13, input_scales[0]), ("w2", w2, input_scales[1])):
            self.register_buffer(f"{name}_weight", w.data, persistent=False)
            self.register_buffer(f"{name}_weight_scale", w.scale, persistent=False)
            self.register_buffer(f"{name}_weight_scale_2",
                                 w.global_scale.to(dev, torch.float32).reshape(-1),
                                 persistent=False)
            self.register_buffer(f"{name}_input_scale", None if s is None else
                                 _scalar(s, f"{name} input scale", dev), persistent=False)
            self.register_buffer(f"{name}_alpha", None, persistent=False)
        self._views: dict = {}
        self._refresh_alpha()

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, mode: str = "w4a16",
                   schedule="auto", input_scales=(None, None), layout: str = "auto",
                   fused="auto") -> NVFP4MoE:
        """Quantize BF16/FP32 expert weights ``w13 [E, 2I, H]`` (gate rows, then up) and
        ``w2 [E, H, I]``, one global scale per expert (on their device: a GPU is faster)."""
        return cls(quantize(w13.detach()), quantize(w2.detach()), mode, schedule,
                   input_scales, layout, fused)

    @classmethod
    def from_modelopt(cls, w13: tuple, w2: tuple, mode: str = "w4a16", schedule="auto",
                      input_scales=(None, None), layout: str = "auto",
                      fused="auto") -> NVFP4MoE:
        """From already-quantized expert stacks in ModelOpt's checkpoint form, without a
        BF16 copy: ``w13 = (weight, weight_scale, weight_scale_2)`` with ``weight`` uint8
        ``[E, 2I, H/2]`` (gate rows, then up), ``weight_scale`` float8_e4m3fn
        ``[E, 2I, H/16]`` (row-major, as stored) and ``weight_scale_2`` float32 ``[E]`` (one
        global scale per expert); ``w2`` likewise ``[E, H, I/2]``, ``[E, H, I/16]``, ``[E]``.
        The bytes are kept as given (the packed layout: repacked expert by expert, so the
        transient is one expert), the scales swizzled expert by expert."""
        stacks = [_modelopt_stack(name, *t) for name, t in (("w13", w13), ("w2", w2))]
        e, h, i = _check_weights(*stacks)
        if layout not in LAYOUTS:
            raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        resolved = _pick_layout(layout, *stacks, h, i, stacks[0].device, mode)
        group = _pick_group(fused, resolved, stacks[0].device, i)
        if resolved == "packed":
            stacks = [_pack_by_expert(stacks[0], group), _pack_by_expert(stacks[1])]
        elif group:
            stacks[0] = interleave_gate_up(stacks[0], group)
        return cls(*stacks, mode, schedule, input_scales, layout, _gate_up_group=group)

    def _refresh_alpha(self) -> None:
        """W4A4 with static scales: alpha[e] = input_scale * weight_scale_2[e], once."""
        for name in ("w13", "w2"):
            s = self._buffers[f"{name}_input_scale"]
            if self.mode != "w4a4" or s is None:
                self._buffers[f"{name}_alpha"] = None
            else:
                self._buffers[f"{name}_alpha"] = s * self._buffers[f"{name}_weight_scale_2"]

    def _view(self, name: str):
        d, s, g = (self._buffers[f"{name}_weight"], self._buffers[f"{name}_weight_scale"],
                   self._buffers[f"{name}_weight_scale_2"])
        v = self._views.get(name)
        if v is None or v.data is not d or v.scale is not s or v.global_scale is not g:
            e, h, i = self.num_experts, self.hidden, self.intermediate
            shape = (e, 2 * i, h) if name == "w13" else (e, h, i)
            v = (PackedNVFP4Weight(d, s, g, shape) if self.layout == "packed"
                 else NVFP4Tensor._unchecked(d, s, g, shape))
            self._views[name] = v
        return v

    @property
    def w13(self):
        """The gate_up weight as the grouped GEMM takes it (a view over the buffers)."""
        return self._view("w13")

    @property
    def w2(self):
        """The down weight as the grouped GEMM takes it (a view over the buffers)."""
        return self._view("w2")

    def _apply(self, fn, recurse=True):
        return keep_format_dtypes(self, super()._apply, fn, recurse, _FORMAT_BUFFERS)

    def extra_repr(self) -> str:
        scale = ""
        if self.mode == "w4a4":
            static = self._buffers["w13_input_scale"] is not None
            scale = f", input_scales={'static' if static else 'dynamic'}"
        return (f"experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, mode={self.mode}{scale}, "
                f"layout={self.layout}, schedule={self.schedule}")

    # ------------------------------------------------------------------ forward

    def _check_input(self, x, topk_ids, topk_weights) -> None:
        if not isinstance(x, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
            raise InputTypeError("x and topk_weights must be torch.Tensors, got "
                                 f"{type(x).__name__} and {type(topk_weights).__name__}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise InputError(f"x must be [T, {self.hidden}], got shape {tuple(x.shape)}")
        if x.dtype not in _ACT_DTYPES:
            raise InputError(f"x must be bfloat16 or float16, got {x.dtype}")
        t, _ = _check_ids(topk_ids, self.num_experts)
        if t != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise InputError(f"x has {x.shape[0]} tokens; topk_ids {tuple(topk_ids.shape)} "
                             f"and topk_weights {tuple(topk_weights.shape)} must be "
                             f"[{x.shape[0]}, top_k]")
        if not topk_weights.is_floating_point():
            raise InputError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        dev = self._buffers["w13_weight"].device
        for tensor, name in ((x, "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
            if tensor.device != dev:
                raise InputError(f"{name} is on {tensor.device} but the layer is on {dev}")

    def _activation(self, h: torch.Tensor, name: str):
        if self.mode == "w4a16":
            return h
        return _quantize(h, self._buffers[f"{name}_input_scale"])

    def stages(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
               ) -> MoEStages:
        """The forward with every intermediate kept (:class:`MoEStages`)."""
        self._check_input(x, topk_ids, topk_weights)
        r = route(topk_ids, self.num_experts)
        xs = x.index_select(0, r.token)
        a13 = self._activation(xs, "w13")
        gate_up = _grouped_gemm(a13, self.w13, r.offsets, self.schedule, x.dtype,
                                self._buffers["w13_alpha"])
        act = (silu_mul_unfused(gate_up, self.gate_up_group) if self.gate_up_group
               else silu_and_mul(gate_up))
        a2 = self._activation(act, "w2")
        down = _grouped_gemm(a2, self.w2, r.offsets, self.schedule, x.dtype,
                             self._buffers["w2_alpha"])
        return MoEStages(r, xs, a13, gate_up, act, a2, down, combine(down, r, topk_weights))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """``x`` bf16/fp16 ``[T, H]``, ``topk_ids`` int ``[T, top_k]``, ``topk_weights``
        ``[T, top_k]`` -> ``[T, H]`` in x's dtype. No host sync; T = 0 launches nothing."""
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 0:
            self._check_input(x, topk_ids, topk_weights)
            return x.new_empty((0, self.hidden))
        if not self.gate_up_group or torch.compiler.is_compiling():
            # under torch.compile the grouped op has no epilogue operands: the unfused
            # activation on the interleaved gate_up (eager: the same bits; Inductor fuses
            # silu(gate) * up without the intermediate rounding)
            return self.stages(x, topk_ids, topk_weights).out
        self._check_input(x, topk_ids, topk_weights)
        r = route(topk_ids, self.num_experts)
        a13 = self._activation(x.index_select(0, r.token), "w13")
        act = _grouped_gemm(a13, self.w13, r.offsets, self.schedule, x.dtype,
                            self._buffers["w13_alpha"], silu_mul=True)
        down = _grouped_gemm(self._activation(act, "w2"), self.w2, r.offsets, self.schedule,
                             x.dtype, self._buffers["w2_alpha"])
        return combine(down, r, topk_weights)

    def gate_up_expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e``'s gate_up weight ``[2I, H]`` in the natural order (gate rows, then
        up), plain layout (a copy when stored packed or interleaved: references, saving)."""
        w = expert(self.w13, e)
        return natural_gate_up(w, self.gate_up_group) if self.gate_up_group else w

    # ------------------------------------------------------------------ references

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` dequantized to ``dtype`` (for
        :func:`moe_bf16` on the same weights)."""
        return (torch.stack([self.gate_up_expert(e).dequantize(dtype)
                             for e in range(self.num_experts)]),
                torch.stack([expert(self.w2, e).dequantize(dtype)
                             for e in range(self.num_experts)]))

    def reference_forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer in float64 on the exact block values (:func:`moe_reference`); W4A4
        quantizes the activations as the layer does (``cute_fp4.quantize`` with the
        static scale, or the amax of the call's activations)."""
        act_quant = None
        if self.mode == "w4a4":
            scales = [None if s is None else float(s) for s in
                      (self._buffers["w13_input_scale"], self._buffers["w2_input_scale"])]

            def act_quant(t: torch.Tensor, which: int) -> torch.Tensor:
                return quantize(t.float(), scales[which]).dequantize(torch.float64)

        return moe_reference(x, topk_ids, topk_weights,
                             lambda e: self.gate_up_expert(e).dequantize(torch.float64),
                             lambda e: expert(self.w2, e).dequantize(torch.float64), act_quant)


def _check_weights(w13, w2) -> tuple[int, int, int]:
    for w, name in ((w13, "w13"), (w2, "w2")):
        if not isinstance(w, (NVFP4Tensor, PackedNVFP4Weight)) or w.experts is None:
            raise InputTypeError(f"{name} must be an NVFP4Tensor expert stack [E, N, K] "
                                 f"(cute_fp4.quantize of a 3-D tensor), got "
                                 f"{type(w).__name__}"
                                 + (f" of shape {w.shape}" if hasattr(w, "shape") else ""))
    e, n13, h = w13.shape
    e2, h2, i = w2.shape
    if e2 != e or h2 != h or n13 != 2 * i:
        raise FormatError(f"w13 {list(w13.shape)} and w2 {list(w2.shape)} must be "
                          "[E, 2I, H] and [E, H, I]")
    for w, name in ((w13, "w13"), (w2, "w2")):
        if tuple(w.global_scale.shape) not in ((e,), (e, 1)):
            raise FormatError(f"{name} must have one global scale per expert ({e}), got "
                              f"shape {tuple(w.global_scale.shape)}")
    if h % 32 or i % 32:
        raise FormatError(f"hidden {h} and intermediate {i} must be multiples of 32 (16-byte "
                          "packed FP4 rows)")
    return e, h, i


def _modelopt_stack(name: str, weight, weight_scale, weight_scale_2) -> NVFP4Tensor:
    """One expert stack from ModelOpt's tensors (see ``NVFP4MoE.from_modelopt``): the
    shapes and dtypes checked, the row-major scales swizzled expert by expert."""
    ts = (weight, weight_scale, weight_scale_2)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        raise InputTypeError(f"{name}: weight, weight_scale and weight_scale_2 must be torch "
                             f"tensors, got {', '.join(type(t).__name__ for t in ts)}")
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise FormatError(f"{name} weight must be uint8 [E, N, K/2], got {weight.dtype} "
                          f"{tuple(weight.shape)}")
    e, n, half_k = weight.shape
    want = (e, n, 2 * half_k // 16)
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(
            weight_scale.shape) != want:
        raise FormatError(f"{name} weight_scale must be float8_e4m3fn {list(want)} (row-major "
                          f"[E, N, K/16]), got {weight_scale.dtype} "
                          f"{tuple(weight_scale.shape)}")
    if weight_scale.device != weight.device:
        raise FormatError(f"{name}: weight is on {weight.device}, weight_scale on "
                          f"{weight_scale.device}")
    raw = weight_scale.contiguous().view(torch.uint8)
    nan, neg = int(((raw & 0x7F) == 0x7F).sum()), int(((raw & 0x80) != 0).sum())
    if nan or neg:
        raise FormatError(f"{name} weight_scale holds {nan} NaN and {neg} negative bytes; "
                          "NVFP4 block scales are finite UE4M3")
    rp, cp = scale_shape(n, 2 * half_k)
    scale = torch.empty((e, rp, cp), dtype=torch.float8_e4m3fn, device=weight.device)
    for x in range(e):
        scale[x] = swizzle_scales(weight_scale[x].contiguous())
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32).reshape(-1)
    return NVFP4Tensor(weight, scale, gs.to(weight.device), (e, n, 2 * half_k))


def _pack_by_expert(w: NVFP4Tensor, group: int | None = None) -> PackedNVFP4Weight:
    """``repack`` of an expert stack one expert at a time (the transient is one expert);
    ``group``: its gate/up rows interleaved first (``cute_fp4.fused``)."""
    e, n, k = w.shape
    data = torch.empty((e, packed_rows(n), k // 2), dtype=torch.uint8, device=w.device)
    scale = w.scale
    if group:
        scale = torch.empty_like(w.scale)
    for x in range(e):
        one = w.expert(x)
        if group:
            one = interleave_gate_up(one, group)
            scale[x] = one.scale
        data[x] = pack(one.data.contiguous())
    return PackedNVFP4Weight(data, scale, w.global_scale, w.shape)


def _pick_group(fused, layout: str, dev: torch.device, i: int) -> int | None:
    """The gate/up group of a fused layer whose weights are in ``layout`` on ``dev``
    (``cute_fp4.fused.device_group``: the group of the grouped kernels it runs), or None:
    unfused ("auto" off a GPU, or where I does not split into groups)."""
    if fused not in ("auto", True, False):
        raise InputError(f"fused must be 'auto', True or False, got {fused!r}")
    if fused is False:
        return None
    if dev.type != "cuda":
        if fused is True:
            raise DeviceError("fused=True needs the weights on a CUDA GPU: the gate/up row "
                              "order depends on its kernels")
        return None
    group = device_group(dev, layout)
    if i % group:
        if fused is True:
            raise FormatError(f"fused=True: intermediate {i} does not split into gate/up "
                              f"groups of {group} rows")
        return None
    return group


def _pick_layout(layout: str, w13, w2, h: int, i: int, dev: torch.device,
                 mode: str = "w4a4") -> str:
    """"auto": packed on sm_90a (its grouped kernels read it) and for W4A16 on SM12x (the
    grouped stream kernel, its only W4A16 one), when H and I allow it; else plain."""
    packed_in = [isinstance(w, PackedNVFP4Weight) for w in (w13, w2)]
    if any(packed_in):
        if not all(packed_in) or layout == "plain":
            raise InputError("w13 and w2 must both be plain or both be packed; a packed "
                             "weight takes layout 'packed' or 'auto'")
        return "packed"
    if layout == "auto":
        major = capability_major(dev)
        wants = major == 9 or (major == 12 and mode == "w4a16")
        layout = "packed" if wants and h % 64 == 0 and i % 64 == 0 else "plain"
    if layout == "packed" and (h % 64 or i % 64):
        raise FormatError(f"the packed layout needs hidden ({h}) and intermediate ({i}) "
                          "multiples of 64")
    return layout


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
    :class:`NVFP4MoE`: ``torch._grouped_mm`` on CUDA (no sync), a per-expert loop elsewhere."""
    r = route(topk_ids, w13.shape[0])
    xs = x.index_select(0, r.token)
    act = silu_and_mul(_bf16_grouped(xs, w13, r.offsets))
    return combine(_bf16_grouped(act, w2, r.offsets), r, topk_weights)


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
