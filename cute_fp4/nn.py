"""The module :class:`NVFP4Linear` and ModelOpt NVFP4 checkpoints (``cute_fp4.convert``,
in ``cute_fp4.conversion``, puts it in a model).

``NVFP4Linear`` is a torch module over a prepared :class:`cute_fp4.layers.Linear` (which
holds the weight in the layout its kernels read and runs every call: modes, layouts,
bindings, ``torch.compile``; its docstring says how): the module registers the layer's
tensors as buffers (packed E2M1 bytes, blocked UE4M3 scales, the FP32 global scale) so that
``.to()``, ``state_dict`` and ``load_state_dict`` work as for ``nn.Linear``, and its
``forward`` is the layer's call. ``mode="w4a16"`` keeps the activations bf16/fp16;
``mode="w4a4"`` quantizes them with the calibrated ``input_scale`` when the layer has one,
else with a per-call amax on the GPU. Weight ``layout``: "plain" (cuBLAS-layout bytes),
"packed" (WGMMA fragment order, ``cute_fp4.packed``: the SM90 ``rs_packed`` and the
``stream`` kernels) or "auto" (``layers.common.resolve_layout``); a packed layer's
``weight`` and ``state_dict`` stay the plain form (unpacked when read or saved, repacked
when loaded).

Checkpoints: the layer's ``state_dict()`` is ModelOpt's NVFP4 form, ``weight`` (uint8
[N, K/2]), ``weight_scale`` (float8_e4m3fn [N, K/16], row-major), ``weight_scale_2`` (FP32,
the decode-form global scale), ``input_scale`` (FP32, when calibrated) and ``bias``, so
``model.load_state_dict(modelopt_state_dict)`` after ``convert`` loads a ModelOpt
checkpoint into the converted layers (in place: CUDA graphs captured before stay valid).
"""

from __future__ import annotations

import torch

from cute_fp4.formats import NVFP4
from cute_fp4.layers import Linear
from cute_fp4.layers.common import LAYOUTS, Mode, mode_of
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import PackedNVFP4Weight

__all__ = ["CHECKPOINT_KEYS", "LAYOUTS", "MODES", "NVFP4Linear", "keep_format_dtypes"]

MODES = (Mode.W4A16, Mode.W4A4)  # a module's mode is explicit ("auto": cute_fp4.layers)
# buffers that hold the NVFP4 encoding: their dtypes never follow module.to(dtype)/half()
_FORMAT_BUFFERS = ("weight_packed", "weight_scale", "weight_scale_2", "input_scale", "alpha",
                   "out_scale")
