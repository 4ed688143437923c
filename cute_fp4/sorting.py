"""The routing sort of a mixture-of-experts call on the GPU: the four outputs of
:func:`cute_fp4.layers.routing.route` (``order``, ``inverse``, ``token``, ``offsets``) from
one CuTe DSL kernel (``cute_fp4.kernels.route``, one CTA) instead of torch's eight small
kernels (sort, arange, scatter, division, arange, searchsorted), for calls of at most
:data:`MAX_PAIRS` (token, slot) pairs and :data:`MAX_EXPERTS` experts: decode.

:func:`kernel_applies` is the choice ``route`` makes, from host facts only (device, sizes,
mode; no GPU value is read); :func:`sort_pairs` launches on the current stream, no host
synchronisation, CUDA-graph capturable. Kernels compile once per (target, id dtype) and
go through the package's disk cache like the activation kernels (``cute_fp4.quant``).
"""

from __future__ import annotations

import torch

from cute_fp4.errors import InputError
from cute_fp4.quant import (
    CompiledSpecKernel,
    cross_compile_spec,
    memo_spec_kernel,
    target_of,
)
from cute_fp4.targets import reference_mode

# One CTA of 256 threads, at most 4 rounds of 32 pairs per warp, an (E + 2) x 8 int32
# histogram in shared memory (32.9 KB at 1,024 experts): gpt-oss (32, 128 experts),
# Qwen3 (128) and DeepSeek (256) up to 128 tokens at top-8.
MAX_PAIRS = 1024
MAX_EXPERTS = 1024
_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def fits(pairs: int, num_experts: int) -> bool:
    """Whether a call of ``pairs`` (T * top_k) pairs over ``num_experts`` experts is within
    the kernel's limits (an empty call is not: torch's path returns it)."""
    return 1 <= pairs <= MAX_PAIRS and 1 <= num_experts <= MAX_EXPERTS


def kernel_applies(ids: torch.Tensor, num_experts: int) -> bool:
    """Whether ``route`` sorts the int ``ids`` (any shape; T * top_k elements) by the
    kernel: a CUDA tensor on the current device (the launch takes its stream) of a GPU with
    kernels here, within :func:`fits`, outside ``targets.reference_mode`` and outside
    ``torch.compile`` tracing (which keeps torch's ops; checked first, so that dynamo
    traces nothing else here). Host facts only."""
    if torch.compiler.is_compiling():
        return False
    if ids.device.type != "cuda" or not fits(ids.numel(), num_experts) or reference_mode():
        return False
    index = ids.device.index
    return index == torch.cuda.current_device() and target_of(index) is not None


# ----------------------------------------------------------------------------- compile

class CompiledRoute(CompiledSpecKernel):
    """The compiled routing kernel of one (target, id dtype)."""

    def launch(self, ids, order, inverse, token, offsets, k: int) -> None:
        self._call(ids.device.index, ids, order, inverse, token, offsets, k)


def default_spec(target: str, id_dtype: str = "int64"):
    """The ``RouteSpec`` :func:`sort_pairs` runs on ``target`` (limits of this module)."""
    from cute_fp4.kernels.route import RouteSpec
    from cute_fp4.targets import get_target

    return RouteSpec(target=get_target(target).name, id_dtype=id_dtype, threads=256,
                     max_pairs=MAX_PAIRS, max_experts=MAX_EXPERTS)


def route_kernel(spec):
    """The kernel object of ``spec`` (imported on first use: no DSL import at import time)."""
    from cute_fp4.kernels.route import RouteKernel

    return RouteKernel(spec)


def cross_compile_route(spec, dump_dir: str | None = None):
    """Compile for ``spec.target`` without a GPU (CI), through the build cache with
    ``dump_dir`` (``quant.cross_compile_spec``). Returns (compiled or None, seconds)."""
    return cross_compile_spec(route_kernel(spec), dump_dir)


_KERNELS: dict[tuple[int, torch.dtype], CompiledRoute] = {}


def _kernel_for(index: int, dtype: torch.dtype) -> CompiledRoute:
    return memo_spec_kernel(_KERNELS, (index, dtype), index,
                            lambda target: route_kernel(default_spec(target, _DTYPES[dtype])),
                            CompiledRoute)


# ----------------------------------------------------------------------------- public

def sort_pairs(ids: torch.Tensor, top_k: int, num_experts: int, out: tuple | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inverse, token, offsets) of ``ids`` (int32/int64, ``T * top_k`` elements in
    pair order) by the kernel: ``Routing``'s fields, bit for bit torch's with every id in
    ``[0, num_experts)`` (``cute_fp4.kernels.route`` for ids outside). ``out``: those four
    tensors to overwrite (contiguous int64 ``[T * top_k]`` x 3 and int32 ``[E + 1]`` on
    ``ids``' device), else allocated. The caller checked :func:`kernel_applies`; the sizes
    are checked again here (host ints)."""
    n = ids.numel()
    if ids.dtype not in _DTYPES or not fits(n, num_experts) or top_k < 1 or n % top_k:
        raise InputError(f"the routing kernel takes {ids.dtype} ids of {n} pairs (top_k "
                         f"{top_k}), {num_experts} experts: int32/int64, 1..{MAX_PAIRS} "
                         f"pairs in whole tokens, 1..{MAX_EXPERTS} experts")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    dev = flat.device
    shapes = ((n, torch.int64),) * 3 + ((num_experts + 1, torch.int32),)
    if out is None:
        out = tuple(torch.empty(m, dtype=dt, device=dev) for m, dt in shapes)
    else:
        _check_out(out, shapes, dev)
    _kernel_for(dev.index, flat.dtype).launch(flat, *out, top_k)
    return tuple(out)


def _check_out(out, shapes, dev: torch.device) -> None:
    names = ("order", "inverse", "token", "offsets")
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        raise InputError(f"out must be a tuple of 4 tensors {names}, got {type(out).__name__}")
    for t, name, (m, dt) in zip(out, names, shapes, strict=True):
        if (not isinstance(t, torch.Tensor) or t.dtype != dt or t.dim() != 1
                or t.numel() != m or not t.is_contiguous() or t.device != dev):
            raise InputError(f"out's {name} must be a contiguous {dt} [{m}] tensor on {dev}")
    ptrs = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    if any(a[1] > b[0] for a, b in zip(ptrs, ptrs[1:])):
        raise InputError("out's four tensors overlap")


__all__ = ["MAX_EXPERTS", "MAX_PAIRS", "CompiledRoute", "cross_compile_route", "default_spec",
           "fits", "kernel_applies", "route_kernel", "sort_pairs"]
