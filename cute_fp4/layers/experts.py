"""A prepared mixture-of-experts layer's experts, :class:`Experts`, and the routing they
run on: :func:`route`, :func:`silu_and_mul`, :func:`combine`.

For every token ``t`` and each of its ``top_k`` slots ``j`` with expert ``e =
topk_ids[t, j]`` and weight ``w = topk_weights[t, j]`` (the router already ran)::

    gate_up = x[t] @ W13[e]^T                   # [2I]; W13 = the fused w13 of vLLM
    h       = silu(gate_up[:I]) * gate_up[I:]   # first I columns gate, last I up
    out[t] += w * (h @ W2[e]^T)                 # [H]

Conventions:

* **gate/up split**: ``w13 [E, 2I, H]`` holds the gate projection in rows ``0 .. I-1``
  and the up projection in rows ``I .. 2I-1`` (vLLM's ``w13_weight``; Qwen3's
  ``gate_proj`` then ``up_proj``); ``w2 [E, H, I]`` is the down projection. ModelOpt may
  store gate and up with their own global scales (``weight_scale_2`` ``[E, 2]``): the
  GEMM then runs with the gate's and each up row is scaled by its expert's ``up / gate``
  before the activation (unfused).
* **routing** (:func:`route`): the ``T * top_k`` (token, slot) pairs, flattened as
  ``pair = t * top_k + j``, sorted by expert with a *stable* sort; ``offsets`` int32
  ``[E + 1]`` on the device. Nothing reads a GPU value on the host, so a call is
  CUDA-graph capturable: one CTA of ``cute_fp4.sorting`` at decode sizes (the same bits),
  torch ops otherwise and under ``torch.compile``, which traces them into one graph.
* **combine** (:func:`combine`): each token's ``top_k`` rows of the down projection times
  its top-k weights (rounded to the activation dtype first), the products added in slot
  order in FP32 and rounded once: the same bits on every path, one kernel of
  ``cute_fp4.combining`` on a GPU (launched while the down GEMM drains), torch ops
  otherwise and under ``torch.compile``.
* **activation**: ``silu`` and the product in the activation dtype (two roundings).
* **fused** (``fused="auto"``, where the GPU's grouped kernels take it): the gate_up GEMM
  computes the activation in its epilogue (``grouped_gemm(silu_mul=True)``, the same bits
  as the unfused GEMM then :func:`silu_and_mul`): two grouped GEMMs and no activation
  kernel. ``w13`` is then stored with its gate and up rows interleaved in groups of
  ``gate_up_group`` rows (``cute_fp4.fused``; converted once).

Both weights are stored once, quantized (one global scale per expert), in the layout the
present GPU's grouped kernels read: the fragment-order packed bytes of ``cute_fp4.packed``
on sm_90a (``rs_packed`` and ``stream``) and for W4A16 on SM12x (``stream``), else the plain
``[E, N, K/2]`` bytes. A call reads no GPU value on the host and allocates only its
intermediate and final outputs. Under ``targets.reference_mode`` the grouped GEMMs and the
activation quantizer compute with the exact reference on any device.
"""

from __future__ import annotations

import torch

from cute_fp4.api import quantize_op
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.fused import interleave_gate_up, natural_gate_up, regroup_gate_up, silu_mul_unfused
from cute_fp4.grouped import grouped_gemm
from cute_fp4.layers.common import (
    Layout,
    check_layout_format,
    resolve_format_mode,
    resolve_mode,
    scalar,
    scale_values,
    stored_view,
    where,
)
from cute_fp4.layers.routing import (
    Routing,
    Stages,
    check_ids,
    combine,
    expert,
    route,
    silu_and_mul,
    softmax_topk,
)
from cute_fp4.layers.stacks import (
    check_biases,
    check_stacks,
    modelopt_stack,
    pack_by_expert,
    pick_group,
    pick_layout,
)
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import PackedWeight, repack

_ACT_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- kernels

