"""The exact reference GEMM and the one error rule every kernel is held to.

``gemm(a, b)`` computes ``D[m, n] = alpha * sum_k A[m, k] * B[n, k]`` (the TN GEMM) with
A and B dequantized exactly to float64 (``e2m1 * block_scale``; the global scales go into
``alpha``, as in the kernels) and accumulated in **float64**. Every product of E2M1 and
UE4M3 values has at most 6 significant bits, so float64 holds each product exactly and
the sum with an error far below the kernels' FP32 accumulation.

Error rule (:func:`error_bound`), per element, for a kernel that accumulates in FP32 and
then rounds to the output dtype::

    |out - ref| <= 2**-p * |ref| + (ceil(K/16) + 16) * 2**-23 * alpha * sum_k |A[m,k] B[n,k]|
                   + tiny

``p`` is the output's precision (bf16: 8, fp16: 11, fp32: 24). The second term bounds FP32
accumulation in which the tensor core sums each 16-wide K chunk (one scale block; WGMMA
BF16 has K = 16, the SM120 MMA K = 64) to FP32 accuracy and then adds it to the
accumulator: one rounding of at most ``2 u = 2**-23`` (truncation allowed) per addition, the
``+ 16`` covering split-K partial sums and the alpha multiply. ``tiny`` is the output's
smallest subnormal step. The rule is a worst-case bound, not a statistical one, so it holds
for any summation order; a single dropped 16-element block still fails it at moderate K,
which is why kernel tests use short and odd K as well as long K.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cute_fp4.errors import InputError, InputTypeError, ValidationError
from cute_fp4.nvfp4 import NVFP4Tensor

_PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
_TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _operand(x, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values without the global scale as float64, global scale as float64)."""
    if isinstance(x, NVFP4Tensor):
        return x.block_values(torch.float64), x.global_scale.double()
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise InputError(f"{name} must be an NVFP4Tensor or a bfloat16/float16 tensor "
                             f"(W4A16), got {x.dtype}")
        if x.dim() != 2:
            raise InputError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
        return x.double(), torch.tensor(1.0, dtype=torch.float64)
    raise InputTypeError(f"{name} must be an NVFP4Tensor or a torch.Tensor, "
                         f"got {type(x).__name__}")


def _prepare(a, b, alpha):
    if not isinstance(b, NVFP4Tensor):
        raise InputTypeError(f"b must be an NVFP4Tensor [N, K], got {type(b).__name__}")
    av, ag = _operand(a, "a")
    bv, bg = _operand(b, "b")
    if av.shape[1] != bv.shape[1]:
        raise InputError(f"K mismatch: a is {tuple(av.shape)} and b is {tuple(bv.shape)} "
                         "(both are [rows, K])")
    if alpha is None:
        alpha64 = (ag * bg).double()
    else:
        alpha64 = torch.as_tensor(alpha, dtype=torch.float32).double().reshape(())
    dev = bv.device
    return av.to(dev), bv, alpha64.to(dev)


def gemm(a, b: NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact reference ``alpha * A @ B^T``, computed in float64 on ``b``'s device.

    ``a``: NVFP4Tensor [M, K] (W4A4) or a bf16/fp16 tensor [M, K] (W4A16); ``b``:
    NVFP4Tensor [N, K]. ``alpha`` defaults to the product of the global scales (W4A16: the
    global scale of ``b``); when given, it replaces that product, as in the kernels.
    """
    av, bv, alpha64 = _prepare(a, b, alpha)
    return ((av @ bv.T) * alpha64).to(out_dtype)


def error_bound(a, b: NVFP4Tensor, alpha=None, out_dtype: torch.dtype = torch.float32,
                ref: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element tolerance of the error rule (float64, on ``b``'s device)."""
    av, bv, alpha64 = _prepare(a, b, alpha)
    k = av.shape[1]
    if ref is None:
        ref = (av @ bv.T) * alpha64
    absdot = (av.abs() @ bv.abs().T) * alpha64.abs()
    p = _PRECISION[out_dtype]
    acc = absdot * ((-(-k // 16) + 16) * 2.0**-23)
    return ref.double().abs() * 2.0**-p + acc * (1 + 2.0**-p) + _TINY[out_dtype]


@dataclasses.dataclass
class CheckResult:
    """Outcome of comparing a kernel's output with the reference."""

    shape: tuple[int, int, int]
    max_abs_err: float
    max_err_over_bound: float  # <= 1 passes
    nonfinite: int  # NaN/Inf in the output (an unwritten poisoned tile shows up here)
    passed: bool

    def __str__(self) -> str:
        m, n, k = self.shape
        verdict = "ok" if self.passed else "FAIL"
        return (f"M={m} N={n} K={k}: max|err| {self.max_abs_err:.3g}, "
                f"err/bound {self.max_err_over_bound:.3g}, non-finite {self.nonfinite} "
                f"-> {verdict}")


def _overflow_threshold(dtype: torch.dtype) -> float:
    """Smallest magnitude that rounds to infinity in ``dtype`` (max + half an ulp)."""
    big = float(torch.finfo(dtype).max)
    emax = math.frexp(big)[1] - 1
    return big + 2.0 ** (emax - _PRECISION[dtype])


def check(out: torch.Tensor, a, b: NVFP4Tensor, alpha=None) -> CheckResult:
    """Compare ``out`` with the reference under the error rule (poison-aware).

    NaN never passes. An infinity passes only where the exact result, within the bound,
    reaches the output dtype's overflow threshold with the same sign (IEEE rounding of a
    result too large for FP16, say); anywhere else it fails like a NaN.
    """
    av, bv, alpha64 = _prepare(a, b, alpha)
    ref = (av @ bv.T) * alpha64
    got = out.detach().double().to(ref.device)
    if got.shape != ref.shape:
        raise InputError(f"output shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    bound = error_bound(a, b, alpha, out.dtype, ref)
    finite = torch.isfinite(got)
    overflow_ok = (torch.isinf(got) & (torch.sign(got) == torch.sign(ref))
                   & (ref.abs() + bound >= _overflow_threshold(out.dtype)))
    err = (got - ref).abs()
    err = torch.where(finite, err, torch.full_like(err, float("inf")))
    err = torch.where(overflow_ok, torch.zeros_like(err), err)
    ratio = float((err / bound).max()) if err.numel() else 0.0
    nonfinite = int((~finite & ~overflow_ok).sum())
    return CheckResult((av.shape[0], bv.shape[0], av.shape[1]),
                       float(err.max()) if err.numel() else 0.0, ratio, nonfinite,
                       nonfinite == 0 and ratio <= 1.0)


def assert_close(out: torch.Tensor, a, b: NVFP4Tensor, alpha=None) -> CheckResult:
    """:func:`check`, raising :class:`ValidationError` when it fails."""
    res = check(out, a, b, alpha)
    if not res.passed:
        raise ValidationError(f"output disagrees with the exact reference: {res}")
    return res
