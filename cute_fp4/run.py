"""The launch path: what a kernel call does between its API (``cute_fp4.gemm``,
``grouped_gemm``, the custom ops, the prepared layers) and the kernel's entry, for dense,
grouped and fused kernels alike, in the order a call takes it:

1. the operand checks (``operands.check_call``, ``check_grouped_call``: host metadata,
   nothing read from the GPU);
2. the schedule and its compiled kernel (:func:`kernel`, :func:`grouped_kernel`:
   ``compile.kernel_for``'s memo over ``tuning``'s resolution of a Schedule, a catalogue
   name or "auto");
3. the checked launch (:func:`run_checked`, :func:`run_grouped`: the plan check per
   shape, the output, the split-K workspace of ``workspaces.split_workspace``, the
   launch's operands);
4. then the first call's validation (``check=True``: :func:`validate_call`,
   :func:`validate_grouped_call`, against the exact reference; with fused epilogue ops the
   unfused pipeline too), or, for the caller that keeps launches, the launch just made
   (``keep``: ``cute_fp4.bindings`` binds it for the next call like it).

One rule for every call: W4A4 on a fragment-order packed weight with ``schedule="auto"``
runs the W4A16 kernel on the activation's exact BF16 block values, the global scales in
alpha (:func:`via_values`; measured faster than the rs_packed mainloop's own W4A4 route
and the plain-layout W4A4 kernels, perf/results/2026-12-01-h200-bound.md). Under
``targets.reference_mode`` every call computes with the exact reference instead
(:func:`reference_call`, :func:`reference_grouped_call`), on any device.
:func:`poisoned_check` runs a kernel into a NaN-filled output against the reference.
"""

from __future__ import annotations

import torch

from cute_fp4 import reference
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.compile import CompiledGemm, Signature, kernel_for
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.formats import Operand
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.operands import (
    GemmCall,
    GroupedDims,
    Operands,
    alpha_tensor,
    as_scale,
    check_call,
    check_grouped_call,
    check_offsets,
    epilogue_ops,
    format_of_scale,
    grouped_alpha,
    nvfp4_out_tensor,
    out_dtype_of,
    require_cuda_operands,
    torch_out,
)
from cute_fp4.packed import PackedWeight, packed_class, tensor_class
from cute_fp4.quant import (
    dequantize_activation,
    quantize_activation,
    quantize_values,
    w4a16_operands,
)
from cute_fp4.schedule import gated_op
from cute_fp4.targets import reference_mode
from cute_fp4.tuning import (
    check_grouped_schedule,
    grouped_regime,
    resolve_grouped,
    resolve_packed,
    resolve_schedule,
    with_ops,
)
from cute_fp4.workspaces import split_workspace

# ----------------------------------------------------------------------------- kernels


def via_values(schedule, a_format: str, packed: bool) -> bool:
    """Whether a call runs W4A4 as the W4A16 kernel on the activation's exact BF16 block
    values (module docstring): NVFP4 activations (the decoder's format), a fragment-order
    packed weight and ``schedule="auto"``."""
    return (a_format == Operand.NVFP4 and packed and isinstance(schedule, str)
            and schedule == "auto")


def kernel(schedule, dims: tuple[int, int, int, str], out_dtype: torch.dtype,
           device_index: int, packed: bool = False, ops: tuple[str, ...] = (),
           b_format: Operand = Operand.NVFP4) -> CompiledGemm:
    """The compiled kernel of a dense call at ``dims`` = (M, N, K, a_format) on a weight of
    block format ``b_format``, memoised per (schedule argument, dims, out dtype, layout,
    ops, weight format, device) by ``compile.kernel_for`` ("auto" resolved again every
    ``tuning.AUTO_RECHECK_S``); ``packed``: for a fragment-order weight
    (``tuning.resolve_packed``); ``ops``: fused epilogue operations (given to the schedule
    resolved as without them; "auto" may take another tile for them: ``tuning.with_ops``)."""
    def resolve():
        s = (resolve_packed if packed else resolve_schedule)(schedule, *dims, out_dtype,
                                                             b_format=b_format)
        if ops and isinstance(schedule, str) and schedule == "auto":
            return with_ops(s, ops, *dims, b_format=b_format)
        return s.replace(ops=ops) if ops and s.epilogue.ops != ops else s

    return kernel_for(schedule, (*dims, out_dtype, packed, ops, b_format),
                      Signature(dims[3], b_format), device_index, resolve)