def _grouped_gemm(a, b, offsets, schedule, out_dtype, alpha, silu_mul: bool = False
                  ) -> torch.Tensor:
    """A grouped GEMM of a call (``cute_fp4.grouped.grouped_gemm``: one
    ``cute_fp4::grouped_mm`` node under torch.compile)."""
    return grouped_gemm(a, b, offsets, schedule=schedule, out_dtype=out_dtype, alpha=alpha,
                        silu_mul=silu_mul)


def _quantize(x: torch.Tensor, global_scale) -> NVFP4Tensor:
    """W4A4 activations: the fused quantization kernel (one ``cute_fp4::quantize`` node
    under torch.compile); ``global_scale`` a 0-d tensor (static) or None (dynamic)."""
    data, scale, gs = quantize_op(x, global_scale)
    return NVFP4Tensor._unchecked(data, scale, gs.reshape(()), tuple(x.shape))


# ----------------------------------------------------------------------------- the layer

class Experts:
    """A MoE layer's experts on block-scaled weights (NVFP4, or MXFP4 for gpt-oss), prepared:
    ``ex(x, topk_ids, topk_weights)`` (module docstring).

    ``w13``: an NVFP4Tensor expert stack ``[E, 2I, H]`` (gate rows first, then up), ``w2``:
    ``[E, H, I]`` (``cute_fp4.quantize`` of a 3-D tensor; PackedNVFP4Weight stacks from
    ``cute_fp4.packed.repack`` are stored as given, shared); ``mode``: "w4a16", "w4a4" or
    "auto" (``common.resolve_mode``); ``schedule``: passed to the grouped GEMM ("auto", a
    catalogue name); ``input_scales``: W4A4's calibrated activation global scales
    ``(gate_up, down)`` (decode form; None: dynamic, per call); ``layout``: "packed",
    "plain" or "auto" (packed when the weights are on an SM90 GPU, or on SM12x for W4A16,
    and H and I are multiples of 64); ``fused``: SiLU-and-mul in the gate_up GEMM's
    epilogue ("auto": where the weights are on a GPU and I splits into its gate/up groups;
    True, False); ``up_ratio``: float32 ``[E]``, each expert's up / gate global scales when
    they differ (:meth:`from_modelopt`); ``activation``: "silu" (``silu(gate) * up``) or
    "swiglu_oai" (gpt-oss's clamped SwiGLU, ``cute_fp4.fused.swiglu_oai_unfused``: then
    ``gate_up_group`` is required, the stored row order of w13, and ``biases`` = (float32
    ``[E, 2I]`` in that row order, float32 ``[E, H]``) are added before the activation and
    after the down projection; :meth:`from_gpt_oss`). Build from a checkpoint with
    :meth:`from_modelopt` (NVFP4) or :meth:`from_gpt_oss` (MXFP4).
    """

    __slots__ = ("num_experts", "hidden", "intermediate", "mode", "schedule", "layout",
                 "gate_up_group", "name", "w13", "w2", "input_scales", "alphas", "up_ratio",
                 "activation", "biases")

    def __init__(self, w13, w2, mode: str = "w4a16", schedule="auto",
                 input_scales=(None, None), layout: str = "auto", fused="auto",
                 name: str = "", *, gate_up_group: int | None = None,
                 up_ratio: torch.Tensor | None = None, activation: str = "silu",
                 biases: tuple = (None, None)):
        layout = Layout.of(layout, f"{where(name)}layout")
        if not isinstance(input_scales, (tuple, list)) or len(input_scales) != 2:
            raise InputError(f"{where(name)}input_scales must be a pair (gate_up, down) of "
                             "scales or None")
        if activation not in ("silu", "swiglu_oai"):
            raise InputError(f"{where(name)}activation must be 'silu' or 'swiglu_oai', got "
                             f"{activation!r}")
        if activation == "swiglu_oai" and not gate_up_group:
            raise InputError(f"{where(name)}swiglu_oai experts take gate_up_group (the row "
                             "order of w13: Experts.from_gpt_oss)")
        self.name, self.activation = name, activation
        self.num_experts, self.hidden, self.intermediate = check_stacks(w13, w2, name)
        dev = w13.data.device
        self.mode = resolve_format_mode(mode, dev, all(s is not None for s in input_scales),
                                        w13.fmt, name)
        self.layout = pick_layout(layout, w13, w2, self.hidden, self.intermediate, dev,
                                  self.mode, name)
        check_layout_format(self.layout, w13.fmt, dev, name)
        if up_ratio is not None:
            fused = False  # the up rows' own scales apply between the GEMM and the activation
        self.gate_up_group = gate_up_group or pick_group(fused, self.layout, dev,
                                                         self.intermediate)
        if self.gate_up_group and not gate_up_group:  # w13 in the natural order
            if isinstance(w13, PackedWeight):
                w13 = w13.unpack()
            w13 = interleave_gate_up(w13, self.gate_up_group)
        if self.layout == "packed":
            w13 = w13 if isinstance(w13, PackedWeight) else repack(w13)
            w2 = w2 if isinstance(w2, PackedWeight) else repack(w2)
        self.schedule = schedule
        gs = [None if w.global_scale is None else
              w.global_scale.to(dev, torch.float32).reshape(-1) for w in (w13, w2)]
        self.w13 = stored_view(w13.data, w13.scale, gs[0], w13.shape, self.layout, w13.fmt)
        self.w2 = stored_view(w2.data, w2.scale, gs[1], w2.shape, self.layout, w2.fmt)
        self.biases = check_biases(biases, self.num_experts, self.hidden, self.intermediate, dev,
                              name)
        self.input_scales = tuple(None if s is None else scalar(s, f"{where(name)}{w} input "
                                                                f"scale", dev)
                                  for s, w in zip(input_scales, ("w13", "w2")))
        self.up_ratio = None if up_ratio is None else up_ratio.to(dev, torch.float32)
        self.alphas = (None, None)
        self._refresh_alpha()

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, mode: str = "w4a16",
                   schedule="auto", input_scales=(None, None), layout: str = "auto",
                   fused="auto", name: str = "") -> Experts:
        """Quantize BF16/FP32 expert weights ``w13 [E, 2I, H]`` (gate rows, then up) and
        ``w2 [E, H, I]``, one global scale per expert (on their device: a GPU is faster)."""
        for t, what in ((w13, "w13"), (w2, "w2")):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                got = (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise InputError(f"{where(name)}{what} must be an expert stack [E, N, K] of "
                                 f"float weights, got {got}")
        return cls(quantize(w13.detach()), quantize(w2.detach()), mode, schedule,
                   input_scales, layout, fused, name)

    @classmethod
    def from_modelopt(cls, w13: tuple, w2: tuple, *, input_scales=(None, None),
                      mode: str = "auto", layout: str = "auto", fused="auto",
                      schedule="auto", name: str = "") -> Experts:
        """From already-quantized expert stacks in ModelOpt's checkpoint form (any
        tensor-parallel shard of them), without a BF16 copy: ``w13 = (weight, weight_scale,
        weight_scale_2)`` with ``weight`` uint8 ``[E, 2I, H/2]`` (gate rows, then up),
        ``weight_scale`` float8_e4m3fn ``[E, 2I, H/16]`` (row-major, as stored) and
        ``weight_scale_2`` float32 ``[E]`` or ``[E, 2]`` (gate, up: when they differ, the up
        rows are scaled by up / gate after the GEMM); ``w2`` likewise ``[E, H, I/2]``,
        ``[E, H, I/16]``, ``[E]``. ``input_scales``: per GEMM a scalar, ``[E]`` or
        ``[E, 2]`` (the largest is used) or None. The bytes are kept as given (the packed
        layout: repacked expert by expert, so the transient is one expert), the scales
        swizzled expert by expert."""
        if not isinstance(w13, (tuple, list)) or len(w13) != 3 or not isinstance(
                w2, (tuple, list)) or len(w2) != 3:
            raise InputTypeError(f"{where(name)}w13 and w2 must each be (weight, "
                                 "weight_scale, weight_scale_2)")
        gs13 = scale_values(w13[2], f"{where(name)}w13 weight_scale_2")
        e = w13[0].shape[0] if isinstance(w13[0], torch.Tensor) else 0
        if gs13.dim() == 2 and tuple(gs13.shape) == (e, 2):
            gate, up = gs13[:, 0].contiguous(), gs13[:, 1].contiguous()
        else:
            gate, up = gs13.reshape(-1), None
        ratio = None if up is None or torch.equal(gate, up) else up / gate
        stacks = [modelopt_stack(f"{where(name)}w13", w13[0], w13[1], gate),
                  modelopt_stack(f"{where(name)}w2", *w2)]
        ex, h, i = check_stacks(*stacks, name)
        layout = Layout.of(layout, f"{where(name)}layout")
        scales = tuple(None if s is None else scale_values(s, f"{where(name)}input_scales").max()
                       for s in input_scales)
        dev = stacks[0].device
        mode = resolve_mode(mode, dev, all(s is not None for s in scales))
        resolved = pick_layout(layout, *stacks, h, i, dev, mode, name)
        group = None if ratio is not None else pick_group(fused, resolved, dev, i)
        if resolved == "packed":
            stacks = [pack_by_expert(stacks[0], group), pack_by_expert(stacks[1])]
        elif group:
            stacks[0] = interleave_gate_up(stacks[0], group)
        return cls(*stacks, mode, schedule, scales if mode == "w4a4" else (None, None),
                   resolved, name=name, gate_up_group=group, up_ratio=ratio)

    @classmethod
    def from_gpt_oss(cls, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                     gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                     down_scales: torch.Tensor, down_bias: torch.Tensor, *,
                     layout: str = "auto", fused="auto", schedule="auto",
                     name: str = "") -> Experts:
        """gpt-oss's MXFP4 experts (transformers' ``GptOssExperts`` checkpoint tensors, any
        expert-parallel subset of them): ``gate_up_blocks`` uint8 ``[E, 2I, H/32, 16]``
        and ``gate_up_scales`` uint8 ``[E, 2I, H/32]`` (UE8M0 codes) with gate and up rows
        alternating (gate ``2i``, up ``2i + 1``), ``gate_up_bias`` ``[E, 2I]`` (same order,
        any float dtype), ``down_blocks`` ``[E, H, I/32, 16]``, ``down_scales``
        ``[E, H, I/32]``, ``down_bias`` ``[E, H]``. The layer computes, per routed token,
        ``h = swiglu_oai(x @ W13^T + b13)`` (gate clamped above at 7, up to [-7, 7],
        ``(up + 1) * gate * sigmoid(1.702 gate)``) then ``h @ W2^T + b2``, weighted by
        its top-k weights (:func:`softmax_topk` gives gpt-oss's). W4A16 (BF16 activations);
        ``fused`` ("auto", True, False): bias and activation in the gate_up GEMM's epilogue
        (``grouped_gemm(bias=, swiglu_oai=True)``), the rows regrouped once for the
        kernels (``cute_fp4.fused.regroup_gate_up``). Bad tensors are a FormatError naming
        ``name``, the tensor and the numbers (a NaN scale code 255 included)."""
        from cute_fp4.layers.gpt_oss import gpt_oss_experts

        return gpt_oss_experts(cls, (gate_up_blocks, gate_up_scales, gate_up_bias),
                               (down_blocks, down_scales, down_bias), layout, fused,
                               schedule, name)

    @property
    def fmt(self):
        """The weights' block format (:class:`~cute_fp4.formats.BlockFormat`)."""
        return self.w13.fmt

    def gpt_oss_checkpoint(self, bias_dtype: torch.dtype = torch.bfloat16) -> dict:
        """Experts made by :meth:`from_gpt_oss` as gpt-oss's checkpoint tensors on the CPU
        (``gate_up_proj_blocks``, ``..._scales``, ``..._bias``, the same for ``down_proj``),
        bit for bit what they were made from (biases in ``bias_dtype``)."""
        from cute_fp4.layers.gpt_oss import gpt_oss_checkpoint

        return gpt_oss_checkpoint(self, bias_dtype)

    def _refresh_alpha(self) -> None:
        """W4A4 with static scales: alpha[e] = input_scale * weight_scale_2[e], once."""
        self.alphas = tuple(None if self.mode != "w4a4" or s is None else s * w.global_scale
                            for s, w in zip(self.input_scales, (self.w13, self.w2)))

    def adopt(self, w13: tuple, w2: tuple, input_scales: tuple, alphas: tuple,
              up_ratio=None, biases: tuple | None = None) -> None:
        """Hold these tensors from now on (a module moved its buffers, ``Module.to``):
        ``w13``/``w2`` = (data, scale, global scale) in the same layout and shapes;
        ``biases``: the float32 (gate_up, down) biases (None: kept)."""
        self.w13 = stored_view(*w13, self.w13.shape, self.layout, self.w13.fmt)
        self.w2 = stored_view(*w2, self.w2.shape, self.layout, self.w2.fmt)
        self.input_scales, self.alphas, self.up_ratio = tuple(input_scales), tuple(alphas), \
            up_ratio
        if biases is not None:
            self.biases = tuple(biases)

    @property
    def device(self) -> torch.device:
        return self.w13.data.device

    def describe(self) -> str:
        scale = ""
        if self.mode == "w4a4":
            scale = f", input_scales={'static' if self.input_scales[0] is not None else 'dynamic'}"
        oai = ", activation=swiglu_oai" if self.activation == "swiglu_oai" else ""
        return (f"experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, format={self.fmt}, mode={self.mode}"
                f"{scale}, layout={self.layout}, schedule={self.schedule}{oai}")

    def __repr__(self) -> str:
        return f"Experts({self.describe()})"

    # ------------------------------------------------------------------ a call

    def check_input(self, x, topk_ids, topk_weights) -> None:
        if not isinstance(x, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
            raise InputTypeError(f"{where(self.name)}x and topk_weights must be torch.Tensors, "
                                 f"got {type(x).__name__} and {type(topk_weights).__name__}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise InputError(f"{where(self.name)}x must be [T, {self.hidden}], got shape "
                             f"{tuple(x.shape)}")
        if x.dtype not in _ACT_DTYPES:
            raise InputError(f"{where(self.name)}x must be bfloat16 or float16, got {x.dtype}")
        t, _ = check_ids(topk_ids, self.num_experts)
        if t != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise InputError(f"{where(self.name)}x has {x.shape[0]} tokens; topk_ids "
                             f"{tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} must be [{x.shape[0]}, top_k]")
        if not topk_weights.is_floating_point():
            raise InputError(f"{where(self.name)}topk_weights must be floating point, got "
                             f"{topk_weights.dtype}")
        dev = self.device
        for tensor, what in ((x, "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
            if tensor.device != dev:
                raise InputError(f"{where(self.name)}{what} is on {tensor.device} but the "
                                 f"layer is on {dev}")

    def _activation(self, h: torch.Tensor, which: int):
        """The input of GEMM ``which`` (0: gate_up, 1: down): ``h`` (W4A16) or its NVFP4
        quantization with the static or a dynamic scale (W4A4)."""
        return h if self.mode == "w4a16" else _quantize(h, self.input_scales[which])

    def stages(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
               ) -> Stages:
        """A call with every intermediate kept (:class:`Stages`), unfused."""
        self.check_input(x, topk_ids, topk_weights)
        if self.activation == "swiglu_oai":
            from cute_fp4.layers.gpt_oss import oai_stages

            return oai_stages(self, x, topk_ids, topk_weights)
        r = route(topk_ids, self.num_experts)
        xs = x.index_select(0, r.token)
        a13 = self._activation(xs, 0)
        gate_up = _grouped_gemm(a13, self.w13, r.offsets, self.schedule, x.dtype,
                                self.alphas[0])
        if self.up_ratio is not None:  # the up rows' own global scales
            i = self.intermediate
            row_ratio = self.up_ratio.index_select(
                0, topk_ids.reshape(-1).index_select(0, r.order))
            up = (gate_up[:, i:].float() * row_ratio.unsqueeze(1)).to(gate_up.dtype)
            gate_up = torch.cat((gate_up[:, :i], up), dim=1)
        act = (silu_mul_unfused(gate_up, self.gate_up_group) if self.gate_up_group
               else silu_and_mul(gate_up))
        a2 = self._activation(act, 1)
        down = _grouped_gemm(a2, self.w2, r.offsets, self.schedule, x.dtype, self.alphas[1])
        return Stages(r, xs, a13, gate_up, act, a2, down, combine(down, r, topk_weights))

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> torch.Tensor:
        """``x`` bf16/fp16 ``[T, H]``, ``topk_ids`` int ``[T, top_k]``, ``topk_weights``
        ``[T, top_k]`` -> ``[T, H]`` in x's dtype. No host sync; T = 0 launches nothing."""
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 0:
            self.check_input(x, topk_ids, topk_weights)
            return x.new_empty((0, self.hidden))
        if self.activation == "swiglu_oai":
            from cute_fp4.layers.gpt_oss import oai_forward

            return oai_forward(self, x, topk_ids, topk_weights)
        if not self.gate_up_group or torch.compiler.is_compiling():
            # under torch.compile the grouped op has no epilogue operands: the unfused
            # activation on the interleaved gate_up (eager: the same bits; Inductor fuses
            # silu(gate) * up without the intermediate rounding)
            return self.stages(x, topk_ids, topk_weights).out
        self.check_input(x, topk_ids, topk_weights)
        r = route(topk_ids, self.num_experts)
        a13 = self._activation(x.index_select(0, r.token), 0)
        act = _grouped_gemm(a13, self.w13, r.offsets, self.schedule, x.dtype, self.alphas[0],
                            silu_mul=True)
        down = _grouped_gemm(self._activation(act, 1), self.w2, r.offsets, self.schedule,
                             x.dtype, self.alphas[1])
        return combine(down, r, topk_weights)

    # ------------------------------------------------------------------ references, state

    def gate_up_expert(self, e: int) -> BlockTensor:
        """Expert ``e``'s gate_up weight ``[2I, H]`` in the natural order (gate rows, then
        up; swiglu_oai experts: gpt-oss's, gate and up rows alternating), plain layout (a
        copy when stored packed or interleaved: references, saving), with the gate's global
        scale."""
        w = expert(self.w13, e)
        if self.activation == "swiglu_oai":
            return w if self.gate_up_group == 1 else regroup_gate_up(w, 1, self.gate_up_group)
        return natural_gate_up(w, self.gate_up_group) if self.gate_up_group else w

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` dequantized to ``dtype`` (the up rows with their
        own global scales)."""
        w13 = []
        for e in range(self.num_experts):
            g = self.gate_up_expert(e).dequantize(torch.float32)
            if self.up_ratio is not None:
                g[self.intermediate:] *= self.up_ratio[e].to(g.device)
            w13.append(g.to(dtype))
        return (torch.stack(w13), torch.stack([expert(self.w2, e).dequantize(dtype)
                                               for e in range(self.num_experts)]))


__all__ = ["Experts", "Routing", "Stages", "check_ids", "check_stacks", "combine", "expert",
           "modelopt_stack", "pack_by_expert", "pick_group", "pick_layout", "route",
           "silu_and_mul", "softmax_topk"]
