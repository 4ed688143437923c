"""The torch-facing API: ``gemm``, ``validate``, the ``cute_fp4::mm`` custom op, NVFP4Linear.

Every call goes through :func:`check_operands` before anything is launched or written:
a bad input raises a typed error naming the problem and the numbers, and the output
tensor is left untouched. ``gemm`` is registered as the ``torch.library`` custom op
``cute_fp4::mm`` (with a fake implementation), so ``torch.compile(fullgraph=True)`` of a
function that calls it captures one node.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cute_fp4 import reference
from cute_fp4.errors import DeviceError, InputError, InputTypeError
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape
from cute_fp4.schedule import OutDtype, Problem, Schedule

_TORCH_OUT = {OutDtype.BF16: torch.bfloat16, OutDtype.FP16: torch.float16,
              OutDtype.FP32: torch.float32}
SWAPAB_MAX_M = 32  # sm90: up to this M the swap-AB decode schedule is picked
ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and row pitches


# ----------------------------------------------------------------------------- checks

def _check_tensor(t: torch.Tensor, name: str, dtypes, shape, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise InputError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} is on {t.device} but the operands are on {device}")
    if not t.is_contiguous():
        raise InputError(f"{name} must be contiguous (row-major); got strides {t.stride()} "
                         f"for shape {tuple(t.shape)}")
    if t.data_ptr() % ALIGN:
        raise InputError(f"{name}'s data pointer 0x{t.data_ptr():x} is not {ALIGN}-byte "
                         f"aligned (offset {t.data_ptr() % ALIGN}); TMA needs {ALIGN} bytes")


def check_operands(a, b, out, alpha, out_dtype: torch.dtype,
                   require_cuda: bool = True) -> tuple[int, int, int, str]:
    """Validate operands; returns (M, N, K, a_format). Raises before anything is written.
    ``require_cuda=False`` skips only the device-type check (CPU tests of the rest)."""
    if not isinstance(b, NVFP4Tensor):
        raise InputTypeError(f"b (the weight) must be an NVFP4Tensor [N, K], got "
                             f"{type(b).__name__}; use cute_fp4.quantize() or "
                             "NVFP4Tensor.from_modelopt()")
    n, k = b.shape
    dev = b.device
    if require_cuda and dev.type != "cuda":
        raise DeviceError(f"operands must be on a CUDA device, b is on {dev}")
    if isinstance(a, NVFP4Tensor):
        m, ka = a.shape
        a_format = "nvfp4"
    elif isinstance(a, torch.Tensor):
        if a.dim() != 2:
            raise InputError(f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
        (m, ka), a_format = a.shape, {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            a.dtype, "")
        if not a_format:
            raise InputError(f"a must be an NVFP4Tensor (W4A4) or bfloat16/float16 (W4A16), "
                             f"got {a.dtype}")
    else:
        raise InputTypeError(f"a must be an NVFP4Tensor or a torch.Tensor, "
                             f"got {type(a).__name__}")
    if ka != k:
        raise InputError(f"K mismatch: a is [{m}, {ka}] and b is [{n}, {k}]")
    if m == 0 or n == 0 or k == 0:
        raise InputError(f"empty GEMM: M = {m}, N = {n}, K = {k}; all must be > 0")
    if k % 32:
        raise InputError(f"K = {k} is not a multiple of 32: packed FP4 rows must be a "
                         "multiple of 16 bytes")
    _check_tensor(b.data, "b.data", (torch.uint8,), (n, k // 2), dev)
    _check_tensor(b.scale, "b.scale", (torch.float8_e4m3fn,), scale_shape(n, k), dev)
    if a_format == "nvfp4":
        _check_tensor(a.data, "a.data", (torch.uint8,), (m, k // 2), dev)
        _check_tensor(a.scale, "a.scale", (torch.float8_e4m3fn,), scale_shape(m, k), dev)
    else:
        _check_tensor(a, "a", (a.dtype,), (m, k), dev)
    if out is not None:
        _check_tensor(out, "out", (out_dtype,), (m, n), dev)
    if (n * out_dtype.itemsize) % ALIGN:
        raise InputError(f"N = {n} gives output rows of {n * out_dtype.itemsize} bytes; they "
                         f"must be a multiple of {ALIGN} (N a multiple of "
                         f"{ALIGN // out_dtype.itemsize})")
    if alpha is not None and isinstance(alpha, torch.Tensor) and alpha.numel() != 1:
        raise InputError(f"alpha must be a scalar, got {alpha.numel()} elements")
    return m, n, k, a_format


def _alpha_tensor(a, b: NVFP4Tensor, alpha) -> torch.Tensor:
    """alpha as a one-element float32 tensor on b's device (0-d when it comes from the
    global scales: the kernels read only its data pointer). No copy when the global scale
    already is float32 on b's device; W4A4 multiplies the two (one elementwise op)."""
    if alpha is None:
        dev = b.device
        gs = b.global_scale
        if gs.dtype != torch.float32 or gs.device != dev:
            gs = gs.to(dev, torch.float32)
        if isinstance(a, NVFP4Tensor):
            ga = a.global_scale
            if ga.dtype != torch.float32 or ga.device != dev:
                ga = ga.to(dev, torch.float32)
            gs = gs * ga
        return gs if gs.dim() == 0 or gs.shape == (1,) else gs.reshape(1)
    return torch.as_tensor(alpha, dtype=torch.float32, device=b.device).reshape(1)


# ----------------------------------------------------------------------------- running

