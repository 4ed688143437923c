"""The torch-facing API: ``gemm``, ``validate``, the ``cute_fp4::mm`` custom op and its
plain-tensor form :func:`mm`, :func:`quantize_op` (fused activation quantization as ops).

Every call goes through :func:`cute_fp4.operands.check_operands` before anything is
launched or written: a bad input raises a typed error naming the problem and the numbers,
and the output tensor is left untouched. ``gemm`` is also the ``torch.library`` custom op
``cute_fp4::mm`` (with a fake implementation), so ``torch.compile(fullgraph=True)`` of a
function that calls it captures one node. The op is registered on first use, not when
this module is imported: by the first ``gemm`` call (eager, or while torch.compile traces
it) or by ``cute_fp4.ops.register()`` (needed first only to call ``torch.ops.cute_fp4.mm``
directly).

Layering: this module builds on the host layer (``compile``, ``run``) and the tuning
store; it re-exports the operand and launch helpers scripts use from here. The module API
(``NVFP4Linear``, ``convert``) is ``cute_fp4.nn``, one layer up in use (it imports this).
"""

from __future__ import annotations

import dataclasses

import torch

from cute_fp4 import reference
from cute_fp4.compile import kernel_for, resolution_deadline
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, scale_shape
from cute_fp4.operands import (
    ALIGN,
    alpha_tensor,
    as_e4m3,
    check_operands,
    make_operands,
    out_dtype_of,
)
from cute_fp4.oplib import LazyOp, define, while_tracing
from cute_fp4.packed import PackedNVFP4Weight
from cute_fp4.run import (
    bound_gemm,
    bound_op,
    op_key,
    poisoned_check,
    private_workspaces,
    remember_gemm,
    remember_op,
    run_checked,
    run_compiled,
)
from cute_fp4.schedule import OutDtype, Schedule

__all__ = ["ALIGN", "DEFAULT_SHAPES", "SWAPAB_MAX_M", "ValidationReport", "check_operands",
           "gemm", "heuristic", "make_operands", "mm", "mm_packed", "out_dtype_of",
           "poisoned_check", "quantize_op", "register_op", "resolve_schedule", "run_compiled",
           "validate"]

SWAPAB_MAX_M = 32  # sm90: up to this M the swap-AB decode schedule is picked
_alpha_tensor = alpha_tensor  # the name scripts under perf/ use


# ----------------------------------------------------------------------------- running

def resolve_schedule(schedule, m: int, n: int, k: int, a_format: str,
                     out_dtype: torch.dtype) -> Schedule:
    """A Schedule from a Schedule, a catalogue name, or "auto" (tuned, else heuristic)."""
    from cute_fp4 import catalogue
    from cute_fp4.targets import require_device

    if isinstance(schedule, str) and schedule != "auto":
        schedule = catalogue.get(schedule)
    if schedule == "auto":
        from cute_fp4.tuning import lookup

        dev = require_device()
        if dev.target.family == "sm120" and a_format != "nvfp4":
            raise InputError(f"W4A16 ({a_format} activations) on {dev.target.name} runs the "
                             "stream kernel, which reads the fragment-order packed weight: "
                             "pass cute_fp4.packed.repack(w) once (NVFP4Linear holds it so), "
                             "or quantize the activations (W4A4)")
        schedule = lookup(dev, m, n, k, a_format) or heuristic(dev.target.family, m, n, k)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    want = OutDtype.of(out_dtype)
    return schedule if schedule.epilogue.out_dtype is want else schedule.replace(out_dtype=want)


