"""A prepared NVFP4 linear layer, :class:`Linear`: ``y = x @ W^T (+ bias)``.

Prepared once (the weight in the layout its kernels read, its scales checked, alpha made),
applied per call on bf16/fp16 ``x`` of any rank:

* ``mode="w4a16"``: the activations stay bf16/fp16;
* ``mode="w4a4"``: the activations are quantized by the fused kernel
  (``cute_fp4.quant.quantize_activation``) with the calibrated ``input_scale`` when the
  layer has one (one kernel), else with a per-call amax computed on the GPU.

A call synchronises nothing with the GPU, checks only the activation (host metadata), never
the stored weight, and allocates only the output (W4A4: also the quantized activation, in
one scratch buffer; a split-K schedule: its workspace; a non-contiguous input: one
contiguous copy). From the second call at an M it launches through a binding of the first
call's kernels (``bindings.Launcher``, ``docs/correctness.md``). Under ``torch.compile``
it is one ``cute_fp4::mm`` node (W4A4: after a ``cute_fp4::quantize`` node), so
``fullgraph=True`` and ``mode="reduce-overhead"`` (CUDA graphs) work. Under
``targets.reference_mode`` it takes ``gemm``'s full path, which computes with the exact
reference on any device.

Weight layout: "plain" keeps the cuBLAS-layout bytes; "packed" holds them in WGMMA fragment
order (``cute_fp4.packed``) for the SM90 ``rs_packed`` kernels and the ``stream`` decode
kernels (``common.resolve_layout``). A packed W4A4 layer with ``schedule="auto"`` decodes
its quantized activation to the exact BF16 block values and runs the W4A16 kernel (the same
products; perf/results/2026-12-01-h200-bound.md).

``silu_group``: the weight is a gated MLP's gate and up projections, rows interleaved in
groups of that many (``cute_fp4.fused``), and the layer returns ``F.silu(gate) * up``
``[..., N / 2]`` computed in the GEMM's epilogue (``gemm(silu_mul=True)``).
"""

from __future__ import annotations

import warnings

import torch

from cute_fp4.api import run_call
from cute_fp4.bindings import Launcher
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.formats import NVFP4
from cute_fp4.layers.common import (
    ACT_FORMATS,
    check_layout_format,
    check_modelopt,
    check_schedule,
    check_weight,
    mxfp4_tensor,
    resolve_format_mode,
    resolve_layout,
    scalar,
    scale_values,
    stored_view,
    where,
)
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import K_MULTIPLE, N_MULTIPLE, GemmCall
from cute_fp4.packed import PackedWeight, pack, packed_class, unpack
from cute_fp4.targets import reference_mode

# ----------------------------------------------------------------------------- the layer

