"""The module :class:`NVFP4Linear` and ModelOpt NVFP4 checkpoints (``cute_fp4.convert``,
in ``cute_fp4.conversion``, puts it in a model).

``NVFP4Linear`` holds the weight as buffers (packed E2M1 bytes, blocked UE4M3 scales, the
FP32 global scale) and computes ``y = x @ W^T (+ bias)`` for bf16/fp16 ``x`` of any rank:

* ``mode="w4a16"``: the activations stay bf16/fp16 (SM90 kernels);
* ``mode="w4a4"``: the activations are quantized by the fused kernel
  (``cute_fp4.quant.quantize_activation``) with the calibrated ``input_scale`` when the
  layer has one (one kernel), else with a per-call amax computed on the GPU.

A forward call synchronises nothing with the GPU, checks only the activation (host
metadata), never the stored weight, and allocates only the output (W4A4: also the
quantized activation, in one scratch buffer; a split-K schedule: its workspace; a
non-contiguous input: one contiguous copy). From the second call at an M it launches
through a binding of the first call's kernels (``docs/correctness.md``). Under
``torch.compile`` it is one ``cute_fp4::mm`` node (W4A4: after a ``cute_fp4::quantize``
node), so ``fullgraph=True`` and ``mode="reduce-overhead"`` (CUDA graphs) work. Kernels
are found through ``gemm``'s memo per (schedule, M, N, K, format, dtype, device).

Weight layout (``layout``): "plain" keeps the cuBLAS-layout bytes; "packed" holds them in
WGMMA fragment order (``cute_fp4.packed``) for the SM90 ``rs_packed`` kernels, which are
1.3-1.6x faster than the plain-layout ones from M = 64 up and the decode heuristic's pick
at M <= 16 (perf/results/2026-12-01-h200-decode.md); "auto" (default) is "packed" for a
layer built on an SM90 GPU with in_features a multiple of 64, else "plain". A packed W4A4
layer with ``schedule="auto"`` decodes its quantized activation to the exact BF16 block
values (``quant.dequantize_activation``) and runs the W4A16 kernel, 1.4-1.6x faster than
the W4A4 kernels from M = 256 up (perf/results/2026-12-01-h200-bound.md). A packed
layer runs on sm_90a only; its ``weight`` and ``state_dict`` stay the plain form (the
NVFP4Tensor, ModelOpt's tensors: unpacked when read or saved, repacked when loaded).

Checkpoints: the layer's ``state_dict()`` is ModelOpt's NVFP4 form, ``weight`` (uint8
[N, K/2]), ``weight_scale`` (float8_e4m3fn [N, K/16], row-major), ``weight_scale_2`` (FP32,
the decode-form global scale), ``input_scale`` (FP32, when calibrated) and ``bias``, so
``model.load_state_dict(modelopt_state_dict)`` after ``convert`` loads a ModelOpt
checkpoint into the converted layers (in place: CUDA graphs captured before stay valid).
"""

from __future__ import annotations

import torch

from cute_fp4 import quant
from cute_fp4.api import gemm, gemm_kernel, mm, mm_packed, quantize_op
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.operands import alpha_tensor
from cute_fp4.packed import UNIT_K, PackedNVFP4Weight, pack, unpack
from cute_fp4.quant import quantize_activation
from cute_fp4.targets import capability_major

__all__ = ["LAYOUTS", "MODES", "NVFP4Linear"]

MODES = ("w4a16", "w4a4")
LAYOUTS = ("auto", "plain", "packed")
_ACT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_K_MULTIPLE = 32  # packed FP4 rows must be a multiple of 16 bytes
_N_MULTIPLE = 8  # bf16/fp16 output rows must be a multiple of 16 bytes
# buffers that hold the NVFP4 encoding: their dtypes never follow module.to(dtype)/half()
_FORMAT_BUFFERS = ("weight_packed", "weight_scale", "weight_scale_2", "input_scale", "alpha",
                   "out_scale")
_CHECKPOINT_KEYS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


# ----------------------------------------------------------------------------- kernels

