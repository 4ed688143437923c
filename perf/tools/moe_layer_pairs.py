"""A gpt-oss experts layer's forward, as ``layers.gpt_oss.oai_forward`` runs it (routing
sort, gather, both grouped GEMMs with their biases and the activation fused, combine),
with one schedule per GEMM: which pair serves decode best inside the layer, where the
gate_up GEMM follows torch's gather rather than a grouped GEMM (``gpt_oss_sweep.py``
times the GEMMs alone, back to back).

    python perf/tools/moe_layer_pairs.py --out FILE.json [--experts 128 32] [--tokens 1 4]
        [--pairs GATE_UP:DOWN ...] [--passes 2]

Timing as perf/gpt_oss.py's: CUDA-graph replays of calls cycling eight routings, median
of ``--reps``; ``auto`` is the layer itself (``Experts.__call__``). Every pair runs once
with ``check=True`` (each GEMM against the exact reference) first, and its output is
compared with the layer's (``same_bits_as_auto``: the eight-warp kernel adds its warps'
partial sums in another order, so it differs in the last bits).
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

S = "sm90_mxfp4_stream_grouped_decode"
PAIRS = [f"{S}:{S}", f"{S}:{S}_w8", f"{S}_w8:{S}", f"{S}_w8:{S}_w8"]


def pair_forward(ex, pair):
    """``oai_forward`` of ``ex`` with gate_up on ``pair[0]`` and down on ``pair[1]``."""
    from cute_fp4.grouped import grouped_gemm
    from cute_fp4.layers.routing import combine, route

    b13, b2 = ex.biases

    def forward(x, ids, weights, check=False):
        r = route(ids, ex.num_experts)
        act = grouped_gemm(x.index_select(0, r.token), ex.w13, r.offsets, schedule=pair[0],
                           out_dtype=x.dtype, bias=b13, swiglu_oai=True, check=check)
        down = grouped_gemm(act, ex.w2, r.offsets, schedule=pair[1], out_dtype=x.dtype,
                            bias=b2, check=check)
        return combine(down, r, weights)

    return forward


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--experts", type=int, nargs="+", default=[128, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--pairs", nargs="*", default=PAIRS)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import gpt_oss as bench

    from cute_fp4.layers import Experts

    rows = []
    for experts in args.experts:
        st = bench._stacks(experts, experts)
        ex = Experts.from_gpt_oss(*st["gate_up_proj"][:2], st["gate_up_proj_bias"],
                                  *st["down_proj"][:2], st["down_proj_bias"], name="experts")
        for tokens in args.tokens:
            cases = [bench._routing(experts, tokens, 100 * tokens + i)
                     for i in range(bench.ROUTINGS)]
            c0 = cases[0]
            want = ex(c0["x"], c0["ids"], c0["weights"])
            fns = {"auto": ex, **{pair: pair_forward(ex, pair.split(":", 1))
                                  for pair in args.pairs}}
            for name, fn in fns.items():
                if name != "auto":
                    fn(c0["x"], c0["ids"], c0["weights"], check=True)
            for n in range(args.passes):
                row = {"experts": experts, "tokens": tokens, "pass": n + 1}
                for name, fn in fns.items():
                    got = fn(c0["x"], c0["ids"], c0["weights"])
                    same = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
                    call = bench._cycle([lambda c=c, fn=fn: fn(c["x"], c["ids"], c["weights"])
                                         for c in cases])
                    row[name] = {"us": bench.graph_us(call, args.iters, args.reps),
                                 "same_bits_as_auto": same}
                    print(experts, tokens, n + 1, name, row[name], flush=True)
                rows.append(row)
                args.out.write_text(json.dumps(rows, indent=1))
        del st, ex
        bench._free()


if __name__ == "__main__":
    main()
