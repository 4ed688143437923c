"""The exact reference GEMM and the one error rule every kernel is held to.

``gemm(a, b)`` computes ``D[m, n] = alpha * sum_k A[m, k] * B[n, k]`` (the TN GEMM) with
A and B dequantized exactly to float64 (``e2m1 * block_scale``; the global scales go into
``alpha``, as in the kernels) and accumulated in **float64**. Every product of E2M1 and
UE4M3 values has at most 6 significant bits, so float64 holds each product exactly and
the sum with an error far below the kernels' FP32 accumulation.

Error rule (:func:`error_bound`), per element, for a kernel that accumulates in FP32 and
then rounds to the output dtype::

    |out - ref| <= 2**-p * |ref| + (ceil(K/c) + 16) * 2**-23 * alpha * sum_k |A[m,k] B[n,k]|
                   + tiny

``p`` is the output's precision (bf16: 8, fp16: 11, fp32: 24). The second term bounds FP32
accumulation in which the tensor core sums each ``c``-wide K chunk to FP32 accuracy and
then adds it to the accumulator: one rounding of at most ``2 u = 2**-23`` (truncation
allowed) per addition, the ``+ 16`` covering split-K partial sums and the alpha multiply.
``c`` is the weight format's block size (one scale block: ``b.fmt.block``), at most
:data:`MMA_K_MIN` = 16, the K of the narrowest MMA any kernel issues (WGMMA BF16 and
``mma.sync.m16n8k16`` have K = 16, the SM120 block-scaled MMA K = 64): NVFP4's 16.
``tiny`` is the output's smallest subnormal step. The rule is a worst-case bound, not a
statistical one, so it holds for any summation order; a single dropped 16-element block
still fails it at moderate K, which is why kernel tests use short and odd K as well as
long K.

Grouped (MoE) GEMMs: :func:`grouped_gemm` and :func:`check_grouped` apply the same
arithmetic and the same rule expert by expert, on the rows ``offsets[e]:offsets[e+1]``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import torch

from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import InputError, InputTypeError, ValidationError
from cute_fp4.formats import BlockFormat

MMA_K_MIN = 16  # K of the narrowest MMA a kernel adds to its FP32 accumulator at a time

_PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
_TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _operand(x, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values without the global scale as float64, global scale as float64: 1 for a
    16-bit operand or a format without one)."""
    if isinstance(x, BlockTensor | torch.Tensor) and x.device.type == "meta":
        raise InputError(f"{name} is on the meta device: the reference reads its values")
    one = torch.tensor(1.0, dtype=torch.float64)
    if isinstance(x, BlockTensor):
        if x.experts is not None:
            raise InputError(f"{name} must be one 2-D [rows, K] tensor, got an expert stack "
                             f"{list(x.shape)} (grouped_gemm takes stacks)")
        gs = one if x.global_scale is None else x.global_scale.double()
        return x.block_values(torch.float64), gs
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise InputError(f"{name} must be an NVFP4Tensor or MXFP4Tensor or a "
                             f"bfloat16/float16 tensor (W4A16), got {x.dtype}")
        if x.dim() != 2:
            raise InputError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
        return x.double(), one
    raise InputTypeError(f"{name} must be an NVFP4Tensor or MXFP4Tensor or a torch.Tensor, "
                         f"got {type(x).__name__}")


def _alpha(alpha, experts: int) -> torch.Tensor:
    """``alpha`` (a real number, a list of them or a real tensor: one value, or with
    ``experts`` > 1 one per expert) as float64, rounded through float32 as the kernels
    read it."""
    def number(v) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    real = number(alpha) or (isinstance(alpha, list | tuple) and all(map(number, alpha))) or (
        isinstance(alpha, torch.Tensor) and not alpha.is_complex() and alpha.dtype != torch.bool)
    if not real:
        raise InputTypeError(f"alpha must be a float, a list of floats or a real tensor, got "
                             f"{type(alpha).__name__} {getattr(alpha, 'dtype', alpha)!r}")
    if isinstance(alpha, torch.Tensor) and alpha.is_meta:
        raise InputError("alpha is on the meta device: the reference reads its value")
    count = alpha.numel() if isinstance(alpha, torch.Tensor) else (
        len(alpha) if isinstance(alpha, list | tuple) else 1)
    if count not in (1, experts):
        want = ("one value" if experts == 1
                else f"a scalar or hold one value per expert ({experts})")
        raise InputError(f"alpha must be {want}, got {count}")
    return torch.as_tensor(alpha, dtype=torch.float32).double()


