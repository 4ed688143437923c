"""Host side of the fused epilogue operations (``Epilogue.ops``, kernels/epilogue.py).

``"silu_mul"`` reads a gate/up weight whose rows interleave the two projections in groups
of ``G`` rows (``G = plan.silu_group(schedule)``: 8 on sm_90a, 32 for SM120's block-scaled
MMA), so that one thread of the MMA holds a gate value and its up value::

    natural [gate 0 .. I-1 ; up 0 .. I-1]  (vLLM's w13, Qwen3's gate_proj then up_proj)
    interleaved rows 2Gj .. 2Gj+G-1 = gate rows Gj .. Gj+G-1,
                rows 2Gj+G .. 2Gj+2G-1 = up rows Gj .. Gj+G-1

:func:`interleave_gate_up` puts a weight (torch, NVFP4, or an expert stack of either) in
that order once, at load; :func:`silu_mul_unfused` is the pipeline the fused epilogue
replaces (the GEMM's output in its own dtype, then ``F.silu(gate) * up`` in that dtype),
against which the fused output is compared bit for bit.

``"swiglu_oai"`` (gpt-oss's clamped SwiGLU) reads the same interleaved order;
:func:`swiglu_oai_unfused` is its pipeline, transformers' ``GptOssExperts._apply_gate`` on
the GEMM's output in its own dtype. gpt-oss checkpoints store ``gate_up_proj`` with gate
and up rows alternating (gate ``2i``, up ``2i + 1``: groups of 1), and its bias the same
way: :func:`regroup_gate_up` puts a weight or a bias into the kernels' groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cute_fp4 import packed as pk
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import InputError
from cute_fp4.nvfp4 import swizzle_scales, unswizzle_scales
from cute_fp4.schedule import SWIGLU_ALPHA, SWIGLU_LIMIT
from cute_fp4.targets import capability_major

__all__ = ["device_group", "gate_up_order", "interleave_gate_up", "interleave_stored",
           "natural_gate_up", "deinterleave_gate_up", "regroup_gate_up", "silu_mul_unfused",
           "swiglu_oai_unfused"]


def device_group(device: torch.device, layout: str) -> int:
    """Gate/up rows per group for a weight in ``layout`` ("plain" or "packed") on the CUDA
    ``device``: ``planning.common.silu_group`` of the kernels that read it there (8 on
    sm_90a and for the packed layout's kernels, rs_packed and stream, on either family; 32
    for SM12x's block-scaled MMA on the plain layout)."""
    major = capability_major(device)
    return 8 if major == 9 or layout == "packed" else 32


def gate_up_order(n: int, group: int, device=None) -> torch.Tensor:
    """Row ``p`` of the interleaved weight is row ``order[p]`` of the natural ``[gate; up]``
    one (``n`` = 2I rows, I a multiple of ``group``)."""
    if n % (2 * group):
        raise InputError(f"a gate/up weight of {n} rows does not split into gate/up groups of "
                         f"{group} rows: its rows must be a multiple of {2 * group}")
    half = n // 2
    p = torch.arange(n, device=device)
    block, q = p // (2 * group), p % (2 * group)
    return torch.where(q < group, block * group + q, half + block * group + (q - group))


def interleave_gate_up(w, group: int):
    """``w`` (``[2I, K]`` or an expert stack ``[E, 2I, K]``: a torch tensor or a block
    tensor, NVFP4 or MXFP4, block scales moved with their rows) in the interleaved order."""
    return _reorder_rows(w, gate_up_order(w.shape[-2], group), "interleave_gate_up")


def _reorder_rows(w, order: torch.Tensor, name: str):
    """Row ``p`` of the result is row ``order[p]`` of ``w`` (a torch tensor: along dim -2; a
    block tensor: its codes and their scales)."""
    if isinstance(w, torch.Tensor):
        return w.index_select(-2, order.to(w.device)).contiguous()
    if not isinstance(w, BlockTensor):
        raise InputError(f"{name} takes a torch tensor or an NVFP4Tensor/MXFP4Tensor, got "
                         f"{type(w).__name__}")
    order = order.to(w.data.device)
    data = w.data.index_select(-2, order).contiguous()
    linear = w.scale_linear().index_select(-2, order)
    if w.experts is None:
        scale = swizzle_scales(linear)
    else:
        scale = torch.stack([swizzle_scales(s) for s in linear])
    return type(w)._checked(data, scale, w.global_scale, w.shape)


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor, group: int) -> torch.Tensor:
    """Natural gate rows and up rows (``[r, C]`` each, ``r`` a multiple of ``group``) ->
    ``[2r, C]`` in the interleaved order."""
    r, c = gate.shape
    return torch.stack([gate.reshape(r // group, group, c), up.reshape(r // group, group, c)],
                       1).reshape(2 * r, c)


def interleave_stored(gate_data: torch.Tensor, up_data: torch.Tensor, gate_scale: torch.Tensor,
                      up_scale: torch.Tensor, shape: tuple[int, int], group: int,
                      packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of the interleaved ``[2I, K]`` gate_up weight, made from gate's and
    up's tensors as an ``NVFP4Linear`` stores them (``shape`` ``(I, K)`` each; bytes plain
    ``[I, K/2]``, or in fragment order when ``packed``; blocked scales), with the bits
    :func:`interleave_gate_up` (and ``cute_fp4.packed.pack``) give the concatenation. The
    bytes are done a chunk of whole units at a time (``cute_fp4.packed``): beside the
    inputs and the result, only one chunk's temporaries exist, where the whole weight's
    would be several times its size on the GPU a model is loaded onto."""
    rows, k = shape
    if rows % group:
        raise InputError(f"{rows} gate rows do not split into gate/up groups of {group}")
    half_k = k // 2
    out = torch.empty((pk.packed_rows(2 * rows) if packed else 2 * rows, half_k),
                      dtype=torch.uint8, device=gate_data.device)
    step = pk.chunk_rows(half_k)
    for r in range(0, rows, step):
        r1 = min(r + step, rows)
        if packed:
            g = pk.unpack(gate_data[r:pk.packed_rows(r1)], r1 - r)
            u = pk.unpack(up_data[r:pk.packed_rows(r1)], r1 - r)
            both = pk.pack(_interleave_rows(g, u, group))
        else:
            both = _interleave_rows(gate_data[r:r1], up_data[r:r1], group)
        out[2 * r:2 * r + both.shape[0]] = both
    linear = _interleave_rows(unswizzle_scales(gate_scale, rows, k),
                              unswizzle_scales(up_scale, rows, k), group)
    return out, swizzle_scales(linear.contiguous())


def natural_gate_up(w, group: int):
    """The inverse of :func:`interleave_gate_up`: an interleaved weight (rows) back in the
    natural ``[gate; up]`` order."""
    return _reorder_rows(w, _inverse(gate_up_order(w.shape[-2], group)), "natural_gate_up")


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return inverse


def regroup_gate_up(w, group: int, source_group: int = 1, dim: int = -2):
    """``w`` with its gate/up rows (``dim`` -2: a weight ``[.., 2I, K]``, torch or block
    tensor) or entries (``dim`` -1: a bias ``[.., 2I]``) interleaved in groups of
    ``source_group`` (gpt-oss's alternating gate and up: 1) put into groups of ``group``
    (the kernels', :func:`device_group`)."""
    if dim not in (-1, -2):
        raise InputError(f"regroup_gate_up reorders rows (dim -2) or a bias (dim -1 of a "
                         f"torch tensor), got dim {dim}")
    n = w.shape[dim]
    order = _inverse(gate_up_order(n, source_group))[gate_up_order(n, group)]
    if dim == -1 and isinstance(w, torch.Tensor):
        return w.index_select(-1, order.to(w.device)).contiguous()
    if dim != -2:
        raise InputError(f"regroup_gate_up reorders rows (dim -2) or a bias (dim -1 of a "
                         f"torch tensor), got dim {dim}")
    return _reorder_rows(w, order, "regroup_gate_up")


def _gate_up_views(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views ``[..., I / G, G]`` of the gate and the up columns of an interleaved
    ``[..., 2I]`` (column ``2Gj + i`` is gate ``Gj + i``, ``2Gj + G + i`` its up): in the
    natural order once flattened, without a copy."""
    *lead, n = t.shape
    if n % (2 * group):
        raise InputError(f"{n} gate/up columns do not split into groups of {group}: they "
                         f"must be a multiple of {2 * group}")
    v = t.reshape(*lead, n // (2 * group), 2, group)
    return v[..., 0, :], v[..., 1, :]


def deinterleave_gate_up(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) columns, in natural order, of a GEMM output ``[..., 2I]`` computed with an
    interleaved weight."""
    gate, up = _gate_up_views(t, group)
    half = t.shape[-1] // 2
    return gate.reshape(*t.shape[:-1], half), up.reshape(*t.shape[:-1], half)


def swiglu_oai_unfused(gate_up: torch.Tensor, group: int) -> torch.Tensor:
    """What ``"swiglu_oai"`` fuses: transformers' ``GptOssExperts._apply_gate`` (gate
    clamped above at 7, up clamped to [-7, 7], ``(up + 1) * gate * sigmoid(1.702 gate)``)
    in ``gate_up``'s dtype, on the GEMM's output with gate/up interleaved in groups of
    ``group`` (the fused output has the same bits, on CUDA)."""
    gate, up = _gate_up_views(gate_up, group)
    gate = gate.clamp(min=None, max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    glu = gate * torch.sigmoid(gate * SWIGLU_ALPHA)
    return ((up + 1) * glu).reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul_unfused(gate_up: torch.Tensor, group: int) -> torch.Tensor:
    """What ``"silu_mul"`` fuses: ``F.silu(gate) * up`` in ``gate_up``'s dtype, from the
    GEMM's interleaved output (the fused output has the same bits): one pass over strided
    views, no reordering copy."""
    gate, up = _gate_up_views(gate_up, group)
    return (F.silu(gate) * up).reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
