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

Each call is one call into the launch path (``cute_fp4.run``: bindings, schedule
resolution, kernel, checked launch, workspaces), which this module gives the
compiled-kernel memo (``compile.kernel_for``) and the activation decoder (``quant``).
Layering: this module builds on the host layer (``compile``, ``run``, ``quant``, the
tuning store); it re-exports the operand, heuristic and launch helpers scripts use from
here. The module API (``NVFP4Linear``, ``convert``) is ``cute_fp4.nn``, one layer up in
use (it imports this).
"""

from __future__ import annotations

import dataclasses

import torch

from cute_fp4 import bindings, reference, run
from cute_fp4.blockscaled import BlockTensor
from cute_fp4.compile import CompiledGemm
from cute_fp4.errors import InputError
from cute_fp4.formats import NVFP4, Operand
from cute_fp4.fused import silu_mul_unfused
from cute_fp4.nvfp4 import quantize
from cute_fp4.operands import (
    ALIGN,
    GemmCall,
    alpha_tensor,
    check_operands,
    make_operands,
    out_dtype_of,
)
from cute_fp4.oplib import LazyOp, define, traced, while_tracing
from cute_fp4.packed import PackedWeight, repack
from cute_fp4.run import poisoned_check, run_compiled  # noqa: F401 (scripts use them here)
from cute_fp4.tuning import (  # noqa: F401 (the heuristic's names, as tests and perf/ use them)
    DECODE_MIN_K_TILES,
    STREAM_MAX_M,
    SWAPAB_MAX_M,
    decode_split,
    heuristic,
    packed_decode_schedule,
    resolve_schedule,
    stream_decode_schedule,
)
from cute_fp4.workspaces import private_workspaces

__all__ = ["ALIGN", "DEFAULT_SHAPES", "SWAPAB_MAX_M", "ValidationReport", "check_operands",
           "gemm", "heuristic", "make_operands", "mm", "mm_packed", "out_dtype_of",
           "poisoned_check", "quantize_op", "register_op", "resolve_schedule", "run_compiled",
           "validate"]

_alpha_tensor = alpha_tensor  # the name scripts under perf/ use


# ----------------------------------------------------------------------------- running

def gemm(a, b: BlockTensor, *, schedule="auto", out: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.bfloat16, alpha=None, bias: torch.Tensor | None = None,
         silu_mul: bool = False, nvfp4_out=None, check: bool = False,
         swiglu_oai: bool = False) -> torch.Tensor:
    """``out = alpha * a @ b.T`` with ``b`` a block-scaled weight [N, K] (NVFP4Tensor or
    MXFP4Tensor, or its packed form) and ``a`` in the same block format (W4A4) or bf16/fp16
    [M, K] (W4A16; MXFP4 weights: bf16). ``alpha`` defaults to the product of the global
    scales (1 for MXFP4, which has none). Mixed block formats are a FormatError naming
    both.

    ``schedule``: "auto" (tuned if a tuning exists, else a heuristic), a catalogue name, or
    a Schedule. ``check=True`` validates the first call of each kernel against the exact
    reference (raises ValidationError on disagreement).

    Fused in the epilogue (``Epilogue.ops``): ``bias`` float32 [N], added in FP32 before
    the output's rounding; ``silu_mul=True``: ``b``'s rows are gate and up interleaved
    (``cute_fp4.fused.interleave_gate_up(w, plan.silu_group(schedule))``) and the output
    is ``F.silu(gate) * up`` [M, N / 2], the bits of that unfused pipeline in the output
    dtype; ``swiglu_oai=True``: the same gate/up order and output, gpt-oss's clamped
    SwiGLU (``cute_fp4.fused.swiglu_oai_unfused``) instead of SiLU;
    ``nvfp4_out=global_scale`` (a float or a float32 device scalar, decode form: the
    next W4A4 layer's static input scale): the output, rounded to ``out_dtype``, quantized
    in the epilogue (``quantize(y, global_scale)``'s bytes) and returned as an
    ``NVFP4Tensor`` (``out``: an ``NVFP4Tensor`` to write). Normal-orientation kernels
    without split-K only (plan() refuses the others with the reason).
    """
    if torch.compiler.is_compiling():
        if bias is not None or silu_mul or swiglu_oai or nvfp4_out is not None:
            raise InputError("gemm with bias=, silu_mul=, swiglu_oai= or nvfp4_out= is not "
                             "supported under torch.compile yet (the cute_fp4::mm op has no "
                             "epilogue operands)")
        if isinstance(b, PackedWeight):
            raise InputError("a packed weight is not supported by gemm under torch.compile "
                             "yet (the cute_fp4::mm op takes the plain layout; "
                             "cute_fp4.mm_packed takes the packed one); use the plain tensor "
                             "there")
        return _traced_call(GemmCall(a, b, schedule, out, out_dtype, alpha))
    OPS.ready()
    return bindings.gemm(GemmCall(a, b, schedule, out, out_dtype, alpha, bias, silu_mul,
                                  swiglu_oai, nvfp4_out, check))


def run_call(call: GemmCall) -> torch.Tensor:
    """Run a dense call stated as a record (:class:`~cute_fp4.operands.GemmCall`), as the
    prepared layers (``cute_fp4.layers.Linear``) do; :func:`gemm` takes the same two ways
    with its own checks first. Eager, the launch path (``bindings.gemm``); while
    torch.compile traces it, the custom ops (:func:`_traced_call`)."""
    if torch.compiler.is_compiling():
        return _traced_call(call)
    OPS.ready()
    return bindings.gemm(call)


# ----------------------------------------------------------------------------- custom ops

def _traced_call(call: GemmCall) -> torch.Tensor:
    """A call while torch.compile traces it: plain tensors into the custom ops (one
    ``cute_fp4::quantize`` node first for ``quantize_a``, then ``cute_fp4::mm`` or
    ``mm_packed``); ``silu_mul`` unfused on the interleaved output (the ops take no
    epilogue operands; Inductor fuses it in FP32, within the rounding of silu(gate) of the
    fused bits). The calls that take other epilogue operands are refused before."""
    a, b, alpha = call.a, call.b, call.alpha
    if call.quantize_a:  # NVFP4 (the formats with global scales)
        a, a_scale, a_gs = quantize_op(a, call.input_scale)
        alpha = alpha if alpha is not None else a_gs * b.global_scale
    else:
        a_scale = a.scale if isinstance(a, BlockTensor) else None
        alpha = alpha_tensor(a, b, alpha)
        a = a.data if isinstance(a, BlockTensor) else a
    n, k = b.shape
    if call.packed:
        y = mm_packed(a, a_scale, b.data, b.scale, alpha, n, k, call.out_dtype, call.schedule)
    else:
        y = mm(a, a_scale, b.data, b.scale, alpha, k, call.out_dtype, call.schedule)
    return y if not call.silu_mul else silu_mul_unfused(y, call.group)


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
    if traced(schedule):
        _register_while_tracing()
        return torch.ops.cute_fp4.mm(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)
    OPS.ready()
    return bindings.mm(a, a_scale, b, b_scale, alpha, _rows(b), k, out_dtype, schedule, False)


def mm_packed(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
              b_scale: torch.Tensor, alpha: torch.Tensor, n: int, k: int,
              out_dtype: torch.dtype = torch.bfloat16, schedule: str = "auto") -> torch.Tensor:
    """:func:`mm` with ``b`` a fragment-order packed weight (``cute_fp4.packed``: uint8
    ``[packed_rows(n), K/2]``) of ``n`` rows: the ``cute_fp4::mm_packed`` op."""
    if traced(schedule):
        _register_while_tracing()
        return torch.ops.cute_fp4.mm_packed(a, a_scale, b, b_scale, alpha, n, k, out_dtype,
                                            schedule)
    OPS.ready()
    return bindings.mm(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule, True)


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


OPS = LazyOp("mm", lambda: _define_ops())  # every cute_fp4 op, registered on first use
_op_exists = OPS.exists


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
    activation quantization (``cute_fp4.quant``) of a bf16/fp16 ``x`` [M, K].

    ``torch.ops.cute_fp4.grouped_mm(a, a_scale, b, b_scale, offsets, alpha, k, out_dtype,
    schedule, n=0, packed=False)``: ``cute_fp4.grouped.grouped_mm``; returns ``[total_M, n
    or b.shape[1]]`` of ``out_dtype``."""
    return OPS.register()


def _mm_op(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule):
    with private_workspaces():
        return bindings.mm(a, a_scale, b, b_scale, alpha, _rows(b), k, out_dtype, schedule,
                           False)


def _mm_packed_op(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule):
    with private_workspaces():
        return bindings.mm(a, a_scale, b, b_scale, alpha, n, k, out_dtype, schedule, True)


def _rows(b) -> int:
    """A plain weight's N (its rows), 0 for anything else (the op body refuses it)."""
    return b.shape[0] if isinstance(b, torch.Tensor) and b.dim() == 2 else 0


def _quantize_static_op(x, global_scale):
    from cute_fp4.quant import quantize_activation

    t = quantize_activation(x, global_scale)
    return t.data, t.scale


def _quantize_dynamic_op(x):
    from cute_fp4.quant import quantize_activation

    t = quantize_activation(x, None)
    return t.data, t.scale, t.global_scale


def _define_ops() -> None:
    from cute_fp4.run import grouped_op_call

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
    define("grouped_mm(Tensor a, Tensor? a_scale, Tensor b, Tensor b_scale, Tensor offsets, "
           "Tensor alpha, SymInt k, ScalarType out_dtype, str schedule, SymInt n=0, "
           "bool packed=False) -> Tensor", grouped_op_call,
           lambda a, a_scale, b, b_scale, offsets, alpha, k, out_dtype, schedule, n=0,
           packed=False: a.new_empty((a.shape[0], n or b.shape[1]), dtype=out_dtype))


def _fake_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return (x.new_empty((m, NVFP4.data_row_bytes(k)), dtype=torch.uint8),
            x.new_empty(NVFP4.scale_shape(m, k), dtype=NVFP4.scale.torch_dtype))


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


def validate(schedule_or_kernel, shapes=None, a_format: str = Operand.NVFP4, seed: int = 0,
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
        run.run_grouped(kern, a, b, offs, out=out)
        torch.cuda.synchronize()
        results.append(reference.check_grouped(out, a, w, offs))
    return results, poison_ok


def _cumsum(counts) -> list[int]:
    out, run = [], 0
    for c in counts:
        run += c
        out.append(run)
    return out
