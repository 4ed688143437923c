"""Perf rows: cute_fp4 schedules against peers (torch BF16, torch FP8, QuACK's NVFP4
W4A16 kernel), all fed the same NVFP4 weight and measured in the same run.

Formulas (also written into every results file):

* FLOP = 2 * M * N * K
* bytes that must move = A + B + scales + D:
  W4A4 ``M*K/2 + N*K/2 + (M + N) * K/16 + M*N*out``, W4A16 (cute_fp4 and QuACK)
  ``2*M*K + N*K/2 + N*K/16 + M*N*out``; torch BF16 ``2*M*K + 2*N*K + 2*M*N``; FP8
  ``M*K + N*K + 2*M*N``. Weight bytes (``weight_TB/s``): NVFP4 ``N*K/2 + N*K/16``, BF16
  ``2*N*K``, FP8 ``N*K``.
* roofline time = max(FLOP / peak, bytes / bandwidth) of the detected GPU (peak: BF16 dense
  on SM90, FP4 dense on SM120); "% roof" = roofline time / measured time.

Timing: each provider's call is captured in a CUDA graph and its replay timed with CUDA
events (device time), the L2 flushed before every repetition by reading a 256 MiB buffer
(so a 36 MiB NVFP4 weight is not served from the 50 MiB L2, and no dirty lines are left
for the timed kernel to write back); median of ``reps``. ``eager_us`` is the host-inclusive
time per call of back-to-back eager calls (what a caller without CUDA graphs pays).

Peers (:data:`PEERS`), each prepared once outside the timed region from the same
:class:`BenchOperands` (one NVFP4 weight ``b``, BF16 activations ``a16`` and their NVFP4
quantization ``a4``):

* ``torch_bf16``: ``b``'s block values in BF16 (E2M1 x UE4M3 is exact in BF16) and
  ``out.addmm_(a16, w.T, beta=0, alpha=global_scale)``: cuBLAS, FP32 accumulation, alpha
  applied before the one rounding, so the same GEMM as the NVFP4 kernels.
* ``torch_fp8``: ``torch._scaled_mm`` of E4M3 copies of ``a16`` and of ``b``'s block values
  with per-tensor scales. FP8 requantizes the weight, so it is not exact: its check says
  ``inexact`` with the error it has, not ``FAIL``.
* ``quack_w4a16``: QuACK's ``gemm_w4a16(wformat="nvfp4")`` (optional: ``pip install
  'cute-fp4[bench]'``) on ``prepare_w4_weight(b.data, b.scale_linear(), "nvfp4")``, the same
  E2M1 bytes and UE4M3 scales repacked into its fragment order, ``tensor_scale`` the global
  scale. Reported as unavailable (with the reason) when ``import quack.gemm_w4`` fails.

Every provider's output is the one its last CUDA-graph replay wrote into an output
poisoned with NaN beforehand, checked against the exact reference
(``cute_fp4.reference.check``: the error rule, NaN never passes) in the same run; the
row carries the verdict, ``err_over_bound`` (<= 1 passes) and ``rel_err`` (max |error| /
max |reference|).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from cute_fp4.errors import CuteFp4Error
from cute_fp4.formats import NVFP4, Operand
from cute_fp4.nvfp4 import NVFP4Tensor

FLUSH_BYTES = 256 << 20

# Projection shapes (N, K) of two public LLMs, with decode and prefill M.
LLM_SHAPES = {
    "llama3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                    "down": (4096, 14336)},
    "llama3.1-70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192),
                     "down": (8192, 28672)},
}
SQUARE_M = (1, 16, 64, 256, 1024, 4096, 8192)


def default_shapes() -> list[tuple[int, int, int]]:
    shapes = [(m, 8192, 8192) for m in SQUARE_M]
    for proj in LLM_SHAPES.values():
        for n, k in proj.values():
            shapes += [(1, n, k), (16, n, k), (4096, n, k)]
    return list(dict.fromkeys(shapes))


# bytes kinds of the providers: what each one reads and writes
_KIND = {"quack_w4a16": Operand.BF16, "cute_fp4_w4a16": Operand.BF16,
         "cute_fp4_w4a4": Operand.NVFP4}
_NV = NVFP4  # the block format the providers' operands are in


def nbytes(m: int, n: int, k: int, kind: str, out_bytes: int = 2) -> int:
    """Bytes that must move for ``kind``: an A format of cute_fp4 ("nvfp4", "bf16") or a
    provider name ("torch_bf16", "torch_fp8", "quack_w4a16", ...)."""
    kind = _KIND.get(kind, kind)
    d = m * n * out_bytes
    if kind == Operand.NVFP4:
        return (m + n) * (_NV.data_row_bytes(k) + _NV.scale_cols(k)) + d
    if kind in (Operand.BF16, Operand.FP16):  # W4A16
        return 2 * m * k + n * (_NV.data_row_bytes(k) + _NV.scale_cols(k)) + d
    if kind == "torch_bf16":
        return 2 * m * k + 2 * n * k + d
    if kind == "torch_fp8":
        return m * k + n * k + d
    raise ValueError(kind)


def weight_bytes(n: int, k: int, kind: str) -> int:
    """Bytes of the weight (and its scales) alone: what decode streams."""
    kind = _KIND.get(kind, kind)
    if kind in (Operand.NVFP4, Operand.BF16, Operand.FP16):
        return n * (_NV.data_row_bytes(k) + _NV.scale_cols(k))
    if kind == "torch_bf16":
        return 2 * n * k
    if kind == "torch_fp8":
        return n * k
    raise ValueError(kind)


FORMULAS = {
    "flop": "2*M*N*K",
    "bytes": {
        "cute_fp4 W4A16, QuACK W4A16": "N*K/2 (weight) + N*K/16 (scales) + M*K*2 "
                                       "(activations) + M*N*2 (output)",
        "cute_fp4 W4A4": "N*K/2 + N*K/16 + M*K/2 + M*K/16 + M*N*2",
        "torch BF16": "N*K*2 + M*K*2 + M*N*2",
        "torch FP8": "N*K + M*K + M*N*2",
    },
    "weight_bytes": {"NVFP4": "N*K/2 + N*K/16", "BF16": "N*K*2", "FP8": "N*K"},
}


def torch_combine(down: torch.Tensor, routing, topk_weights: torch.Tensor) -> torch.Tensor:
    """The combine of the torch peers' MoE layers, as a torch MoE writes it: one gather and
    one batched matmul in ``down``'s dtype (cuBLAS accumulates in float32), the weights
    rounded to that dtype; ``routing`` a :class:`cute_fp4.layers.Routing`. (The package's
    layers use :func:`cute_fp4.layers.routing.combine`: one kernel on a GPU.)"""
    t, k = topk_weights.shape
    pairs = down.index_select(0, routing.inverse).view(t, k, down.shape[-1])
    return torch.bmm(topk_weights.to(down.dtype).unsqueeze(1), pairs).squeeze(1)


def capture_graph(fn, warmups: int = 1):
    """``fn`` captured in a CUDA graph after ``warmups`` calls on a side stream (so that
    allocations and lazy compiles happen outside the capture). Returns (the graph, what
    ``fn`` returned while captured)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        result = fn()
    return g, result