def grouped_kernel(schedule, dims: GroupedDims, out_dtype: torch.dtype, b,
                   ops: tuple[str, ...] = ()) -> CompiledGemm:
    """The compiled kernel of a grouped call, memoised like :func:`kernel` but per regime
    ("auto" depends on the rows per expert: ``tuning.grouped_regime``), not per shape.
    The schedule is resolved and checked against the operands before the device check,
    so its errors are the same on the CPU."""
    def resolve():
        s = resolve_grouped(schedule, out_dtype, dims)
        if ops and schedule == "auto":
            s = with_ops(s, ops, dims.total_m, dims.n, dims.k, dims.a_format, dims.experts,
                         dims.b_format)
        elif ops and s.epilogue.ops != ops:
            s = s.replace(ops=ops)
        check_grouped_schedule(s, dims)
        require_cuda_operands(b)
        return s

    kern = kernel_for(schedule, ("grouped", grouped_regime(schedule, dims), dims.a_format,
                                 dims.b_format, out_dtype, ops),
                      Signature(dims.a_format, dims.b_format), b.data.get_device(), resolve)
    check_grouped_schedule(kern.schedule, dims)  # a memoised kernel: these operands' layout
    return kern


# ----------------------------------------------------------------------------- dense calls

def gemm_call(call: GemmCall, keep=None) -> torch.Tensor:
    """A dense call's full path (module docstring). ``call.quantize_a``: its 16-bit
    activation is quantized first (``quant.quantize_activation``), or on a packed weight
    with ``schedule="auto"`` turned into the exact BF16 block values in one pass
    (:func:`via_values`). ``keep(kernel, a, b, result, alpha, dims)``: called after a
    launch that was not validated, without fused ops, on the operands it ran (a binding can
    fix it)."""
    if call.quantize_a:
        call = _quantized(call)
    if reference_mode():
        return reference_call(call)
    ops = call.ops
    a, b, alpha = call.a, call.b, call.alpha
    packed = call.packed
    view = _plain_view(b) if packed else b
    dims = check_call(a, view, call.out, alpha, call.out_dtype, ops, call.bias)
    m, n, k, a_format = dims
    if via_values(call.schedule, a_format, packed):
        given = None if alpha is None else alpha_tensor(a, view, alpha)
        a, alpha = w4a16_operands(a, b.global_scale, given)
        dims = (m, n, k, Operand.BF16)
    kern = kernel(call.schedule, dims, call.out_dtype, b.data.get_device(), packed, ops,
                  Operand.of(b.fmt))
    alpha_t = alpha_tensor(a, b, alpha)  # what the kernel reads, and a binding fixes
    result = run_checked(kern, a, b, call.out, alpha_t, dims, call.bias, call.nvfp4_out,
                         call.early)
    if call.check:
        validate_call(kern, result, a, b, alpha, dims, call.bias)
    elif keep is not None and not ops:
        keep(kern, a, b, result, alpha_t, dims)
    return result


def _quantized(call: GemmCall) -> GemmCall:
    """``call`` with its 16-bit activation in the weight's block format: quantized with
    ``call.input_scale`` (None: a per-call global scale), or, where the call runs on the
    values (:func:`via_values`) with a static scale, those values in one pass
    (``quant.quantize_values``; alpha the product of the global scales)."""
    x, gs = call.a, call.input_scale
    if gs is not None and not reference_mode() and via_values(
            call.schedule, Operand.of(call.b.fmt), call.packed):
        alpha = call.alpha if call.alpha is not None else gs * call.b.global_scale
        return call.replace(a=quantize_values(x, gs), alpha=alpha, quantize_a=False)
    return call.replace(a=quantize_activation(x, gs), quantize_a=False)