def _kernel_for(schedule, m: int, n: int, k: int, a_format: str, out_dtype: torch.dtype,
                device_index: int, packed: bool = False):
    """The compiled kernel of a call of this shape: ``gemm``'s (``run.GemmPath.kernel``:
    "auto" is resolved again every second, so a new tuning is picked up); ``packed``: for a
    fragment-order weight (``gemm``'s packed resolution)."""
    return gemm_kernel(schedule, (m, n, k, a_format), out_dtype, device_index, packed)


def _resolve_layout(layout: str, mode: str, weight: NVFP4Tensor, schedule="auto") -> str:
    """"auto" -> "packed" when K allows it and the schedule reads that layout ("auto" or an
    rs_packed or stream schedule): on an SM90 GPU (W4A4 then decodes the activation once
    and runs the W4A16 kernel: ``run.GemmPath._w4a4_via_bf16``) and for W4A16 on SM12x (the stream
    kernel, its W4A16 kernel); else "plain" (SM12x W4A4: the block-scaled MMA)."""
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    k = weight.shape[1]
    if layout == "packed" and k % UNIT_K:
        raise FormatError(f"layout='packed' needs in_features to be a multiple of {UNIT_K}, "
                          f"got {k}: use layout='plain'")
    if layout != "auto":
        return layout
    dev = weight.device
    wants = _on_sm90(dev) or (mode == "w4a16" and _on_sm12x(dev))
    return "packed" if wants and k % UNIT_K == 0 and _reads_packed(schedule) else "plain"


def _on_sm90(dev: torch.device) -> bool:
    return capability_major(dev) == 9


def _on_sm12x(dev: torch.device) -> bool:
    return capability_major(dev) == 12


def _reads_packed(schedule) -> bool:
    """Whether ``schedule`` ("auto", a catalogue name or a Schedule) can run on the
    fragment-order layout: "auto" (the packed heuristic) or a mainloop that reads it
    (rs_packed, stream)."""
    from cute_fp4 import catalogue
    from cute_fp4.schedule import Mainloop

    if isinstance(schedule, str):
        if schedule == "auto":
            return True
        schedule = catalogue.get(schedule)  # an unknown name raises here, with suggestions
    mainloop = getattr(schedule, "mainloop", None)
    return isinstance(mainloop, Mainloop) and mainloop.reads_packed


def _check_schedule(schedule) -> None:
    """"auto", a catalogue name (looked up now: an unknown one is an InputError naming the
    closest names) or a Schedule; anything else is a typed error."""
    from cute_fp4 import catalogue
    from cute_fp4.schedule import Schedule

    if isinstance(schedule, str):
        if schedule != "auto":
            catalogue.get(schedule)
    elif not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be 'auto', a catalogue name or a Schedule, got "
                             f"{type(schedule).__name__}")


def _run(kern, a, w: NVFP4Tensor, alpha, dims, out=None) -> torch.Tensor:
    from cute_fp4.run import run_checked

    return run_checked(kern, a, w, out, alpha, dims)


def _device_scalar(t: torch.Tensor, device: torch.device) -> bool:
    """A float32 tensor of one element on ``device`` (what a kernel reads a scale from)."""
    return t.dtype == torch.float32 and t.numel() == 1 and t.device == device


def _scalar(value, name: str, device) -> torch.Tensor:
    """A positive finite FP32 scale as a 0-d tensor on ``device`` (checked once, at
    construction or load: reading a GPU value synchronises)."""
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.numel() != 1:
        raise FormatError(f"{name} must be a scalar, got {t.numel()} elements "
                          f"(shape {tuple(t.shape)})")
    v = float(t)
    if not (v > 0 and v != float("inf")):
        raise FormatError(f"{name} must be finite and > 0, got {v:g}")
    return t.reshape(()).to(device)


# ----------------------------------------------------------------------------- module