class Linear:
    """``y = x @ W^T (+ bias)`` with ``W`` block-scaled ``[out_features, in_features]``
    (NVFP4, or MXFP4: W4A16 with bfloat16 activations), prepared (module docstring).

    ``weight``: an NVFP4Tensor (``cute_fp4.quantize``, ``NVFP4Tensor.from_modelopt``) or
    MXFP4Tensor (``MXFP4Tensor.from_blocks``, :meth:`from_mxfp4`), or its packed weight
    (already in fragment order); ``mode``: "w4a16" or "w4a4" ("auto":
    ``common.resolve_mode``; MXFP4: "w4a16"); ``schedule``: "auto", a catalogue name (both
    work under torch.compile) or a Schedule; ``input_scale``: W4A4's calibrated activation
    global scale (decode form, ``amax / 2688``), None for a dynamic one; ``layout``:
    "auto", "plain" or "packed"; ``name``: the layer's name in error messages;
    ``silu_group``: see the module docstring. The output has the input's dtype and shape
    ``[..., out_features]`` (``[..., out_features / 2]`` with ``silu_group``). Build from a
    checkpoint's tensors with :meth:`from_modelopt` (NVFP4) or :meth:`from_mxfp4`.
    """

    __slots__ = ("out_features", "in_features", "mode", "schedule", "layout", "name",
                 "silu_group", "stored", "bias", "input_scale", "alpha", "out_scale",
                 "launches", "prefetch_weights", "_parts", "_one")

    def __init__(self, weight, bias: torch.Tensor | None = None, mode: str = "w4a16",
                 schedule="auto", input_scale=None, layout: str = "auto", name: str = "",
                 *, silu_group: int | None = None):
        check_weight(weight, name)
        check_schedule(schedule)
        self.out_features, self.in_features = weight.shape
        self.name, self.silu_group, self._parts = name, silu_group, None
        dev, fmt = weight.device, weight.fmt
        self.mode = resolve_format_mode(mode, dev, input_scale is not None, fmt, name)
        self.schedule = schedule
        self.layout = resolve_layout(layout, self.mode, self.in_features, dev, schedule)
        check_layout_format(self.layout, fmt, dev, name)
        if isinstance(weight, PackedWeight) and self.layout == "plain":
            weight = weight.unpack()
        if not isinstance(weight, PackedWeight) and self.layout == "packed":
            weight = packed_class(fmt)(pack(weight.data.contiguous()), weight.scale,
                                       weight.global_scale, weight.shape)
        gs = None if not fmt.global_scale else scalar(
            weight.global_scale, f"{where(name)}weight global scale", dev)
        # a format without global scales: alpha 1, held so a launch binding can keep it
        self._one = None if gs is not None else torch.ones((), dtype=torch.float32, device=dev)
        self.stored = stored_view(weight.data, weight.scale, gs, weight.shape, self.layout, fmt)
        self.bias = _bias(bias, self.out_features, dev, name)
        if silu_group is not None and self.bias is not None:
            raise InputError(f"{where(name)}a gated layer (silu_group) takes no bias: its "
                             "output is silu(gate) * up; give the GEMM's bias to "
                             "cute_fp4.gemm(bias=, silu_mul=True)")
        self.input_scale = None if input_scale is None else scalar(
            input_scale, f"{where(name)}input_scale", dev)
        self.alpha = self.out_scale = None
        self.launches = Launcher()  # the bindings of its calls, per M and dtype
        # the stream kernel reads this weight before the kernel before it ends (off: see
        # set_prefetch_weights)
        self.prefetch_weights = False
        self._refresh_alpha()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                      input_scale=None, bias: torch.Tensor | None = None, *,
                      output_sizes=None, mode: str = "auto", layout: str = "auto",
                      schedule="auto", name: str = "") -> Linear:
        """From a ModelOpt NVFP4 checkpoint's tensors of one layer, or of any tensor-parallel
        shard of it: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn (or its
        uint8 bytes) ``[N, K/16]`` row-major, ``weight_scale_2`` FP32, a scalar or one value
        per logical output shard (fused q/k/v, gate/up) of ``output_sizes`` rows each;
        ``input_scale`` a scalar or one per shard (the largest is used), None: dynamic in
        W4A4; ``bias`` ``[N]``. Shards whose global scales differ run as one GEMM each
        (exact; one warning). Sizes the kernels cannot run are a FormatError naming
        ``name`` and the numbers."""
        for t, what in ((weight, "weight"), (weight_scale, "weight_scale")):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise FormatError(f"{where(name)}{what} must be a 2-D tensor, got {got}")
        n, k = weight.shape[0], weight.shape[1] * 2
        check_sizes(n, k, name)
        gs = scale_values(weight_scale_2, f"{where(name)}weight_scale_2").reshape(-1)
        sizes = [n] if output_sizes is None else [int(s) for s in output_sizes]
        if sum(sizes) != n or gs.numel() not in (1, len(sizes)):
            raise FormatError(f"{where(name)}output_sizes {sizes} (sum {sum(sizes)}) and "
                              f"weight_scale_2 ({gs.numel()} values) do not describe the "
                              f"weight's {n} rows: one global scale, or one per shard")
        inp = None
        if input_scale is not None:
            inp = scale_values(input_scale, f"{where(name)}input_scale").reshape(-1).max()
        if gs.numel() > 1 and not bool((gs == gs[0]).all()):
            return cls._sharded(weight, weight_scale, gs, sizes, inp, bias, mode, layout,
                                schedule, name)
        w = NVFP4Tensor.from_modelopt(weight, weight_scale, gs[0].to(weight.device))
        return cls(w, bias, mode, schedule, inp, layout, name)

    @classmethod
    def from_mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None, *, mode: str = "auto",
                   layout: str = "auto", schedule="auto", name: str = "") -> Linear:
        """From an MXFP4 checkpoint's tensors of one layer (OCP Microscaling, as
        transformers' ``mxfp4`` quantization stores them; any tensor-parallel shard):
        ``blocks`` uint8 ``[N, K/32, 16]`` (each row's packed E2M1 bytes, 32 elements per
        block), ``scales`` uint8 ``[N, K/32]`` (UE8M0 codes, row-major), ``bias`` ``[N]``.
        W4A16 with bfloat16 activations (``mode`` "auto" or "w4a16"); on sm_90a K must be a
        multiple of 64 (the packed layout). Bad tensors (shapes, dtypes, a NaN scale code
        255) are a FormatError naming ``name``. :meth:`checkpoint` gives them back."""
        w = mxfp4_tensor(blocks, scales, ("N",), where(name), where(name))
        check_sizes(*w.shape, name)
        return cls(w, bias, mode, schedule, None, layout, name)

    @classmethod
    def _sharded(cls, weight, weight_scale, gs, sizes, inp, bias, mode, layout, schedule,
                 name) -> Linear:
        """A layer of per-shard layers (their global scales differ): one GEMM each, the
        outputs side by side."""
        warnings.warn(f"{where(name)}the output shards {sizes} have different global scales "
                      f"{[float(g) for g in gs]}: running one GEMM per shard (exact, slower); "
                      "a checkpoint with one global scale per fused layer runs one",
                      RuntimeWarning, stacklevel=3)
        parts, row = [], 0
        for i, rows in enumerate(sizes):
            sl = slice(row, row + rows)
            parts.append(cls.from_modelopt(
                weight[sl], weight_scale[sl], gs[i], inp, None if bias is None else bias[sl],
                mode=mode, layout=layout, schedule=schedule, name=f"{name}[shard {i}]"))
            row += rows
        first = parts[0]
        whole = object.__new__(cls)
        for slot in cls.__slots__:
            setattr(whole, slot, getattr(first, slot))
        whole.out_features, whole.name, whole._parts = sum(sizes), name, tuple(parts)
        whole.bias = None
        return whole

    def _refresh_alpha(self) -> None:
        """W4A4 with a static input scale: alpha = input_scale * weight_scale_2, computed
        once (in place when it exists, so a captured CUDA graph reads the new value)."""
        gs = self.stored.global_scale
        if self.mode != "w4a4" or self.input_scale is None or gs is None:
            self.alpha = None
        elif self.alpha is None:
            self.alpha = self.input_scale * gs
        else:
            torch.mul(self.input_scale, gs, out=self.alpha)

    # ------------------------------------------------------------------ state

    @property
    def device(self) -> torch.device:
        return self.stored.data.device

    @property
    def fmt(self):
        """The weight's block format (:class:`~cute_fp4.formats.BlockFormat`)."""
        return self.stored.fmt

    @property
    def weight(self) -> BlockTensor:
        """The weight as a block tensor in the plain layout (a packed one unpacked: a copy,
        which a call never uses)."""
        w = self.stored
        if isinstance(w, PackedWeight):
            return w.tensor_class._unchecked(unpack(w.data, self.out_features), w.scale,
                                             w.global_scale, w.shape)
        return w

    def layout_bytes(self, data: torch.Tensor) -> torch.Tensor:
        """Plain weight bytes ``[N, K/2]`` as this layer stores them (packed: repacked)."""
        return pack(data.contiguous()) if self.layout == "packed" else data

    def adopt(self, data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
              input_scale=None, alpha=None, out_scale=None, bias=None) -> None:
        """Hold these tensors from now on (a module moved its buffers, ``Module.to``): the
        same layout and shapes; the bindings are dropped."""
        self.stored = stored_view(data, scale, global_scale, self.stored.shape, self.layout,
                            self.fmt)
        self.input_scale, self.alpha, self.out_scale = input_scale, alpha, out_scale
        self.bias = bias
        self.launches = Launcher()
        self._settle()

    def load_modelopt(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                      input_scale=None) -> None:
        """Overwrite the weight (and the calibrated input scale, when given) in place with
        a ModelOpt checkpoint's tensors; the tensors keep their addresses (CUDA graphs
        captured before stay valid)."""
        check_modelopt(self.name, self.out_features, self.in_features, weight, weight_scale,
                       weight_scale_2, input_scale)
        w = NVFP4Tensor.from_modelopt(weight, weight_scale, weight_scale_2)
        gs = scalar(w.global_scale, f"{where(self.name)}weight_scale_2", self.device)
        with torch.no_grad():
            self.stored.data.copy_(self.layout_bytes(w.data))
            self.stored.scale.copy_(w.scale)
            self.stored.global_scale.copy_(gs)
        self._settle()
        if input_scale is not None:
            self.set_input_scale(input_scale)
        else:
            self._refresh_alpha()

    def set_prefetch_weights(self, on: bool = True) -> None:
        """Let the W4A16 stream kernel read this weight (and its scales) before the kernel
        before it on the stream has finished (``Operands.early``: its loads overlap that
        kernel's tail). Safe because the weight is prepared: no kernel in flight writes it;
        the layer's own writes (:meth:`load_modelopt`, :meth:`adopt`) wait for their copies
        to end before it launches again. Off by default: measure it for the model
        (perf/model_decode.py, decode_bench's early providers)."""
        self.prefetch_weights = bool(on)
        self._settle()

    def _settle(self) -> None:
        """With prefetching on, the stream's work so far (a write of the weight) finished
        before the next launch reads the weight early."""
        if self.prefetch_weights and self.stored.data.is_cuda:
            torch.cuda.current_stream(self.stored.data.device).synchronize()

    def set_input_scale(self, input_scale) -> None:
        """Set the calibrated activation global scale (decode form, ``amax / 2688``) in
        place; a W4A4 layer then quantizes with it (one kernel) instead of a per-call amax.
        The value is checked here (a GPU value is read: one sync), never in a call."""
        s = scalar(input_scale, f"{where(self.name)}input_scale", self.device)
        with torch.no_grad():
            if self.input_scale is None:
                self.input_scale = s
            else:
                self.input_scale.copy_(s)
        self._refresh_alpha()

    def emit_nvfp4(self, next_input_scale) -> None:
        """Make a call return its output as NVFP4 quantized with ``next_input_scale`` (the
        following W4A4 layer's static input scale, decode form): the GEMM's epilogue writes
        it (``gemm(..., nvfp4_out=)``). None: back to a BF16/FP16 output."""
        self.out_scale = None if next_input_scale is None else scalar(
            next_input_scale, f"{where(self.name)}next_input_scale", self.device)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The layer as ModelOpt's tensors (``weight``, ``weight_scale`` row-major,
        ``weight_scale_2``, ``input_scale`` when calibrated, ``bias`` when present), bit for
        bit what it was prepared from (per-shard layers: their scales side by side); an
        MXFP4 layer as its checkpoint's ``blocks``, ``scales`` (and ``bias``)."""
        if self.fmt is not NVFP4:
            blocks, scales = self.weight.to_blocks()
            out = {"blocks": blocks, "scales": scales}
            if self.bias is not None:
                out["bias"] = self.bias
            return out
        if self._parts is not None:
            parts = [p.checkpoint() for p in self._parts]
            out = {key: torch.cat([p[key] for p in parts]) for key in ("weight", "weight_scale")}
            out["weight_scale_2"] = torch.stack([p["weight_scale_2"] for p in parts])
            if "input_scale" in parts[0]:
                out["input_scale"] = parts[0]["input_scale"]
            if any("bias" in p for p in parts):
                out["bias"] = torch.cat([p["bias"] for p in parts])
            return out
        w = self.weight
        out = {"weight": w.data, "weight_scale": w.scale_linear(),
               "weight_scale_2": self.stored.global_scale}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def __repr__(self) -> str:
        return f"Linear({self.describe()})"

    def __getstate__(self) -> dict:
        """Pickled or copied without its bindings (this process's kernels and addresses)."""
        return {s: getattr(self, s) for s in self.__slots__ if s != "launches"}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.launches = Launcher()

    def describe(self) -> str:
        """``in_features=..., out_features=..., mode=..., schedule=..., layout=...``."""
        scale = "" if self.mode != "w4a4" else (
            ", input_scale=static" if self.input_scale is not None else ", input_scale=dynamic")
        sched = self.schedule if isinstance(self.schedule, str) else (
            self.schedule.name or self.schedule.label())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}{scale}, schedule={sched}, "
                f"layout={self.layout}")

    # ------------------------------------------------------------------ a call

    def check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{where(self.name)}input must be a torch.Tensor, got "
                                 f"{type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise InputError(f"{where(self.name)}input has {x.shape[-1] if x.dim() else 0} "
                             f"features (shape {tuple(x.shape)}), the layer expects "
                             f"{self.in_features}")
        if x.dtype not in ACT_FORMATS:
            raise InputError(f"{where(self.name)}input must be bfloat16 or float16, got "
                             f"{x.dtype} (convert the model's activations, e.g. "
                             "model.to(torch.bfloat16))")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._parts is not None:
            return torch.cat([p(x) for p in self._parts], dim=-1)
        if (isinstance(x, NVFP4Tensor) or self.out_scale is not None
                or self.silu_group is not None or torch.compiler.is_compiling()
                or reference_mode()):
            return self._forward_full(x)
        self.check_input(x)
        k, n = self.in_features, self.out_features
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        w = self.stored
        dev = w.data.get_device()
        if x.get_device() != dev:  # ints: cheaper than comparing torch.device objects
            raise InputError(f"{where(self.name)}input is on {x.device} but the layer is on "
                             f"{w.data.device}")
        m = x.shape[0] if x.dim() == 2 else x.numel() // k
        if m == 0:
            return x.new_empty((*x.shape[:-1], n))
        # the kernel reads A's and writes C's memory only: an N-D contiguous input and an
        # output of the final shape need no reshape or view (~2 us of host each)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        if self.mode == "w4a4":
            x2 = x if x.dim() == 2 else x.reshape(-1, k)  # the quantizer takes [M, K]
            self.launches.w4a4(x2, w, self.schedule, m, out, self.input_scale, self.alpha)
        else:
            self.launches.w4a16(x, w, self.schedule, m, out, self.prefetch_weights, self._one)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _forward_full(self, x):
        """The launch path's full path (``api.run_call``), no binding of the layer's own, on
        the layer's call stated once as a record (``operands.GemmCall``). What a gated layer
        runs (SiLU-and-mul fused in the GEMM's epilogue), a layer that emits NVFP4
        (:meth:`emit_nvfp4`; the output [M, N] quantized in the epilogue) or is given NVFP4
        (a W4A4 layer after one that emits it: used as it is, its own global scale in alpha;
        2-D [M, K]), and every layer while torch.compile traces it (the custom ops; a gated
        layer's activation unfused on the interleaved output, which Inductor fuses in FP32
        without the intermediate rounding of silu(gate): within that rounding of the eager
        bits) or under ``targets.reference_mode`` (the exact reference, any device). The
        bias is added to the output as the bound path adds it, or fused in FP32 where the
        output or the input is NVFP4."""
        nvfp4_in, emit = isinstance(x, NVFP4Tensor), self.out_scale is not None
        if torch.compiler.is_compiling():
            if nvfp4_in or emit:
                raise InputError("NVFP4 inputs and outputs of a layer are not supported under "
                                 "torch.compile yet (the custom ops take no NVFP4 output)")
            if not isinstance(self.schedule, str):
                raise InputTypeError(f"{where(self.name)}under torch.compile, a layer's "
                                     "schedule must be a catalogue name or 'auto'")
        if nvfp4_in and self.mode != "w4a4":
            raise InputError(f"{where(self.name)}an NVFP4 input needs mode='w4a4' (this "
                             f"layer is {self.mode}); give it the BF16/FP16 activation")
        if not nvfp4_in:
            self.check_input(x)
            if x.device != self.device:
                raise InputError(f"{where(self.name)}input is on {x.device} but the layer is "
                                 f"on {self.device}")
        lead = x.shape[:-1]
        n = self.out_features if self.silu_group is None else self.out_features // 2
        a = x if nvfp4_in else x.reshape(-1, self.in_features).contiguous()
        if a.shape[0] == 0 and not emit:
            return torch.empty((*lead, n), dtype=torch.bfloat16 if nvfp4_in else x.dtype,
                               device=self.device)
        quantize = self.mode == "w4a4" and not nvfp4_in
        fused_bias = self.bias is not None and (nvfp4_in or emit)
        y = run_call(GemmCall(
            a, self.stored, self.schedule, out_dtype=torch.bfloat16 if nvfp4_in else x.dtype,
            alpha=self._one if self.mode == "w4a16" else self.alpha if quantize else None,
            bias=self.bias.float() if fused_bias else None,
            silu_mul=self.silu_group is not None, nvfp4_out=self.out_scale,
            quantize_a=quantize, input_scale=self.input_scale, group=self.silu_group))
        if emit or nvfp4_in:
            return y
        if self.bias is not None:
            y.add_(self.bias)  # in y's dtype, as the bound path adds it
        return y.view(*lead, n)


