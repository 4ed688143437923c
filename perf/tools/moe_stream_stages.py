"""The NVFP4 grouped stream kernel's ring depth on MoE decode shapes: both grouped GEMMs of
one experts layer (gate_up ``N = 2 I, K = H`` then down ``N = H, K = I``, W4A16, BF16
activations, fragment-order packed experts) back to back, at ``stages`` K units per batch
of each warp's ring (and the schedules of ``--also``: "auto", the rs_packed decode tile),
against torch ``_grouped_mm`` on the BF16 experts in the same run.

    python3 perf/tools/moe_stream_stages.py --out FILE.json [--models qwen3-30b-a3b ...]
        [--tokens 1 4 16] [--stages 1 2] [--experts E] [--also NAME ...] [--per-gemm]

Shapes: a Qwen3-30B-A3B-like layer (hidden 2048, expert intermediate 768, 128 experts) and
a DeepSeek-V3-like one (hidden 7168, intermediate 2048; ``--experts`` caps its 256 experts,
default 64, for the float32 quantization's memory); top-8 over N(0, 1) router logits,
eight seeded routings cycled so that a call mostly does not find its experts in L2. Every
candidate runs once with ``check=True`` (the exact reference) before it is timed, and its
output is compared with the first candidate's. Timing: perf/gpt_oss.py's ``graph_us``
(16 calls per CUDA graph, median of the replays).
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

from gpt_oss import _cycle, graph_us  # noqa: E402

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.grouped import grouped_gemm  # noqa: E402
from cute_fp4.layers import softmax_topk  # noqa: E402
from cute_fp4.layers.routing import route  # noqa: E402
from cute_fp4.nvfp4 import quantize  # noqa: E402
from cute_fp4.packed import repack  # noqa: E402

MODELS = {"qwen3-30b-a3b": (2048, 768, 128), "deepseek-v3": (7168, 2048, 256)}
TOP_K, ROUTINGS, STREAM = 8, 8, "sm90_stream_grouped_decode"
DEV = "cuda"


def stack(experts: int, n: int, k: int, seed: int):
    """(packed NVFP4 stack [E, N, K], per-expert global scales; its BF16 values transposed
    [E, K, N] for torch)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = quantize(torch.randn(experts, n, k, generator=g, device=DEV) * 0.02)
    return repack(q), q.dequantize().bfloat16().transpose(1, 2).contiguous()


def point(model: str, experts: int, tokens: int, w13, w2, args) -> dict:
    hidden, inter, _ = MODELS[model]
    cases = []
    for i in range(ROUTINGS):
        g = torch.Generator(device=DEV).manual_seed(100 * tokens + i)
        x = torch.randn(tokens, hidden, generator=g, device=DEV).bfloat16()
        ids, _ = softmax_topk(torch.randn(tokens, experts, generator=g,
                                           device=DEV).bfloat16(), TOP_K)
        r = route(ids, experts)
        cases.append({"xs": x.index_select(0, r.token), "r": r,
                      "act": torch.randn(tokens * TOP_K, inter, generator=g,
                                         device=DEV).bfloat16()})

    def torch_gemms(c):
        ends = c["r"].offsets[1:]
        torch._grouped_mm(c["xs"], w13[1], offs=ends)
        torch._grouped_mm(c["act"], w2[1], offs=ends)

    def ours(c, s):
        grouped_gemm(c["xs"], w13[0], c["r"].offsets, schedule=s)
        grouped_gemm(c["act"], w2[0], c["r"].offsets, schedule=s)

    row = {"model": model, "experts": experts, "tokens": tokens}
    row["torch_us"] = graph_us(_cycle([lambda c=c: torch_gemms(c) for c in cases]),
                               args.iters, args.reps)
    candidates = {f"stages={n}": catalogue.get(STREAM).replace(stages=n) for n in args.stages}
    candidates.update({name: name for name in args.also})
    first = None
    for name, s in candidates.items():
        c0 = cases[0]
        try:
            got = grouped_gemm(c0["xs"], w13[0], c0["r"].offsets, schedule=s, check=True)
        except Exception as e:  # a refused candidate: say which and why
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(model, experts, tokens, name, row[name], flush=True)
            continue
        grouped_gemm(c0["act"], w2[0], c0["r"].offsets, schedule=s, check=True)
        first = got if first is None else first
        us = graph_us(_cycle([lambda c=c, s=s: ours(c, s) for c in cases]), args.iters,
                      args.reps)
        row[name] = {"us": us, "x_torch": row["torch_us"] / us,
                     "max_diff_vs_first": float((got.float() - first.float()).abs().max())}
        if args.per_gemm:  # each GEMM alone
            row[name]["gate_up_us"] = graph_us(_cycle([
                lambda c=c, s=s: grouped_gemm(c["xs"], w13[0], c["r"].offsets, schedule=s)
                for c in cases]), args.iters, args.reps)
            row[name]["down_us"] = graph_us(_cycle([
                lambda c=c, s=s: grouped_gemm(c["act"], w2[0], c["r"].offsets, schedule=s)
                for c in cases]), args.iters, args.reps)
        print(model, experts, tokens, name, row[name], flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 1])
    p.add_argument("--experts", type=int, default=64, help="DeepSeek-V3's experts at most")
    p.add_argument("--also", nargs="*", default=[],
                   help='more schedules to time: catalogue names or "auto"')
    p.add_argument("--per-gemm", action="store_true", help="also each GEMM alone")
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    rows = []
    for model in args.models:
        hidden, inter, experts = MODELS[model]
        experts = min(experts, args.experts) if model == "deepseek-v3" else experts
        w13 = stack(experts, 2 * inter, hidden, 1)
        w2 = stack(experts, hidden, inter, 2)
        for tokens in args.tokens:
            rows.append(point(model, experts, tokens, w13, w2, args))
            args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                            "stream": STREAM, "rows": rows}, indent=1))
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
