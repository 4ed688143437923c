"""The torch-facing API: ``gemm``, ``validate``, the ``cute_fp4::mm`` custom op, NVFP4Linear.

Every call goes through :func:`cute_fp4.operands.check_operands` before anything is
launched or written: a bad input raises a typed error naming the problem and the numbers,
and the output tensor is left untouched. ``gemm`` is also the ``torch.library`` custom op
``cute_fp4::mm`` (with a fake implementation), so ``torch.compile(fullgraph=True)`` of a
function that calls it captures one node. The op is registered on first use, not when
this module is imported: by the first ``gemm`` call (eager, or while torch.compile traces
it) or by ``cute_fp4.ops.register()`` (needed first only to call ``torch.ops.cute_fp4.mm``
directly).

Layering: this module builds on the host layer (``compile``, ``run``) and the tuning
store; it re-exports the operand and launch helpers scripts use from here.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from cute_fp4 import reference
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.operands import (
    ALIGN,
    alpha_tensor,
    check_operands,
    make_operands,
    out_dtype_of,
)
from cute_fp4.run import poisoned_check, run_checked, run_compiled
from cute_fp4.schedule import OutDtype, Schedule

__all__ = ["ALIGN", "DEFAULT_SHAPES", "NVFP4Linear", "SWAPAB_MAX_M", "ValidationReport",
           "check_operands", "gemm", "heuristic", "make_operands", "out_dtype_of",
           "poisoned_check", "register_op", "resolve_schedule", "run_compiled", "validate"]

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
        schedule = lookup(dev, m, n, k, a_format) or heuristic(dev.target.family, m, n, k)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    want = OutDtype.of(out_dtype)
    return schedule if schedule.epilogue.out_dtype is want else schedule.replace(out_dtype=want)


def heuristic(family: str, m: int, n: int, k: int) -> Schedule:
    """The catalogue schedule a shape gets when nothing was tuned for it."""
    from cute_fp4 import catalogue

    if family == "sm90":
        if m <= SWAPAB_MAX_M:
            # swap-AB decode: activation tile (WGMMA's N) = the smallest of 8/16/32 >= M
            tm = 8 if m <= 8 else 16 if m <= 16 else 32
            s = catalogue.get("sm90_decode_swapab")
            if s.tile.m != tm:
                s = s.replace(tile=(tm, s.tile.n, s.tile.k))
            # one CTA per 64 weight rows: when that leaves over half the SMs idle and K is
            # long, split K in two (measured on H200: N=4096, K=14336, M=1: 37.6 -> 31.7 us
            # with the host reduction; N=6144, K=4096 got slower, 17.1 -> 24.4 us)
            if -(-n // s.tile.n) * 2 <= s.arch.sm_count and k >= 8192:
                s = s.replace(split_k=2)
            return s
        # measured on H200, N = K = 8192 (perf/results/2026-11-30-h200.md): at M = 256
        # 128x128x64 takes 96 us vs 138 us for 128x256x64 (twice the tiles); from M = 1024
        # the 128x256x64 default is fastest
        name = ("sm90_decode" if m <= 64 else "sm90_128x128x64" if m <= 512
                else "sm90_default")
    else:
        name = "sm120_decode_splitk4" if m <= 64 and k >= 2048 else "sm120_default"
    return catalogue.get(name)


def _gemm_impl(a, b: NVFP4Tensor, schedule, out, out_dtype, alpha, check) -> torch.Tensor:
    from cute_fp4.compile import Signature, compile

    dims = check_operands(a, b, out, alpha, out_dtype)
    m, n, k, a_format = dims
    s = resolve_schedule(schedule, m, n, k, a_format, out_dtype)
    kern = compile(s, Signature(a_format))
    result = run_checked(kern, a, b, out, alpha, dims)  # checked once, above
    if check and not kern.validated:
        reference.assert_close(result, a, b, alpha)
        kern.validated = True
    return result


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
        return _op_call(a, b, schedule, out_dtype, alpha)
    if not _REGISTERED:
        register_op()
    return _gemm_impl(a, b, schedule, out, out_dtype, alpha, check)


# ----------------------------------------------------------------------------- custom op

def _flatten(a, b: NVFP4Tensor, alpha):
    """NVFP4 operands -> plain tensors for the op (W4A16: a has no scale)."""
    if isinstance(a, NVFP4Tensor):
        a_t, a_sf = a.data, a.scale
    else:
        a_t, a_sf = a, None
    return a_t, a_sf, b.data, b.scale, alpha_tensor(a, b, alpha)


def _op_call(a, b, schedule, out_dtype, alpha):
    """``gemm`` while torch.compile traces it: one ``cute_fp4::mm`` node."""
    if not isinstance(schedule, str):
        raise InputTypeError("under torch.compile, pass schedule as a catalogue name or 'auto'")
    _register_while_tracing()
    a_t, a_sf, b_t, b_sf, alpha_t = _flatten(a, b, alpha)
    return torch.ops.cute_fp4.mm(a_t, a_sf, b_t, b_sf, alpha_t, b.shape[1], out_dtype, schedule)


def _register_while_tracing() -> None:
    """Register the op from inside a function Dynamo is tracing. Defining a custom op
    cannot be traced, so it runs through ``torch._dynamo.comptime``: its function runs
    at trace time and adds nothing to the graph. Without comptime (another torch), the op
    must have been registered before tracing (any eager ``gemm`` call or
    ``cute_fp4.ops.register()``)."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:
        return
    comptime(lambda ctx: register_op(), register_op)