# ----------------------------------------------------------------------------- helpers

def check_sizes(n: int, k: int, name: str = "") -> None:
    """The kernels' limits on a weight's sizes (per tensor-parallel rank), as a FormatError
    naming the layer: K (in_features) a multiple of :data:`K_MULTIPLE`, N a multiple of
    :data:`N_MULTIPLE`."""
    if k % K_MULTIPLE:
        raise FormatError(f"{where(name)}in_features {k} is not a multiple of {K_MULTIPLE}: "
                          "the NVFP4 kernels read 16-byte packed rows (a row-parallel shard "
                          "must keep a multiple per rank)")
    if n % N_MULTIPLE:
        raise FormatError(f"{where(name)}out_features {n} is not a multiple of {N_MULTIPLE}: "
                          "the kernels write 16-byte output rows (a column-parallel shard must "
                          "keep a multiple per rank)")


def _bias(bias, n: int, device: torch.device, name: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias)
        raise InputError(f"{where(name)}bias must have shape ({n},), got {shape}")
    if not bias.is_floating_point():
        raise InputError(f"{where(name)}bias must be a floating-point tensor (it is added to "
                         f"the bf16/fp16 output), got {bias.dtype}")
    return bias.detach().clone().to(device)


__all__ = ["K_MULTIPLE", "N_MULTIPLE", "Linear", "check_sizes"]