class Timer:
    """Median device time of a callable, L2 flushed before each repetition.

    ``graph=True`` (default) captures the callable in a CUDA graph and times its replay:
    device time only, the same for every provider, as a decode loop under CUDA graphs sees
    it. The flush *reads* a 256 MiB buffer, so L2 is left holding clean lines: a flush
    that writes (``zero_()``) leaves up to 50 MiB of dirty lines that the timed kernel must
    write back, adding ~10 us to every measurement. ``flush=False`` leaves L2 warm (what
    ``triton.testing.do_bench_cudagraph`` measures). :meth:`eager` measures the host-
    inclusive time per call of back-to-back eager calls.
    """

    def __init__(self, reps: int = 20, warmup: int = 3, graph: bool = True, flush: bool = True):
        self.reps, self.warmup, self.graph, self.flush = reps, warmup, graph, flush
        self._flush = (torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
                       if flush else None)

    def _flush_l2(self) -> None:
        if self._flush is not None:
            self._flush.sum()

    @staticmethod
    def _graphed(fn):
        """(replay, what fn returned while captured) of ``fn`` captured in a CUDA graph."""
        g, result = capture_graph(fn)
        return g.replay, result

    def __call__(self, fn) -> float:
        return self.timed(fn)[0]

    def timed(self, fn) -> tuple[float, object]:
        """(median microseconds, fn's result after the last timed run). In graph mode the
        result is a copy, taken after the last replay, of the tensor the captured call
        returned: the output the replays wrote, which is what a check should look at."""
        result = None
        for _ in range(self.warmup):
            result = fn()
        if self.graph:
            run, result = self._graphed(fn)
        else:
            run = fn
        times = []
        for _ in range(self.reps):
            self._flush_l2()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            r = run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
            if not self.graph:
                result = r
        if isinstance(result, torch.Tensor):
            result = result.clone()  # while the graph (and its memory pool) is alive
        return statistics.median(times), result

    def eager(self, fn, calls: int = 200) -> float:
        """Wall-clock microseconds per call of ``calls`` back-to-back eager calls."""
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6


