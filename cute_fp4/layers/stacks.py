"""Preparing a mixture-of-experts layer's weight stacks (:class:`cute_fp4.layers.Experts`):
their checks (:func:`check_stacks`), ModelOpt's per-expert tensors as a stack
(:func:`modelopt_stack`), the packed layout expert by expert (:func:`pack_by_expert`), the
layout and gate/up group "auto" picks (:func:`pick_layout`, :func:`pick_group`), the stored
views and the experts' biases.
"""

from __future__ import annotations

import torch

from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.formats import NVFP4
from cute_fp4.fused import device_group, interleave_gate_up
from cute_fp4.layers.common import scale_values, where
from cute_fp4.nvfp4 import NVFP4Tensor, swizzle_scales
from cute_fp4.operands import K_MULTIPLE
from cute_fp4.packed import UNIT_K, PackedWeight, pack, packed_class, packed_rows
from cute_fp4.targets import capability_major, reference_mode


def check_stacks(w13, w2, name: str = "") -> tuple[int, int, int]:
    """(E, H, I) of two expert stacks that make a MoE layer; typed errors naming ``name``."""
    for w, what in ((w13, "w13"), (w2, "w2")):
        if not isinstance(w, (BlockTensor, PackedWeight)) or w.experts is None:
            got = type(w).__name__ + (f" of shape {w.shape}" if hasattr(w, "shape") else "")
            hint = (": quantize it first (Experts.from_float takes float weights)"
                    if isinstance(w, torch.Tensor) else "")
            raise InputTypeError(f"{where(name)}{what} must be an NVFP4Tensor expert stack "
                                 f"[E, N, K] or an MXFP4Tensor one (cute_fp4.quantize of a "
                                 f"3-D tensor), got {got}{hint}")
    if w13.fmt is not w2.fmt:
        raise FormatError(f"{where(name)}w13 is {w13.fmt} and w2 is {w2.fmt}: a layer's "
                          "experts take one block format")
    e, n13, h = w13.shape
    e2, h2, i = w2.shape
    if e2 != e or h2 != h or n13 != 2 * i:
        raise FormatError(f"{where(name)}w13 {list(w13.shape)} and w2 {list(w2.shape)} must "
                          "be [E, 2I, H] and [E, H, I]")
    for w, what in ((w13, "w13"), (w2, "w2")):
        if w.global_scale is not None and tuple(w.global_scale.shape) not in ((e,), (e, 1)):
            raise FormatError(f"{where(name)}{what} must have one global scale per expert "
                              f"({e}), got shape {tuple(w.global_scale.shape)}")
    if h % K_MULTIPLE or i % K_MULTIPLE:
        raise FormatError(f"{where(name)}hidden {h} and intermediate {i} must be multiples of "
                          f"{K_MULTIPLE} (16-byte packed FP4 rows; per tensor-parallel rank)")
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
    k = half_k * NVFP4.element.per_byte
    want = (e, n, NVFP4.scale_cols(k))
    if weight_scale.dtype not in (NVFP4.scale.torch_dtype, torch.uint8) or tuple(
            weight_scale.shape) != want:
        raise FormatError(f"{name} weight_scale must be float8_e4m3fn {list(want)} (row-major "
                          f"[E, N, K/{NVFP4.block}]), got {weight_scale.dtype} "
                          f"{tuple(weight_scale.shape)}")
    if weight_scale.device != weight.device:
        raise FormatError(f"{name}: weight is on {weight.device}, weight_scale on "
                          f"{weight_scale.device}")
    raw = weight_scale.contiguous().view(torch.uint8)
    nan, neg = int(((raw & 0x7F) == 0x7F).sum()), int(((raw & 0x80) != 0).sum())
    if nan or neg:
        raise FormatError(f"{name} weight_scale holds {nan} NaN and {neg} negative bytes; "
                          "NVFP4 block scales are finite UE4M3")
    scale_e4m3 = weight_scale.contiguous().view(NVFP4.scale.torch_dtype)
    rp, cp = NVFP4.scale_shape(n, k)
    scale = torch.empty((e, rp, cp), dtype=NVFP4.scale.torch_dtype, device=weight.device)
    for x in range(e):
        scale[x] = swizzle_scales(scale_e4m3[x])
    gs = scale_values(weight_scale_2, f"{name} weight_scale_2").reshape(-1)
    return NVFP4Tensor(weight, scale, gs.to(weight.device), (e, n, k))


def pack_by_expert(w: BlockTensor, group: int | None = None) -> PackedWeight:
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
    return packed_class(w.fmt)(data, scale, w.global_scale, w.shape)


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
                mode: str = "w4a4", name: str | None = None) -> str:
    """"auto": packed on sm_90a (its grouped kernels read it) and for W4A16 on SM12x (the
    grouped stream kernel, its only W4A16 one), when H and I allow it; else plain. On
    sm_90a, where every grouped kernel reads the packed layout, a stack that cannot be
    packed is a FormatError (unless the products run on the exact reference)."""
    packed_in = [isinstance(w, PackedWeight) for w in (w13, w2)]
    if any(packed_in):
        if not all(packed_in) or layout == "plain":
            raise InputError("w13 and w2 must both be plain or both be packed; a packed "
                             "weight takes layout 'packed' or 'auto'")
        return "packed"
    if layout == "auto":
        major = capability_major(dev)
        wants = major == 9 or (major == 12 and mode == "w4a16")
        layout = "packed" if wants and h % UNIT_K == 0 and i % UNIT_K == 0 else "plain"
    if layout == "packed" and (h % UNIT_K or i % UNIT_K):
        raise FormatError(f"{where(name)}the packed layout needs hidden ({h}) and "
                          f"intermediate ({i}) multiples of {UNIT_K}")
    if layout == "plain" and capability_major(dev) == 9 and not reference_mode():
        raise FormatError(f"{where(name)}sm_90a's grouped kernels read the packed layout "
                          f"only, which needs hidden ({h}) and intermediate ({i}) multiples "
                          f"of {UNIT_K} (a tensor-parallel shard of the experts must keep "
                          f"that per rank: use a smaller TP size, or expert parallelism)")
    return layout


def check_biases(biases, e: int, h: int, i: int, dev: torch.device, name: str) -> tuple:
    """The experts' biases ``(gate_up [E, 2I], down [E, H])`` as float32 on ``dev`` (what
    the fused bias reads), or (None, None)."""
    if not isinstance(biases, (tuple, list)) or len(biases) != 2:
        raise InputError(f"{where(name)}biases must be a pair (gate_up, down) of tensors or "
                         "None")
    out = []
    for b, shape, what in ((biases[0], (e, 2 * i), "gate_up bias"),
                           (biases[1], (e, h), "down bias")):
        if b is None:
            out.append(None)
            continue
        if not isinstance(b, torch.Tensor) or not b.is_floating_point() or tuple(
                b.shape) != shape:
            got = (f"{b.dtype} {list(b.shape)}" if isinstance(b, torch.Tensor)
                   else type(b).__name__)
            raise FormatError(f"{where(name)}{what} must be a float tensor {list(shape)}, "
                              f"got {got}")
        out.append(b.detach().to(dev, torch.float32).contiguous())
    return tuple(out)


__all__ = ["check_biases", "check_stacks", "modelopt_stack", "pack_by_expert", "pick_group",
           "pick_layout"]