def keep_format_dtypes(module: torch.nn.Module, parent_apply, fn, recurse: bool,
                       names: tuple[str, ...]) -> torch.nn.Module:
    """``module._apply(fn)`` (``parent_apply``: the base class's) that keeps the dtypes of
    the buffers ``names``: ``module.to(torch.bfloat16)`` / ``.half()`` convert every
    floating buffer, float8 scales and FP32 global scales included, but NVFP4 buffers must
    keep their dtypes; they follow the device."""
    before = {n: module._buffers[n] for n in names if module._buffers[n] is not None}
    parent_apply(fn, recurse)
    for name, old in before.items():
        new = module._buffers[name]
        if new.dtype != old.dtype:
            module._buffers[name] = old.to(new.device)
    return module


class NVFP4Linear(torch.nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` NVFP4 ``[out_features, in_features]``.

    ``weight``: an NVFP4Tensor (``cute_fp4.quantize``, ``NVFP4Tensor.from_modelopt``), or
    a PackedNVFP4Weight (already in fragment order: stored as it is in the packed layout);
    ``mode``: "w4a16" or "w4a4"; ``schedule``: "auto", a catalogue name (both work under
    torch.compile) or a Schedule; ``input_scale``: W4A4's calibrated activation global
    scale (decode form, ``amax / 2688``), None for a dynamic one; ``layout``: "auto",
    "plain" or "packed" (module docstring). The output has the input's dtype (bf16 or
    fp16) and shape ``[..., out_features]``.
    """

    def __init__(self, weight: NVFP4Tensor, bias: torch.Tensor | None = None,
                 mode: str = "w4a16", schedule="auto", input_scale=None, layout: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise InputError(f"mode must be 'w4a4' or 'w4a16', got {mode!r}")
        if not isinstance(weight, (NVFP4Tensor, PackedNVFP4Weight)):
            raise InputTypeError(f"weight must be an NVFP4Tensor, got {type(weight).__name__}")
        if weight.experts is not None:
            raise InputError(f"weight must be one [out_features, in_features] matrix, got an "
                             f"expert stack {list(weight.shape)}: one NVFP4Linear per expert "
                             "(weight.expert(e)), or cute_fp4.grouped_gemm for the stack")
        _check_schedule(schedule)
        self.out_features, self.in_features = weight.shape
        dev = weight.device
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.out_features,):
                shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias)
                raise InputError(f"bias must have shape ({self.out_features},), got {shape}")
            if not bias.is_floating_point():
                raise InputError(f"bias must be a floating-point tensor (it is added to the "
                                 f"bf16/fp16 output), got {bias.dtype}")
            bias = torch.nn.Parameter(bias.detach().clone().to(dev), requires_grad=False)
        self.mode, self.schedule = mode, schedule
        self.layout = _resolve_layout(layout, mode, weight, schedule)
        if isinstance(weight, PackedNVFP4Weight) and self.layout == "plain":
            weight = weight.unpack()
        stored = (weight.data if isinstance(weight, PackedNVFP4Weight)
                  else self._layout_bytes(weight.data))
        self.register_buffer("weight_packed", stored, persistent=False)
        self.register_buffer("weight_scale", weight.scale, persistent=False)
        self.register_buffer("weight_scale_2", _scalar(weight.global_scale, "weight global "
                                                       "scale", dev), persistent=False)
        self.register_buffer("input_scale", None if input_scale is None else
                             _scalar(input_scale, "input_scale", dev), persistent=False)
        self.register_buffer("alpha", None, persistent=False)
        # emit_nvfp4: the next W4A4 layer's input scale; forward then returns NVFP4
        self.register_buffer("out_scale", None, persistent=False)
        self.bias = bias
        self._view: NVFP4Tensor | None = None
        self._bound: dict[tuple, object] = {}  # (M, dtype) -> run.BoundLaunch (forward)
        self._refresh_alpha()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, mode: str = "w4a16", schedule="auto",
                    input_scale=None, layout: str = "auto") -> NVFP4Linear:
        """Quantize an ``nn.Linear``'s weight (its global scale from its amax)."""
        w = quantize(linear.weight.detach())
        return cls(w, None if linear.bias is None else linear.bias.detach(), mode, schedule,
                   input_scale, layout)

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                      input_scale=None, bias: torch.Tensor | None = None,
                      mode: str | None = None, schedule="auto",
                      layout: str = "auto") -> NVFP4Linear:
        """From a ModelOpt NVFP4 checkpoint's tensors of one layer (see the module
        docstring). ``mode`` None: "w4a4" when ``input_scale`` is given, else "w4a16"."""
        w = NVFP4Tensor.from_modelopt(weight, weight_scale, weight_scale_2)
        if mode is None:
            mode = "w4a16" if input_scale is None else "w4a4"
        return cls(w, bias, mode, schedule, input_scale, layout)

    def load_modelopt(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                      input_scale=None) -> None:
        """Overwrite the weight (and the calibrated input scale, when given) in place with
        a ModelOpt checkpoint's tensors; the buffers keep their addresses."""
        w = NVFP4Tensor.from_modelopt(weight, weight_scale, weight_scale_2)
        if w.shape != (self.out_features, self.in_features):
            raise FormatError(f"checkpoint weight is {list(w.shape)}, the layer is "
                              f"[{self.out_features}, {self.in_features}]")
        dev = self.weight_packed.device
        gs = _scalar(w.global_scale, "weight_scale_2", dev)
        with torch.no_grad():
            self.weight_packed.copy_(self._layout_bytes(w.data))
            self.weight_scale.copy_(w.scale)
            self.weight_scale_2.copy_(gs)
        if input_scale is not None:
            self.set_input_scale(input_scale)
        else:
            self._refresh_alpha()

    def set_input_scale(self, input_scale) -> None:
        """Set the calibrated activation global scale (decode form, ``amax / 2688``) in
        place; a W4A4 layer then quantizes with it (one kernel) instead of a per-call amax.
        The value is checked here (a GPU value is read: one sync), never in forward."""
        s = _scalar(input_scale, "input_scale", self.weight_packed.device)
        with torch.no_grad():
            if self.input_scale is None:
                self.input_scale = s
            else:
                self.input_scale.copy_(s)
        self._refresh_alpha()

    def _refresh_alpha(self) -> None:
        """W4A4 with a static input scale: alpha = input_scale * weight_scale_2, computed
        once (in place when it exists, so a captured CUDA graph reads the new value)."""
        if self.mode != "w4a4" or self.input_scale is None:
            self.alpha = None
        elif self.alpha is None:
            self.alpha = self.input_scale * self.weight_scale_2
        else:
            torch.mul(self.input_scale, self.weight_scale_2, out=self.alpha)

    def emit_nvfp4(self, next_input_scale) -> None:
        """Make forward return its output as NVFP4 quantized with ``next_input_scale`` (the
        following W4A4 layer's static input scale, decode form): the GEMM's epilogue writes
        it (``gemm(..., nvfp4_out=)``: the bytes ``quantize`` gives for the output rounded
        to BF16), so that layer, which takes an NVFP4Tensor input as it is, needs no
        quantize kernel. None: back to a BF16/FP16 output. The NVFP4 output needs a tile
        that writes NVFP4 (``docs/fused.md``): a plain-layout weight on sm_90a."""
        if next_input_scale is None:
            self.out_scale = None
            return
        self.out_scale = _scalar(next_input_scale, "next_input_scale",
                                 self.weight_scale.device)

    # ------------------------------------------------------------------ views, state

    @property
    def weight(self) -> NVFP4Tensor:
        """The weight as an NVFP4Tensor (plain layout: over the buffers, built once without
        the value checks; ``layout="packed"``: unpacked, a copy each time, which forward
        never uses)."""
        if self.layout == "packed":
            d, s, g = self.weight_packed, self.weight_scale, self.weight_scale_2
            return NVFP4Tensor._unchecked(unpack(d, self.out_features), s, g,
                                          (self.out_features, self.in_features))
        return self._stored_weight()

    def _layout_bytes(self, data: torch.Tensor) -> torch.Tensor:
        """Plain weight bytes ``[N, K/2]`` as this layer stores them (packed: repacked)."""
        return pack(data.contiguous()) if self.layout == "packed" else data

    def _stored_weight(self) -> NVFP4Tensor | PackedNVFP4Weight:
        """The weight as stored (NVFP4Tensor or PackedNVFP4Weight over the buffers), built
        once per set of buffers, without the value checks: what forward runs on."""
        d, s, g = (self._buffers["weight_packed"], self._buffers["weight_scale"],
                   self._buffers["weight_scale_2"])
        v = self._view
        if v is None or v.data is not d or v.scale is not s or v.global_scale is not g:
            shape = (self.out_features, self.in_features)
            v = (PackedNVFP4Weight(d, s, g, shape) if self.layout == "packed"
                 else NVFP4Tensor._unchecked(d, s, g, shape))
            self._view = v
        return v

    def __getstate__(self):
        state = super().__getstate__().copy()
        state["_bound"] = {}  # launches bound to this process's kernels and addresses
        return state

    def _apply(self, fn, recurse=True):
        return keep_format_dtypes(self, super()._apply, fn, recurse, _FORMAT_BUFFERS)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        def keep(t):
            return t if keep_vars else t.detach()

        w = self.weight  # the plain layout (packed: unpacked here)
        destination[prefix + "weight"] = keep(w.data)
        destination[prefix + "weight_scale"] = w.scale_linear()
        destination[prefix + "weight_scale_2"] = keep(self.weight_scale_2)
        if self.input_scale is not None:
            destination[prefix + "input_scale"] = keep(self.input_scale)
        super()._save_to_state_dict(destination, prefix, keep_vars)  # bias

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)  # bias
        keys = {name: prefix + name for name in _CHECKPOINT_KEYS}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in keys.values()]
        mismatched = self._size_mismatches(state_dict, keys)
        if mismatched:  # raised by load_state_dict even with strict=False, as torch does
            error_msgs.extend(mismatched)
            return
        need = ["weight", "weight_scale", "weight_scale_2"]
        if self.mode == "w4a4" and self.input_scale is not None:
            need.append("input_scale")
        absent = [keys[n] for n in need if keys[n] not in state_dict]
        missing_keys.extend(absent)
        if any(keys[n] not in state_dict for n in need[:3]):
            return
        self.load_modelopt(*(state_dict[keys[n]] for n in need[:3]),
                           input_scale=state_dict.get(keys["input_scale"]))

    def _size_mismatches(self, state_dict, keys: dict[str, str]) -> list[str]:
        """torch's "size mismatch" messages for the checkpoint tensors present with the
        wrong shape (packed E2M1 bytes [N, K/2], UE4M3 scales [N, K/16], scalar scales)."""
        n, k = self.out_features, self.in_features
        want = {"weight": (n, k // 2), "weight_scale": (n, k // 16),
                "weight_scale_2": None, "input_scale": None}
        out = []
        for name, shape in want.items():
            t = state_dict.get(keys[name])
            if not isinstance(t, torch.Tensor):
                continue
            if shape is None and t.numel() != 1:
                out.append(f"size mismatch for {keys[name]}: copying a param with shape "
                           f"{t.shape} from checkpoint, {name} is one FP32 value")
            elif shape is not None and tuple(t.shape) != shape:
                out.append(f"size mismatch for {keys[name]}: copying a param with shape "
                           f"{t.shape} from checkpoint, the shape in current model is "
                           f"{torch.Size(shape)} (NVFP4 {n} x {k})")
        return out

    def extra_repr(self) -> str:
        scale = "" if self.mode != "w4a4" else (
            ", input_scale=static" if self.input_scale is not None else ", input_scale=dynamic")
        sched = self.schedule if isinstance(self.schedule, str) else (
            self.schedule.name or self.schedule.label())
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}{scale}, schedule={sched}, "
                f"layout={self.layout}")

    # ------------------------------------------------------------------ forward

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise InputError(f"input has {x.shape[-1] if x.dim() else 0} features "
                             f"(shape {tuple(x.shape)}), the layer expects "
                             f"{self.in_features}")
        if x.dtype not in _ACT_FORMATS:
            raise InputError(f"input must be bfloat16 or float16, got {x.dtype} "
                             "(convert the model's activations, e.g. model.to(torch.bfloat16))")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, NVFP4Tensor) or self.out_scale is not None:
            return self._forward_nvfp4_io(x)
        self._check_input(x)
        if torch.compiler.is_compiling():
            return self._forward_traced(x)
        k, n = self.in_features, self.out_features
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        w = self._stored_weight()
        dev = w.data.get_device()
        if x.get_device() != dev:  # ints: cheaper than comparing torch.device objects
            raise InputError(f"input is on {x.device} but the layer is on {w.data.device}")
        m = x.shape[0] if x.dim() == 2 else x.numel() // k
        if m == 0:
            return x.new_empty((*x.shape[:-1], n))
        if self.mode == "w4a4":
            return self._forward_w4a4(x, w, m, dev)
        # the kernel reads A's and writes C's memory only: an N-D contiguous input and an
        # output of the final shape need no reshape or view (~2 us of host each)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        bound = self._bound.get((m, x.dtype))
        if (bound is None or bound.key[0] is not w or bound.key[1] is not self.schedule
                or not bound.launch(x, w, out)):
            self._launch_w4a16(x, w, m, dev, out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _forward_nvfp4_io(self, x):
        """An NVFP4 input (a W4A4 layer after one that emits NVFP4: used as it is, its
        own global scale in alpha) or an NVFP4 output (:meth:`emit_nvfp4`), through
        ``gemm``'s full path (no binding); the bias is fused in FP32. 2-D [M, K] inputs for
        an NVFP4 one; the NVFP4 output is [M, N]."""
        if torch.compiler.is_compiling():
            raise InputError("NVFP4 inputs and outputs of NVFP4Linear are not supported under "
                             "torch.compile yet (the custom ops take no NVFP4 output)")
        dtype = torch.bfloat16
        if isinstance(x, NVFP4Tensor):
            if self.mode != "w4a4":
                raise InputError("an NVFP4 input needs mode='w4a4' (this layer is "
                                 f"{self.mode}); give it the BF16/FP16 activation")
            a = x
        else:
            self._check_input(x)
            dtype = x.dtype
            x2 = x.reshape(-1, self.in_features)
            a = x2 if self.mode == "w4a16" else quantize_activation(x2, self.input_scale)
        bias = None if self.bias is None else self.bias.float()
        return gemm(a, self._stored_weight(), schedule=self.schedule, out_dtype=dtype,
                    bias=bias, nvfp4_out=self.out_scale)

    def _launch_w4a16(self, x, w, m: int, dev: int, out: torch.Tensor) -> None:
        """The full launch (kernel lookup, checks, workspace), then a binding of it that
        the next calls at this M and dtype launch through (``run.bind``)."""
        from cute_fp4.run import bind, resolution_deadline

        k, n = self.in_features, self.out_features
        fmt, alpha = _ACT_FORMATS[x.dtype], self.weight_scale_2
        kern = _kernel_for(self.schedule, m, n, k, fmt, x.dtype, dev,
                           packed=self.layout == "packed")
        dims = (m, n, k, fmt)
        _run(kern, x, w, alpha, dims, out)
        bound = bind(kern, x, w, out, alpha, dims, (w, self.schedule),
                     resolution_deadline(self.schedule))
        if len(self._bound) >= 64:  # many distinct M (prefill): don't grow forever
            self._bound.clear()
        if bound is not None:
            self._bound[(m, x.dtype)] = bound

    def _forward_w4a4(self, x, w, m: int, dev: int) -> torch.Tensor:
        """Quantize the activation (the fused kernel), then the W4A4 kernel; on a packed
        weight with ``schedule="auto"``, as ``gemm`` does there: the activation's exact
        BF16 block values (static scale: quantized to them in one pass,
        ``quant.quantize_values``; dynamic: quantized, then decoded), then the W4A16
        kernel, the global scales' product as alpha (static: ``self.alpha``, computed
        once; dynamic: per call, by the decoder, or by torch on the codes route). From the
        second call at an M and dtype the launches go through a binding made by the first
        (``quant.BoundActivation`` and ``run.BoundLaunch``)."""
        k, n = self.in_features, self.out_features
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # the quantizer takes [M, K]
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        bound = self._bound.get((m, x.dtype, "w4a4"))
        if bound is None or not self._launch_bound_w4a4(bound, x2, w, out):
            self._launch_w4a4(x2, w, m, dev, out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def _launch_bound_w4a4(self, bound, x2, w, out) -> bool:
        act, gemm = bound
        if (act.key[0] is not self.input_scale or act.key[1] is not self.weight_scale_2
                or gemm.key[0] is not w or gemm.key[1] is not self.schedule
                or gemm.key[2] is not self.alpha):
            return False
        b_ptr = w.data.data_ptr()
        if gemm.accepts(b_ptr) is None:  # e.g. split-K while capturing: the full path
            return False
        # scratch: held until the GEMM is queued behind the activation kernels on this stream
        scratch, a_ptr, sfa_ptr, alpha_ptr = act.launch(x2)  # noqa: F841
        return gemm.launch_ptrs(a_ptr, sfa_ptr or None, b_ptr, out.data_ptr(),
                                alpha_ptr or None)

    def _launch_w4a4(self, x2, w, m: int, dev: int, out: torch.Tensor) -> None:
        """The full W4A4 launches, then their binding."""
        from cute_fp4.run import bind, resolution_deadline

        k, n = self.in_features, self.out_features
        alpha, dynamic = self.alpha, self.input_scale is None  # static: alpha made once
        packed = self.layout == "packed"
        decode = packed and isinstance(self.schedule, str) and self.schedule == "auto"
        if decode and not dynamic:  # the values in one pass
            fmt, a = _ACT_FORMATS[torch.bfloat16], quant.quantize_values(x2, self.input_scale)
        elif decode:  # the decoder writes alpha too
            fmt = _ACT_FORMATS[torch.bfloat16]
            a, alpha = quant.w4a16_operands(quantize_activation(x2, None),
                                            self.weight_scale_2, None)
        else:
            fmt, a = "nvfp4", quantize_activation(x2, self.input_scale)
            if dynamic:  # gemm's own product, made here as the tensor the binding takes
                alpha = alpha_tensor(a, w, None)
        scalar = _device_scalar(self.weight_scale_2, x2.device)
        kern = _kernel_for(self.schedule, m, n, k, fmt, x2.dtype, dev, packed=packed)
        dims = (m, n, k, fmt)
        _run(kern, a, w, alpha, dims, out)
        if dynamic and not scalar:
            return  # alpha from a scale of another dtype or device: the full path
        gemm = bind(kern, a, w, out, alpha, dims, (w, self.schedule, self.alpha),
                    resolution_deadline(self.schedule), a_scale_per_call=not decode)
        act = gemm and quant.BoundActivation.make(
            x2, self.input_scale, decode, (self.input_scale, self.weight_scale_2),
            other_scale=self.weight_scale_2 if dynamic else None)
        if len(self._bound) >= 64:
            self._bound.clear()
        if act is not None:
            self._bound[(m, x2.dtype, "w4a4")] = (act, gemm)

    def _forward_traced(self, x: torch.Tensor) -> torch.Tensor:
        """The forward torch.compile traces: plain tensors into the custom ops."""
        if not isinstance(self.schedule, str):
            raise InputTypeError("under torch.compile, NVFP4Linear's schedule must be a "
                                 "catalogue name or 'auto'")
        k, n = self.in_features, self.out_features
        x2 = x.reshape(-1, k).contiguous()
        ws, gs = self.weight_packed, self.weight_scale_2
        if self.mode == "w4a4":
            a, a_scale, a_gs = quantize_op(x2, self.input_scale)
            alpha = self.alpha if self.alpha is not None else a_gs * gs
        else:
            a, a_scale, alpha = x2, None, gs
        if self.layout == "packed":
            y = mm_packed(a, a_scale, ws, self.weight_scale, alpha, n, k, x.dtype,
                          self.schedule)
        else:
            y = mm(a, a_scale, ws, self.weight_scale, alpha, k, x.dtype, self.schedule)
        if self.bias is not None:
            y.add_(self.bias)  # in y's dtype, as eager
        return y.view(*x.shape[:-1], n)