# ----------------------------------------------------------------------------- operands

@dataclasses.dataclass(frozen=True)
class BenchOperands:
    """One problem's operands, shared by every provider: the NVFP4 weight ``b`` [N, K],
    the W4A16 activations ``a16`` (BF16 [M, K]) and ``a4``, their NVFP4 quantization (the
    W4A4 activations, as ``NVFP4Linear(mode="w4a4")`` would make them)."""

    b: NVFP4Tensor
    a16: torch.Tensor
    a4: NVFP4Tensor
    memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def mnk(self) -> tuple[int, int, int]:
        return self.a16.shape[0], self.b.shape[0], self.b.shape[1]

    def activation(self, a_format: str):
        """The A operand of ``a_format``: "bf16", "fp16" (``a16`` converted) or "nvfp4"."""
        if a_format == Operand.NVFP4:
            return self.a4
        if a_format == "bf16":
            return self.a16
        if a_format == "fp16":
            return self.memo.setdefault("fp16", self.a16.half())
        raise CuteFp4Error(f"unknown A format {a_format!r}; known: bf16, fp16, nvfp4")

    def ref_absmax(self, a_format: str) -> float:
        """max |exact reference| of ``activation(a_format) @ b.T`` (computed once)."""
        key = ("absmax", a_format)
        if key not in self.memo:
            from cute_fp4 import reference

            ref = reference.gemm(self.activation(a_format), self.b, out_dtype=torch.float64)
            self.memo[key] = float(ref.abs().max())
        return self.memo[key]


def bench_operands(m: int, n: int, k: int, seed: int = 0, dist: str = "normal",
                   device="cuda") -> BenchOperands:
    """Random operands (``cute_fp4.operands.make_operands``) for every provider."""
    from cute_fp4.nvfp4 import quantize
    from cute_fp4.operands import make_operands

    a16, b = make_operands(m, n, k, "bf16", seed, dist, device)
    return BenchOperands(b, a16, quantize(a16))