def heuristic(family: str, m: int, n: int, k: int, packed: bool = False,
              a_format: str = "bf16", target: str | None = None) -> Schedule:
    """The catalogue schedule a shape gets when nothing was tuned for it (``packed``: the
    weight is a fragment-order PackedNVFP4Weight, which the ``rs_packed`` and ``stream``
    mainloops read; the schedule depends on the activation format, ``a_format``;
    ``target``: the GPU's target name, default the family's first)."""
    from cute_fp4 import catalogue

    if packed:
        target = target or _family_target(family)
        if family == "sm120":
            if a_format == "nvfp4":
                raise InputError("on sm_120a/sm_121a a PackedNVFP4Weight takes 16-bit "
                                 "activations (the stream kernel); W4A4 runs on the plain "
                                 "weight: use weight.unpack()")
            # the stream kernel is SM120's only W4A16 kernel: every M (activation tiles of
            # 8 rows up to M = 8, else of 16, as many as M needs)
            return stream_decode_schedule(target, min(m, 16), n, k)
        if family != "sm90":
            raise InputError(f"a PackedNVFP4Weight runs on sm_90a and sm_120a/sm_121a, not "
                             f"on {family}; use weight.unpack()")
        return _packed_heuristic(m, n, k, a_format, target)
    if family == "sm90":
        if m <= SWAPAB_MAX_M:
            # swap-AB decode: activation tile (WGMMA's N) = the smallest of 8/16/32 >= M
            tm = 8 if m <= 8 else 16 if m <= 16 else 32
            s = catalogue.get("sm90_decode_swapab")
            if s.tile.m != tm:
                s = s.replace(tile=(tm, s.tile.n, s.tile.k))
            # one CTA per 64 weight rows; split-K (reduced in the kernel) where that leaves
            # SMs idle: measured on H200 (perf/results/2026-12-01-h200-decode.md), M = 1:
            # N x K = 1024 x 4096 17.0 -> 10.2 us (split 4), 4096 x 4096 16.3 -> 13.5 (2)
            split = decode_split(-(-n // s.tile.n), -(-k // s.tile.k), s.arch.sm_count)[1]
            return s.replace(split_k=split) if split > 1 else s
        # measured on H200, N = K = 8192 (perf/results/2026-11-30-h200.md): at M = 256
        # 128x128x64 takes 96 us vs 138 us for 128x256x64 (twice the tiles); from M = 1024
        # the 128x256x64 default is fastest
        name = ("sm90_decode" if m <= 64 else "sm90_128x128x64" if m <= 512
                else "sm90_default")
    else:
        name = "sm120_decode_splitk4" if m <= 64 and k >= 2048 else "sm120_default"
    return catalogue.get(name)


DECODE_SPLITS = (1, 2, 3, 4, 6, 8, 16)
DECODE_MIN_K_TILES = 4  # K tiles per split at least
# what a work unit costs besides its K tiles, in K tiles: its partials (a 16-column tile
# even at M = 1), arrival and epilogue. Fitted to H200 runs of one 256 x 128 tile at
# N x K = 28672 x 4096, M = 1, split 1/2/4/8: 40.4/44.1/50.2/61.5 us -> 2.8-3.8
DECODE_UNIT_COST = 3


def decode_split(tiles: int, k_tiles: int, sms: int) -> tuple[int, int, int]:
    """(cost, split, waves) of the best split-K for a weight-streaming decode GEMM of
    ``tiles`` output tiles x ``k_tiles`` K tiles on ``sms`` SMs: cost = what the busiest
    CTA does (waves x (K tiles per split + ``DECODE_UNIT_COST``)), fewest waves on a tie.
    Each split keeps ``DECODE_MIN_K_TILES``; the split-K reduction is the kernel's own."""
    best = None
    for sk in DECODE_SPLITS:
        if sk > 1 and k_tiles // sk < DECODE_MIN_K_TILES:
            break
        waves = -(-tiles * sk // sms)
        cand = (waves * (-(-k_tiles // sk) + DECODE_UNIT_COST), waves, sk)
        if best is None or cand[:2] < best[:2]:
            best = cand
    return best[0], best[2], best[1]


def packed_decode_schedule(n: int, k: int) -> Schedule:
    """W4A16 at M <= 16 on the packed weight: 256 weight rows over four warpgroups or 128
    over two, and the split, by :func:`decode_split` with a tile's cost weighted by its
    rows (equal cost: fewer waves, then the taller tile, which has the more warps).
    Measured on H200 at M = 1 (perf/results/2026-12-01-h200-decode.md): 28672 x 4096 d4
    40.4 us vs d2 45.2 (2 waves); 1024 x 4096 d2 split 8 10.5 us vs d4 split 8 12.6."""
    from cute_fp4 import catalogue

    best = None
    for s in (catalogue.get("sm90_rs_packed_decode"), catalogue.get("sm90_rs_packed_decode_128")):
        cost, split, waves = decode_split(-(-n // s.tile.n), -(-k // s.tile.k),
                                          s.arch.sm_count)
        cand = (cost * s.tile.n, waves, -s.tile.n, split, s)
        if best is None or cand[:3] < best[:3]:
            best = cand
    split, s = best[3], best[4]
    return s.replace(split_k=split) if split > 1 else s


STREAM_MIN_UNITS = 16  # 64-element K units per split at least
STREAM_CTAS_PER_SM = 2  # the grid split-K grows to, at most
STREAM_MAX_M = 8  # sm_90a: the stream kernel up to this M; rs_packed's decode tile above
# H200, 2026-12-03 (perf/results/2026-12-03-h200-decode.md): the best split of each shape
# at M = 1 gave ~2 CTAs per SM with >= 16 K units each (8192^2: 2; 28672 x 4096: 1;
# 4096 x 14336 and 4096^2: 4); at M = 16 the rs_packed decode tile was faster on every
# shape but 1024 x 4096


def stream_decode_schedule(target: str, m: int, n: int, k: int) -> Schedule:
    """The weight-streaming decode kernel (``mainloop=stream``): an 8- or 16-row activation
    tile, the default batch of a warp's ring, and split-K doubled (16 at most) while
    the grid stays within :data:`STREAM_CTAS_PER_SM` CTAs per SM (the splits' partial sums
    cost traffic, a second wave a tail) and each split keeps :data:`STREAM_MIN_UNITS` K
    units."""
    from cute_fp4.planning.common import MAX_SPLIT_K
    from cute_fp4.planning.stream import stream_schedule

    tm = 8 if m <= 8 else 16
    s = stream_schedule(target, tm, name="stream_decode")
    tiles = -(-n // 64) * -(-m // tm)
    units = k // 64
    wave = STREAM_CTAS_PER_SM * s.arch.sm_count
    split = 1
    while (tiles * split * 2 <= wave and split * 2 <= MAX_SPLIT_K
           and units // (split * 2) >= STREAM_MIN_UNITS):
        split *= 2
    return s.replace(split_k=split, name="stream_decode") if split > 1 else s


def _family_target(family: str) -> str:
    from cute_fp4.targets import TARGETS

    return next(t.name for t in TARGETS.values() if t.family == family)


def _packed_heuristic(m: int, n: int, k: int, a_format: str = "bf16",
                      target: str = "sm_90a") -> Schedule:
    """rs_packed tiles by M: 256 activation rows x 128 weight rows at large M; at M <= 16
    with 16-bit activations :func:`stream_decode_schedule` (W4A4 needs 64-row activation
    tiles);
    at small M a grid of ~one CTA per SM made up by split-K while each split keeps >= 16
    K tiles."""
    from cute_fp4 import catalogue

    if m > 128:
        s = catalogue.get("sm90_rs_packed")
    elif m <= STREAM_MAX_M and a_format != "nvfp4":
        return stream_decode_schedule(target, m, n, k)
    elif m <= 16 and a_format != "nvfp4":
        return packed_decode_schedule(n, k)
    else:
        s = catalogue.get("sm90_rs_packed_m64")
        if m > 64:
            s = s.replace(tile=(128, s.tile.n, s.tile.k))
    ctas = -(-n // s.tile.n) * -(-m // s.tile.m)
    k_tiles = -(-k // s.tile.k)
    split = 1
    while ctas * split * 2 <= s.arch.sm_count and k_tiles // (split * 2) >= 16:
        split *= 2
    return s.replace(split_k=split) if split > 1 else s


_AUTO_PACKED = "auto:packed"  # kernel_for's memo key of "auto" with a packed weight


def _resolve_packed(schedule, m: int, n: int, k: int, a_format: str,
                    out_dtype: torch.dtype) -> Schedule:
    """resolve_schedule for a PackedNVFP4Weight: "auto" is the packed heuristic (the tuning
    store holds plain-weight schedules), anything else must be ``mainloop=rs_packed``."""
    from cute_fp4.targets import require_device

    if schedule == _AUTO_PACKED:
        t = require_device().target
        s = heuristic(t.family, m, n, k, packed=True, a_format=a_format, target=t.name)
        want = OutDtype.of(out_dtype)
        return s if s.epilogue.out_dtype is want else s.replace(out_dtype=want)
    s = resolve_schedule(schedule, m, n, k, a_format, out_dtype)
    if not s.mainloop.reads_packed:
        raise InputError(f"schedule {s.name or s.label()} reads the plain weight layout, but "
                         "b is a PackedNVFP4Weight: use a mainloop=rs_packed or stream "
                         "schedule, 'auto', or b.unpack()")
    return s


def packed_kernel_for(schedule, dims: tuple[int, int, int, str], out_dtype: torch.dtype,
                      device_index: int):
    """``compile.kernel_for`` for a fragment-order packed weight: "auto" is memoised under
    its own key and resolved by the packed heuristic (:func:`_resolve_packed`)."""
    key = _AUTO_PACKED if isinstance(schedule, str) and schedule == "auto" else schedule
    return kernel_for(key, dims, out_dtype, device_index, _resolve_packed)


def _gemm_packed(a, b: PackedNVFP4Weight, schedule, out, out_dtype, alpha, check,
                 bind: bool = True, op_key: tuple | None = None):
    """gemm with a fragment-order packed weight: the plain checks on a view of its first N
    rows (same bytes count per row, same scales), then an rs_packed kernel (W4A4 with
    ``schedule="auto"``: :func:`_w4a4_via_bf16`)."""
    if len(b.shape) != 2:
        raise InputError(f"b is a stack of {b.shape[0]} packed experts {list(b.shape)}: gemm "
                         "takes one [N, K] weight; cute_fp4.grouped_gemm runs stacks")
    n, k = b.shape
    view = NVFP4Tensor._unchecked(b.data[:n], b.scale, b.global_scale, (n, k))
    dims = check_operands(a, view, out, alpha, out_dtype)
    if dims[3] == "nvfp4" and isinstance(schedule, str) and schedule == "auto":
        result = _w4a4_via_bf16(a, b, view, out, out_dtype, alpha, dims)
        if check:
            reference.assert_close(result, a, b.unpack(), alpha)
        return result
    kern = packed_kernel_for(schedule, dims, out_dtype, b.data.get_device())
    result = run_checked(kern, a, b, out, alpha, dims)
    _after(kern, a, b, result, schedule, out_dtype, alpha, dims, check,
           b.unpack() if check and not kern.validated else None, bind, op_key)
    return result


def _w4a4_via_bf16(a: NVFP4Tensor, b: PackedNVFP4Weight, view: NVFP4Tensor, out, out_dtype,
                   alpha, dims) -> torch.Tensor:
    """W4A4 on a fragment-order weight with ``schedule="auto"``: the activation decoded to
    its exact BF16 block values (one pass, ``quant.dequantize_activation``), then the W4A16
    rs_packed kernel with alpha = the two global scales' product (written by the same
    launch: no multiply kernel) or the given alpha. The
    same exact products as a W4A4 kernel; measured faster than the rs_packed mainloop's own
    W4A4 route, which converts each activation stage without overlap, and than the
    plain-layout W4A4 kernels (perf/results/2026-12-01-h200-bound.md)."""
    from cute_fp4.quant import w4a16_operands

    m, n, k, _ = dims
    kern = packed_kernel_for("auto", (m, n, k, "bf16"), out_dtype, b.data.get_device())
    given = None if alpha is None else alpha_tensor(a, view, alpha)
    a16, alpha_t = w4a16_operands(a, b.global_scale, given)
    return run_checked(kern, a16, b, out, alpha_t, (m, n, k, "bf16"))


def _gemm_impl(a, b: NVFP4Tensor, schedule, out, out_dtype, alpha, check,
               bind: bool = True, op_key: tuple | None = None) -> torch.Tensor:
    """``gemm``'s eager body. ``bind``: launch through (and keep) a binding for calls like
    this one on the same weight object (``run.bound_gemm``); the custom ops' bodies, which
    wrap fresh weight objects per call, pass False and their ``op_key`` (``run.bound_op``).
    """
    if bind and not check:  # a W4A16 call like an earlier one on this weight: its binding
        result = bound_gemm(a, b, schedule, out, out_dtype, alpha)
        if result is not None:
            return result
    if isinstance(b, PackedNVFP4Weight):
        return _gemm_packed(a, b, schedule, out, out_dtype, alpha, check, bind, op_key)
    dims = check_operands(a, b, out, alpha, out_dtype)
    # resolve_schedule + compile, memoised per (schedule, dims, out dtype, device)
    kern = kernel_for(schedule, dims, out_dtype, b.data.get_device(), resolve_schedule)
    result = run_checked(kern, a, b, out, alpha, dims)  # checked once, above
    _after(kern, a, b, result, schedule, out_dtype, alpha, dims, check, b, bind, op_key)
    return result


def _after(kern, a, b, result, schedule, out_dtype, alpha, dims, check, plain,
           bind: bool, op_key: tuple | None = None) -> None:
    """Validate the first call of ``kern`` (``check``: against ``plain``, the weight in the
    plain layout) or, with ``bind`` (or an op's ``op_key``), keep this call's launch for the
    next like it."""
    if check:
        if not kern.validated:
            reference.assert_close(result, a, plain, alpha)
            kern.validated = True
        return
    if op_key is not None:
        remember_op(op_key, kern, a, b, result, alpha, dims, resolution_deadline(schedule))
    elif bind:
        remember_gemm(kern, a, b, result, schedule, out_dtype, alpha, dims,
                      resolution_deadline(schedule))


def gemm(a, b: NVFP4Tensor, *, schedule="auto", out: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16, alpha=None, check: bool = False
         ) -> torch.Tensor:
    """``out = alpha * a @ b.T`` with ``b`` NVFP4 [N, K] and ``a`` NVFP4 (W4A4) or
    bf16/fp16 [M, K] (W4A16). ``alpha`` defaults to the product of the global scales.

    ``schedule``: "auto" (tuned if a tuning exists, else a heuristic), a catalogue name, or
    a Schedule. ``check=True`` validates the first call of each kernel against the exact
    reference (raises ValidationError on disagreement).
    """
    if torch.compiler.is_compiling():
        if isinstance(b, PackedNVFP4Weight):
            raise InputError("a PackedNVFP4Weight is not supported under torch.compile yet "
                             "(the cute_fp4::mm op takes the plain layout); use the plain "
                             "NVFP4Tensor there")
        return _op_call(a, b, schedule, out_dtype, alpha)
    if not _OP.registered:
        _OP.register()
    return _gemm_impl(a, b, schedule, out, out_dtype, alpha, check)


# ----------------------------------------------------------------------------- custom ops

def _flatten(a, b: NVFP4Tensor, alpha):
    """NVFP4 operands -> plain tensors for the op (W4A16: a has no scale)."""
    if isinstance(a, NVFP4Tensor):
        a_t, a_sf = a.data, a.scale
    else:
        a_t, a_sf = a, None
    return a_t, a_sf, b.data, b.scale, alpha_tensor(a, b, alpha)


def _op_call(a, b, schedule, out_dtype, alpha):
    """``gemm`` while torch.compile traces it: one ``cute_fp4::mm`` node."""
    a_t, a_sf, b_t, b_sf, alpha_t = _flatten(a, b, alpha)
    return mm(a_t, a_sf, b_t, b_sf, alpha_t, b.shape[1], out_dtype, schedule)


def mm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor,
       alpha: torch.Tensor, k: int, out_dtype: torch.dtype = torch.bfloat16,
       schedule: str = "auto") -> torch.Tensor:
    """``gemm`` on plain tensors, in the form of the ``cute_fp4::mm`` op (arguments on
    :func:`register_op`): ``alpha * a @ b.T`` with ``alpha`` a float32 tensor of one element
    (the product of the global scales; it is not derived here).

    Eager, it runs the kernel without going through the op's dispatch; under torch.compile it
    is one ``cute_fp4::mm`` node (registered while tracing). The weight's tensors are taken as
    a valid NVFP4 encoding: shapes, dtypes, devices and alignment are checked, the values
    are not (no GPU sync), which is what lets CUDA graphs capture it."""
    if torch.compiler.is_compiling():
        if not isinstance(schedule, str):
            raise InputTypeError("under torch.compile, pass schedule as a catalogue name or "
                                 "'auto'")
        _register_while_tracing()
        return torch.ops.cute_fp4.mm(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)
    if not _OP.registered:
        _OP.register()
    return _mm_impl(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)


def mm_packed(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
              b_scale: torch.Tensor, alpha: torch.Tensor, n: int, k: int,
              out_dtype: torch.dtype = torch.bfloat16, schedule: str = "auto") -> torch.Tensor:
    """:func:`mm` with ``b`` a fragment-order packed weight (``cute_fp4.packed``: uint8
    ``[packed_rows(n), K/2]``) of ``n`` rows: the ``cute_fp4::mm_packed`` op."""
    if torch.compiler.is_compiling():
        if not isinstance(schedule, str):
            raise InputTypeError("under torch.compile, pass schedule as a catalogue name or "
                                 "'auto'")
        _register_while_tracing()
        return torch.ops.cute_fp4.mm_packed(a, a_scale, b, b_scale, alpha, n, k, out_dtype,
                                            schedule)
    if not _OP.registered:
        _OP.register()
    return _mm_packed_impl(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule)


def _mm_packed_impl(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule) -> torch.Tensor:
    """The packed op's body: as :func:`_mm_impl` (no value checks, no sync)."""
    key = _op_bound_key("mm_packed", a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule)
    if key is not None:
        result = bound_op(key, a, b)
        if result is not None:
            return result
    at, gs = _op_activation(a, a_scale, b, b_scale, alpha, k)
    bt = PackedNVFP4Weight(b, as_e4m3(b_scale), gs, (n, k))
    return _gemm_packed(at, bt, schedule, None, out_dtype, alpha, False, bind=False,
                        op_key=key)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types the ops' bindings accept


def _op_bound_key(kind, a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule):
    """``run.op_key`` of a W4A16 op call whose operands are all tensors (else None: the
    full path, which raises on bad types). The ops' bodies get fresh weight wrappers every
    call, so their bindings are keyed by the weight's buffers instead (``run.bound_op``)."""
    if (a_scale is not None or not isinstance(schedule, str)
            or not all(type(t) in _PLAIN for t in (a, b, b_scale, alpha))):
        return None
    return op_key(kind, a, b, b_scale, alpha, n, k, out_dtype, schedule)


def _op_activation(a, a_scale, b, b_scale, alpha, k):
    """The ops' common part: the tensor-type checks, and ``(A, alpha as a scalar)`` with
    A wrapped without checks when it is NVFP4 (see :func:`_mm_impl`)."""
    for t, name in ((b, "b"), (b_scale, "b_scale"), (alpha, "alpha")):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    gs = alpha.reshape(())
    if a_scale is None:
        return a, gs
    return NVFP4Tensor._unchecked(a, as_e4m3(a_scale), gs, (a.shape[0], k)), gs


def _mm_impl(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule) -> torch.Tensor:
    """The op's body. The operands are wrapped without ``NVFP4Tensor``'s checks: its
    global-scale check reads the value back from the GPU, and that sync inside a CUDA-graph
    capture (torch.compile's ``mode="reduce-overhead"``) invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``). ``alpha`` is explicit, so the global scales
    the wrappers carry (alpha itself, a placeholder) are never read."""
    key = None
    if isinstance(b, torch.Tensor) and b.dim() == 2:
        key = _op_bound_key("mm", a, a_scale, b, b_scale, alpha, b.shape[0], k, out_dtype,
                            schedule)
    if key is not None:
        result = bound_op(key, a, b)
        if result is not None:
            return result
    at, gs = _op_activation(a, a_scale, b, b_scale, alpha, k)
    if b.dim() != 2:
        raise InputTypeError(f"b must be the packed weight [N, K/2], got shape "
                             f"{tuple(b.shape)}")
    bt = NVFP4Tensor._unchecked(b, as_e4m3(b_scale), gs, (b.shape[0], k))
    return _gemm_impl(at, bt, schedule, None, out_dtype, alpha, False, bind=False,
                      op_key=key)


def quantize_op(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """``cute_fp4.quant.quantize_activation`` as ``(data, scale, global_scale)`` tensors,
    one node under torch.compile: ``cute_fp4::quantize`` for a static scale (a float32
    tensor of one element, e.g. a calibrated ``input_scale``; returned as given) or
    ``cute_fp4::quantize_dynamic`` (``global_scale=None``: computed on the GPU)."""
    if not torch.compiler.is_compiling():
        from cute_fp4.quant import quantize_activation

        t = quantize_activation(x, global_scale)
        return t.data, t.scale, t.global_scale
    _register_while_tracing()
    if global_scale is None:
        return torch.ops.cute_fp4.quantize_dynamic(x)
    data, scale = torch.ops.cute_fp4.quantize(x, global_scale)
    return data, scale, global_scale


def _register_while_tracing() -> None:
    """Register the op while Dynamo traces a call (``cute_fp4.oplib.while_tracing``)."""
    while_tracing(lambda ctx: register_op(), register_op)


_OP = LazyOp("mm", lambda: _define_op())  # registered on first use
_op_exists = _OP.exists


def register_op():
    """Register the custom ops with their fake implementations, once per process
    (idempotent, thread-safe); returns the ``torch.ops.cute_fp4`` namespace.

    ``torch.ops.cute_fp4.mm(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)``: ``a``
    the packed NVFP4 bytes [M, K/2] with ``a_scale`` (W4A4) or bf16/fp16 [M, K] with
    ``a_scale=None`` (W4A16); ``b``/``b_scale`` the weight's bytes and blocked scales;
    ``alpha`` a one-element float32 tensor; ``schedule`` a catalogue name or "auto".
    ``torch.ops.cute_fp4.mm_packed(a, a_scale, b, b_scale, alpha, n, k, out_dtype,
    schedule)``: the same with ``b`` a fragment-order packed weight of ``n`` rows.

    ``torch.ops.cute_fp4.quantize(x, global_scale) -> (data, scale)`` and
    ``torch.ops.cute_fp4.quantize_dynamic(x) -> (data, scale, global_scale)``: the fused
    activation quantization (``cute_fp4.quant``) of a bf16/fp16 ``x`` [M, K]."""
    return _OP.register()


def _mm_op(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule):
    with private_workspaces():
        return _mm_impl(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)


def _mm_packed_op(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule):
    with private_workspaces():
        return _mm_packed_impl(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule)


def _quantize_static_op(x, global_scale):
    from cute_fp4.quant import quantize_activation

    t = quantize_activation(x, global_scale)
    return t.data, t.scale


def _quantize_dynamic_op(x):
    from cute_fp4.quant import quantize_activation

    t = quantize_activation(x, None)
    return t.data, t.scale, t.global_scale


def _define_op() -> None:
    define("mm(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor alpha, SymInt k, "
           "ScalarType out_dtype, str schedule) -> Tensor", _mm_op,
           lambda a, a_scale, b, b_scale, alpha, k, out_dtype, schedule:
           a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype))
    define("mm_packed(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor alpha, "
           "SymInt n, SymInt k, ScalarType out_dtype, str schedule) -> Tensor", _mm_packed_op,
           lambda a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule:
           a.new_empty((a.shape[0], n), dtype=out_dtype))
    define("quantize(Tensor x, Tensor global_scale) -> (Tensor, Tensor)",
           _quantize_static_op, lambda x, global_scale: _fake_nvfp4(x))
    define("quantize_dynamic(Tensor x) -> (Tensor, Tensor, Tensor)", _quantize_dynamic_op,
           lambda x: (*_fake_nvfp4(x), x.new_empty((), dtype=torch.float32)))


def _fake_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return (x.new_empty((m, k // 2), dtype=torch.uint8),
            x.new_empty(scale_shape(m, k), dtype=torch.float8_e4m3fn))


# ----------------------------------------------------------------------------- validate

@dataclasses.dataclass
class ValidationReport:
    schedule: str
    a_format: str
    results: list[reference.CheckResult]
    poison_detected: bool  # an unwritten (poisoned) output fails the rule
    rule: str = ("|out - ref| <= 2^-p |ref| + (ceil(K/16) + 16) 2^-23 alpha sum|a b| + tiny "
                 "(see cute_fp4.reference)")

    @property
    def passed(self) -> bool:
        return self.poison_detected and all(r.passed for r in self.results)

    @property
    def max_err_over_bound(self) -> float:
        return max((r.max_err_over_bound for r in self.results), default=0.0)

    def __str__(self) -> str:
        head = (f"{self.schedule} [{self.a_format}]: {'PASS' if self.passed else 'FAIL'} "
                f"on {len(self.results)} shapes, max err/bound "
                f"{self.max_err_over_bound:.3g}, poison detected: {self.poison_detected}")
        bad = [str(r) for r in self.results if not r.passed]
        return "\n  ".join([head, *bad])


DEFAULT_SHAPES = [(1, 264, 320), (7, 136, 4096), (16, 512, 8256), (127, 136, 320),
                  (128, 256, 4096), (129, 264, 832), (1000, 136, 4096), (256, 392, 8256)]


def validate(schedule_or_kernel, shapes=None, a_format: str = "nvfp4", seed: int = 0,
             dist: str = "awkward") -> ValidationReport:
    """Run a schedule (or a CompiledGemm) on many shapes against the exact reference,
    with the output poisoned (NaN) before each run so an unwritten element fails. A grouped
    (MoE) schedule runs over MoE routings instead (``grouped.validate_grouped``)."""
    from cute_fp4.compile import CompiledGemm, Signature, compile

    kern = schedule_or_kernel
    if not isinstance(kern, CompiledGemm):
        s = schedule_or_kernel
        if isinstance(s, str):
            from cute_fp4 import catalogue

            s = catalogue.get(s)
        kern = compile(s, Signature(a_format))
    if kern.schedule.scheduler.grouped:  # MoE routings instead of shapes
        from cute_fp4.grouped import validate_grouped

        results, poison_ok = validate_grouped(kern, a_format, seed)
        return ValidationReport(kern.schedule.name or kern.schedule.label(), a_format,
                                results, poison_ok)
    out_dtype = out_dtype_of(kern.schedule)
    results = []
    poison_ok = True
    for i, (m, n, k) in enumerate(shapes or DEFAULT_SHAPES):
        a, b = make_operands(m, n, k, a_format, seed + i, dist)
        if i == 0:
            poison = torch.full((m, n), float("nan"), dtype=out_dtype, device=b.device)
            poison_ok = not reference.check(poison, a, b).passed
        results.append(poisoned_check(kern, a, b))
    return ValidationReport(kern.schedule.name or kern.schedule.label(), a_format, results,
                            poison_ok)