def out_dtype_of(schedule: Schedule) -> torch.dtype:
    """The torch dtype a schedule's epilogue writes."""
    return _TORCH_OUT[schedule.epilogue.out_dtype]


def run_compiled(kernel, a, b: NVFP4Tensor, out=None, alpha=None) -> torch.Tensor:
    """Validate, allocate, launch ``kernel`` (a CompiledGemm), reduce split-K partials."""
    dims = check_operands(a, b, out, alpha, out_dtype_of(kernel.schedule))
    return _run_checked(kernel, a, b, out, alpha, dims)


def _run_checked(kernel, a, b: NVFP4Tensor, out, alpha, dims) -> torch.Tensor:
    """:func:`run_compiled` after :func:`check_operands` returned ``dims``."""
    s: Schedule = kernel.schedule
    out_dtype = out_dtype_of(s)
    m, n, k, a_format = dims
    if a_format != kernel.signature.a_format:
        raise InputError(f"kernel was compiled for A in {kernel.signature.a_format}, "
                         f"got {a_format}")
    _check_plan(s, Problem(m, n, k, a_format))
    alpha_t = _alpha_tensor(a, b, alpha)
    result = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=b.device)
    a_data, a_scale = (a.data, a.scale) if a_format == "nvfp4" else (a, None)
    if s.split_k > 1:
        ws = torch.empty((s.split_k, m, n), dtype=torch.float32, device=b.device)
        kernel.launch(a_data, a_scale, b.data, b.scale, result, alpha_t, ws)
        # sum over the split in a fixed order (deterministic), then alpha, rounded once
        # into result's dtype: bit-identical to result.copy_(ws.sum(0).mul_(alpha_t)) with
        # two elementwise kernels instead of three
        torch.mul(ws.sum(dim=0), alpha_t, out=result)
    else:
        kernel.launch(a_data, a_scale, b.data, b.scale, result, alpha_t, None)
    return result


@functools.lru_cache(maxsize=4096)
def _check_plan(s: Schedule, p: Problem) -> None:
    """``plan(s, p).raise_if_invalid()``, memoised: plan() is pure but costs ~150 us of
    Python, which at decode sizes is several times the kernel. Refusals are not cached
    (the exception propagates), so they are re-raised with their message every call."""
    from cute_fp4.plan import plan

    plan(s, p).raise_if_invalid()


def resolve_schedule(schedule, m: int, n: int, k: int, a_format: str,
                     out_dtype: torch.dtype) -> Schedule:
    """A Schedule from a Schedule, a catalogue name, or "auto" (tuned, else heuristic)."""
    from cute_fp4 import catalogue
    from cute_fp4.targets import require_device

    if isinstance(schedule, str) and schedule != "auto":
        schedule = catalogue.get(schedule)
    if schedule == "auto":
        from cute_fp4.tune import lookup

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
    result = _run_checked(kern, a, b, out, alpha, dims)  # checked once, above
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
    return _gemm_impl(a, b, schedule, out, out_dtype, alpha, check)


# ----------------------------------------------------------------------------- custom op

def _flatten(a, b: NVFP4Tensor, alpha):
    """NVFP4 operands -> plain tensors for the op (W4A16: a has no scale)."""
    if isinstance(a, NVFP4Tensor):
        a_t, a_sf = a.data, a.scale
    else:
        a_t, a_sf = a, None
    return a_t, a_sf, b.data, b.scale, _alpha_tensor(a, b, alpha)


def _op_call(a, b, schedule, out_dtype, alpha):
    if not isinstance(schedule, str):
        raise InputTypeError("under torch.compile, pass schedule as a catalogue name or 'auto'")
    a_t, a_sf, b_t, b_sf, alpha_t = _flatten(a, b, alpha)
    return torch.ops.cute_fp4.mm(a_t, a_sf, b_t, b_sf, alpha_t, b.shape[1], out_dtype, schedule)


@functools.cache
def _ops():
    """Register ``cute_fp4::mm`` once, on first use (no import-time side effects)."""

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

    return torch.ops.cute_fp4


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


def make_operands(m: int, n: int, k: int, a_format: str = "nvfp4", seed: int = 0,
                  dist: str = "awkward", device="cuda"):
    """Random operands: ``awkward`` gives rows whose magnitudes span 2^-6..2^6 (block scales
    over ~14 binades of UE4M3's 18, subnormal scales included), 5% zero blocks and 2%
    blocks 16x larger, so scale handling bugs show up; ``normal`` is N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def mat(rows):
        x = torch.randn(rows, k, generator=g, device=device)
        if dist == "awkward":
            x *= torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g, device=device).float())
            blocks = x.view(rows, k // 16, 16)
            blocks[torch.rand(rows, k // 16, generator=g, device=device) < 0.05] = 0.0
            blocks[torch.rand(rows, k // 16, generator=g, device=device) < 0.02] *= 16.0
        return x

    b = quantize(mat(n))
    a_raw = mat(m)
    if a_format == "nvfp4":
        return quantize(a_raw), b
    dt = torch.bfloat16 if a_format == "bf16" else torch.float16
    return (a_raw / a_raw.abs().max().clamp(min=1e-30)).to(dt), b


def poisoned_check(kernel, a, b: NVFP4Tensor) -> reference.CheckResult:
    """Run ``kernel`` into an output filled with NaN (so an unwritten element fails) and
    compare it with the exact reference."""
    m, n = a.shape[0], b.shape[0]
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(kernel.schedule),
                     device=b.device)
    run_compiled(kernel, a, b, out=out)
    torch.cuda.synchronize()
    return reference.check(out, a, b)


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


_ops()
