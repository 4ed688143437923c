"""The grouped (mixture-of-experts) GEMM: :func:`grouped_gemm` and the ``cute_fp4::grouped_mm``
custom op (its plain-tensor form :func:`grouped_mm`).

``out[offsets[e]:offsets[e+1]] = alpha[e] * a[offsets[e]:offsets[e+1]] @ b[e]^T`` (TN, like
``gemm``), with ``a`` the tokens sorted by expert, ``[total_M, K]`` NVFP4 (W4A4, one global
scale) or bf16/fp16 (W4A16); ``b`` the experts' weights, an NVFP4Tensor with a leading expert
mode ``[E, N, K]`` (a PackedNVFP4Weight stack for the sm_90a ``rs_packed`` schedules and
the ``stream`` ones, sm_90a and SM12x);
``offsets`` int32 ``[E + 1]`` on the GPU (``offsets[0] = 0``, non-decreasing,
``offsets[E] = total_M``; empty experts allowed); ``alpha`` float32 ``[E]``, default
``a.global_scale * b.global_scale`` (W4A16: ``b.global_scale``). W4A4 on a packed stack with
``schedule="auto"`` runs as ``gemm`` runs it on a packed weight: the activation decoded to
its exact BF16 block values, then the W4A16 kernel, alpha as above (:func:`via_values`).

The values of ``offsets`` are never read on the host by default: a call checks metadata
only (shapes, dtypes, devices, strides, pointers), so it needs no GPU sync and can be
captured in a CUDA graph with the offsets changing between replays. Whatever the offsets
hold, the kernels read and write only rows ``0 .. total_M`` of ``a`` and ``out``: each
expert's range is clamped to them (``kernels.scheduler.group_rows``), so an offset past the
end, a negative or a decreasing one never touches memory outside the tensors (the rows of
``out`` they describe are then not the contract's). ``validate_offsets=True`` checks the
offsets on every call (torch ops on the device, one sync) and raises
:class:`~cute_fp4.errors.OffsetsError` naming the first bad entry before anything is
launched; ``check=True`` does so on the calls it validates. Every check runs before
anything is launched or written; a bad input raises a typed error with the numbers and
leaves ``out`` untouched. Shape and dtype checks come before the device check, so they are
the same on the CPU. ``check=True`` (which does sync) validates the first call of each
kernel against ``reference.check_grouped``.

Layering: the API layer, next to ``api``: one call each into the launch path
(``run.grouped_call``: the checks of ``cute_fp4.operands``, the "auto" of
``cute_fp4.tuning``, the checked launch and the validation are the dense calls'); nothing
below imports it. The op is registered on first use, as ``cute_fp4::mm`` is (see
``cute_fp4.api``): by the first eager call, while torch.compile traces a call, or by
:func:`register_op`.
"""

from __future__ import annotations

import torch

from cute_fp4 import run
from cute_fp4.api import OPS, register_op
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.errors import InputError
from cute_fp4.operands import b_stack, grouped_alpha, torch_out
from cute_fp4.oplib import traced, while_tracing

__all__ = ["grouped_gemm", "grouped_mm", "register_op"]


# ----------------------------------------------------------------------------- the call

