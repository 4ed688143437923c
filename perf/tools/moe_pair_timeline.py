"""When does each grouped GEMM of a gpt-oss experts layer start and end, with one schedule
per GEMM: does the down GEMM start before the gate_up GEMM ends (programmatic dependent
launch), and how long does each run, back to back.

    python perf/tools/moe_pair_timeline.py --out DIR [--experts 128] [--tokens 1]
        [--pairs GATE_UP:DOWN ...] [--layers 4]

Per pair of catalogue schedules (gate_up's, down's): ``--layers`` experts layers' two GEMMs
(gpt-oss-sized MXFP4 experts, bias and clamped SwiGLU fused in the first, each layer its
own routing: other experts, so little of a weight is in L2) in a row on one stream,
captured in one CUDA graph; one replay after an L2 flush recorded with ``torch.profiler``
(CUPTI kernel records, ``pdl_timeline.timeline``). Per layer: each GEMM's start to end,
and ``overlap_us`` = gate_up's end - down's start (positive: the down GEMM ran before the
gate_up GEMM ended). The replay time is the median of 30 cold replays. Writes
``DIR/moe_pair_timeline.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

S = "sm90_mxfp4_stream_grouped_decode"
PAIRS = [f"{S}:{S}", f"{S}:{S}_w8", f"{S}:{S}_deep", f"{S}_w8:{S}_w8"]


def layers_call(ex, cases, b13, b2, pair: tuple[str, str]):
    """The call running every case's two GEMMs in turn (gate_up with ``pair[0]``, down with
    ``pair[1]``), each down GEMM on its case's precomputed activation."""
    from cute_fp4.grouped import grouped_gemm

    def call():
        for c in cases:
            grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13, swiglu_oai=True,
                         schedule=pair[0])
            grouped_gemm(c["act"], ex.w2, c["r"].offsets, bias=b2, schedule=pair[1])

    return call


def per_layer(kernels: list) -> list:
    """(gate_up, down) kernel records of each layer -> their durations and overlap, us
    (the grouped GEMMs' records, in start order; any other kernel of the graph is left
    out)."""
    gemms = [k for k in kernels if "GroupedGemm" in k["name"]]
    rows = []
    for up, down in zip(gemms[0::2], gemms[1::2]):
        rows.append({"gate_up_us": round(up["end"] - up["start"], 2),
                     "down_us": round(down["end"] - down["start"], 2),
                     "overlap_us": round(up["end"] - down["start"], 2)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pairs", nargs="*", default=PAIRS)
    args = ap.parse_args(argv)
    import gpt_oss as bench
    from pdl_timeline import add_row, save, timeline

    from cute_fp4.grouped import grouped_gemm

    st = bench._stacks(args.experts, args.experts)
    ex = bench._experts(st)
    b13, b2 = ex.biases
    cases = [bench._routing(args.experts, args.tokens, 100 * args.tokens + i)
             for i in range(args.layers)]
    for c in cases:
        c["act"] = grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13, swiglu_oai=True)
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "experts": args.experts, "tokens": args.tokens, "layers": args.layers,
           "method": __doc__, "rows": []}
    for pair in args.pairs:
        names = tuple(pair.split(":", 1))
        c0 = cases[0]  # each schedule checked against the exact reference once
        grouped_gemm(c0["xs"], ex.w13, c0["r"].offsets, bias=b13, swiglu_oai=True,
                     schedule=names[0], check=True)
        grouped_gemm(c0["act"], ex.w2, c0["r"].offsets, bias=b2, schedule=names[1],
                     check=True)
        t = timeline(layers_call(ex, cases, b13, b2, names))
        layers = per_layer(t["kernels"])
        row = {"pair": pair, "replay_us": t["replay_us"],
               "us_per_layer": round(t["replay_us"] / args.layers, 2), "layers": layers,
               "median_overlap_us": statistics.median(r["overlap_us"] for r in layers),
               "kernels": t["kernels"]}
        add_row(res, row)
    save(args.out, "moe_pair_timeline", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
