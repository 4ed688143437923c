"""Fused activation quantization (``cute_fp4.quant``): device time and bandwidth on a GPU.

    python perf/quantize_bench.py OUT.json [--quick] [--sweep] [--large MxK,...] [--no-decode]

Rows: large tensors (16M+ elements: [4096, 4096], [8192, 4096], [4096, 14336],
[16384, 4096]) and decode sizes (M in 1, 2, 4, 8, 16 x K in 4096, 8192), BF16 (and FP16
for the large ones), for the static scale, the dynamic scale two-pass and fused, and the
static scale forced through the general (div.rn) path, the static scale 2^-7 (a power of
two) and a calibrated static scale (the inputs' amax / 2688, what a calibrated
``input_scale`` gives: no block scale saturates). The other static rows use 2 / 2688, an
arbitrary value that saturates about half of randn's blocks (their words are clamped).
``--sweep`` adds thread / item / CTAs-per-SM splits and item orders of the static kernel on
the large and decode sizes.
Every row is checked bit for bit against ``cute_fp4.quantize`` before it is timed.

Timing (device time, CUDA events):
* ``graph1_us``: ``cute_fp4.bench.Timer``: one call captured in a CUDA graph, L2 flushed
  (256 MiB read) before each replay, median of 20: what the GEMM rows of ``cute_fp4.bench``
  use, launch latency included.
* ``graphN_us``: 10 calls in one graph over rotating inputs and outputs (over 100 MiB in
  all for the large sizes, so a call does not find its input in the 50 MiB L2), replay
  time / 10, median of 10: the steady-state cost between other kernels.
* ``copy_us`` (large sizes): ``out.copy_(x)`` of the same input bytes under the same
  graphN method: the bandwidth this GPU reaches in practice, measured in the same run.
* ``torch_us``: ``cute_fp4.quantize`` eagerly (it synchronises, so no graph).

Bytes (the minimum that must move) = ``2 M K`` (read) + ``M K / 2`` (codes) +
``round_up(M, 128) * round_up(K / 16, 4)`` (scales); the two-pass dynamic variant reads
the input twice (``traffic_bytes``); the values variant (``quant.quantize_values``, a row
per large shape with the calibrated scale, checked against ``block_values``) moves
``4 M K`` (BF16 in, BF16 out). ``gbs = bytes / graphN_us``; ``pct_peak`` against the
device's datasheet bandwidth (``cute_fp4.targets``, 4800 GB/s on an H200).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cute_fp4 import quant  # noqa: E402
from cute_fp4.bench import Timer, capture_graph  # noqa: E402
from cute_fp4.kernels.quantize import PARTIALS_MAX, QuantSpec  # noqa: E402
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape  # noqa: E402
from cute_fp4.quant import default_spec  # noqa: E402
from cute_fp4.targets import detect_device  # noqa: E402

LARGE = [(4096, 4096), (8192, 4096), (4096, 14336), (16384, 4096)]
DECODE = [(m, k) for k in (4096, 8192) for m in (1, 2, 4, 8, 16)]
# (threads, items, ctas_per_sm, order); 0 CTAs per SM: one CTA per chunk, no persistent
# loop (one register set: 42 registers at 2 items); a persistent grid takes two sets
# (~74 registers at 2 items: 3 CTAs of 256 per SM)
SWEEP = [(256, 2, 3, "rows"), (256, 2, 0, "rows"), (256, 2, 3, "atoms"), (128, 2, 6, "atoms"),
         (256, 1, 0, "atoms"), (256, 2, 0, "atoms"), (256, 4, 0, "atoms"),
         (128, 2, 0, "atoms"), (128, 4, 0, "atoms"), (128, 8, 0, "atoms"), (64, 4, 0, "atoms"),
         (64, 8, 0, "atoms"), (128, 6, 0, "atoms"), (256, 8, 0, "atoms"), (128, 3, 0, "atoms"),
         (128, 4, 2, "atoms")]
DECODE_SWEEP = [(256, 2, 3, "rows"), (256, 2, 0, "atoms"), (128, 4, 0, "atoms"),
                (128, 1, 0, "rows"), (64, 1, 0, "atoms")]
GRAPH_N = 10
DEFAULT_GS = 2.0 / 2688  # an arbitrary float: SM90's approximate path on almost every block
POW2_GS = 2.0**-7  # a power of two: SM90 runs its exact loop on every block
ROTATE_BYTES = 100 << 20


def nbytes(m: int, k: int, values: bool = False) -> int:
    if values:  # output="values": BF16 in, BF16 out
        return 4 * m * k
    rp, cp = scale_shape(m, k)
    return 2 * m * k + m * k // 2 + rp * cp


class Buffers:
    """Rotating inputs and poisoned outputs for one shape."""

    def __init__(self, m: int, k: int, dtype, count: int, gs: float | None = DEFAULT_GS,
                 values: bool = False):
        self.m, self.k = m, k
        g = torch.Generator(device="cuda").manual_seed(m * 31 + k)
        self.x = [torch.randn(m, k, generator=g, device="cuda").to(dtype) for _ in range(count)]
        self.out = [self._values_out() if values else self._out() for _ in range(count)]
        if gs is None:  # calibrated: the inputs' amax / 2688, no block scale saturates
            gs = max(x.float().abs().max().item() for x in self.x) / 2688
        self.gs = torch.full((1,), gs, dtype=torch.float32, device="cuda")
        self.partials = torch.empty(PARTIALS_MAX, dtype=torch.float32, device="cuda")

    def _out(self) -> NVFP4Tensor:
        m, k = self.m, self.k
        data = torch.full((m, k // 2), 0xA5, dtype=torch.uint8, device="cuda")
        scale = torch.full(scale_shape(m, k), 0x5A, dtype=torch.uint8, device="cuda")
        gs = torch.full((), float("nan"), dtype=torch.float32, device="cuda")
        return NVFP4Tensor._unchecked(data, scale.view(torch.float8_e4m3fn), gs, (m, k))

    def _values_out(self) -> torch.Tensor:
        return torch.full((self.m, self.k), float("nan"), dtype=torch.bfloat16, device="cuda")


def _launcher(kern, buf: Buffers, i: int, dynamic: bool, two_pass: bool):
    x, out = buf.x[i], buf.out[i]
    if isinstance(out, torch.Tensor):  # output="values": BF16 [M, K] (no scale buffer)
        return lambda: kern.launch(x, out, out, buf.gs, None)
    gs = out.global_scale if dynamic else buf.gs
    part = buf.partials if two_pass else None
    return lambda: kern.launch(x, out.data, out.scale, gs, part)


def _check(kern, buf: Buffers, dynamic: bool, two_pass: bool) -> bool:
    _launcher(kern, buf, 0, dynamic, two_pass)()
    ref = quantize(buf.x[0], None if dynamic else buf.gs)
    out = buf.out[0]
    torch.cuda.synchronize()
    if isinstance(out, torch.Tensor):
        return torch.equal(out.view(torch.int16),
                           ref.block_values(torch.bfloat16).view(torch.int16))
    ok = (torch.equal(out.data, ref.data)
          and torch.equal(out.scale.view(torch.uint8), ref.scale.view(torch.uint8)))
    if dynamic:
        ok = ok and torch.equal(out.global_scale.reshape(1).view(torch.int32),
                                ref.global_scale.reshape(1).view(torch.int32))
    return ok


def _graph_n(fns) -> float:
    """Median over replays of (one graph of all ``fns``) / len(fns), in microseconds."""
    def all_fns():
        for f in fns:
            f()

    g, _ = capture_graph(all_fns)
    g.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


def _eager_torch(x, gs, reps: int = 5) -> float:
    quantize(x, gs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        quantize(x, gs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def bench_row(spec: QuantSpec, m: int, k: int, dtype, timer: Timer, bw: float,
              with_torch: bool, gs: float = DEFAULT_GS) -> dict:
    dynamic = spec.scale != "static"
    two_pass = spec.scale == "dynamic"
    values = spec.output == "values"
    count = max(2, min(GRAPH_N, -(-ROTATE_BYTES // nbytes(m, k, values))))
    buf = Buffers(m, k, dtype, count, gs, values)
    kern = quant.compile_quantize(spec)
    row = {"m": m, "k": k, "dtype": str(dtype).replace("torch.", ""), "spec": spec.label(),
           "scale": spec.scale, "gs": None if dynamic else buf.gs.item(),
           "gs_kind": "dynamic" if dynamic else {None: "calibrated", DEFAULT_GS: "arbitrary",
                                                 POW2_GS: "pow2"}.get(gs, "given"),
           "general": spec.force_general, "threads": spec.threads,
           "items": spec.items, "ctas_per_sm": spec.ctas_per_sm,
           "order": spec.order,
           "compile_s": round(kern.compile_s, 2), "source": kern.source}
    row["bit_identical"] = _check(kern, buf, dynamic, two_pass)
    row["graph1_us"] = timer(_launcher(kern, buf, 0, dynamic, two_pass))
    fns = [_launcher(kern, buf, i % count, dynamic, two_pass) for i in range(GRAPH_N)]
    row["graphN_us"] = _graph_n(fns)
    b = nbytes(m, k, values)
    row["bytes"] = b
    row["traffic_bytes"] = b + (2 * m * k if two_pass else 0)
    row["gbs"] = b / row["graphN_us"] / 1e3
    row["pct_peak"] = 100 * row["gbs"] / bw
    if with_torch:
        row["torch_us"] = _eager_torch(buf.x[0], None if dynamic else buf.gs)
    return row


def copy_row(m: int, k: int, dtype, bw: float) -> dict:
    count = max(2, min(GRAPH_N, -(-ROTATE_BYTES // (2 * m * k))))
    xs = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(count)]
    ys = [torch.empty_like(x) for x in xs]
    us = _graph_n([lambda i=i: ys[i % count].copy_(xs[i % count]) for i in range(GRAPH_N)])
    b = 4 * m * k  # read + write
    return {"m": m, "k": k, "dtype": str(dtype).replace("torch.", ""), "spec": "torch copy_",
            "copy_us": us, "bytes": b, "gbs": b / us / 1e3, "pct_peak": 100 * b / us / 1e3 / bw}


def _variants(text: str) -> list[dict]:
    """'f=v,f=v;f=v' -> QuantSpec changes (integer values as ints)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = dict(kv.split("=", 1) for kv in part.split(","))
        out.append({k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="one large shape, BF16 only")
    p.add_argument("--sweep", action="store_true", help="thread/item splits on large sizes")
    p.add_argument("--large", default=None, metavar="MxK,...",
                   help="the large shapes to run (default: all four; --quick: the first)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode sizes")
    p.add_argument("--bf16-only", action="store_true", help="skip the FP16 rows")
    p.add_argument("--variants", default="", metavar="F=V[,F=V];...",
                   help="extra static rows per large shape, with the calibrated scale (the "
                        "inputs' amax / 2688): QuantSpec field changes, e.g. "
                        "'items=2;ctas_per_sm=3,order=rows'")
    args = p.parse_args(argv)
    dev = detect_device()
    if dev is None or dev.target is None:
        print("needs a supported CUDA GPU", file=sys.stderr)
        return 2
    target, bw = dev.target.name, dev.mem_bw_gbs
    timer = Timer()
    large = LARGE[:1] if args.quick else LARGE
    if args.large:
        large = [tuple(int(v) for v in shape.split("x")) for shape in args.large.split(",")]
    rows = []

    def add(row):
        rows.append(row)
        keys = ("graph1_us", "graphN_us", "copy_us", "gbs", "pct_peak", "torch_us")
        vals = " ".join(f"{key}={row[key]:.1f}" for key in keys if key in row)
        ok = "" if row.get("bit_identical", True) else " NOT BIT-IDENTICAL"
        gs = "" if row.get("gs_kind", "arbitrary") in ("arbitrary", "dynamic") else \
            f" gs={row['gs']:g} ({row['gs_kind']})"
        print(f"[{row['m']:>5}, {row['k']:>5}] {row['dtype']:<8} {row['spec']:<46} {vals}{ok}"
              f"{gs}", flush=True)

    bf16_only = args.quick or args.bf16_only
    for dtype in ([torch.bfloat16] if bf16_only else [torch.bfloat16, torch.float16]):
        dt = "bf16" if dtype == torch.bfloat16 else "fp16"
        for m, k in large:
            add(copy_row(m, k, dtype, bw))
            for scale, general in (("static", False), ("static", True), ("dynamic", False),
                                   ("dynamic_fused", False)):
                if scale == "dynamic_fused" and m * k > 16 * quant.FUSED_MAX_ELEMENTS:
                    continue
                spec = default_spec(target, dt, scale, force_general=general)
                add(bench_row(spec, m, k, dtype, timer, bw, with_torch=not general))
            add(bench_row(default_spec(target, dt), m, k, dtype, timer, bw, False, POW2_GS))
            add(bench_row(default_spec(target, dt), m, k, dtype, timer, bw, False, None))
            add(bench_row(default_spec(target, dt, output="values"), m, k, dtype, timer, bw,
                          False, None))
            for changes in _variants(args.variants):
                add(bench_row(default_spec(target, dt, **changes), m, k, dtype, timer, bw,
                              False, None))
            if args.sweep:
                for threads, items, per_sm, order in SWEEP:
                    spec = default_spec(target, dt, threads=threads, items=items,
                                        ctas_per_sm=per_sm, order=order)
                    add(bench_row(spec, m, k, dtype, timer, bw, with_torch=False))
        if dtype == torch.float16 or args.no_decode:
            continue  # decode sizes: BF16 only
        for m, k in DECODE:
            for scale in ("static", "dynamic", "dynamic_fused"):
                spec = default_spec(target, dt, scale, small=True)
                add(bench_row(spec, m, k, dtype, timer, bw, with_torch=scale == "static"))
            for threads, items, per_sm, order in (DECODE_SWEEP if args.sweep else ()):
                spec = default_spec(target, dt, small=True, threads=threads, items=items,
                                    ctas_per_sm=per_sm, order=order)
                add(bench_row(spec, m, k, dtype, timer, bw, with_torch=False))
    env = {"gpu": dev.name, "target": target, "datasheet_gbs": bw, "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "formulas": __doc__[__doc__.index("Timing"):]}
    try:
        from importlib.metadata import version

        env["cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except Exception:  # the bundle on the GPU host may not carry metadata
        env["cutlass_dsl"] = "unknown"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    bad = [r for r in rows if not r.get("bit_identical", True)]
    print(f"wrote {len(rows)} rows to {args.out}; {len(bad)} not bit-identical", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