def op_call(a, a_scale, b, b_scale, alpha, n: int, k: int, out_dtype, schedule,
            packed: bool, keep=None) -> torch.Tensor:
    """The body of the ``cute_fp4::mm`` (``packed`` False) and ``mm_packed`` ops: the
    operands wrapped without the containers' checks (the global-scale check reads the
    value back from the GPU, and that sync inside a CUDA-graph capture invalidates it),
    then :func:`gemm_call`. The weight's format is its scales' dtype's
    (``operands.format_of_scale``); ``alpha`` is explicit, so the global scales the
    wrappers carry (alpha itself, a placeholder) are never read."""
    for t, name in ((b, "b"), (b_scale, "b_scale"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    fmt = format_of_scale(b_scale)
    gs = alpha.reshape(()) if fmt.global_scale else None
    at = a if a_scale is None else _wrap(fmt, a, a_scale, gs, (a.shape[0], k))
    if packed:
        bt = packed_class(fmt)(b, as_scale(b_scale, fmt), gs, (n, k))
    else:
        if b.dim() != 2:
            raise InputTypeError(f"b must be the packed weight [N, K/2], got shape "
                                 f"{tuple(b.shape)}")
        bt = _wrap(fmt, b, b_scale, gs, (b.shape[0], k))
    return gemm_call(GemmCall(at, bt, schedule, out_dtype=out_dtype, alpha=alpha), keep)


def _wrap(fmt, data, scale, gs, shape) -> BlockTensor:
    """A block tensor of ``fmt`` over the tensors, without the checks (see :func:`op_call`)."""
    return tensor_class(fmt)._unchecked(data, as_scale(scale, fmt), gs, shape)


def _plain_view(b: PackedWeight) -> BlockTensor:
    """The plain-weight checks' view of a packed weight's first N rows (same bytes per row,
    same scales)."""
    if len(b.shape) != 2:
        raise InputError(f"b is a stack of {b.shape[0]} packed experts {list(b.shape)}: "
                         "gemm takes one [N, K] weight; cute_fp4.grouped_gemm runs stacks")
    n, k = b.shape
    return b.tensor_class._unchecked(b.data[:n], b.scale, b.global_scale, (n, k))


# ----------------------------------------------------------------------------- grouped calls

def grouped_call(a, b, offsets, schedule, out, out_dtype, alpha, check: bool = False,
                 validate_offsets: bool = False, bias=None, silu_mul: bool = False,
                 nvfp4_out=None, swiglu_oai: bool = False) -> torch.Tensor:
    """A grouped (MoE) call's full path (module docstring): ``check`` validates the first
    call of each kernel, its offsets first; ``validate_offsets`` checks the offsets on
    every call (one sync each)."""
    ops = epilogue_ops(bias, silu_mul, nvfp4_out, swiglu_oai)
    dt = torch_out(out_dtype)
    if reference_mode():
        return reference_grouped_call(a, b, offsets, out, dt, alpha, bias, ops, nvfp4_out,
                                      validate_offsets)
    dims = check_grouped_call(a, b, offsets, out, alpha, dt, ops, bias, require_cuda=False)
    alpha_t = None
    if via_values(schedule, dims.a_format, dims.packed):
        alpha_t = grouped_alpha(a, b, alpha, dims.experts)
        dims = dims._replace(a_format=Operand.BF16)
    kern = grouped_kernel(schedule, dims, dt, b, ops)
    validate = check and dims.total_m and not kern.validated
    if validate or validate_offsets:
        check_offsets(offsets, dims.total_m)
    a_run = a
    if alpha_t is not None:  # the values route: the decoder, then the W4A16 kernel
        a_run = dequantize_activation(a) if dims.total_m else torch.empty(
            (0, dims.k), dtype=torch.bfloat16, device=b.data.device)
    result = _launch_grouped(kern, a_run, b, offsets, out,
                             alpha if alpha_t is None else alpha_t, dims, bias, nvfp4_out)
    if validate:
        validate_grouped_call(kern, result, a, b, alpha, bias, offsets)
    return result


def grouped_op_call(a, a_scale, b, b_scale, offsets, alpha, k: int, out_dtype,
                    schedule, n: int = 0, packed: bool = False) -> torch.Tensor:
    """The body of the ``cute_fp4::grouped_mm`` op: the tensors wrapped without the
    containers' checks (their global-scale check reads values back from the GPU), then
    :func:`grouped_call`; ``alpha`` is explicit, so the global scales the wrappers carry
    (views of alpha) are never read. ``packed``: ``b`` is the fragment-order layout of
    ``n`` rows per expert (its rows padded to 64)."""
    for t, name in ((b, "b"), (b_scale, "b_scale"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if b.dim() != 3:
        raise InputError(f"b must be the experts' packed weights [E, rows, K/2], got shape "
                         f"{tuple(b.shape)}")
    n_exp, rows = b.shape[0], b.shape[1]
    n = n or rows
    fmt = format_of_scale(b_scale)
    rp, cp = fmt.scale_shape(n, k)
    if b_scale.numel() == n_exp * rp * cp and b_scale.is_contiguous():
        b_scale = b_scale.view(n_exp, rp, cp)
    gs = alpha.reshape(-1) if fmt.global_scale else None
    if packed:
        bt = packed_class(fmt)(b, as_scale(b_scale, fmt), gs, (n_exp, n, k))
    else:
        if n != rows:
            raise InputError(f"n = {n} but the plain weight layout has b.shape[1] = {rows} "
                             "rows per expert")
        bt = _wrap(fmt, b, b_scale, gs, (n_exp, n, k))
    at = a
    if a_scale is not None:
        at = _wrap(fmt, a, a_scale, None if gs is None else gs[:1].reshape(()),
                   (a.shape[0], k))
    return grouped_call(at, bt, offsets, schedule, None, out_dtype, alpha)


# ----------------------------------------------------------------------------- checked launches

def run_compiled(kernel, a, b, out=None, alpha=None, bias=None, nvfp4_out=None
                 ) -> torch.Tensor:
    """Check, allocate, launch ``kernel`` (a CompiledGemm) on a dense call's operands.

    A kernel whose mainloop reads the packed weight (rs_packed, stream) takes a
    fragment-order packed weight: a plain block tensor ``b`` is packed here on every
    call (so validation harnesses run those schedules unchanged; ``gemm`` users pack once,
    cute_fp4.packed.repack). A schedule with ``"nvfp4_out"`` takes the output's global
    scale as ``nvfp4_out`` (or an ``NVFP4Tensor`` ``out`` to write) and returns the
    ``NVFP4Tensor``."""
    check_b = b
    if isinstance(b, PackedWeight):
        check_b = _plain_view(b)
    elif kernel.schedule.mainloop.reads_packed and isinstance(b, BlockTensor):
        b = PackedWeight.from_tensor(b)
    ops = kernel.schedule.epilogue.ops
    dims = check_call(a, check_b, out, alpha, kernel.out_dtype, ops, bias)
    return run_checked(kernel, a, b, out, alpha, dims, bias, nvfp4_out)


def run_checked(kernel, a, b, out, alpha, dims, bias=None, nvfp4_out=None,
                early: bool = False) -> torch.Tensor:
    """:func:`run_compiled` after :func:`~cute_fp4.operands.check_call` returned ``dims``.
    The plan check is remembered per kernel and shape (``CompiledGemm.check_plan``).
    ``early``: ``Operands.early`` (the caller guarantees no kernel still in flight on the
    stream writes ``b``)."""
    m, n, k, a_format = dims
    s = kernel.schedule
    if s.scheduler.grouped:
        raise InputError(f"schedule {s.name or s.label()} is a grouped (MoE) schedule: call "
                         "cute_fp4.grouped_gemm(a, b, offsets)")
    if s.mainloop.reads_packed != isinstance(b, PackedWeight):
        raise InputError(f"schedule {s.name or s.label()} reads "
                         f"{'a packed' if isinstance(b, BlockTensor) else 'the plain'} weight "
                         f"layout but b is a {type(b).__name__}: rs_packed schedules take "
                         "cute_fp4.packed.repack(w) (so do stream schedules), the others "
                         "the plain block tensor")
    check_signature(kernel, a_format, b.fmt)
    kernel.check_plan(dims)
    dev = b.data.device
    result = _output(kernel, out, nvfp4_out, m, n, dev)
    ws = split_workspace(kernel, m, n, dev) if s.split_k > 1 else None
    kernel.launch(operands(a, b, result, alpha_tensor(a, b, alpha), a_format, ws, bias,
                           early=early))
    return result


def operands(a, b, out, alpha_t: torch.Tensor, a_format: str, workspace=None, bias=None,
             offsets=None, early: bool = False) -> Operands:
    """The launch's operands (``operands.Operands``): A's data and block scales (None
    for 16-bit activations), B's, the output, alpha (float32 on the device), the split-K
    workspace or the grouped offsets, the fused bias (None: absent). What
    :func:`run_checked` launches and ``bindings.bind`` fixes."""
    a_data, a_scale = (a, None) if Operand.of(a_format).sixteen_bit else (a.data, a.scale)
    return Operands(a_data, a_scale, b.data, b.scale, out, alpha_t, workspace, offsets, bias,
                    early)


def _output(kernel, out, nvfp4_out, rows: int, n: int, dev):
    """The tensor a launch writes: ``out``, or a new one of ``rows`` x the kernel's output
    columns (N / 2 with a gated activation); with ``"nvfp4_out"`` an ``NVFP4Tensor``."""
    epi = kernel.schedule.epilogue
    cols = n // 2 if gated_op(epi.ops) else n
    if epi.has("nvfp4_out"):
        return nvfp4_out_tensor(out, nvfp4_out, rows, cols, dev)
    return out if out is not None else torch.empty((rows, cols), dtype=kernel.out_dtype,
                                                   device=dev)


def run_grouped(kernel, a, b, offsets, out=None, alpha=None, bias=None,
                nvfp4_out=None) -> torch.Tensor:
    """Check, allocate, launch a compiled grouped kernel (from ``compile``, or
    ``compile_emulated`` for an SM120 schedule on an SM90 GPU): what ``grouped_gemm`` does
    after choosing the kernel; validation harnesses call it directly. ``bias``: ``[E, N]``
    for a schedule with the fused ``"bias"``; ``nvfp4_out``: the output's global scale with
    ``"nvfp4_out"`` (an ``NVFP4Tensor`` over all total_M rows is returned)."""
    ops = kernel.schedule.epilogue.ops
    dims = check_grouped_call(a, b, offsets, out, alpha, kernel.out_dtype, ops, bias)
    check_grouped_kernel(kernel, dims)
    return _launch_grouped(kernel, a, b, offsets, out, alpha, dims, bias, nvfp4_out)


def check_grouped_kernel(kernel, dims: GroupedDims) -> None:
    """A compiled kernel against a grouped call's operands: a grouped kernel, compiled for
    their A format, reading their weight layout."""
    if not kernel.schedule.scheduler.grouped:
        raise InputError(f"kernel {kernel!r} is not a grouped kernel (Scheduler.grouped is "
                         "False)")
    check_signature(kernel, dims.a_format, dims.b_format)
    check_grouped_schedule(kernel.schedule, dims)


def check_signature(kernel, a_format, b_format) -> None:
    """The kernel was compiled for these operands' formats (A's and the weight's)."""
    sig = kernel.signature
    if Operand.of(b_format) is not sig.b_format:
        raise InputError(f"kernel was compiled for A in {sig.a_format} and B in "
                         f"{sig.b_format}, got A in {a_format} and B in {b_format}")
    if a_format != sig.a_format:
        raise InputError(f"kernel was compiled for A in {sig.a_format}, got {a_format}")


def _launch_grouped(kernel, a, b, offsets, out, alpha, dims: GroupedDims, bias=None,
                    nvfp4_out=None) -> torch.Tensor:
    """Allocate the output (when not given) and launch; total_M = 0 launches nothing. The
    plan check is remembered per kernel and problem (``CompiledGemm.check_plan``)."""
    m, n, k, n_exp, a_format, *_ = dims
    result = _output(kernel, out, nvfp4_out, m, n, b.data.device)
    if m == 0:
        return result
    kernel.check_plan((m, n, k, a_format, n_exp))  # Problem(m, n, k, a_format, groups=E)
    alpha_t = grouped_alpha(a, b, alpha, n_exp)
    kernel.launch(operands(a, b, result, alpha_t, a_format, offsets=offsets, bias=bias))
    return result


# ----------------------------------------------------------------------------- validation

def validate_call(kern, result, a, b, alpha, dims, bias=None) -> None:
    """``check=True``: the first call of ``kern`` held to the exact reference (a packed
    ``b`` in its plain layout; ``a``/``alpha``/``dims`` as the kernel ran them: a W4A4 call
    run on its activation's values, those values and alpha). With fused epilogue ops, the
    unfused pipeline runs too (the same schedule without ops, FP32 output, the bias added in
    FP32, rounded, then ``F.silu(gate) * up``: ``reference.fused``): its GEMM is held to
    the reference and ``result`` must have its bits."""
    if kern.validated:
        return
    gemm = result
    if kern.schedule.epilogue.ops:  # the unfused pipeline's GEMM: no ops, FP32 output
        unfused = kernel(kern.unfused_schedule, dims, torch.float32, b.data.get_device(),
                         isinstance(b, PackedWeight), b_format=Operand.of(b.fmt))
        gemm = run_checked(unfused, a, b, None, alpha, dims)
    reference.assert_close(gemm, a, b.unpack() if isinstance(b, PackedWeight) else b, alpha)
    _assert_fused(kern, result, gemm, bias, None)
    kern.validated = True


def validate_grouped_call(kern, result, a, b, alpha, bias, offsets) -> None:
    """:func:`validate_call` of a grouped call (its ``offsets``; ``a``: the NVFP4
    activation it was given, decoded here for a kernel that ran on the values)."""
    if kern.validated:
        return
    gemm = result
    if kern.schedule.epilogue.ops:
        from cute_fp4.compile import compile as compile_schedule

        a_run = a
        if kern.signature.a_format.sixteen_bit and isinstance(a, NVFP4Tensor):
            a_run = dequantize_activation(a)
        gemm = run_grouped(compile_schedule(kern.unfused_schedule, kern.signature), a_run, b,
                           offsets, alpha=grouped_alpha(a, b, alpha, b.data.shape[0]))
    reference.assert_close_grouped(gemm, a, b, offsets, alpha)
    _assert_fused(kern, result, gemm, bias, offsets)
    kern.validated = True


def _assert_fused(kern, result, raw, bias, offsets) -> None:
    """The fused ``result`` against the unfused pipeline's GEMM ``raw`` (bit for bit); no
    check without fused ops."""
    ops = kern.schedule.epilogue.ops
    if not ops:
        return
    name = kern.schedule.name or kern.schedule.label()
    if offsets is None:
        reference.assert_fused(result, raw, bias, ops, kern.silu_group, name,
                               out_dtype_of(kern.schedule))
        return
    if bias is not None:
        raw = reference.add_expert_bias(raw, bias, offsets)
    if "nvfp4_out" in ops:  # over all rows: the blocked scales' padding is the last rows'
        reference.assert_fused(result, raw, None, ops, kern.silu_group, name,
                               out_dtype_of(kern.schedule))
        return
    lo, hi = int(offsets[0]), int(offsets[-1])  # the rows the experts cover
    reference.assert_fused(result[lo:hi], raw[lo:hi], None, ops, kern.silu_group, name)


def poisoned_check(kernel, a, b: BlockTensor) -> reference.CheckResult:
    """Run ``kernel`` into an output filled with NaN (so an unwritten element fails) and
    compare it with the exact reference."""
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(kernel.schedule),
                     device=b.device)
    run_compiled(kernel, a, b, out=out)
    torch.cuda.synchronize()
    return reference.check(out, a, b)


# ----------------------------------------------------------------------------- the reference

def reference_call(call: GemmCall):
    """A dense call under ``targets.reference_mode``: the same operand checks on any
    device, then the exact reference instead of a kernel (``reference.gemm``, the fused
    ops, ``call.ops``, by their definition, ``reference.fused``, with ``call.group`` or the
    gate/up group of the kernels that read ``b``'s layout on its device:
    ``fused.device_group``); written into ``call.out`` when given."""
    a, b, out, out_dtype, ops = call.a, call.b, call.out, call.out_dtype, call.ops
    packed = call.packed
    view = _plain_view(b) if packed else b
    check_call(a, view, out, call.alpha, out_dtype, ops, call.bias, require_cuda=False)
    w = b.unpack() if packed else b
    if not ops:
        return _into(out, reference.gemm(a, w, call.alpha, out_dtype=out_dtype))
    raw = reference.gemm(a, w, call.alpha, out_dtype=torch.float32)
    return _into(out, _fused(raw, b, packed, call.bias, ops, out_dtype, out, call.nvfp4_out,
                             call.group))


def reference_grouped_call(a, b, offsets, out, dt: torch.dtype, alpha, bias,
                           ops: tuple[str, ...], nvfp4_out, validate_offsets: bool):
    """A grouped call under ``targets.reference_mode``: the same checks on any device,
    then the exact reference (``reference.grouped_gemm``; the fused ops by their
    definition), written into ``out`` when given (the experts' rows)."""
    dims = check_grouped_call(a, b, offsets, out, alpha, dt, ops, bias, require_cuda=False)
    if validate_offsets:
        check_offsets(offsets, dims.total_m)
    if not ops:
        return _into(out, reference.grouped_gemm(a, b, offsets, alpha, dt))
    raw = reference.grouped_gemm(a, b, offsets, alpha, torch.float32)
    if bias is not None:
        raw = reference.add_expert_bias(raw, bias, offsets)
    return _into(out, _fused(raw, b, dims.packed, None, ops, dt, out, nvfp4_out))


def _fused(raw, b, packed: bool, bias, ops, out_dtype, out, nvfp4_out, group=None):
    from cute_fp4.fused import device_group

    scale = out.global_scale if isinstance(out, NVFP4Tensor) else nvfp4_out
    if group is None:
        group = device_group(b.data.device, "packed" if packed else "plain")
    return reference.fused(raw, bias, ops, group, out_dtype, scale)


def _into(out, y):
    """``y`` written into ``out`` (a tensor, or an NVFP4Tensor's codes and scales)."""
    if out is None:
        return y
    if isinstance(y, NVFP4Tensor):
        out.data.copy_(y.data)
        out.scale.copy_(y.scale)
        return out
    return out.copy_(y)


__all__ = ["check_grouped_kernel", "gemm_call", "grouped_call", "grouped_kernel",
           "grouped_op_call", "kernel", "op_call", "operands", "poisoned_check", "reference_call",
           "reference_grouped_call", "run_checked", "run_compiled", "run_grouped",
           "validate_call", "validate_grouped_call", "via_values"]