def check_output(out: torch.Tensor, ops: BenchOperands, a_format: str, exact: bool) -> dict:
    """The verdict of the exact reference's error rule on ``out``: "ok", "FAIL", or, for a
    provider that does not compute the same exact products (``exact=False``: FP8),
    "inexact" when it misses the rule; with ``err_over_bound`` and ``rel_err``."""
    from cute_fp4 import reference

    res = reference.check(out, ops.activation(a_format), ops.b)
    top = ops.ref_absmax(a_format)
    rel = res.max_abs_err / top if top > 0 else float("inf")
    verdict = "ok" if res.passed else "FAIL" if exact else "inexact"
    return {"check": verdict, "err_over_bound": float(f"{res.max_err_over_bound:.4g}"),
            "rel_err": float(f"{rel:.3g}"), "nonfinite": res.nonfinite}


# ----------------------------------------------------------------------------- providers

class Unavailable(CuteFp4Error):
    """A provider cannot run here or for this shape (the message says why, with numbers)."""


class Prepared(NamedTuple):
    """A provider made ready for one problem, outside the timed region."""

    call: Callable[[], torch.Tensor]  # graph-capturable; returns the [M, N] output
    info: dict  # what to record beside the time (schedule name, compile seconds, ...)


class Provider(NamedTuple):
    """One way of computing ``alpha * A @ B^T`` for a :class:`BenchOperands`."""

    name: str
    a_format: str  # the activations it takes: "bf16" (W4A16) or "nvfp4" (W4A4)
    kind: str  # what it moves, for :func:`nbytes` / :func:`weight_bytes`
    exact: bool  # the same exact products, FP32 accumulation: the error rule applies
    what: str  # one line for results files
    status: Callable[[], str | None]  # None when usable here, else why not
    prepare: Callable[[BenchOperands], Prepared]


def _poisoned(m: int, n: int, device) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)


def _always() -> None:
    return None


def _prepare_torch_bf16(ops: BenchOperands) -> Prepared:
    m, n, _ = ops.mnk
    w = ops.b.block_values(torch.float64).to(torch.bfloat16)  # exact: <= 6 significant bits
    gs = float(ops.b.global_scale)
    out = _poisoned(m, n, w.device)
    a, wt = ops.a16, w.T
    return Prepared(lambda: out.addmm_(a, wt, beta=0.0, alpha=gs), {})


def _fp8_status() -> str | None:
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return f"needs FP8 tensor cores (sm_89 or later), the GPU is sm_{cc[0]}{cc[1]}"
    return None


