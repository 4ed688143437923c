"""The kernels' stand-ins of the CPU tests: the exact reference where a GEMM would run."""

from __future__ import annotations

import torch

from cute_fp4 import reference
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.packed import PackedNVFP4Weight


def exact_run(kern, a, w, alpha, dims, out=None, early=False) -> torch.Tensor:
    """``layers.linear._run`` on the CPU: the exact reference (float64, one rounding) of the GEMM
    ``dims`` = (M, N, K, format), written into ``out`` when given."""
    w = w.unpack() if isinstance(w, PackedNVFP4Weight) else w
    m, n, k, _ = dims
    a = a if isinstance(a, NVFP4Tensor) else a.reshape(m, k)
    y = reference.gemm(a, w, alpha, out_dtype=kern.out_dtype)
    if out is None:
        return y
    out.view(m, n).copy_(y)
    return out
