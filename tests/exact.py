"""The kernels' stand-ins of the CPU tests: the exact reference where a GEMM would run, and
:func:`fake_launch_path`, which puts stand-ins into the launch path's kernel and launch
steps (``run.kernel``, ``run.run_checked``) and lets its operand checks pass CPU tensors."""

from __future__ import annotations

import torch

from cute_fp4 import operands, reference, run
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.packed import PackedNVFP4Weight


def exact_run(kern, a, w, alpha, dims, out=None, early=False) -> torch.Tensor:
    """A dense launch on the CPU: the exact reference (float64, one rounding) of the GEMM
    ``dims`` = (M, N, K, format), written into ``out`` when given."""
    w = w.unpack() if isinstance(w, PackedNVFP4Weight) else w
    m, n, k, _ = dims
    a = a if isinstance(a, NVFP4Tensor) else a.reshape(m, k)
    y = reference.gemm(a, w, alpha, out_dtype=kern.out_dtype)
    if out is None:
        return y
    out.view(m, n).copy_(y)
    return out


def fake_launch_path(monkeypatch, kernel_for, launch=exact_run) -> None:
    """``kernel_for(schedule, m, n, k, a_format, out_dtype, device_index, packed, b_format)``
    stands in for ``run.kernel`` (it returns the kernel ``launch`` is given) and
    ``launch(kern, a, w, alpha, dims, out, early)`` for ``run.run_checked``; the operand
    checks run without their device-type check (CPU tensors)."""
    def kernel(schedule, dims, out_dtype, device_index, packed=False, ops=(), b_format=None):
        return kernel_for(schedule, *dims, out_dtype, device_index, packed, b_format)

    def run_checked(kern, a, b, out, alpha, dims, bias=None, nvfp4_out=None, early=False):
        return launch(kern, a, b, alpha, dims, out, early)

    monkeypatch.setattr(run, "kernel", kernel)
    monkeypatch.setattr(run, "run_checked", run_checked)
    monkeypatch.setattr(run, "check_call", lambda *args, **kw: operands.check_call(
        *args, **{**kw, "require_cuda": False}))
