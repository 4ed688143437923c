"""Perf rows: cute_fp4 schedules vs torch BF16 and FP8 GEMMs, measured in the same run.

Formulas (also written into every results file):

* FLOP = 2 * M * N * K
* bytes that must move = A + B + scales + D:
  W4A4 ``M*K/2 + N*K/2 + (M + N) * K/16 + M*N*out``, W4A16 ``2*M*K + N*K/2 + N*K/16 +
  M*N*out``; torch BF16 ``2*M*K + 2*N*K + 2*M*N``; FP8 ``M*K + N*K + 2*M*N``.
* roofline time = max(FLOP / peak, bytes / bandwidth) of the detected GPU (peak: BF16 dense
  on SM90, FP4 dense on SM120); "% roof" = roofline time / measured time.

Timing: each provider's call is captured in a CUDA graph and its replay timed with CUDA
events (device time), the L2 flushed before every repetition by reading a 256 MiB buffer
(so a 36 MiB NVFP4 weight is not served from the 50 MiB L2, and no dirty lines are left
for the timed kernel to write back); median of ``reps``. ``eager_us`` is the host-inclusive
time per call of back-to-back eager calls (what a caller without CUDA graphs pays).
"""

from __future__ import annotations

import statistics
import sys

import torch

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


def nbytes(m: int, n: int, k: int, kind: str, out_bytes: int = 2) -> int:
    d = m * n * out_bytes
    if kind == "nvfp4":
        return m * k // 2 + n * k // 2 + (m + n) * k // 16 + d
    if kind == "bf16":  # W4A16
        return 2 * m * k + n * k // 2 + n * k // 16 + d
    if kind == "torch_bf16":
        return 2 * m * k + 2 * n * k + d
    if kind == "torch_fp8":
        return m * k + n * k + d
    raise ValueError(kind)


class Timer:
    """Median device time of a callable, L2 flushed before each repetition.

    ``graph=True`` (default) captures the callable in a CUDA graph and times its replay:
    device time only, the same for every provider, as a decode loop under CUDA graphs sees
    it. The flush *reads* a 256 MiB buffer, so L2 is left holding clean lines: a flush
    that writes (``zero_()``) leaves up to 50 MiB of dirty lines that the timed kernel must
    write back, adding ~10 us to every measurement. :meth:`eager` measures the host-
    inclusive time per call of back-to-back eager calls.
    """

    def __init__(self, reps: int = 20, warmup: int = 3, graph: bool = True):
        self.reps, self.warmup, self.graph = reps, warmup, graph
        self._flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")

    def _flush_l2(self) -> None:
        self._flush.sum()

    @staticmethod
    def _graphed(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm up allocations outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.graph:
            fn = self._graphed(fn)
        times = []
        for _ in range(self.reps):
            self._flush_l2()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # us
        return statistics.median(times)

    def eager(self, fn, calls: int = 200) -> float:
        """Wall-clock microseconds per call of ``calls`` back-to-back eager calls."""
        import time

        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6


def _baselines(m, n, k, timer: Timer) -> dict[str, float]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = {"torch_bf16": timer(lambda: a @ w.T)}
    if m >= 16 and m % 16 == 0:  # cuBLASLt FP8 needs M >= 16
        a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        try:
            out["torch_fp8"] = timer(lambda: torch._scaled_mm(
                a8, w8.T, one, one, out_dtype=torch.bfloat16))
        except RuntimeError:
            pass
    return out


def _row(name, fmt, m, n, k, us, dev, base) -> dict:
    flops = 2 * m * n * k
    byts = nbytes(m, n, k, fmt)
    roof = max(flops / (dev.target.peak_tflops * 1e12), byts / (dev.mem_bw_gbs * 1e9))
    row = {"M": m, "N": n, "K": k, "schedule": name, "A": fmt, "us": round(us, 2),
           "TFLOP/s": round(flops / us / 1e6, 1), "GB/s": round(byts / us / 1e3, 1),
           "%roof": round(100 * roof / (us * 1e-6), 1),
           "x_bf16": round(base["torch_bf16"] / us, 2)}
    if "torch_fp8" in base:
        row["x_fp8"] = round(base["torch_fp8"] / us, 2)
    return row


def run_bench(schedules, shapes=None, formats=("nvfp4",), validate=True, reps=20,
              progress=True) -> list[dict]:
    """One row per shape x schedule x A format, plus the torch baselines of each shape.
    ``schedules=None`` uses ``schedule="auto"`` per shape."""
    from cute_fp4.api import make_operands, poisoned_check, resolve_schedule, run_compiled
    from cute_fp4.compile import Signature, compile
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem
    from cute_fp4.targets import require_device

    dev = require_device()
    timer = Timer(reps)
    rows = []
    for m, n, k in shapes or default_shapes():
        base = _baselines(m, n, k, timer)
        for key, us in base.items():
            rows.append({"M": m, "N": n, "K": k, "schedule": key, "A": "-", "us": round(us, 2),
                         "TFLOP/s": round(2 * m * n * k / us / 1e6, 1),
                         "GB/s": round(nbytes(m, n, k, key) / us / 1e3, 1)})
        for fmt in formats:
            a, b = make_operands(m, n, k, fmt, dist="normal")
            for s in schedules or ["auto"]:
                s = resolve_schedule(s, m, n, k, fmt, torch.bfloat16)
                if not plan(s, Problem(m, n, k, fmt)).ok:
                    continue
                if progress:
                    print(f"bench {m}x{n}x{k} {fmt} {s.name}", file=sys.stderr)
                kern = compile(s, Signature(fmt))
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                call = lambda: run_compiled(kern, a, b, out=out)  # noqa: B023, E731
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
        from cute_fp4.errors import CuteFp4Error

        raise CuteFp4Error("--plot needs matplotlib: pip install 'cute-fp4[plot]'") from None
    from cute_fp4.targets import require_device

    dev = device or require_device()
    fig, ax = plt.subplots(figsize=(7, 5))
    for key in sorted({r["schedule"] for r in rows}):
        pts = [(2 * r["M"] * r["N"] * r["K"] / nbytes(
            r["M"], r["N"], r["K"], r["A"] if r["A"] != "-" else key), r["TFLOP/s"])
            for r in rows if r["schedule"] == key]
        ax.scatter(*zip(*pts), label=key, s=14)
    xs = [2.0**i for i in range(-2, 14)]
    ax.plot(xs, [min(dev.target.peak_tflops, x * dev.mem_bw_gbs / 1e3) for x in xs], "k--",
            label=f"roofline {dev.name}: {dev.target.peak_tflops:.0f} TFLOP/s "
                  f"({'BF16' if dev.target.family == 'sm90' else 'FP4'}), "
                  f"{dev.mem_bw_gbs:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="TFLOP/s")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
