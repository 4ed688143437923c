"""What the prepared layers share: the mode and layout rules, schedule and scale checks.

``mode``: "w4a16" (16-bit activations), "w4a4" (activations quantized to NVFP4 by the fused
kernel) or "auto" (:func:`resolve_mode`). ``layout``: "plain" (the checkpoint's row-major
bytes), "packed" (WGMMA fragment order, ``cute_fp4.packed``) or "auto"
(:func:`resolve_layout`).
"""

from __future__ import annotations

import difflib
import math
import numbers

import torch

from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.formats import NVFP4, BlockFormat
from cute_fp4.operands import A_FORMATS
from cute_fp4.packed import UNIT_K, PackedWeight, packed_class, tensor_class
from cute_fp4.schedule import Choice
from cute_fp4.targets import capability_major


class Mode(Choice):
    """How a layer computes: W4A16 (16-bit activations on the 4-bit weight), W4A4 (the
    activations quantized to NVFP4 per call), or "auto" (:func:`resolve_mode`)."""

    AUTO = "auto"
    W4A16 = "w4a16"
    W4A4 = "w4a4"


class Layout(Choice):
    """Where a layer keeps its weight: the plain (cuBLAS) layout, the fragment-order packed
    one (``cute_fp4.packed``), or "auto" (what the GPU's kernels read)."""

    AUTO = "auto"
    PLAIN = "plain"
    PACKED = "packed"


MODES = tuple(Mode)
LAYOUTS = tuple(Layout)


def mode_of(mode: object, allowed: tuple[Mode, ...] = MODES, field: str = "mode") -> Mode:
    """``mode`` (a :class:`Mode` or its string) as a Mode of ``allowed``; an InputError
    naming ``field``, the allowed modes and the closest one otherwise."""
    try:
        got = Mode.of(mode, field)
    except InputError:
        got = None
    if got not in allowed:
        values = [m.value for m in allowed]
        close = difflib.get_close_matches(str(mode).lower(), values, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"{field} must be one of {', '.join(map(repr, values))}, got "
                         f"{mode!r}{hint}")
    return got
ACT_FORMATS = A_FORMATS  # 16-bit activations: their format names


def resolve_mode(mode: str, device: torch.device, has_input_scales: bool) -> Mode:
    """"auto": W4A4 where the GPU has FP4 MMA (SM12x) and the checkpoint has input scales,
    else W4A16; "w4a16" and "w4a4" as given (a :class:`Mode` or its string)."""
    mode = mode_of(mode)
    if mode is not Mode.AUTO:
        return mode
    return Mode.W4A4 if capability_major(device) == 12 and has_input_scales else Mode.W4A16


def resolve_format_mode(mode: str, device: torch.device, has_input_scales: bool,
                        fmt: BlockFormat = NVFP4, name: str = "") -> Mode:
    """:func:`resolve_mode` for a weight of block format ``fmt``: a format other than NVFP4
    runs W4A16 ("auto" is W4A16; "w4a4" a FormatError: the layers' fused activation
    quantizer writes NVFP4 only; ``gemm(quantize(x, format=...), w)`` runs W4A4 on
    SM12x)."""
    if fmt is NVFP4:
        return resolve_mode(mode, device, has_input_scales)
    if mode_of(mode) is Mode.W4A4:
        raise FormatError(f"{where(name)}{fmt} layers run W4A16 (bfloat16 activations): the "
                          "fused activation quantizer writes NVFP4 only; "
                          f"cute_fp4.gemm(cute_fp4.quantize(x, format='{fmt}'), w) runs W4A4 "
                          "on SM12x")
    return Mode.W4A16


def mxfp4_tensor(blocks, scales, lead: tuple[str, ...], prefix: str, context: str = ""):
    """An MXFP4 weight (``lead`` ``("N",)``) or expert stack (``("E", "N")``) from a
    checkpoint's ``*_blocks`` ``[*lead, K/32, 16]`` and ``*_scales`` ``[*lead, K/32]``
    (:meth:`~cute_fp4.mxfp4.MXFP4Tensor.from_blocks`). Errors name ``<prefix>blocks`` /
    ``<prefix>scales``; those of the values are prefixed with ``context``."""
    from cute_fp4.formats import MXFP4
    from cute_fp4.mxfp4 import MXFP4Tensor

    for t, key in ((blocks, "blocks"), (scales, "scales")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{prefix}{key} must be a torch.Tensor, got "
                                 f"{type(t).__name__}")
    if blocks.dim() != len(lead) + 2:
        raise FormatError(f"{prefix}blocks must be uint8 [{', '.join(lead)}, "
                          f"K/{MXFP4.block}, {MXFP4.block // 2}], got {blocks.dtype} "
                          f"{list(blocks.shape)}")
    try:
        return MXFP4Tensor.from_blocks(blocks, scales)
    except FormatError as e:
        raise FormatError(f"{context}{e}") from None


def stored_view(data, scale, global_scale, shape, layout: str, fmt: BlockFormat = NVFP4):
    """The stored weight (``[N, K]``) or expert stack (``[E, N, K]``) of block format ``fmt``
    over its tensors, plain or packed by ``layout`` (no value checks: they were checked
    once)."""
    if layout == "packed":
        return packed_class(fmt)(data, scale, global_scale, shape)
    return tensor_class(fmt)._unchecked(data, scale, global_scale, shape)