def _e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 copy of x / s, s) with the per-tensor scale s = amax / 448."""
    s = (x.abs().amax() / 448.0).clamp(min=2.0**-120).float()
    return (x / s).to(torch.float8_e4m3fn), s


def _prepare_torch_fp8(ops: BenchOperands) -> Prepared:
    m, n, _ = ops.mnk
    w8, sw = _e4m3(ops.b.block_values(torch.float32))
    a8, sa = _e4m3(ops.a16.float())
    sb = (sw * ops.b.global_scale.float()).reshape(())
    out = _poisoned(m, n, w8.device)
    w8t = w8.T  # column-major [K, N], what cuBLASLt FP8 takes
    return Prepared(lambda: torch._scaled_mm(a8, w8t, scale_a=sa, scale_b=sb,
                                             out_dtype=torch.bfloat16, out=out),
                    {"fp8_scaling": "per-tensor, use_fast_accum=False"})


QUACK_HINT = "pip install 'cute-fp4[bench]' (quack-kernels)"


def _quack_status() -> str | None:
    try:
        import quack.gemm_w4  # noqa: F401
    except Exception as e:  # an absent package, or one that fails to import here
        return f"quack-kernels is not importable ({type(e).__name__}: {e}); {QUACK_HINT}"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def quack_version() -> str | None:
    """The installed quack-kernels version, or None."""
    from importlib import metadata

    try:
        return metadata.version("quack-kernels")
    except metadata.PackageNotFoundError:
        mod = sys.modules.get("quack")
        return getattr(mod, "__version__", None) if mod is not None else None


def _prepare_quack(ops: BenchOperands) -> Prepared:
    from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

    m, n, k = ops.mnk
    if k % 64:
        raise Unavailable(f"QuACK's NVFP4 repack needs K a multiple of 64, K = {k}")
    blob, sf = prepare_w4_weight(ops.b.data, ops.b.scale_linear(), NVFP4.name)
    n_full = blob.shape[0] * 64  # N padded by the repack
    gs = float(ops.b.global_scale)
    out = _poisoned(m, n_full, ops.b.device)
    a = ops.a16

    def call() -> torch.Tensor:
        return gemm_w4a16(a, blob, sf, tensor_scale=gs, out=out, wformat=NVFP4.name)[:, :n]

    return Prepared(call, {"quack": quack_version(), "n_padded": n_full})


TORCH_BF16 = Provider("torch_bf16", "bf16", "torch_bf16", True,
                      "cuBLAS BF16 GEMM of b's exact BF16 block values, alpha = global scale",
                      _always, _prepare_torch_bf16)
TORCH_FP8 = Provider("torch_fp8", "bf16", "torch_fp8", False,
                     "torch._scaled_mm of per-tensor E4M3 copies of a16 and b (requantized)",
                     _fp8_status, _prepare_torch_fp8)
QUACK_W4A16 = Provider("quack_w4a16", "bf16", "bf16", True,
                       "QuACK gemm_w4a16(wformat='nvfp4') on b's bytes and scales, repacked",
                       _quack_status, _prepare_quack)
PEERS = (TORCH_BF16, TORCH_FP8, QUACK_W4A16)


def provider_status(providers=PEERS) -> dict[str, str | None]:
    """Each provider's name -> None (usable here) or the reason it is not. Never raises."""
    out = {}
    for p in providers:
        try:
            out[p.name] = p.status()
        except Exception as e:  # a status check must not take the run down
            out[p.name] = f"status check failed: {type(e).__name__}: {e}"
    return out


def cute_fp4_provider(schedule, a_format: str) -> Provider:
    """cute_fp4 with ``schedule`` (a Schedule, a catalogue name or "auto", resolved per
    shape) and A in ``a_format``; compiled once per schedule signature (symbolic M, N, K)."""
    name = "cute_fp4_w4a16" if Operand.of(a_format).sixteen_bit else "cute_fp4_w4a4"

    def status() -> str | None:
        from cute_fp4.targets import detect_device

        dev = detect_device()
        return None if dev is not None and dev.target is not None else \
            "needs a GPU cute_fp4 has kernels for (sm_90a, sm_120a, sm_121a)"

    def prepare(ops: BenchOperands) -> Prepared:
        from cute_fp4.api import resolve_schedule
        from cute_fp4.compile import Signature, compile
        from cute_fp4.operands import alpha_tensor
        from cute_fp4.plan import plan
        from cute_fp4.run import run_compiled
        from cute_fp4.schedule import Problem

        m, n, k = ops.mnk
        s = resolve_schedule(schedule, m, n, k, a_format, torch.bfloat16)
        pl = plan(s, Problem(m, n, k, a_format))
        if not pl.ok:
            raise Unavailable(f"plan() refuses {s.name or s.label()}: {'; '.join(pl.reasons)}")
        kern = compile(s, Signature(a_format))
        a, b = ops.activation(a_format), ops.b
        if s.mainloop.reads_packed:  # packed once, as NVFP4Linear would hold it
            from cute_fp4.packed import repack

            b = repack(b)
        # alpha (W4A4: the product of the two global scales) made once, as a static
        # activation scale allows: the graph then holds the GEMM alone, no multiply
        alpha = alpha_tensor(a, b, None)
        out = _poisoned(m, n, b.device)
        return Prepared(lambda: run_compiled(kern, a, b, out=out, alpha=alpha),
                        {"schedule_name": s.name or s.label(), "schedule_key": s.key(),
                         "compile_s": round(kern.compile_s, 2), "kernel_source": kern.source})

    return Provider(name, a_format, a_format, True, f"cute_fp4 schedule={schedule!r}", status,
                    prepare)


