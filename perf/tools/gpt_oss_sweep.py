"""Which grouped kernel and ring depth serve gpt-oss's experts best at decode: the two
grouped GEMMs of one gpt-oss-like experts layer (hidden = expert width = 2880, top-4,
MXFP4 W4A16, bias and clamped SwiGLU fused) under each candidate schedule, at 1, 4 and 16
tokens, against torch ``_grouped_mm`` on the BF16 experts in the same run. Timing as
perf/gpt_oss.py's (CUDA-graph replays of calls cycling eight routings).

    python3 perf/tools/gpt_oss_sweep.py --out FILE.json [--experts 32 128] [--tokens 1 4 16]
        [--stages 4 6 8] [--w8-stages 1 3 4] [--only NAME ...] [--per-gemm]
        [--pairs GATE_UP:DOWN ...]

``--pairs``: a candidate of two schedules, the first for the gate_up GEMM and the second
for the down GEMM (catalogue names), named ``GATE_UP:DOWN``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

import gpt_oss as bench  # noqa: E402

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.grouped import grouped_gemm  # noqa: E402
from cute_fp4.layers import Experts  # noqa: E402

STREAM = "sm90_mxfp4_stream_grouped_decode"


def candidates(stages, w8_stages=(), only=(), pairs=()) -> dict:
    """Name -> (gate_up schedule, down schedule) (catalogue names or derived Schedules) of
    each candidate: the grouped stream kernel's catalogue variants, its ring at each of
    ``stages`` K units per batch (the eight-warp kernel's at each of ``w8_stages``), the
    rs_packed decode tile, each for both GEMMs, and each ``pairs`` entry ``"A:B"`` (A for
    gate_up, B for down); ``only``: the candidates whose names are in it (all when
    empty)."""
    s, w8 = catalogue.get(STREAM), catalogue.get(f"{STREAM}_w8")
    out = {f"{STREAM}+stages={n}": s.replace(stages=n) for n in stages}
    out.update({f"{STREAM}_w8+stages={n}": w8.replace(stages=n) for n in w8_stages})
    named = {n: n for n in (f"{STREAM}_deep", f"{STREAM}_w8")}
    every = {STREAM: STREAM, **named, **out, "sm90_grouped_decode": "sm90_grouped_decode"}
    every = {k: (v, v) for k, v in every.items()}
    every.update({pair: tuple(pair.split(":", 1)) for pair in pairs})
    return {k: v for k, v in every.items() if not only or k in only or k in pairs}


def point(experts: int, tokens: int, st: dict, ex: Experts, args) -> dict:
    """One (experts, tokens) point: torch's two GEMMs, then each candidate's."""
    b13, b2 = ex.biases
    w13 = st["gate_up_proj"][2].transpose(1, 2)
    w2 = st["down_proj"][2].transpose(1, 2)
    cases = [bench._routing(experts, tokens, 100 * tokens + i) for i in range(bench.ROUTINGS)]
    for c in cases:
        c["act"] = grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13, swiglu_oai=True)

    def torch_gemms(c):
        ends = c["r"].offsets[1:]
        torch._grouped_mm(c["xs"], w13, offs=ends)
        torch._grouped_mm(c["act"], w2, offs=ends)

    def ours(c, s):
        grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13, swiglu_oai=True,
                     schedule=s[0])
        grouped_gemm(c["act"], ex.w2, c["r"].offsets, bias=b2, schedule=s[1])

    row = {"experts": experts, "tokens": tokens}
    fn = bench._cycle([lambda c=c: torch_gemms(c) for c in cases])
    row["torch_us"] = bench.graph_us(fn, args.iters, args.reps)
    c0 = cases[0]
    for name, s in candidates(args.stages, args.w8_stages, args.only, args.pairs).items():
        try:
            got = grouped_gemm(c0["xs"], ex.w13, c0["r"].offsets, bias=b13, swiglu_oai=True,
                               schedule=s[0], check=True)
            grouped_gemm(c0["act"], ex.w2, c0["r"].offsets, bias=b2, schedule=s[1], check=True)
            diff = float((got.float() - c0["act"].float()).abs().max())
            fn = bench._cycle([lambda c=c, s=s: ours(c, s) for c in cases])
            us = bench.graph_us(fn, args.iters, args.reps)
            row[name] = {"us": us, "x_torch": row["torch_us"] / us, "max_diff_vs_auto": diff}
            if args.per_gemm:  # each GEMM alone
                row[name]["gate_up_us"] = bench.graph_us(bench._cycle([
                    lambda c=c, s=s: grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13,
                                                  swiglu_oai=True, schedule=s[0])
                    for c in cases]), args.iters, args.reps)
                row[name]["down_us"] = bench.graph_us(bench._cycle([
                    lambda c=c, s=s: grouped_gemm(c["act"], ex.w2, c["r"].offsets, bias=b2,
                                                  schedule=s[1])
                    for c in cases]), args.iters, args.reps)
        except Exception as e:  # a refused or failing candidate: say which and why
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(experts, tokens, name, row[name], flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--experts", type=int, nargs="+", default=[32, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--per-gemm", action="store_true", help="also each GEMM alone")
    p.add_argument("--stages", type=int, nargs="*", default=[4, 6, 8],
                   help="ring depths to try beside the catalogue's")
    p.add_argument("--w8-stages", type=int, nargs="*", default=[],
                   help="the eight-warp kernel's ring depths to try")
    p.add_argument("--only", nargs="*", default=[], help="these candidates alone (names)")
    p.add_argument("--pairs", nargs="*", default=[],
                   help="GATE_UP:DOWN candidates: one schedule per GEMM (catalogue names)")
    args = p.parse_args()
    rows = []
    for experts in args.experts:
        st = bench._stacks(experts, experts)
        ex = bench._experts(st)
        for tokens in args.tokens:
            rows.append(point(experts, tokens, st, ex, args))
            args.out.write_text(json.dumps(rows, indent=1))
        del st, ex
        bench._free()


if __name__ == "__main__":
    main()
