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
  ``[E + 1]`` on the device. Only torch ops that never read a GPU value on the host, so a
  call is CUDA-graph capturable and traces into one ``torch.compile`` graph.
* **combine**: the down projection's rows put back in pair order and reduced per token by
  one batched matmul ``[1, top_k] @ [top_k, H]`` (FP32 accumulation, one rounding to the
  activation dtype): deterministic. The top-k weights are rounded to that dtype first.
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

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cute_fp4.api import quantize_op
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.fused import device_group, interleave_gate_up, natural_gate_up, silu_mul_unfused
from cute_fp4.grouped import grouped_gemm
from cute_fp4.layers.common import LAYOUTS, resolve_mode, scalar, scale_values, where
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape, swizzle_scales
from cute_fp4.packed import PackedNVFP4Weight, pack, packed_rows, repack
from cute_fp4.targets import capability_major

_ACT_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


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


def check_ids(topk_ids, num_experts) -> tuple[int, int]:
    """(T, top_k) of ``topk_ids``; typed errors for anything but an int ``[T, top_k]``."""
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
    _, k = check_ids(topk_ids, num_experts)
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


def expert(w, e: int) -> NVFP4Tensor:
    """Expert ``e`` of an expert stack (NVFP4Tensor or PackedNVFP4Weight) as a plain 2-D
    NVFP4Tensor ``[N, K]``: views of a plain stack; a packed one is unpacked (a copy, and
    its checked constructor reads the global scale: references and loops only)."""
    one = w.expert(e)
    return one.unpack() if isinstance(one, PackedNVFP4Weight) else one


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


class Stages(NamedTuple):
    """Every intermediate of one call, in sorted (expert) order except ``out``."""

    routing: Routing
    x_sorted: torch.Tensor  # [T*k, H] the gathered activations
    a13: torch.Tensor | NVFP4Tensor  # x_sorted, or its NVFP4 quantization (w4a4)
    gate_up: torch.Tensor  # [T*k, 2I], in w13's row order (interleaved when fused)
    act: torch.Tensor  # [T*k, I]
    a2: torch.Tensor | NVFP4Tensor  # act, or its NVFP4 quantization (w4a4)
    down: torch.Tensor  # [T*k, H]
    out: torch.Tensor  # [T, H]


# ----------------------------------------------------------------------------- the layer

class Experts:
    """A MoE layer's experts on NVFP4 weights, prepared: ``ex(x, topk_ids, topk_weights)``
    (module docstring).

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
    they differ (:meth:`from_modelopt`). Build from a checkpoint with :meth:`from_modelopt`.
    """

    __slots__ = ("num_experts", "hidden", "intermediate", "mode", "schedule", "layout",
                 "gate_up_group", "name", "w13", "w2", "input_scales", "alphas", "up_ratio")

    def __init__(self, w13, w2, mode: str = "w4a16", schedule="auto",
                 input_scales=(None, None), layout: str = "auto", fused="auto",
                 name: str = "", *, gate_up_group: int | None = None,
                 up_ratio: torch.Tensor | None = None):
        if layout not in LAYOUTS:
            raise InputError(f"{where(name)}layout must be one of {LAYOUTS}, got {layout!r}")
        if not isinstance(input_scales, (tuple, list)) or len(input_scales) != 2:
            raise InputError(f"{where(name)}input_scales must be a pair (gate_up, down) of "
                             "scales or None")
        self.name = name
        self.num_experts, self.hidden, self.intermediate = check_stacks(w13, w2, name)
        dev = w13.data.device
        self.mode = resolve_mode(mode, dev, all(s is not None for s in input_scales))
        self.layout = pick_layout(layout, w13, w2, self.hidden, self.intermediate, dev,
                                  self.mode)
        if up_ratio is not None:
            fused = False  # the up rows' own scales apply between the GEMM and the activation
        self.gate_up_group = gate_up_group or pick_group(fused, self.layout, dev,
                                                         self.intermediate)
        if self.gate_up_group and not gate_up_group:  # w13 in the natural order
            if isinstance(w13, PackedNVFP4Weight):
                w13 = w13.unpack()
            w13 = interleave_gate_up(w13, self.gate_up_group)
        if self.layout == "packed":
            w13 = w13 if isinstance(w13, PackedNVFP4Weight) else repack(w13)
            w2 = w2 if isinstance(w2, PackedNVFP4Weight) else repack(w2)
        self.schedule = schedule
        gs = [w.global_scale.to(dev, torch.float32).reshape(-1) for w in (w13, w2)]
        self.w13 = _stack_view(w13.data, w13.scale, gs[0], w13.shape, self.layout)
        self.w2 = _stack_view(w2.data, w2.scale, gs[1], w2.shape, self.layout)
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
        if layout not in LAYOUTS:
            raise InputError(f"{where(name)}layout must be one of {LAYOUTS}, got {layout!r}")
        scales = tuple(None if s is None else scale_values(s, f"{where(name)}input_scales").max()
                       for s in input_scales)
        dev = stacks[0].device
        mode = resolve_mode(mode, dev, all(s is not None for s in scales))
        resolved = pick_layout(layout, *stacks, h, i, dev, mode)
        group = None if ratio is not None else pick_group(fused, resolved, dev, i)
        if resolved == "packed":
            stacks = [pack_by_expert(stacks[0], group), pack_by_expert(stacks[1])]
        elif group:
            stacks[0] = interleave_gate_up(stacks[0], group)
        return cls(*stacks, mode, schedule, scales if mode == "w4a4" else (None, None),
                   resolved, name=name, gate_up_group=group, up_ratio=ratio)

    def _refresh_alpha(self) -> None:
        """W4A4 with static scales: alpha[e] = input_scale * weight_scale_2[e], once."""
        self.alphas = tuple(None if self.mode != "w4a4" or s is None else s * w.global_scale
                            for s, w in zip(self.input_scales, (self.w13, self.w2)))

    def adopt(self, w13: tuple, w2: tuple, input_scales: tuple, alphas: tuple,
              up_ratio=None) -> None:
        """Hold these tensors from now on (a module moved its buffers, ``Module.to``):
        ``w13``/``w2`` = (data, scale, global scale) in the same layout and shapes."""
        self.w13 = _stack_view(*w13, self.w13.shape, self.layout)
        self.w2 = _stack_view(*w2, self.w2.shape, self.layout)
        self.input_scales, self.alphas, self.up_ratio = tuple(input_scales), tuple(alphas), \
            up_ratio

    @property
    def device(self) -> torch.device:
        return self.w13.data.device

    def describe(self) -> str:
        scale = ""
        if self.mode == "w4a4":
            scale = f", input_scales={'static' if self.input_scales[0] is not None else 'dynamic'}"
        return (f"experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, mode={self.mode}{scale}, "
                f"layout={self.layout}, schedule={self.schedule}")

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

    def gate_up_expert(self, e: int) -> NVFP4Tensor:
        """Expert ``e``'s gate_up weight ``[2I, H]`` in the natural order (gate rows, then
        up), plain layout (a copy when stored packed or interleaved: references, saving),
        with the gate's global scale."""
        w = expert(self.w13, e)
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