def measure(p: Provider, ops: BenchOperands, timer) -> dict:
    """One row: ``p`` prepared for ``ops`` (not timed), called once (``setup_s`` includes
    any compile), timed with ``timer.timed`` and its output checked. A provider that is
    unavailable or raises gives a row with ``status`` saying so, never an exception."""
    m, n, k = ops.mnk
    row = {"M": m, "N": n, "K": k, "provider": p.name, "A": p.a_format}
    why = p.status()
    if why:
        return {**row, "status": f"unavailable: {why}"}
    t0 = time.perf_counter()
    try:
        prep = p.prepare(ops)
        prep.call()
        if ops.b.device.type == "cuda":
            torch.cuda.synchronize()
        setup_s = time.perf_counter() - t0
        us, out = timer.timed(prep.call)
    except Unavailable as e:
        return {**row, "status": f"unavailable: {e}"}
    except Exception as e:  # record what broke and keep going
        return {**row, "status": f"error: {type(e).__name__}: {str(e)[:300]}"}
    row.update(status="ok", us=round(us, 2), **rates(m, n, k, p.kind, us),
               setup_s=round(setup_s, 2), **prep.info)
    row.update(check_output(out, ops, p.a_format, p.exact))
    return row


def rates(m: int, n: int, k: int, kind: str, us: float) -> dict:
    """TFLOP/s, GB/s (all bytes) and weight TB/s of ``us`` microseconds."""
    return {"TFLOP/s": round(2 * m * n * k / us / 1e6, 1),
            "GB/s": round(nbytes(m, n, k, kind) / us / 1e3, 1),
            "weight_TB/s": round(weight_bytes(n, k, kind) / us / 1e6, 3)}


# ----------------------------------------------------------------------------- environment

def environment() -> dict:
    """What a results file must say about where it was measured: GPU, driver, versions
    (torch, CUDA, CuTe DSL, QuACK, Triton), the git commit (when the checkout has one) and
    the package's source fingerprint (which also keys the compile cache), date."""
    import datetime
    import platform
    import subprocess
    from importlib import metadata
    from pathlib import Path

    from cute_fp4.cache import source_fingerprint

    def version(dist: str, module: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            mod = sys.modules.get(module)
            return getattr(mod, "__version__", None) if mod is not None else None

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "cute_dsl": version("nvidia-cutlass-dsl", "cutlass"),
           "quack_kernels": version("quack-kernels", "quack"),
           "triton": version("triton", "triton"), "python": platform.python_version(),
           "host": platform.node(), "cute_fp4_sources": source_fingerprint()[:16]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, cc=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count)
    try:
        root = str(Path(__file__).resolve().parent.parent)
        git = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        env["git_commit"] = git.stdout.strip() if git.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
        env["nvidia_smi"] = smi
        env["driver"] = smi.splitlines()[0].split(",")[1].strip() if smi else None
    except (OSError, subprocess.SubprocessError, IndexError):
        env["driver"] = None
    return env


# ----------------------------------------------------------------------------- bench rows

def _row(name, fmt, m, n, k, us, dev, base) -> dict:
    flops = 2 * m * n * k
    byts = nbytes(m, n, k, fmt)
    roof = max(flops / (dev.target.peak_tflops * 1e12), byts / (dev.mem_bw_gbs * 1e9))
    row = {"M": m, "N": n, "K": k, "schedule": name, "A": fmt, "us": round(us, 2),
           "TFLOP/s": round(flops / us / 1e6, 1), "GB/s": round(byts / us / 1e3, 1),
           "%roof": round(100 * roof / (us * 1e-6), 1)}
    for peer, col in (("torch_bf16", "x_bf16"), ("torch_fp8", "x_fp8"),
                      ("quack_w4a16", "x_quack")):
        if peer in base:
            row[col] = round(base[peer] / us, 2)
    return row