_REGISTERED = False
_REGISTER_LOCK = threading.Lock()


def register_op():
    """Register the custom op ``cute_fp4::mm`` with its fake implementation, once per
    process (idempotent, thread-safe); returns the ``torch.ops.cute_fp4`` namespace.

    ``torch.ops.cute_fp4.mm(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule)``: ``a``
    the packed NVFP4 bytes [M, K/2] with ``a_scale`` (W4A4) or bf16/fp16 [M, K] with
    ``a_scale=None`` (W4A16); ``b``/``b_scale`` the weight's bytes and scales; ``alpha`` a
    one-element float32 tensor; ``schedule`` a catalogue name or "auto"."""
    global _REGISTERED
    with _REGISTER_LOCK:
        if not _REGISTERED:
            if not _op_exists():  # a reloaded module finds it defined already
                _define_op()
            _REGISTERED = True
    return torch.ops.cute_fp4


def _op_exists() -> bool:
    try:
        torch.ops.cute_fp4.mm  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _define_op() -> None:
    @torch.library.custom_op("cute_fp4::mm", mutates_args=())
    def mm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor,
           b_scale: torch.Tensor, alpha: torch.Tensor, k: int, out_dtype: torch.dtype,
           schedule: str) -> torch.Tensor:
        one = torch.ones((), dtype=torch.float32, device=b.device)
        bt = NVFP4Tensor(b, b_scale, one, (b.shape[0], k))
        at = NVFP4Tensor(a, a_scale, one, (a.shape[0], k)) if a_scale is not None else a
        return _gemm_impl(at, bt, schedule, None, out_dtype, alpha, False)

    @mm.register_fake
    def _(a, a_scale, b, b_scale, alpha, k, out_dtype, schedule):
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


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
    with the output poisoned (NaN) before each run so an unwritten element fails."""
    from cute_fp4.compile import CompiledGemm, Signature, compile

    kern = schedule_or_kernel
    if not isinstance(kern, CompiledGemm):
        s = schedule_or_kernel
        if isinstance(s, str):
            from cute_fp4 import catalogue

            s = catalogue.get(s)
        kern = compile(s, Signature(a_format))
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


# ----------------------------------------------------------------------------- module

class NVFP4Linear(torch.nn.Module):
    """``y = x @ W^T (+ bias)`` with W stored as NVFP4 ``[out_features, in_features]``.

    ``mode="w4a4"`` quantizes activations to NVFP4 on the fly (per-call global scale; the
    amax and the NaN/Inf check synchronise with the GPU once per call, and the quantization
    is plain torch ops, not a fused kernel); ``mode="w4a16"`` keeps them in bf16/fp16 (no
    sync). The output has the activation's dtype.
    """

    def __init__(self, weight: NVFP4Tensor, bias: torch.Tensor | None = None,
                 mode: str = "w4a16", schedule="auto"):
        super().__init__()
        if mode not in ("w4a4", "w4a16"):
            raise InputError(f"mode must be 'w4a4' or 'w4a16', got {mode!r}")
        if not isinstance(weight, NVFP4Tensor):
            raise InputTypeError(f"weight must be an NVFP4Tensor, got {type(weight).__name__}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise InputError(f"bias must have shape ({self.out_features},), "
                             f"got {tuple(bias.shape)}")
        self.register_buffer("w_data", weight.data)
        self.register_buffer("w_scale", weight.scale)
        self.register_buffer("w_global_scale", weight.global_scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.mode, self.schedule = mode, schedule

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, mode: str = "w4a16") -> NVFP4Linear:
        w = quantize(linear.weight.detach())
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, mode)

    @property
    def weight(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.w_data, self.w_scale, self.w_global_scale,
                           (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise InputError(f"input has {x.shape[-1]} features, the layer expects "
                             f"{self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        a = quantize(x2) if self.mode == "w4a4" else x2.contiguous()
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        y = gemm(a, self.weight, schedule=self.schedule, out_dtype=out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)
