"""A MoE experts layer's forward with one schedule per GEMM: which pair serves decode best
inside the layer, where the gate_up GEMM follows torch's gather rather than a grouped GEMM
(``gpt_oss_sweep.py`` times the GEMMs alone, back to back).

    python perf/tools/moe_layer_pairs.py --out FILE.json [--model gpt-oss|qwen3]
        [--experts 128 32] [--tokens 1 4] [--pairs GATE_UP:DOWN ...] [--passes 2]

``gpt-oss``: MXFP4 experts (H = I = 2880, top-4) as ``layers.gpt_oss.oai_forward`` runs
them (routing sort, gather, both grouped GEMMs with their biases and the activation fused,
combine). ``qwen3``: a Qwen3-30B-A3B-like NVFP4 W4A16 layer (H 2048, I 768, top-8, SiLU
and mul fused in the gate_up GEMM), ``Experts.__call__`` with its GEMM hook
(``layers.experts._grouped_gemm``) given each GEMM's schedule. A schedule is a catalogue
name, or ``NAME+w8``: that schedule with eight warps per CTA.

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


def schedule_of(name: str):
    """A catalogue name, or ``NAME+w8``: that schedule with eight warps over the K units."""
    from cute_fp4 import catalogue
    from cute_fp4.schedule import Warps

    if not name.endswith("+w8"):
        return name
    s = catalogue.get(name[:-3])
    return s.replace(warps=Warps(roles=s.warps.roles, mma=(8, 1)))


def qwen3_forward(ex, pair):
    """``Experts.__call__`` of ``ex`` with gate_up on ``pair[0]``, down on ``pair[1]`` (the
    layer's GEMM hook swapped for the call)."""
    import cute_fp4.layers.experts as layer

    hook = layer._grouped_gemm
    scheds = {id(ex.w13): schedule_of(pair[0]), id(ex.w2): schedule_of(pair[1])}

    def gemm(a, b, offsets, schedule, out_dtype, alpha, silu_mul=False, check=False):
        return hook(a, b, offsets, scheds[id(b)], out_dtype, alpha, silu_mul)

    def forward(x, ids, weights, check=False):
        layer._grouped_gemm = gemm
        try:
            return ex(x, ids, weights)
        finally:
            layer._grouped_gemm = hook

    return forward


def qwen3_layer(experts: int):
    """A Qwen3-30B-A3B-like NVFP4 experts layer (W4A16) and its routings' maker."""
    from cute_fp4.layers import Experts, softmax_topk

    g = torch.Generator(device="cuda").manual_seed(experts)
    w13 = torch.randn(experts, 2 * 768, 2048, generator=g, device="cuda") * 0.02
    w2 = torch.randn(experts, 2048, 768, generator=g, device="cuda") * 0.02
    ex = Experts.from_float(w13, w2, mode="w4a16", name="experts")

    def routing(tokens: int, seed: int) -> dict:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
        ids, weights = softmax_topk(torch.randn(tokens, experts, generator=gen,
                                                device="cuda").bfloat16(), 8)
        return {"x": x, "ids": ids, "weights": weights}

    return ex, routing


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", choices=("gpt-oss", "qwen3"), default="gpt-oss")
    p.add_argument("--experts", type=int, nargs="+", default=[128, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    p.add_argument("--pairs", nargs="*", default=PAIRS)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import gpt_oss as bench


    rows = []
    qwen = args.model == "qwen3"
    for experts in args.experts:
        if qwen:
            ex, routing = qwen3_layer(experts)
        else:
            st = bench._stacks(experts, experts)
            ex = bench._experts(st)

            def routing(tokens, seed, experts=experts):
                return bench._routing(experts, tokens, seed)
        make = qwen3_forward if qwen else pair_forward
        for tokens in args.tokens:
            cases = [routing(tokens, 100 * tokens + i) for i in range(bench.ROUTINGS)]
            c0 = cases[0]
            want = ex(c0["x"], c0["ids"], c0["weights"])
            fns = {"auto": ex, **{pair: make(ex, pair.split(":", 1)) for pair in args.pairs}}
            for name, fn in fns.items():
                if name != "auto":
                    fn(c0["x"], c0["ids"], c0["weights"], check=True)
            for n in range(args.passes):
                row = {"model": args.model, "experts": experts, "tokens": tokens,
                       "pass": n + 1}
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
        del ex
        bench._free()


if __name__ == "__main__":
    main()