def _peer_rows(ops: BenchOperands, timer: Timer, said: set) -> tuple[list[dict], dict]:
    """The peers' rows of one shape and their times by name. A peer that is unavailable
    (said once) or raised (said each time) is a line on stderr, not a row."""
    rows, base = [], {}
    for p in PEERS:
        r = measure(p, ops, timer)
        if "us" not in r:
            if r["status"].startswith("error") or p.name not in said:
                said.add(p.name)
                print(f"bench {r['M']}x{r['N']}x{r['K']}: {p.name} {r['status']}",
                      file=sys.stderr)
            continue
        base[p.name] = r["us"]
        rows.append({"M": r["M"], "N": r["N"], "K": r["K"], "schedule": p.name, "A": "-",
                     **{c: r[c] for c in ("us", "TFLOP/s", "GB/s", "check")}})
    return rows, base


def run_bench(schedules, shapes=None, formats=(Operand.NVFP4,), validate=True, reps=20,
              progress=True) -> list[dict]:
    """One row per shape x schedule x A format, plus the peers' rows of each shape
    (:data:`PEERS` that are available here, fed the same weight, each with its check).
    ``schedules=None`` uses ``schedule="auto"`` per shape."""
    from cute_fp4.api import poisoned_check, resolve_schedule, run_compiled
    from cute_fp4.compile import Signature, compile
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem
    from cute_fp4.targets import require_device

    dev = require_device()
    timer = Timer(reps)
    rows, said = [], set()
    for m, n, k in shapes or default_shapes():
        ops = bench_operands(m, n, k)
        peer_rows, base = _peer_rows(ops, timer, said)
        rows += peer_rows
        for fmt in formats:
            a, b = ops.activation(fmt), ops.b
            for s in schedules or ["auto"]:
                s = resolve_schedule(s, m, n, k, fmt, torch.bfloat16)
                if not plan(s, Problem(m, n, k, fmt)).ok:
                    continue
                if progress:
                    print(f"bench {m}x{n}x{k} {fmt} {s.name}", file=sys.stderr)
                kern = compile(s, Signature(fmt))
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                wb = b
                if s.mainloop.reads_packed:  # packed once, outside the timing
                    from cute_fp4.packed import repack

                    wb = repack(b)
                call = lambda: run_compiled(kern, a, wb, out=out)  # noqa: B023, E731
                us = timer(call)
                row = _row(s.name, fmt, m, n, k, us, dev, base)
                row["eager_us"] = round(timer.eager(call), 1)
                if validate:
                    row["validated"] = "yes" if poisoned_check(kern, a, b).passed else "NO"
                rows.append(row)
    return rows


def plot_roofline(rows: list[dict], path: str, device=None) -> None:
    """Achieved TFLOP/s against arithmetic intensity, with the roofline of ``device``
    (default: the present GPU)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CuteFp4Error("--plot needs matplotlib: pip install 'cute-fp4[plot]'") from None
    from cute_fp4.targets import require_device

    dev = device or require_device()
    fig, ax = plt.subplots(figsize=(7, 5))
    for key in sorted({r["schedule"] for r in rows if "TFLOP/s" in r}):
        pts = [(2 * r["M"] * r["N"] * r["K"] / nbytes(
            r["M"], r["N"], r["K"], r["A"] if r["A"] != "-" else key), r["TFLOP/s"])
            for r in rows if r["schedule"] == key and "TFLOP/s" in r]
        ax.scatter(*zip(*pts), label=key, s=14)
    xs = [2.0**i for i in range(-2, 14)]
    ax.plot(xs, [min(dev.target.peak_tflops, x * dev.mem_bw_gbs / 1e3) for x in xs], "k--",
            label=f"roofline {dev.name}: {dev.target.peak_tflops:.0f} TFLOP/s "
                  f"({'BF16' if dev.target.family == 'sm90' else 'FP4'}), "
                  f"{dev.mem_bw_gbs:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="TFLOP/s")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
