"""The combine of a mixture-of-experts call on the GPU: ``out[t] = sum_j w[t, j] *
down[inverse[t * k + j]]`` (:func:`cute_fp4.layers.routing.combine`) from one CuTe DSL
kernel (``cute_fp4.kernels.combine``) instead of torch's gather and batched matmul, with
programmatic dependent launch after the down GEMM.

:func:`kernel_applies` is the choice ``combine`` makes, from host facts only (device,
dtypes, sizes, mode; no GPU value is read); :func:`combine_rows` launches on the current
stream, no host synchronisation, CUDA-graph capturable. Kernels compile once per (target,
dtype) and go through the package's disk cache like the routing sort (``cute_fp4.sorting``).
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

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
MAX_ROWS = 1 << 20  # T * top_k at most: int32 indexing of the rows inside the kernel


def kernel_applies(down: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``combine`` runs the kernel on these tensors: CUDA tensors on the current
    device of a GPU with kernels here, ``down`` a contiguous 16-bit ``[T * k, H]`` with ``H``
    a multiple of 8 and 16-byte aligned, ``inverse`` int64, outside ``targets.reference_mode``
    and ``torch.compile`` tracing (checked first: dynamo traces nothing else here). Host
    facts only."""
    if torch.compiler.is_compiling() or reference_mode():
        return False
    if (down.device.type != "cuda" or down.dtype not in _DTYPES or down.dim() != 2
            or down.shape[1] % 8 or not down.is_contiguous() or down.data_ptr() % 16
            or not 0 < down.shape[0] <= MAX_ROWS or inverse.dtype != torch.int64
            or weights.dim() != 2 or weights.numel() != down.shape[0]):
        return False
    index = down.device.index
    return index == torch.cuda.current_device() and target_of(index) is not None


# ----------------------------------------------------------------------------- compile

class CompiledCombine(CompiledSpecKernel):
    """The compiled combine kernel of one (target, dtype)."""

    def launch(self, down, inverse, weights, out, k: int) -> None:
        self._call(down.device.index, down, inverse, weights, out, k)


def default_spec(target: str, dtype: str = "bfloat16"):
    """The ``CombineSpec`` :func:`combine_rows` runs on ``target``."""
    from cute_fp4.kernels.combine import CombineSpec
    from cute_fp4.targets import get_target

    return CombineSpec(target=get_target(target).name, dtype=dtype)


def combine_kernel(spec):
    """The kernel object of ``spec`` (imported on first use: no DSL import at import time)."""
    from cute_fp4.kernels.combine import CombineKernel

    return CombineKernel(spec)


def cross_compile_combine(spec, dump_dir: str | None = None):
    """Compile for ``spec.target`` without a GPU (CI), through the build cache with
    ``dump_dir`` (``quant.cross_compile_spec``). Returns (compiled or None, seconds)."""
    return cross_compile_spec(combine_kernel(spec), dump_dir)


_KERNELS: dict[tuple[int, torch.dtype], CompiledCombine] = {}


def _kernel_for(index: int, dtype: torch.dtype) -> CompiledCombine:
    return memo_spec_kernel(_KERNELS, (index, dtype), index,
                            lambda target: combine_kernel(default_spec(target, _DTYPES[dtype])),
                            CompiledCombine)


# ----------------------------------------------------------------------------- public

def combine_rows(down: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, H]`` in ``down``'s dtype: each token's ``k`` rows of ``down`` (``inverse[t * k +
    j]``) times ``weights[t, j]`` (rounded to ``down``'s dtype first), summed in slot order
    in float32 and rounded once, by the kernel (``out``: a contiguous, 16-byte aligned
    ``[T, H]`` tensor of that dtype to write, else one is allocated). The caller checked
    :func:`kernel_applies`; the sizes are checked again here (host ints), before anything
    is written."""
    t, k = weights.shape
    p, h = down.shape
    if p != t * k or tuple(inverse.shape) != (p,) or h % 8:
        raise InputError(f"combine takes down [T * k, H] with H a multiple of 8, inverse "
                         f"[T * k] and weights [T, k]; got down {tuple(down.shape)}, inverse "
                         f"{tuple(inverse.shape)}, weights {tuple(weights.shape)}")
    if out is None:
        out = torch.empty((t, h), dtype=down.dtype, device=down.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (t, h)
          or out.dtype != down.dtype or out.device != down.device
          or not out.is_contiguous() or out.data_ptr() % 16):
        raise InputError(f"out must be a contiguous, 16-byte aligned {down.dtype} [{t}, {h}] "
                         f"tensor on {down.device}")
    w = weights.to(down.dtype)
    if not w.is_contiguous():
        w = w.contiguous()
    inv = inverse if inverse.is_contiguous() else inverse.contiguous()
    _kernel_for(down.device.index, down.dtype).launch(down, inv, w, out, k)
    return out


__all__ = ["MAX_ROWS", "CompiledCombine", "combine_kernel", "combine_rows",
           "cross_compile_combine", "default_spec", "kernel_applies"]