def _same_format(a, b) -> None:
    """W4A4 takes A and B in one block format (SM120's MMA takes one scale type)."""
    if isinstance(a, BlockTensor) and a.fmt != b.fmt:
        raise InputError(f"a is {a.fmt} and b is {b.fmt}: W4A4 takes both operands in one "
                         "block format")


def _prepare(a, b, alpha):
    if not isinstance(b, BlockTensor):
        raise InputTypeError(f"b must be an NVFP4Tensor or MXFP4Tensor [N, K], got "
                             f"{type(b).__name__}")
    _same_format(a, b)
    av, ag = _operand(a, "a")
    bv, bg = _operand(b, "b")
    if av.shape[1] != bv.shape[1]:
        raise InputError(f"K mismatch: a is {tuple(av.shape)} and b is {tuple(bv.shape)} "
                         "(both are [rows, K])")
    if alpha is None:
        alpha64 = (ag * bg).double()
    else:
        alpha64 = _alpha(alpha, 1).reshape(())
    dev = bv.device
    return av.to(dev), bv, alpha64.to(dev)


def _chunk(fmt: BlockFormat) -> int:
    """K elements a kernel sums before one accumulator addition, at most (module docstring)."""
    return min(fmt.block, MMA_K_MIN)


def gemm(a, b: BlockTensor, alpha=None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact reference ``alpha * A @ B^T``, computed in float64 on ``b``'s device.

    ``a``: a block tensor [M, K] (W4A4: NVFP4Tensor, or MXFP4Tensor with an MXFP4 ``b``)
    or a bf16/fp16 tensor [M, K] (W4A16); ``b``: NVFP4Tensor or MXFP4Tensor [N, K].
    ``alpha`` defaults to the product of the global scales (1 for MXFP4; W4A16: the
    global scale of ``b``); when given, it replaces that product, as in the kernels.
    """
    av, bv, alpha64 = _prepare(a, b, alpha)
    return ((av @ bv.T) * alpha64).to(out_dtype)


def error_bound(a, b: BlockTensor, alpha=None, out_dtype: torch.dtype = torch.float32,
                ref: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element tolerance of the error rule (float64, on ``b``'s device)."""
    av, bv, alpha64 = _prepare(a, b, alpha)
    if ref is None:
        ref = (av @ bv.T) * alpha64
    return _bound(av, bv, alpha64, out_dtype, ref, b.fmt)


def _bound(av: torch.Tensor, bv: torch.Tensor, alpha64: torch.Tensor, out_dtype: torch.dtype,
           ref: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The error rule on float64 values: ``av`` [M, K], ``bv`` [N, K] (of block format
    ``fmt``), a scalar alpha."""
    k = av.shape[1]
    absdot = (av.abs() @ bv.abs().T) * alpha64.abs()
    p = _PRECISION[out_dtype]
    acc = absdot * ((-(-k // _chunk(fmt)) + 16) * 2.0**-23)
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


def check(out: torch.Tensor, a, b: BlockTensor, alpha=None) -> CheckResult:
    """Compare ``out`` with the reference under the error rule (poison-aware).

    NaN never passes. An infinity passes only where the exact result, within the bound,
    reaches the output dtype's overflow threshold with the same sign (IEEE rounding of a
    result too large for FP16, say); anywhere else it fails like a NaN.
    """
    _check_out(out)
    av, bv, alpha64 = _prepare(a, b, alpha)
    ref = (av @ bv.T) * alpha64
    got = out.detach().double().to(ref.device)
    if got.shape != ref.shape:
        raise InputError(f"output shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    bound = _bound(av, bv, alpha64, out.dtype, ref, b.fmt)
    err, nonfinite = _errors(got, ref, bound, out.dtype)
    ratio = float((err / bound).max()) if err.numel() else 0.0
    return CheckResult((av.shape[0], bv.shape[0], av.shape[1]),
                       float(err.max()) if err.numel() else 0.0, ratio, nonfinite,
                       nonfinite == 0 and ratio <= 1.0)


def _check_out(out) -> None:
    """A kernel's output to compare: a bf16/fp16/fp32 tensor with values."""
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype not in _PRECISION:
        raise InputError(f"out must be bfloat16, float16 or float32, got {out.dtype}")
    if out.is_meta:
        raise InputError("out is on the meta device: there are no values to check")


def _errors(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(|got - ref| with inf where ``got`` is non-finite and not an allowed overflow,
    the count of those non-finite elements)."""
    finite = torch.isfinite(got)
    overflow_ok = (torch.isinf(got) & (torch.sign(got) == torch.sign(ref))
                   & (ref.abs() + bound >= _overflow_threshold(out_dtype)))
    err = (got - ref).abs()
    err = torch.where(finite, err, torch.full_like(err, float("inf")))
    err = torch.where(overflow_ok, torch.zeros_like(err), err)
    return err, int((~finite & ~overflow_ok).sum())


def assert_close(out: torch.Tensor, a, b: BlockTensor, alpha=None) -> CheckResult:
    """:func:`check`, raising :class:`ValidationError` when it fails."""
    res = check(out, a, b, alpha)
    if not res.passed:
        raise ValidationError(f"output disagrees with the exact reference: {res}")
    return res


def fused(raw: torch.Tensor, bias, ops: tuple, group: int, out_dtype: torch.dtype,
          out_scale=None):
    """What a fused epilogue writes, by its definition (the unfused pipeline): ``raw`` (the
    GEMM without ops, FP32) plus ``bias`` (FP32, or None), rounded to ``out_dtype``, then
    ``F.silu(gate) * up`` of the gate/up columns interleaved in groups of ``group``
    (``"silu_mul"``, ``cute_fp4.fused``; ``"swiglu_oai"``: gpt-oss's clamped SwiGLU,
    ``fused.swiglu_oai_unfused``), then with ``"nvfp4_out"`` quantized with the
    global scale ``out_scale`` (an ``NVFP4Tensor``)."""
    from cute_fp4.fused import silu_mul_unfused, swiglu_oai_unfused

    want = (raw if bias is None else raw + bias).to(out_dtype)
    if "silu_mul" in ops:
        want = silu_mul_unfused(want, group)
    if "swiglu_oai" in ops:
        want = swiglu_oai_unfused(want, group)
    if "nvfp4_out" in ops:
        from cute_fp4.nvfp4 import quantize

        return quantize(want, out_scale)
    return want


def assert_fused(result, raw: torch.Tensor, bias, ops: tuple, group: int,
                 name: str = "", out_dtype: torch.dtype | None = None) -> None:
    """A fused epilogue's ``result`` against the unfused pipeline it replaces, bit for bit:
    ``raw`` (the same GEMM without ops, FP32 output) plus ``bias`` (FP32; already added
    when None), rounded to ``result``'s dtype, then ``F.silu(gate) * up`` of the gate/up
    columns interleaved in groups of ``group`` (``cute_fp4.fused``) with ``"silu_mul"``.
    Raises :class:`ValidationError` naming how many values differ. With ``"nvfp4_out"``,
    ``result`` is an ``NVFP4Tensor`` and the rounded output (``out_dtype``) is quantized
    with its global scale: codes and blocked scales (padding included) compared as bytes."""
    dtype = out_dtype if "nvfp4_out" in ops else result.dtype
    if "nvfp4_out" in ops:
        q = fused(raw, bias, ops, group, dtype, result.global_scale)
        bad = int((q.data != result.data).sum())
        bad_sf = int((q.scale.view(torch.uint8) != result.scale.view(torch.uint8)).sum())
        if bad or bad_sf:
            raise ValidationError(f"fused epilogue {'+'.join(ops)} of {name}: {bad} of "
                                  f"{result.data.numel()} code bytes and {bad_sf} of "
                                  f"{result.scale.numel()} scale bytes differ from the "
                                  "unfused pipeline's (quantize of the rounded output)")
        return
    want = fused(raw, bias, ops, group, dtype)
    bits = torch.int16 if result.element_size() == 2 else torch.int32
    bad = int((want.view(bits) != result.view(bits)).sum())
    if bad:
        raise ValidationError(f"fused epilogue {'+'.join(ops)} of {name}: {bad} of "
                              f"{result.numel()} values differ from the unfused pipeline's bits")


# ----------------------------------------------------------------------------- grouped

def group_bounds(offsets, experts: int, total_m: int) -> list[int]:
    """The ``E + 1`` group offsets as Python ints (reads them: CPU or CUDA tensor, or a
    sequence), checked: ``offsets[0] = 0``, non-decreasing, ``offsets[E] = total_m``."""
    if isinstance(offsets, torch.Tensor):
        if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
            raise InputError(f"offsets must be an integer tensor, got {offsets.dtype}")
        if offsets.is_meta:
            raise InputError("offsets are on the meta device: the reference reads them")
        offs = [int(v) for v in offsets.reshape(-1).tolist()]
    elif isinstance(offsets, (list, tuple)):
        try:
            offs = [operator.index(v) for v in offsets]
        except TypeError:
            raise InputTypeError(f"offsets must be ints, got {offsets!r}") from None
    else:
        raise InputTypeError(f"offsets must be a tensor or a sequence of ints, got "
                             f"{type(offsets).__name__}")
    if len(offs) != experts + 1:
        raise InputError(f"offsets must have E + 1 = {experts + 1} elements for {experts} "
                         f"experts, got {len(offs)}")
    if offs[0] != 0 or offs[-1] != total_m:
        raise InputError(f"offsets must start at 0 and end at total_M = {total_m}, got "
                         f"{offs[0]} .. {offs[-1]}")
    drop = next((e for e in range(experts) if offs[e + 1] < offs[e]), None)
    if drop is not None:
        raise InputError(f"offsets must be non-decreasing: offsets[{drop}] = {offs[drop]} > "
                         f"offsets[{drop + 1}] = {offs[drop + 1]}")
    return offs


def _experts_of(b) -> BlockTensor:
    """``b`` as a plain block-tensor expert stack (a packed stack is unpacked)."""
    from cute_fp4.packed import PackedWeight

    if isinstance(b, PackedWeight):
        b = b.unpack()
    if not isinstance(b, BlockTensor):
        raise InputTypeError(f"b must be an NVFP4Tensor or MXFP4Tensor [E, N, K], got "
                             f"{type(b).__name__}")
    if b.experts is None:
        raise InputError(f"b must have a leading expert mode [E, N, K], got shape {b.shape}")
    return b


def _grouped_prepare(a, b, offsets, alpha):
    """(A values [M, K], B stack, group offsets, alpha [E]) in float64 on ``b``'s device."""
    b = _experts_of(b)
    _same_format(a, b)
    n_exp, n, k = b.shape
    av, ag = _operand(a, "a")
    if av.shape[1] != k:
        raise InputError(f"K mismatch: a is {tuple(av.shape)} and b is {b.shape} "
                         "([total_M, K] and [E, N, K])")
    offs = group_bounds(offsets, n_exp, av.shape[0])
    dev = b.device
    if alpha is None:
        gs = (torch.ones(n_exp, dtype=torch.float64, device=dev) if b.global_scale is None
              else b.global_scale.double())
        alpha64 = ag.to(dev) * gs
    else:
        alpha64 = _alpha(alpha, n_exp).reshape(-1).to(dev).expand(n_exp)
    return av.to(dev), b, offs, alpha64


def _grouped_ref(a, b, offsets, alpha, out_dtype: torch.dtype | None):
    """(exact result [M, N] float64, bound or None, offsets, (M, N, K)): expert by expert,
    each block of rows by :func:`gemm`'s arithmetic and :func:`error_bound`'s rule."""
    av, b, offs, alpha64 = _grouped_prepare(a, b, offsets, alpha)
    n_exp, n, k = b.shape
    m = av.shape[0]
    ref = torch.zeros((m, n), dtype=torch.float64, device=b.device)
    bound = None if out_dtype is None else torch.zeros_like(ref)
    for e in range(n_exp):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        bv = b.expert(e).block_values(torch.float64)
        ref[lo:hi] = (av[lo:hi] @ bv.T) * alpha64[e]
        if bound is not None:
            bound[lo:hi] = _bound(av[lo:hi], bv, alpha64[e], out_dtype, ref[lo:hi], b.fmt)
    return ref, bound, offs, (m, n, k)


def grouped_gemm(a, b, offsets, alpha=None, out_dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """Exact reference of the grouped (MoE) GEMM, in float64 on ``b``'s device:
    ``out[offsets[e]:offsets[e+1]] = alpha[e] * A[offsets[e]:offsets[e+1]] @ B[e]^T``.

    ``a``: NVFP4Tensor [total_M, K] (W4A4, one global scale) or bf16/fp16 [total_M, K]
    (W4A16); ``b``: NVFP4Tensor or MXFP4Tensor expert stack [E, N, K] (or its packed
    weight);
    ``offsets``: E + 1 cumulative row offsets (CPU or CUDA tensor, or ints; read here);
    ``alpha``: one value or E values, default ``a.global_scale * b.global_scale[e]``
    (W4A16: ``b.global_scale[e]``)."""
    ref, _, _, _ = _grouped_ref(a, b, offsets, alpha, None)
    return ref.to(out_dtype)


def add_expert_bias(raw: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor):
    """FP32 ``raw`` plus each row's expert's bias (rows by the offsets)."""
    counts = (offsets[1:] - offsets[:-1]).clamp(min=0).long()
    expert = torch.repeat_interleave(torch.arange(len(counts), device=raw.device), counts)
    out = raw.clone()
    lo = int(offsets[0])
    out[lo:lo + len(expert)] += bias[expert]
    return out


@dataclasses.dataclass
class GroupedCheckResult(CheckResult):
    """:class:`CheckResult` of a grouped GEMM (``shape`` is (total_M, N, K)), with the
    expert whose rows hold the largest error relative to the bound."""

    experts: int = 0
    worst_expert: int | None = None  # None when no expert has rows

    def __str__(self) -> str:
        return (f"E={self.experts} {super().__str__()}"
                + ("" if self.worst_expert is None else f" (worst: expert {self.worst_expert})"))


def check_grouped(out: torch.Tensor, a, b, offsets, alpha=None) -> GroupedCheckResult:
    """:func:`check` for a grouped GEMM: every expert's rows under the same error rule
    (its own alpha and K), aggregated; empty experts have no rows to check. A row no
    expert wrote (NaN-poisoned) fails."""
    _check_out(out)
    ref, bound, offs, shape = _grouped_ref(a, b, offsets, alpha, out.dtype)
    got = out.detach().double().to(ref.device)
    if got.shape != ref.shape:
        raise InputError(f"output shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    err, nonfinite = _errors(got, ref, bound, out.dtype)
    row_ratio = (err / bound).amax(dim=1) if err.numel() else err.new_zeros(shape[0])
    worst, worst_ratio = None, -1.0
    for e in range(len(offs) - 1):
        if offs[e + 1] > offs[e]:
            r = float(row_ratio[offs[e]:offs[e + 1]].max())
            if r > worst_ratio:
                worst, worst_ratio = e, r
    ratio = max(worst_ratio, 0.0)
    return GroupedCheckResult(shape, float(err.max()) if err.numel() else 0.0, ratio,
                              nonfinite, nonfinite == 0 and ratio <= 1.0, len(offs) - 1,
                              worst)


def assert_close_grouped(out: torch.Tensor, a, b, offsets, alpha=None) -> GroupedCheckResult:
    """:func:`check_grouped`, raising :class:`ValidationError` when it fails."""
    res = check_grouped(out, a, b, offsets, alpha)
    if not res.passed:
        raise ValidationError(f"grouped output disagrees with the exact reference: {res}")
    return res