def grouped_gemm(a, b, offsets: torch.Tensor, *, schedule="auto",
                 out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 alpha=None, bias: torch.Tensor | None = None, silu_mul: bool = False,
                 nvfp4_out=None, check: bool = False,
                 validate_offsets: bool = False, swiglu_oai: bool = False) -> torch.Tensor:
    """The grouped (MoE) GEMM: ``out[offsets[e]:offsets[e+1]] = alpha[e] *
    a[offsets[e]:offsets[e+1]] @ b[e].T`` (module docstring for the operands).

    ``schedule``: "auto" (``sm90_grouped`` on sm_90a, ``sm120_grouped`` on sm_120a/sm_121a),
    a catalogue name or a Schedule, grouped. ``out``: ``[total_M, N]`` of ``out_dtype``,
    written only on the experts' rows (all of them); allocated when None. total_M = 0
    returns the (empty) output without a launch. No GPU sync; ``check=True`` validates the
    first call of each kernel against the exact reference, its offsets first (syncs;
    OffsetsError, ValidationError). ``validate_offsets=True``: the offsets on every call,
    before the launch (one sync; OffsetsError naming the first bad entry). Without it, bad
    offsets give wrong rows of ``out`` but never touch memory outside ``a`` and ``out``.

    Fused in the epilogue, as ``gemm``'s: ``bias`` float32 ``[E, N]`` (each expert's),
    ``silu_mul=True`` or ``swiglu_oai=True`` (gpt-oss's clamped SwiGLU; each expert's rows
    gate/up interleaved, ``cute_fp4.fused``; the output ``[total_M, N / 2]``),
    ``nvfp4_out=global_scale`` (the output quantized in the epilogue, returned as an
    ``NVFP4Tensor`` over all total_M rows; the offsets must cover them: ``offsets[0] = 0``,
    ``offsets[E] = total_M``).
    """
    if torch.compiler.is_compiling():
        if bias is not None or silu_mul or swiglu_oai or nvfp4_out is not None:
            raise InputError("grouped_gemm with bias=, silu_mul=, swiglu_oai= or nvfp4_out= "
                             "is not supported under torch.compile yet (cute_fp4::grouped_mm "
                             "has no epilogue operands)")
        if validate_offsets:
            raise InputError("validate_offsets=True reads the offsets back (a GPU sync), "
                             "which torch.compile cannot trace: validate them outside")
        return _op_call(a, b, offsets, schedule, out, out_dtype, alpha)
    OPS.ready()
    return run.grouped_call(a, b, offsets, schedule, out, out_dtype, alpha, check,
                            validate_offsets, bias, silu_mul, nvfp4_out, swiglu_oai)


# ----------------------------------------------------------------------------- custom op

def _op_call(a, b, offsets, schedule, out, out_dtype, alpha) -> torch.Tensor:
    """``grouped_gemm`` while torch.compile traces it: one ``cute_fp4::grouped_mm`` node (a
    given ``out`` is filled from its result)."""
    n_exp, n, k, packed = b_stack(b)
    a_t, a_sf = (a.data, a.scale) if isinstance(a, BlockTensor) else (a, None)
    alpha_t = grouped_alpha(a, b, alpha, n_exp)
    res = grouped_mm(a_t, a_sf, b.data, b.scale, offsets, alpha_t, k, torch_out(out_dtype),
                     schedule, n, packed)
    if out is None:
        return res
    out.copy_(res)
    return out


def grouped_mm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
               b_scale: torch.Tensor, offsets: torch.Tensor, alpha: torch.Tensor, k: int,
               out_dtype: torch.dtype = torch.bfloat16, schedule: str = "auto",
               n: int = 0, packed: bool = False) -> torch.Tensor:
    """``grouped_gemm`` on plain tensors, in the form of the ``cute_fp4::grouped_mm`` op:
    ``a`` the packed NVFP4 bytes [total_M, K/2] with ``a_scale`` (W4A4) or bf16/fp16
    [total_M, K] with ``a_scale=None`` (W4A16); ``b``/``b_scale`` the experts' bytes
    [E, rows, K/2] and blocked scales [E, ...]; ``offsets`` int32 [E + 1]; ``alpha`` float32
    [E] (not derived here); ``n`` the weight rows per expert, 0 for ``b.shape[1]``;
    ``packed``: ``b`` is the fragment-order layout (``cute_fp4.packed``: its rows padded
    to 64, so it must give ``n``).

    Eager, it runs the kernel without the op's dispatch; under torch.compile it is one
    ``cute_fp4::grouped_mm`` node (registered while tracing). Values are not checked (no
    GPU sync), which is what lets CUDA graphs capture it."""
    if traced(schedule):
        _register_while_tracing()
        return torch.ops.cute_fp4.grouped_mm(a, a_scale, b, b_scale, offsets, alpha, k,
                                             out_dtype, schedule, n, packed)
    OPS.ready()
    return run.grouped_op_call(a, a_scale, b, b_scale, offsets, alpha, k, out_dtype,
                               schedule, n, packed)


def _register_while_tracing() -> None:
    """Register the ops while Dynamo traces a call (``cute_fp4.oplib.while_tracing``)."""
    while_tracing(lambda ctx: register_op(), register_op)
