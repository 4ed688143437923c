"""The routing of a prepared mixture-of-experts layer (:class:`cute_fp4.layers.Experts`):
the (token, slot) pairs sorted by expert (:func:`route`), the gated activation
(:func:`silu_and_mul`), the weighted combine (:func:`combine`), gpt-oss's top-k softmax
(:func:`softmax_topk`) and a call's intermediates (:class:`Stages`). Conventions: the
docstring of :mod:`cute_fp4.layers.experts`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cute_fp4 import combining, sorting
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import DeviceError, InputError, InputTypeError
from cute_fp4.packed import PackedWeight

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


ROUTE_METHODS = ("auto", "torch", "kernel")


def route(topk_ids: torch.Tensor, num_experts: int, *, validate: bool = False,
          method: str = "auto") -> Routing:
    """Sort the (token, slot) pairs of ``topk_ids`` ``[T, top_k]`` by expert (stable).

    Sync-free and CUDA-graph capturable, on ``topk_ids``' device. ``method``: "torch" (one
    sort, one scatter (the inverse), one division (the tokens) and one ``searchsorted``
    (the offsets): eight small kernels on a GPU), "kernel" (one CTA of
    ``cute_fp4.sorting``, bit for bit the same; an error where it does not apply) or
    "auto": the kernel where :func:`cute_fp4.sorting.kernel_applies` (a CUDA call of at
    most ``sorting.MAX_PAIRS`` pairs and ``sorting.MAX_EXPERTS`` experts, outside reference
    mode and ``torch.compile`` tracing), torch otherwise.
    Expert ids must lie in ``[0, num_experts)``; that is not checked (it would read a GPU
    value) unless ``validate=True`` (tests, debugging: one host sync). An id out of range
    leaves ``offsets`` short of ``T * top_k`` (or ``offsets[0] > 0``): the layer's output is
    then undefined (the kernel writes only inside its outputs too).
    """
    _, k = check_ids(topk_ids, num_experts)
    if method not in ROUTE_METHODS:
        raise InputError(f"method must be one of {ROUTE_METHODS}, got {method!r}")
    flat = topk_ids.reshape(-1)
    if validate and flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_experts:
            raise InputError(f"topk_ids hold expert ids in [{lo}, {hi}], the layer has "
                             f"{num_experts} experts (ids 0..{num_experts - 1})")
    if method != "torch" and sorting.kernel_applies(flat, num_experts):
        return Routing(*sorting.sort_pairs(flat, k, num_experts))
    if method == "kernel":
        raise DeviceError(f"the routing kernel does not apply to {flat.numel()} pairs on "
                          f"{flat.device} over {num_experts} experts (sorting.kernel_applies: "
                          f"the current CUDA device, 1..{sorting.MAX_PAIRS} pairs, "
                          f"1..{sorting.MAX_EXPERTS} experts, no reference mode or "
                          f"torch.compile)")
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
    in sorted order -> ``[T, H]`` in its dtype. The weights are rounded to ``down``'s dtype;
    each product is rounded to float32, the products added in slot order in float32 and
    the sum rounded once: the same bits on every path. On a GPU one kernel
    (:func:`cute_fp4.combining.combine_rows`, where :func:`~cute_fp4.combining.
    kernel_applies`), else torch: a gather, then the products and the sum in that order."""
    if combining.kernel_applies(down, routing.inverse, topk_weights):
        return combining.combine_rows(down, routing.inverse, topk_weights)
    return combine_torch(down, routing.inverse, topk_weights)


def combine_torch(down: torch.Tensor, inverse: torch.Tensor, topk_weights: torch.Tensor
                  ) -> torch.Tensor:
    """:func:`combine` in torch ops on any device: the gather, each slot's products in
    float32 (exact: a product of two 16-bit values fits float32's significand), their sum
    in slot order, one rounding."""
    t, k = topk_weights.shape
    pairs = down.index_select(0, inverse).view(t, k, down.shape[-1]).float()
    terms = pairs * topk_weights.to(down.dtype).float().unsqueeze(-1)
    out = terms[:, 0]
    for j in range(1, k):
        out = out + terms[:, j]
    return out.to(down.dtype)


def expert(w, e: int) -> BlockTensor:
    """Expert ``e`` of an expert stack (a block tensor or its packed weight) as a plain 2-D
    block tensor ``[N, K]``: views of a plain stack; a packed one is unpacked (a copy, and
    its checked constructor reads the global scale: references and loops only)."""
    one = w.expert(e)
    return one.unpack() if isinstance(one, PackedWeight) else one


def softmax_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing (transformers' ``GptOssTopKRouter``): the ``top_k`` largest router
    logits per token (``torch.topk``) and their softmax, in the logits' dtype: ``(topk_ids
    [T, top_k], topk_weights [T, top_k])``, what :class:`Experts` takes."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return ids, torch.softmax(values, dim=1, dtype=values.dtype)


class Stages(NamedTuple):
    """Every intermediate of one call, in sorted (expert) order except ``out``."""

    routing: Routing
    x_sorted: torch.Tensor  # [T*k, H] the gathered activations
    a13: torch.Tensor | BlockTensor  # x_sorted, or its NVFP4 quantization (w4a4)
    gate_up: torch.Tensor  # [T*k, 2I], in w13's row order (interleaved when fused)
    act: torch.Tensor  # [T*k, I]
    a2: torch.Tensor | BlockTensor  # act, or its NVFP4 quantization (w4a4)
    down: torch.Tensor  # [T*k, H]
    out: torch.Tensor  # [T, H]


__all__ = ["ROUTE_METHODS", "Routing", "Stages", "check_ids", "combine", "combine_torch",
           "expert", "route", "silu_and_mul", "softmax_topk"]
