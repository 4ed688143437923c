"""Dense MXFP4 W4A16 against NVFP4 W4A16 at decode: the weight-streaming kernel on each
format's weight of one shape, timed in the same run, beside each weight's read floor.

    python perf/mxfp4_decode.py --out DIR [--ms 1 4 16] [--shapes N,K ...]

The issue's bar (issue 43): at M = 1 on 2880 x 2880 and 8192 x 8192 weights the MXFP4 time
within 10% of NVFP4's. Both formats run the schedule "auto" picks for the shape
(``tuning.stream_decode_schedule``: the same tile, split-K and units in flight), compiled
for the format (``Problem(a_format="bf16", b_format=...)``), BF16 activations, BF16 output.
Timing as perf/decode_bench.py's: 8 distinct weight copies per format in one CUDA graph, L2
flushed before each replay (cold), median of 30 replays / 8 (``read_floor.time_copies``);
every copy's output checked against the exact reference before its time counts (first and
last copy). The floor of each format is a plain read of its weight's bytes:
``N K / 2 + N K / 16`` (NVFP4) and ``N K / 2 + N K / 32`` (MXFP4), ``read_floor.floor``.
Writes ``DIR/mxfp4_decode.json`` and ``DIR/mxfp4_decode.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import read_floor  # noqa: E402
from outputs import write_outputs  # noqa: E402

SHAPES = [(2880, 2880), (8192, 8192)]
FORMATS = ("nvfp4", "mxfp4")


def weight_bytes(n: int, k: int, fmt: str) -> int:
    from cute_fp4.formats import get_format

    return n * k // 2 + n * k // get_format(fmt).block


def compiled(s, problem):
    """``s`` compiled for ``problem`` (the weight format is the problem's)."""
    import cutlass.cute as cute

    from cute_fp4.compile import CompiledGemm, Signature, kernel_class

    kernel = kernel_class(s)(s, problem)
    fn = cute.compile(kernel, *kernel.fake_args())
    return CompiledGemm(s, Signature(str(problem.a_format)), fn, kernel, 0.0, "built-uncached")


def one_format(m: int, n: int, k: int, fmt: str, copies: int = read_floor.COPIES) -> dict:
    from cute_fp4 import packed, reference, tuning
    from cute_fp4.nvfp4 import quantize
    from cute_fp4.operands import Operands
    from cute_fp4.schedule import Problem
    from cute_fp4.targets import detect_device
    from cute_fp4.workspaces import split_workspace

    s = tuning.stream_decode_schedule(detect_device().target.name, m, n, k)
    kern = compiled(s, Problem(a_format="bf16", b_format=fmt))
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    weights, calls = [], []
    for _ in range(copies):
        w = quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02, format=fmt)
        pw = packed.repack(w)
        alpha = (torch.ones(1, dtype=torch.float32, device="cuda") if w.global_scale is None
                 else w.global_scale.reshape(1).float())
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ws = split_workspace(kern, m, n, out.device) if s.split_k > 1 else None
        ops = Operands(x, None, pw.data, pw.scale, out, alpha, ws)

        def call(ops=ops):
            kern.launch(ops)
            return ops.out

        weights.append(w)
        calls.append(call)
    us, outs = read_floor.time_copies(calls)
    checks = [reference.check(outs[i], x, weights[i]) for i in (0, -1)]
    return {"M": m, "N": n, "K": k, "format": fmt, "schedule": s.label(),
            "split_k": s.split_k, "cold_us": round(us, 3),
            "weight_bytes": weight_bytes(n, k, fmt),
            "TB/s": round(weight_bytes(n, k, fmt) / us / 1e6, 3),
            "check": "ok" if all(c.passed for c in checks) else "FAIL",
            "max_err_over_bound": max(c.max_err_over_bound for c in checks)}


def run(shapes, ms) -> dict:
    from cute_fp4 import bench

    rows = []
    for n, k in shapes:
        floors = {f: read_floor.floor(weight_bytes(n, k, f)) for f in FORMATS}
        for m in ms:
            for fmt in FORMATS:
                row = one_format(m, n, k, fmt)
                row["floor_us"] = floors[fmt]["floor_us"]
                row["floor_over_time"] = round(row["floor_us"] / row["cold_us"], 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    return {"rows": rows, "env": bench.environment(), "date": time.strftime("%Y-%m-%d"),
            "bar": "MXFP4 time / NVFP4 time <= 1.10 at M = 1 (2880x2880, 8192x8192)",
            "formulas": {"weight_bytes": "N*K/2 + N*K/block (16 NVFP4, 32 MXFP4)",
                         "floor": "read_floor.floor of the weight bytes",
                         "timing": "8 weight copies per CUDA graph, L2 flushed before each "
                                   "replay, median of 30 replays / 8"}}


def ratios(res: dict) -> list[dict]:
    by = {(r["M"], r["N"], r["K"], r["format"]): r for r in res["rows"]}
    out = []
    for (m, n, k, fmt), r in by.items():
        if fmt != "mxfp4" or (m, n, k, "nvfp4") not in by:
            continue
        nv = by[m, n, k, "nvfp4"]
        out.append({"M": m, "N": n, "K": k, "nvfp4_us": nv["cold_us"], "mxfp4_us": r["cold_us"],
                    "mxfp4_over_nvfp4": round(r["cold_us"] / nv["cold_us"], 3),
                    "bar_met": (m != 1 or r["cold_us"] <= 1.10 * nv["cold_us"])})
    return out


def render_md(res: dict) -> str:
    lines = ["| M | N x K | format | schedule | us (cold) | floor us | floor/time | TB/s | "
             "check |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['M']} | {r['N']}x{r['K']} | {r['format']} | {r['schedule']} | "
                     f"{r['cold_us']} | {r['floor_us']} | {r['floor_over_time']} | "
                     f"{r['TB/s']} | {r['check']} |")
    lines += ["", "| M | N x K | NVFP4 us | MXFP4 us | MXFP4 / NVFP4 | bar (M = 1: <= 1.10) |",
              "|---|---|---|---|---|---|"]
    for q in res["ratios"]:
        lines.append(f"| {q['M']} | {q['N']}x{q['K']} | {q['nvfp4_us']} | {q['mxfp4_us']} | "
                     f"{q['mxfp4_over_nvfp4']} | {'met' if q['bar_met'] else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--shapes", nargs="*", help="N,K pairs (default: 2880,2880 8192,8192)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mxfp4_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes \
        else SHAPES
    res = run(shapes, args.ms)
    res["ratios"] = ratios(res)
    write_outputs(args.out, "mxfp4_decode", res, render_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
