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

Layering: the API layer, next to ``api`` (it builds on ``compile``, ``catalogue`` and the
operand checks); nothing below imports it. The op is registered on first use, as
``cute_fp4::mm`` is (see ``cute_fp4.api``): by the first eager call, while torch.compile
traces a call, or by :func:`register_op`.
"""

from __future__ import annotations

import torch

from cute_fp4 import reference
from cute_fp4.compile import CompiledGemm, Signature
from cute_fp4.compile import compile as compile_schedule
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape
from cute_fp4.operands import (
    N_MULTIPLE,
    GroupedDims,
    as_e4m3,
    b_stack,
    check_fused_operands,
    check_grouped_operands,
    check_offsets,
    epilogue_ops,
    grouped_alpha,
    nvfp4_out_tensor,
    out_dtype_of,
    require_cuda_operands,
    torch_out,
)
from cute_fp4.oplib import LazyOp, define, while_tracing
from cute_fp4.packed import PackedNVFP4Weight, repack
from cute_fp4.schedule import Mainloop, OutDtype, Problem, Schedule
from cute_fp4.targets import reference_mode
from cute_fp4.tuning import with_ops

__all__ = ["AUTO_SCHEDULES", "N_MULTIPLE", "GroupedDims", "check_grouped_operands",
           "check_offsets", "grouped_alpha", "grouped_gemm", "grouped_mm", "register_op",
           "via_values",
           "resolve_grouped", "run_grouped"]

# the catalogue schedule "auto" runs, per kernel family of the present GPU ...
AUTO_SCHEDULES = {"sm90": "sm90_grouped", "sm120": "sm120_grouped"}
# ... unless the experts average at most this many rows (decode): then this one. Measured
# on the H200 (perf/tools/grouped_tiles.py, 2026-12-01): at 1-4 rows per expert the 16-row
# four-warpgroup tile runs 1.6-1.8x the 128-row one, at 256 rows 0.3x; sm_90a's decode tile
# takes 16-bit activations only (W4A4 needs 64-row activation tiles there).
AUTO_DECODE = {"sm90": ("sm90_grouped_decode", 16), "sm120": ("sm120_grouped_decode", 32)}
# ... and this one when they average at least this many (large prefill: 256-row tiles;
# 0.93-0.97x torch grouped_mm at 256 rows per expert against 0.86-0.90x for 192 rows)
AUTO_LARGE = {"sm90": ("sm90_grouped_large", 192)}
# 16-bit activations on a packed stack, the experts averaging at most this many rows: the
# grouped weight-streaming kernel (one CTA per routed expert's 64 weight rows, 8 activation
# rows). On SM12x it is the only W4A16 grouped kernel, so every size takes it there. On
# sm_90a only while its CTAs (routed experts, at most min(E, total_M), x N / 64) fit about
# two waves of three per SM and K is at most STREAM_MAX_K: it has no split of K and is not
# persistent, so past that the persistent rs_packed decode tile balances better. H200,
# 2026-12-03 (perf/results/2026-12-03-h200-grouped-decode.md), stream / rs_packed decode
# time: 0.71x and 0.79x at 192 and 256 CTAs (Qwen3-30B-A3B 1 token), 0.85x at 768 (4
# tokens gate_up), 1.20x at 1024 (4 tokens down), 1.17x and 1.26x at 2064 and 2752 (16
# tokens); 1.17x at 512 CTAs with K = 7168 (DeepSeek-V3 1 token gate_up: a second, partial
# wave of long CTAs), 0.92-0.96x with K = 7168 and 1920+ CTAs (4-128 tokens). So: few
# CTAs with K up to STREAM_MAX_K, or many (at least four waves) with a longer K.
AUTO_STREAM = {"sm90": ("sm90_stream_grouped_decode", 4),
               "sm120": ("sm120_stream_grouped_decode", float("inf"))}
STREAM_MAX_UNITS = {"sm90": 800}  # sm_90a: CTAs of the estimate above (two waves, 132 SMs)
STREAM_MAX_K = {"sm90": 4096}
STREAM_LONG_K_UNITS = {"sm90": 1600}  # ... and past STREAM_MAX_K, at least this many


# ----------------------------------------------------------------------------- schedules

def auto_schedule_name(family: str, dims: GroupedDims | None = None) -> str:
    """The catalogue schedule "auto" means for ``dims`` on a GPU of ``family``: the
    grouped stream kernel of :data:`AUTO_STREAM` for 16-bit activations on a packed stack
    when the experts average few rows (sm_90a: by CTAs and K, :func:`_stream_fits`); the decode one
    of :data:`AUTO_DECODE` when they average few rows, the large one of
    :data:`AUTO_LARGE` when they average many, else :data:`AUTO_SCHEDULES`'s; of those,
    the first that ``plan()`` accepts for the activation format (sm_90a's decode and
    192-row tiles take 16-bit activations only: W4A4 needs 128-row activation tiles)."""
    if dims is None:
        return AUTO_SCHEDULES[family]
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan

    per_expert = dims.total_m / max(dims.experts, 1)
    if _stream_fits(family, dims):
        return AUTO_STREAM[family][0]
    decode, few = AUTO_DECODE[family]
    large, many = AUTO_LARGE.get(family, (None, float("inf")))
    first = [decode] if per_expert <= few else [large] if per_expert >= many else []
    for name in (*first, AUTO_SCHEDULES[family], large, decode):
        if name is not None and plan(catalogue.get(name), Problem(a_format=dims.a_format)).ok:
            return name
    return AUTO_SCHEDULES[family]


def resolve_grouped(schedule, out_dtype=torch.bfloat16,
                    dims: GroupedDims | None = None) -> Schedule:
    """A grouped Schedule from a Schedule, a catalogue name, or "auto" (for the present
    GPU's family and ``dims``: :func:`auto_schedule_name`), with ``out_dtype``'s
    epilogue."""
    from cute_fp4 import catalogue

    if isinstance(schedule, str):
        if schedule == "auto":
            from cute_fp4.targets import gemm_device

            schedule = auto_schedule_name(str(gemm_device().target.family), dims)
        schedule = catalogue.get(schedule)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    if not schedule.scheduler.grouped:
        raise InputError(f"schedule {schedule.name or schedule.label()} is not a grouped "
                         "schedule (Scheduler.grouped is False): grouped_gemm runs "
                         f"{' / '.join(AUTO_SCHEDULES.values())} or a schedule made with "
                         "replace(grouped=True)")
    want = OutDtype.of(out_dtype)
    return schedule if schedule.epilogue.out_dtype is want else schedule.replace(out_dtype=want)


def check_schedule(s: Schedule, dims: GroupedDims) -> None:
    """The operands' layout and A format against what the schedule's kernel reads."""
    name = s.name or s.label()
    reads_packed = s.mainloop.reads_packed
    stream = s.mainloop is Mainloop.STREAM
    if reads_packed and not dims.packed:
        raise InputError(f"schedule {name} reads the fragment-order packed weight "
                         f"(mainloop={s.mainloop.value}) but b is a plain NVFP4Tensor: "
                         "repack it once with cute_fp4.packed.repack(b)")
    if dims.packed and not reads_packed:
        raise InputError(f"schedule {name} reads the plain weight layout but b is a "
                         "PackedNVFP4Weight: use an rs_packed or stream grouped schedule, "
                         "'auto', or b.unpack()")
    if stream and dims.a_format == "nvfp4":
        raise InputError(f"schedule {name} (mainloop=stream) takes 16-bit activations "
                         "(W4A16); NVFP4 activations on a packed stack: schedule='auto' runs "
                         "it on their exact BF16 block values")
    if s.arch.family == "sm120" and not stream and dims.a_format != "nvfp4":
        raise InputError(f"schedule {name} ({s.target}) takes NVFP4 activations (W4A4), a is "
                         f"{dims.a_format} (W4A16): quantize them first "
                         "(cute_fp4.quant.quantize_activation)")


# memos of a schedule argument (a name, or a Schedule by identity: the memo holds it, so
# the id stays its own), keyed with the out dtype and the device index (and A's format)
_SCHEDULES: dict[tuple, tuple[object, Schedule]] = {}
_KERNELS: dict[tuple, tuple[object, CompiledGemm]] = {}
_MEMO_MAX = 1024


def clear_memos() -> None:
    """Forget the memoised schedule resolutions and kernels (``emulation.emulate`` changes
    what "auto" resolves to)."""
    _SCHEDULES.clear()
    _KERNELS.clear()


def _memo_put(memo: dict, key: tuple, value: tuple) -> None:
    if len(memo) >= _MEMO_MAX:
        memo.clear()
    memo[key] = value


def _stream_fits(family: str, dims: GroupedDims) -> bool:
    """Whether "auto" runs the grouped stream kernel (:data:`AUTO_STREAM`): 16-bit
    activations on a packed stack, few rows per expert, and on sm_90a few CTAs with K at
    most :data:`STREAM_MAX_K`, or many with a longer K."""
    if family not in AUTO_STREAM or not dims.packed or dims.a_format == "nvfp4":
        return False
    if dims.total_m > AUTO_STREAM[family][1] * max(dims.experts, 1):
        return False
    units = min(dims.experts, dims.total_m) * -(-dims.n // 64)
    if dims.k > STREAM_MAX_K.get(family, float("inf")):
        return units >= STREAM_LONG_K_UNITS[family]
    return units <= STREAM_MAX_UNITS.get(family, float("inf"))


def _auto_regime(schedule, dims: GroupedDims | None):
    """What "auto" depends on besides the device: (decode-sized?, A format); None else."""
    if schedule != "auto" or dims is None:
        return None
    experts = max(dims.experts, 1)
    few = tuple(dims.total_m <= limit * experts for _, limit in AUTO_DECODE.values())
    many = tuple(dims.total_m >= limit * experts for _, limit in AUTO_LARGE.values())
    stream = tuple(_stream_fits(f, dims) for f in AUTO_STREAM)
    return few, many, stream, dims.a_format


def _schedule_for(schedule, out_dtype: torch.dtype, device_index: int,
                  dims: GroupedDims | None = None) -> Schedule:
    """:func:`resolve_grouped`, memoised (``Schedule.replace`` and the catalogue lookup
    cost tens of microseconds a call otherwise)."""
    key = (schedule if isinstance(schedule, str) else id(schedule), out_dtype, device_index,
           _auto_regime(schedule, dims))
    hit = _SCHEDULES.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    s = resolve_grouped(schedule, out_dtype, dims)
    _memo_put(_SCHEDULES, key, (schedule, s))
    return s


def _kernel_for(schedule, dims: GroupedDims, out_dtype: torch.dtype, b,
                ops: tuple[str, ...] = ()) -> CompiledGemm:
    """The compiled kernel for a ``schedule`` argument, memoised like :func:`_schedule_for`.
    The schedule is resolved and checked against the operands before the device check,
    so its errors are the same on the CPU. ``ops``: fused epilogue operations, given to
    the schedule resolved as without them."""
    dev = b.data.get_device()
    key = (schedule if isinstance(schedule, str) else id(schedule), dims.a_format, out_dtype,
           dev, _auto_regime(schedule, dims), ops)
    hit = _KERNELS.get(key)
    if hit is not None and hit[0] is schedule:
        check_schedule(hit[1].schedule, dims)
        return hit[1]
    s = _schedule_for(schedule, out_dtype, dev, dims)
    if ops and schedule == "auto":  # "auto" may take another tile for the ops
        s = with_ops(s, ops, dims.total_m, dims.n, dims.k, dims.a_format, dims.experts)
    elif ops and s.epilogue.ops != ops:
        s = s.replace(ops=ops)
    check_schedule(s, dims)
    require_cuda_operands(b)
    kern = compile_schedule(s, Signature(dims.a_format))
    _memo_put(_KERNELS, key, (schedule, kern))
    return kern


# ----------------------------------------------------------------------------- running

def _check_kernel(kern: CompiledGemm, dims: GroupedDims) -> None:
    if not kern.schedule.scheduler.grouped:
        raise InputError(f"kernel {kern!r} is not a grouped kernel (Scheduler.grouped is "
                         "False)")
    if kern.signature.a_format != dims.a_format:
        raise InputError(f"kernel was compiled for A in {kern.signature.a_format}, "
                         f"got {dims.a_format}")
    check_schedule(kern.schedule, dims)


def run_grouped(kern: CompiledGemm, a, b, offsets, out=None, alpha=None,
                bias=None, nvfp4_out=None) -> torch.Tensor:
    """Run a compiled grouped kernel (from ``compile``, or ``compile_emulated`` for an SM120
    schedule on an SM90 GPU): check, allocate, launch. What :func:`grouped_gemm` does after
    choosing the kernel; validation harnesses call it directly. ``bias``: ``[E, N]`` for a
    schedule with the fused ``"bias"``; ``nvfp4_out``: the output's global scale with
    ``"nvfp4_out"`` (an ``NVFP4Tensor`` over all total_M rows is returned)."""
    ops = kern.schedule.epilogue.ops
    dims = check_grouped_operands(a, b, offsets, None if ops else out, alpha, kern.out_dtype)
    if ops:
        check_fused_operands(bias, out, dims.total_m, dims.n, kern.out_dtype, ops,
                             b.data.device, dims.experts)
    _check_kernel(kern, dims)
    return _launch(kern, a, b, offsets, out, alpha, dims, bias, nvfp4_out)


def _launch(kern: CompiledGemm, a, b, offsets, out, alpha, dims: GroupedDims,
            bias=None, nvfp4_out=None) -> torch.Tensor:
    """Allocate the output (when not given) and launch; total_M = 0 launches nothing. The
    plan check is remembered per kernel and problem (``CompiledGemm.check_plan``)."""
    m, n, k, n_exp, a_format, _ = dims
    dev = b.data.device
    cols = n // 2 if kern.schedule.epilogue.has("silu_mul") else n
    if kern.schedule.epilogue.has("nvfp4_out"):  # rows the offsets leave out get no scales
        result = nvfp4_out_tensor(out, nvfp4_out, m, cols, dev)
    else:
        result = out if out is not None else torch.empty((m, cols), dtype=kern.out_dtype,
                                                         device=dev)
    if m == 0:
        return result
    kern.check_plan((m, n, k, a_format, n_exp))  # Problem(m, n, k, a_format, groups=E)
    alpha_t = grouped_alpha(a, b, alpha, n_exp)
    a_data, a_scale = (a.data, a.scale) if a_format == "nvfp4" else (a, None)
    kern.launch(a_data, a_scale, b.data, b.scale, result, alpha_t, offsets, bias)
    return result


def via_values(schedule, dims: GroupedDims) -> bool:
    """Whether a call runs W4A4 as the W4A16 kernel on the activation's exact BF16 block
    values: NVFP4 activations, a fragment-order packed weight (sm_90a) and "auto", as
    ``gemm`` does for a dense W4A4 product there (``run.GemmPath._w4a4_via_bf16``: the rs_packed
    mainloop's own W4A4 route converts each activation stage without overlap and ran at
    0.56-0.90x torch BF16 grouped at every size, H200 2026-12-02)."""
    return (dims.a_format == "nvfp4" and dims.packed and isinstance(schedule, str)
            and schedule == "auto")


def _w4a4_via_values(a: NVFP4Tensor, b, offsets, out, dt, alpha, dims: GroupedDims,
                     check_offsets_first: bool, bias=None,
                     ops: tuple[str, ...] = ()) -> tuple[torch.Tensor, CompiledGemm]:
    """:func:`via_values`'s launches: the decoder (one pass, ``quant.dequantize_activation``:
    bit for bit ``a.block_values``), then the W4A16 grouped kernel with alpha = the global
    scales' product per expert (or the given alpha): the same exact products as a W4A4
    kernel."""
    from cute_fp4.quant import dequantize_activation

    dims16 = dims._replace(a_format="bf16")
    kern = _kernel_for("auto", dims16, dt, b, ops)
    if check_offsets_first:
        check_offsets(offsets, dims.total_m)
    alpha_t = grouped_alpha(a, b, alpha, dims.experts)
    a16 = dequantize_activation(a) if dims.total_m else torch.empty(
        (0, dims.k), dtype=torch.bfloat16, device=b.data.device)
    return _launch(kern, a16, b, offsets, out, alpha_t, dims16, bias), kern


def _reference_grouped(a, b, offsets, out, dt: torch.dtype, alpha, bias,
                       ops: tuple[str, ...], nvfp4_out, validate_offsets: bool):
    """:func:`grouped_gemm` under ``targets.reference_mode``: the same checks on any device,
    then the exact reference (``reference.grouped_gemm``; the fused ops by their definition,
    ``reference.fused``, with the gate/up group of the kernels reading ``b``'s layout there),
    written into ``out`` when given (the experts' rows)."""
    from cute_fp4.fused import device_group

    dims = check_grouped_operands(a, b, offsets, None if ops else out, alpha, dt,
                                  require_cuda=False)
    dev = b.data.device
    if ops:
        check_fused_operands(bias, out, dims.total_m, dims.n, dt, ops, dev, dims.experts)
    if validate_offsets:
        check_offsets(offsets, dims.total_m)
    if not ops:
        y = reference.grouped_gemm(a, b, offsets, alpha, dt)
    else:
        raw = reference.grouped_gemm(a, b, offsets, alpha, torch.float32)
        if bias is not None:
            raw = _add_expert_bias(raw, bias, offsets)
        scale = out.global_scale if isinstance(out, NVFP4Tensor) else nvfp4_out
        y = reference.fused(raw, None, ops, device_group(dev, "packed" if dims.packed
                                                         else "plain"), dt, scale)
    if out is None:
        return y
    if isinstance(y, NVFP4Tensor):
        out.data.copy_(y.data)
        out.scale.copy_(y.scale)
        return out
    return out.copy_(y)


def _grouped_impl(a, b, offsets, schedule, out, out_dtype, alpha, check,
                  validate_offsets: bool = False, bias=None,
                  ops: tuple[str, ...] = (), nvfp4_out=None) -> torch.Tensor:
    dt = torch_out(out_dtype)
    if reference_mode():
        return _reference_grouped(a, b, offsets, out, dt, alpha, bias, ops, nvfp4_out,
                                  validate_offsets)
    dims = check_grouped_operands(a, b, offsets, None if ops else out, alpha, dt,
                                  require_cuda=False)
    if ops:
        check_fused_operands(bias, out, dims.total_m, dims.n, dt, ops, b.data.device,
                             dims.experts)
    if via_values(schedule, dims):
        result, kern = _w4a4_via_values(a, b, offsets, out, dt, alpha, dims,
                                        check or validate_offsets, bias, ops)
        if check and dims.total_m and not kern.validated:
            _validate(kern, result, a, b, offsets, alpha, bias, ops)
        return result
    kern = _kernel_for(schedule, dims, dt, b, ops)
    validate = check and dims.total_m and not kern.validated
    if validate or validate_offsets:
        check_offsets(offsets, dims.total_m)
    result = _launch(kern, a, b, offsets, out, alpha, dims, bias, nvfp4_out)
    if validate:
        _validate(kern, result, a, b, offsets, alpha, bias, ops)
        kern.validated = True
    return result


def _validate(kern: CompiledGemm, result, a, b, offsets, alpha, bias, ops) -> None:
    """``check=True``: the GEMM against the exact reference; with fused ``ops``, the GEMM
    of the same schedule without them (FP32 output) against the reference and the fused
    output against that unfused pipeline, bit for bit (``run.GemmPath.run_fused``)."""
    from cute_fp4.quant import dequantize_activation

    if not ops:
        reference.assert_close_grouped(result, a, b, offsets, alpha)
        return
    plain = kern.schedule.replace(ops=(), out_dtype="fp32")
    a_run = a
    if kern.signature.a_format != "nvfp4" and isinstance(a, NVFP4Tensor):
        a_run = dequantize_activation(a)  # the values route: the W4A16 kernel ran
    raw = run_grouped(compile_schedule(plain, kern.signature), a_run, b, offsets,
                      alpha=grouped_alpha(a, b, alpha, b.data.shape[0]))
    reference.assert_close_grouped(raw, a, b, offsets, alpha)
    if bias is not None:
        raw = _add_expert_bias(raw, bias, offsets)
    name = kern.schedule.name or kern.schedule.label()
    if "nvfp4_out" in ops:  # over all rows: the blocked scales' padding is the last rows'
        reference.assert_fused(result, raw, None, ops, kern.silu_group, name,
                               out_dtype_of(kern.schedule))
        return
    lo, hi = int(offsets[0]), int(offsets[-1])  # the rows the experts cover
    reference.assert_fused(result[lo:hi], raw[lo:hi], None, ops, kern.silu_group, name)


def _add_expert_bias(raw: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor):
    """FP32 ``raw`` plus each row's expert's bias (rows by the offsets)."""
    counts = (offsets[1:] - offsets[:-1]).clamp(min=0).long()
    expert = torch.repeat_interleave(torch.arange(len(counts), device=raw.device), counts)
    out = raw.clone()
    lo = int(offsets[0])
    out[lo:lo + len(expert)] += bias[expert]
    return out


def grouped_gemm(a, b, offsets: torch.Tensor, *, schedule="auto",
                 out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 alpha=None, bias: torch.Tensor | None = None, silu_mul: bool = False,
                 nvfp4_out=None, check: bool = False,
                 validate_offsets: bool = False) -> torch.Tensor:
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
    ``silu_mul=True`` (each expert's rows gate/up interleaved, ``cute_fp4.fused``; the
    output ``[total_M, N / 2]``), ``nvfp4_out=global_scale`` (the output quantized in the
    epilogue, returned as an ``NVFP4Tensor`` over all total_M rows; the offsets must cover
    them: ``offsets[0] = 0``, ``offsets[E] = total_M``).
    """
    ops = epilogue_ops(bias, silu_mul, nvfp4_out)
    if ops:
        if torch.compiler.is_compiling():
            raise InputError("grouped_gemm with bias= or silu_mul= is not supported under "
                             "torch.compile yet (cute_fp4::grouped_mm has no epilogue "
                             "operands)")
        return _grouped_impl(a, b, offsets, schedule, out, out_dtype, alpha, check,
                             validate_offsets, bias, ops, nvfp4_out)
    if torch.compiler.is_compiling():
        if validate_offsets:
            raise InputError("validate_offsets=True reads the offsets back (a GPU sync), "
                             "which torch.compile cannot trace: validate them outside")
        return _op_call(a, b, offsets, schedule, out, out_dtype, alpha)
    if not _OP.registered:
        _OP.register()
    return _grouped_impl(a, b, offsets, schedule, out, out_dtype, alpha, check,
                         validate_offsets)


# ----------------------------------------------------------------------------- custom op

def _op_call(a, b, offsets, schedule, out, out_dtype, alpha) -> torch.Tensor:
    """``grouped_gemm`` while torch.compile traces it: one ``cute_fp4::grouped_mm`` node (a
    given ``out`` is filled from its result)."""
    n_exp, n, k, _ = b_stack(b)
    a_t, a_sf = (a.data, a.scale) if isinstance(a, NVFP4Tensor) else (a, None)
    alpha_t = grouped_alpha(a, b, alpha, n_exp)
    res = grouped_mm(a_t, a_sf, b.data, b.scale, offsets, alpha_t, k, torch_out(out_dtype),
                     schedule, n)
    if out is None:
        return res
    out.copy_(res)
    return out


def grouped_mm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
               b_scale: torch.Tensor, offsets: torch.Tensor, alpha: torch.Tensor, k: int,
               out_dtype: torch.dtype = torch.bfloat16, schedule: str = "auto",
               n: int = 0) -> torch.Tensor:
    """``grouped_gemm`` on plain tensors, in the form of the ``cute_fp4::grouped_mm`` op:
    ``a`` the packed NVFP4 bytes [total_M, K/2] with ``a_scale`` (W4A4) or bf16/fp16
    [total_M, K] with ``a_scale=None`` (W4A16); ``b``/``b_scale`` the experts' bytes
    [E, rows, K/2] and blocked scales [E, ...]; ``offsets`` int32 [E + 1]; ``alpha`` float32
    [E] (not derived here); ``n`` the weight rows per expert, 0 for ``b.shape[1]`` (a packed
    weight pads its rows to 64, so it must give ``n``). The schedule's mainloop says
    whether ``b`` is the plain or the packed layout.

    Eager, it runs the kernel without the op's dispatch; under torch.compile it is one
    ``cute_fp4::grouped_mm`` node (registered while tracing). Values are not checked (no
    GPU sync), which is what lets CUDA graphs capture it."""
    if torch.compiler.is_compiling():
        if not isinstance(schedule, str):
            raise InputTypeError("under torch.compile, pass schedule as a catalogue name or "
                                 "'auto'")
        _register_while_tracing()
        return torch.ops.cute_fp4.grouped_mm(a, a_scale, b, b_scale, offsets, alpha, k,
                                             out_dtype, schedule, n)
    if not _OP.registered:
        _OP.register()
    return _grouped_mm_impl(a, a_scale, b, b_scale, offsets, alpha, k, out_dtype, schedule, n)


def _grouped_mm_impl(a, a_scale, b, b_scale, offsets, alpha, k, out_dtype, schedule,
                     n) -> torch.Tensor:
    """The op's body: wrap the tensors without the containers' checks (their global-scale
    check reads values back from the GPU) and run :func:`grouped_gemm`'s path; ``alpha`` is
    explicit, so the global scales the wrappers carry (views of alpha) are never read."""
    for t, name in ((b, "b"), (b_scale, "b_scale"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if b.dim() != 3:
        raise InputError(f"b must be the experts' packed weights [E, rows, K/2], got shape "
                         f"{tuple(b.shape)}")
    n_exp, rows = b.shape[0], b.shape[1]
    n = n or rows
    if reference_mode() and schedule == "auto":  # no GPU to resolve "auto" for: the rows
        packed = n != rows  # tell (a packed stack pads them to 64)
    else:
        packed = _schedule_for(schedule, torch_out(out_dtype),
                               b.get_device()).mainloop.reads_packed
    rp, cp = scale_shape(n, k)
    if b_scale.numel() == n_exp * rp * cp and b_scale.is_contiguous():
        b_scale = b_scale.view(n_exp, rp, cp)
    gs = alpha.reshape(-1)
    if packed:
        bt = PackedNVFP4Weight(b, as_e4m3(b_scale), gs, (n_exp, n, k))
    else:
        if n != rows:
            raise InputError(f"n = {n} but the plain weight layout has b.shape[1] = {rows} "
                             f"rows per expert (schedule {schedule})")
        bt = NVFP4Tensor._unchecked(b, as_e4m3(b_scale), gs, (n_exp, n, k))
    at = a
    if a_scale is not None:
        at = NVFP4Tensor._unchecked(a, as_e4m3(a_scale), gs[:1].reshape(()), (a.shape[0], k))
    return _grouped_impl(at, bt, offsets, schedule, None, out_dtype, alpha, False)


def _register_while_tracing() -> None:
    """Register the op while Dynamo traces a call (``cute_fp4.oplib.while_tracing``)."""
    while_tracing(lambda ctx: register_op(), register_op)


_OP = LazyOp("grouped_mm", lambda: _define_op())  # registered on first use
_op_exists = _OP.exists


def register_op():
    """Register ``cute_fp4::grouped_mm`` with its fake implementation, once per process
    (idempotent, thread-safe); returns the ``torch.ops.cute_fp4`` namespace.

    ``torch.ops.cute_fp4.grouped_mm(a, a_scale, b, b_scale, offsets, alpha, k, out_dtype,
    schedule, n=0)``: arguments as :func:`grouped_mm`; returns ``[total_M, n or
    b.shape[1]]`` of ``out_dtype``."""
    return _OP.register()


def _define_op() -> None:
    define("grouped_mm(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor offsets, "
           "Tensor alpha, SymInt k, ScalarType out_dtype, str schedule, SymInt n=0) -> Tensor",
           _grouped_mm_impl,
           lambda a, a_scale, b, b_scale, offsets, alpha, k, out_dtype, schedule, n=0:
           a.new_empty((a.shape[0], n or b.shape[1]), dtype=out_dtype))


# ----------------------------------------------------------------------------- validation

# (routing name, tokens per expert) of validate_grouped: ragged, empty first/last experts,
# one token each, every token to one expert, a single token, tails past the tile
VALIDATION_ROUTINGS = (("ragged", (3, 0, 17, 1, 40, 0, 9, 130)), ("empty_ends", (0, 5, 9, 0)),
                       ("one_each", (1,) * 16), ("all_to_one", (0, 0, 300, 0)),
                       ("single", (0, 0, 0, 1)), ("tails", (129, 64, 257)))


def validate_grouped(kern: CompiledGemm, a_format: str, seed: int = 0
                     ) -> tuple[list[reference.GroupedCheckResult], bool]:
    """Run a compiled grouped kernel over :data:`VALIDATION_ROUTINGS` (N with a tail, K a
    few K tiles) against the exact reference, outputs NaN-poisoned so an unwritten row
    fails. Returns (one check per routing, whether the poison itself fails the rule):
    what ``cute_fp4.api.validate`` reports for a grouped schedule."""
    from cute_fp4.operands import make_operands

    rs_packed = kern.schedule.mainloop.reads_packed
    n, k = 136, (384 if rs_packed else 352)
    results, poison_ok = [], True
    for i, (_, counts) in enumerate(VALIDATION_ROUTINGS):
        total = sum(counts)
        a, _ = make_operands(total, 16, k, a_format, seed + i)
        g = torch.Generator(device="cuda").manual_seed(seed + 100 + i)
        w = quantize(torch.randn(len(counts), n, k, generator=g, device="cuda"))
        b = repack(w) if rs_packed else w
        offs = torch.tensor([0, *_cumsum(counts)], dtype=torch.int32, device="cuda")
        out = torch.full((total, n), float("nan"), dtype=kern.out_dtype, device="cuda")
        if i == 0:
            poison_ok = not reference.check_grouped(out, a, w, offs).passed
        run_grouped(kern, a, b, offs, out=out)
        torch.cuda.synchronize()
        results.append(reference.check_grouped(out, a, w, offs))
    return results, poison_ok


def _cumsum(counts) -> list[int]:
    out, run = [], 0
    for c in counts:
        run += c
        out.append(run)
    return out