CHECKPOINT_KEYS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_LAYER_ATTRS = frozenset({"in_features", "out_features", "mode", "layout"})


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
    """``y = x @ W^T (+ bias)`` with ``W`` NVFP4 ``[out_features, in_features]``: a module
    over a :class:`cute_fp4.layers.Linear` (``self.layer``).

    ``weight``: an NVFP4Tensor (``cute_fp4.quantize``, ``NVFP4Tensor.from_modelopt``), or
    a PackedNVFP4Weight (already in fragment order: stored as it is in the packed layout);
    ``mode``: "w4a16" or "w4a4"; ``schedule``: "auto", a catalogue name (both work under
    torch.compile) or a Schedule; ``input_scale``: W4A4's calibrated activation global
    scale (decode form, ``amax / 2688``), None for a dynamic one; ``layout``: "auto",
    "plain" or "packed" (module docstring). The output has the input's dtype (bf16 or
    fp16) and shape ``[..., out_features]``.
    """

    def __init__(self, weight: NVFP4Tensor, bias: torch.Tensor | None = None,
                 mode: str = "w4a16", schedule="auto", input_scale=None, layout: str = "auto",
                 *, layer: Linear | None = None):
        super().__init__()
        if layer is None:
            mode = mode_of(mode, MODES)
            layer = Linear(weight, bias, mode, schedule, input_scale, layout)
        self.layer = layer
        w = layer.stored
        self.register_buffer("weight_packed", w.data, persistent=False)
        self.register_buffer("weight_scale", w.scale, persistent=False)
        self.register_buffer("weight_scale_2", w.global_scale, persistent=False)
        self.register_buffer("input_scale", layer.input_scale, persistent=False)
        self.register_buffer("alpha", layer.alpha, persistent=False)
        # emit_nvfp4: the next W4A4 layer's input scale; forward then returns NVFP4
        self.register_buffer("out_scale", layer.out_scale, persistent=False)
        self.bias = (None if layer.bias is None else
                     torch.nn.Parameter(layer.bias, requires_grad=False))
        self._give_layer()

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
        docstring). ``mode`` None: "w4a4" when ``input_scale`` is given, else "w4a16";
        "auto": ``layers.resolve_mode``."""
        if mode is None:
            mode = "w4a16" if input_scale is None else "w4a4"
        return cls(None, layer=Linear.from_modelopt(weight, weight_scale, weight_scale_2,
                                                    input_scale, bias, mode=mode,
                                                    layout=layout, schedule=schedule))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if ((name in _FORMAT_BUFFERS or name == "bias") and "layer" in self.__dict__
                and "out_scale" in self._buffers):
            self._give_layer()  # a buffer replaced by assignment: the layer runs on it

    def _give_layer(self) -> None:
        """The layer holds the module's buffers (after they were made or moved)."""
        b = self._buffers
        self.layer.adopt(b["weight_packed"], b["weight_scale"], b["weight_scale_2"],
                         b["input_scale"], b["alpha"], b["out_scale"], self.bias)

    def _take_layer(self) -> None:
        """The module's buffers are the layer's scale tensors (after the layer made one)."""
        lay = self.layer
        self._buffers["input_scale"], self._buffers["alpha"] = lay.input_scale, lay.alpha
        self._buffers["out_scale"] = lay.out_scale

    def load_modelopt(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2,
                      input_scale=None) -> None:
        """Overwrite the weight (and the calibrated input scale, when given) in place with
        a ModelOpt checkpoint's tensors; the buffers keep their addresses."""
        self.layer.load_modelopt(weight, weight_scale, weight_scale_2, input_scale)
        self._take_layer()

    def set_input_scale(self, input_scale) -> None:
        """Set the calibrated activation global scale (decode form, ``amax / 2688``) in
        place; a W4A4 layer then quantizes with it (one kernel) instead of a per-call amax.
        The value is checked here (a GPU value is read: one sync), never in forward."""
        self.layer.set_input_scale(input_scale)
        self._take_layer()

    def emit_nvfp4(self, next_input_scale) -> None:
        """Make forward return its output as NVFP4 quantized with ``next_input_scale`` (the
        following W4A4 layer's static input scale, decode form): the GEMM's epilogue writes
        it (``gemm(..., nvfp4_out=)``: the bytes ``quantize`` gives for the output rounded
        to BF16), so that layer, which takes an NVFP4Tensor input as it is, needs no
        quantize kernel. None: back to a BF16/FP16 output. The NVFP4 output needs a tile
        that writes NVFP4 (``docs/fused.md``): a plain-layout weight on sm_90a."""
        self.layer.emit_nvfp4(next_input_scale)
        self._take_layer()

    # ------------------------------------------------------------------ views, state

    def __getattr__(self, name: str):
        """The layer's sizes and choices (``in_features``, ``out_features``, ``mode``,
        ``layout``): read from ``self.layer``, never copied."""
        if name in _LAYER_ATTRS and "layer" in self.__dict__:
            return getattr(self.__dict__["layer"], name)
        return super().__getattr__(name)

    @property
    def schedule(self):
        return self.layer.schedule

    @schedule.setter
    def schedule(self, schedule) -> None:
        from cute_fp4.layers.common import check_schedule

        check_schedule(schedule)
        self.layer.schedule = schedule  # the bindings hold the old one: not matched again

    @property
    def weight(self) -> NVFP4Tensor:
        """The weight as an NVFP4Tensor (plain layout: over the buffers, built once without
        the value checks; ``layout="packed"``: unpacked, a copy each time, which forward
        never uses)."""
        return self.layer.weight

    @property
    def stored_weight(self) -> NVFP4Tensor | PackedNVFP4Weight:
        """The weight as stored (over the buffers): what forward runs on."""
        return self.layer.stored

    def _apply(self, fn, recurse=True):
        keep_format_dtypes(self, super()._apply, fn, recurse, _FORMAT_BUFFERS)
        self._give_layer()
        return self

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
        keys = {name: prefix + name for name in CHECKPOINT_KEYS}
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
        want = {"weight": (n, NVFP4.data_row_bytes(k)), "weight_scale": (n, NVFP4.scale_cols(k)),
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
        return self.layer.describe()

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)