def check_layout_format(layout: str, fmt: BlockFormat, device: torch.device,
                        name: str = "") -> None:
    """A weight layout the present GPU's kernels take for ``fmt``: sm_90a decodes
    non-NVFP4 scales (MXFP4's UE8M0) in the packed layout's kernels only (rs_packed,
    stream)."""
    if fmt is not NVFP4 and layout == "plain" and capability_major(device) == 9:
        raise FormatError(f"{where(name)}{fmt} weights run on sm_90a in the packed layout "
                          f"only (its in_features, or hidden and intermediate, must be "
                          f"multiples of {UNIT_K}); got layout='plain'")


def reads_packed(schedule) -> bool:
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


def resolve_layout(layout: str, mode: str, k: int, device: torch.device,
                   schedule="auto") -> Layout:
    """"auto" -> "packed" when K allows it and the schedule reads that layout ("auto" or an
    rs_packed or stream schedule): on an SM90 GPU (W4A4 then decodes the activation once
    and runs the W4A16 kernel) and for W4A16 on SM12x (the stream kernel, its W4A16
    kernel); else "plain" (SM12x W4A4: the block-scaled MMA)."""
    layout = Layout.of(layout, "layout")
    if layout == "packed" and k % UNIT_K:
        raise FormatError(f"layout='packed' needs in_features to be a multiple of {UNIT_K}, "
                          f"got {k}: use layout='plain'")
    if layout is not Layout.AUTO:
        return layout
    major = capability_major(device)
    wants = major == 9 or (mode == Mode.W4A16 and major == 12)
    packs = wants and k % UNIT_K == 0 and reads_packed(schedule)
    return Layout.PACKED if packs else Layout.PLAIN


def check_schedule(schedule) -> None:
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


def scalar(value, name: str, device) -> torch.Tensor:
    """A positive finite FP32 scale as a 0-d tensor on ``device`` (checked once, at
    preparation or load: reading a GPU value synchronises)."""
    t = scale_values(value, name)
    if t.numel() != 1:
        raise FormatError(f"{name} must be a scalar, got {t.numel()} elements "
                          f"(shape {tuple(t.shape)})")
    v = float(t)
    if not (v > 0 and math.isfinite(v)):
        raise FormatError(f"{name} must be finite and > 0, got {v:g}")
    return t.reshape(()).to(device)


def scale_values(value, name: str) -> torch.Tensor:
    """Scales given as a number, a list of numbers or a real tensor holding data, as a
    float32 tensor of their shape with at least one value; anything else is a typed error
    naming ``name`` (before torch sees it)."""
    def number(v) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise FormatError(f"{name} must be real values with data, got {value.dtype} on "
                              f"{value.device}")
    elif not (number(value) or (isinstance(value, list | tuple) and all(map(number, value)))):
        raise InputTypeError(f"{name} must be a float, a list of floats or a float32 tensor, "
                             f"got {type(value).__name__}")
    t = torch.as_tensor(value, dtype=torch.float32)
    if t.numel() == 0:
        raise FormatError(f"{name} holds no value (shape {tuple(t.shape)})")
    return t


def where(name: str) -> str:
    """A message prefix naming the layer (``name``), or nothing."""
    return f"{name}: " if name else ""


def check_weight(weight, name: str = "") -> None:
    """One block-scaled weight matrix (an NVFP4Tensor or MXFP4Tensor, or its packed form),
    not an expert stack."""
    if not isinstance(weight, (BlockTensor, PackedWeight)):
        raise InputTypeError(f"{where(name)}weight must be an NVFP4Tensor or MXFP4Tensor, got "
                             f"{type(weight).__name__}")
    if weight.experts is not None:
        raise InputError(f"{where(name)}weight must be one [out_features, in_features] "
                         f"matrix, got an expert stack {list(weight.shape)}: one layer per "
                         "expert (weight.expert(e)), or cute_fp4.layers.Experts for the stack")


def check_modelopt(name: str, n: int, k: int, weight, weight_scale, weight_scale_2,
                   input_scale=None) -> None:
    """ModelOpt tensors of one layer against the layer ``name`` (out_features ``n``,
    in_features ``k``) they fill, the weight first (a weight of the wrong K is the
    weight's fault, not its scale's): typed errors naming the layer, what it needs and
    what came. Nothing may change a layer's declared size."""
    at = f"{f'layer {name}' if name else 'the layer'} (out_features={n}, in_features={k})"
    tensors = (("weight", weight, (torch.uint8,), (n, NVFP4.data_row_bytes(k)), "K/2"),
               ("weight_scale", weight_scale, (NVFP4.scale.torch_dtype, torch.uint8),
                (n, NVFP4.scale_cols(k)), f"K/{NVFP4.block}"))
    for key, t, dtypes, shape, last in tensors:
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{at}: {key} must be a torch.Tensor, got "
                                 f"{type(t).__name__}")
        if t.dtype not in dtypes or tuple(t.shape) != shape:
            want, got = (str(d).removeprefix("torch.") for d in (dtypes[0], t.dtype))
            raise FormatError(f"{at}: {key} must be {want} [N, {last}] = {list(shape)}, "
                              f"got {got} {list(t.shape)}")
    for key, v in (("weight_scale_2", weight_scale_2), ("input_scale", input_scale)):
        if isinstance(v, torch.Tensor) and (not v.is_floating_point() or v.numel() != 1):
            raise FormatError(f"{at}: {key} must be one float32 value, got {v.dtype} "
                              f"{list(v.shape)}")


__all__ = ["ACT_FORMATS", "LAYOUTS", "MODES", "Layout", "Mode", "check_layout_format",
           "check_modelopt", "check_schedule", "check_weight", "mode_of", "mxfp4_tensor",
           "reads_packed", "resolve_format_mode", "resolve_layout", "resolve_mode", "scalar",
           "scale_values", "stored_view", "where"]