# ----------------------------------------------------------------------------- preparation

def check_stacks(w13, w2, name: str = "") -> tuple[int, int, int]:
    """(E, H, I) of two expert stacks that make a MoE layer; typed errors naming ``name``."""
    for w, what in ((w13, "w13"), (w2, "w2")):
        if not isinstance(w, (NVFP4Tensor, PackedNVFP4Weight)) or w.experts is None:
            got = type(w).__name__ + (f" of shape {w.shape}" if hasattr(w, "shape") else "")
            hint = (": quantize it first (Experts.from_float takes float weights)"
                    if isinstance(w, torch.Tensor) else "")
            raise InputTypeError(f"{where(name)}{what} must be an NVFP4Tensor expert stack "
                                 f"[E, N, K] (cute_fp4.quantize of a 3-D tensor), got {got}"
                                 f"{hint}")
    e, n13, h = w13.shape
    e2, h2, i = w2.shape
    if e2 != e or h2 != h or n13 != 2 * i:
        raise FormatError(f"{where(name)}w13 {list(w13.shape)} and w2 {list(w2.shape)} must "
                          "be [E, 2I, H] and [E, H, I]")
    for w, what in ((w13, "w13"), (w2, "w2")):
        if tuple(w.global_scale.shape) not in ((e,), (e, 1)):
            raise FormatError(f"{where(name)}{what} must have one global scale per expert "
                              f"({e}), got shape {tuple(w.global_scale.shape)}")
    if h % 32 or i % 32:
        raise FormatError(f"{where(name)}hidden {h} and intermediate {i} must be multiples of "
                          "32 (16-byte packed FP4 rows; per tensor-parallel rank)")
    return e, h, i


def modelopt_stack(name: str, weight, weight_scale, weight_scale_2) -> NVFP4Tensor:
    """One expert stack from ModelOpt's tensors (see :meth:`Experts.from_modelopt`): the
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
    scale_e4m3 = weight_scale.contiguous().view(torch.float8_e4m3fn)
    rp, cp = scale_shape(n, 2 * half_k)
    scale = torch.empty((e, rp, cp), dtype=torch.float8_e4m3fn, device=weight.device)
    for x in range(e):
        scale[x] = swizzle_scales(scale_e4m3[x])
    gs = scale_values(weight_scale_2, f"{name} weight_scale_2").reshape(-1)
    return NVFP4Tensor(weight, scale, gs.to(weight.device), (e, n, 2 * half_k))


def pack_by_expert(w: NVFP4Tensor, group: int | None = None) -> PackedNVFP4Weight:
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


def pick_group(fused, layout: str, dev: torch.device, i: int) -> int | None:
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


def pick_layout(layout: str, w13, w2, h: int, i: int, dev: torch.device,
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


def _stack_view(data, scale, global_scale, shape, layout: str):
    """The stored stack over its tensors (no value checks: they were checked once)."""
    if layout == "packed":
        return PackedNVFP4Weight(data, scale, global_scale, shape)
    return NVFP4Tensor._unchecked(data, scale, global_scale, shape)


__all__ = ["Experts", "Routing", "Stages", "check_ids", "check_stacks", "combine", "expert",
           "modelopt_stack", "pack_by_expert", "pick_group", "pick_layout", "route",
           "silu_and_mul"]
