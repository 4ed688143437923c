"""The layer API at tensor-parallel shard shapes: what one GPU runs per rank for a
Llama-8B-, a Qwen3-30B-A3B- and a DeepSeek-V3-like layer at TP 1/2/4/8, each NVFP4 layer
(``cute_fp4.layers``, W4A16, "auto": the GPU's layout and kernels) timed against torch
BF16 at the same shard (``F.linear``; the MoE experts: ``torch._grouped_mm`` on BF16
experts), CUDA graphs, L2 flushed. The ratio is the speed-up per GPU a user gets from
NVFP4 at that TP size. The shapes (``SHARDS``) are shared with tests/gpu/test_shards.py.

    python3 perf/shards.py --out DIR       # DIR/shards.json and DIR/shards.md

FLOPs: 2 M N K per linear (2 x top-k x T x (2I x H + H x I) for the experts); bytes: the
NVFP4 weight (N K / 2 + N K / 16 + 4) against BF16's 2 N K.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cute_fp4 as cf  # noqa: E402
from cute_fp4.layers import Experts, Linear  # noqa: E402


class Dense(NamedTuple):
    name: str
    n: int  # output features of the whole layer
    k: int  # input features of the whole layer
    parallel: str  # "column" (N split) or "row" (K split)


class Moe(NamedTuple):
    name: str
    experts: int
    hidden: int
    inter: int  # one expert's intermediate size (split by TP)
    top_k: int


MODELS = {
    "llama8b": [Dense("qkv_proj", 4096 + 2 * 1024, 4096, "column"),
                Dense("o_proj", 4096, 4096, "row"),
                Dense("gate_up_proj", 2 * 14336, 4096, "column"),
                Dense("down_proj", 4096, 14336, "row")],
    "qwen3_30b_a3b": [Dense("qkv_proj", 4096 + 2 * 512, 2048, "column"),
                      Dense("o_proj", 2048, 4096, "row"),
                      Moe("experts", 128, 2048, 768, 8)],
    "deepseek_v3": [Dense("o_proj", 7168, 16384, "row"),
                    Dense("shared_gate_up", 2 * 2048, 7168, "column"),
                    Moe("experts", 256, 7168, 2048, 8)],
}
TP_SIZES = (1, 2, 4, 8)


def shard(layer, tp: int):
    """The per-rank shape of ``layer`` at TP ``tp``."""
    if isinstance(layer, Moe):
        return layer._replace(inter=layer.inter // tp)
    if layer.parallel == "column":
        return layer._replace(n=layer.n // tp)
    return layer._replace(k=layer.k // tp)


SHARDS = [(model, tp, shard(layer, tp)) for model, layers in MODELS.items()
          for tp in TP_SIZES for layer in layers]


def modelopt_tensors(lead: tuple[int, ...], n: int, k: int, seed: int, device="cuda"):
    """Random ModelOpt NVFP4 tensors of a weight ``[*lead, n, k]``, made directly (no float
    copy: a DeepSeek-sized expert stack would not fit as float32): uniform E2M1 code bytes,
    UE4M3 block scales between 2^-2 and 2^2 (bytes 0x28-0x48), global scales ~1e-3."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randint(0, 256, (*lead, n, k // 2), generator=g, device=device,
                           dtype=torch.uint8)
    scale = torch.randint(0x28, 0x49, (*lead, n, k // 16), generator=g, device=device,
                          dtype=torch.uint8).view(torch.float8_e4m3fn)
    gs = torch.full(lead, 1e-3, device=device) if lead else torch.tensor(1e-3, device=device)
    return weight, scale, gs


def modelopt_linear(n: int, k: int, seed: int, device="cuda"):
    """(weight, weight_scale row-major, weight_scale_2) of a random NVFP4 [n, k] weight."""
    return modelopt_tensors((), n, k, seed, device)


def modelopt_experts(e: int, h: int, i: int, seed: int, device="cuda"):
    """The ModelOpt tensors of an expert stack pair (w13 [E, 2I, H], w2 [E, H, I])."""
    return (modelopt_tensors((e,), 2 * i, h, seed, device),
            modelopt_tensors((e,), h, i, seed + 1, device))


def routing(tokens: int, experts: int, top_k: int, seed: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, ids = logits.softmax(-1).topk(top_k)
    return ids, weights


def _bf16_experts(ex: Experts):
    w13, w2 = ex.dequantized(torch.bfloat16)
    return w13, w2


def measure(model: str, tp: int, layer, ms: list[int], timer) -> list[dict]:
    """One row per M of ``layer``'s shard at TP ``tp``: the layer is prepared once."""
    from cute_fp4 import moe as cmoe

    rows = []
    if isinstance(layer, Moe):
        w13, w2 = modelopt_experts(layer.experts, layer.hidden, layer.inter, seed=tp)
        ex = Experts.from_modelopt(w13, w2, mode="w4a16")
        del w13, w2
        b13, b2 = _bf16_experts(ex)
        for m in ms:
            x = torch.randn(m, layer.hidden, device="cuda", dtype=torch.bfloat16)
            ids, wts = routing(m, layer.experts, layer.top_k, seed=m)
            rows.append({"shape": f"E{layer.experts} H{layer.hidden} I{layer.inter} "
                                  f"top{layer.top_k}", "m": m, "layout": ex.layout,
                         "nvfp4_us": timer(lambda x=x, ids=ids, wts=wts: ex(x, ids, wts)),
                         "bf16_us": timer(
                             lambda x=x, ids=ids, wts=wts: cmoe.moe_bf16(x, b13, b2, ids, wts))})
        del b13, b2, ex
    else:
        t = modelopt_linear(layer.n, layer.k, seed=tp)
        lin = Linear.from_modelopt(*t, mode="w4a16", name=layer.name)
        wb = lin.weight.dequantize(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
            rows.append({"shape": f"{layer.n}x{layer.k}", "m": m, "layout": lin.layout,
                         "nvfp4_us": timer(lambda x=x: lin(x)),
                         "bf16_us": timer(lambda x=x: torch.nn.functional.linear(x, wb)),
                         "nvfp4_bytes": layer.n * layer.k // 2 + layer.n * layer.k // 16 + 4,
                         "bf16_bytes": 2 * layer.n * layer.k})
        del wb, lin
    for r in rows:
        r.update(model=model, tp=tp, layer=layer.name,
                 speedup=round(r["bf16_us"] / r["nvfp4_us"], 3))
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    from cute_fp4.bench import Timer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    timer = Timer(reps=20)
    props = torch.cuda.get_device_properties(0)
    rows = []
    for model, tp, layer in SHARDS:
        if model not in args.models.split(","):
            continue
        ms = [int(m) for m in args.ms.split(",")]
        try:
            got = measure(model, tp, layer, ms, timer)
        except Exception as e:  # a layer that fails says why; the run goes on
            got = [{"model": model, "tp": tp, "layer": layer.name, "m": m,
                    "error": f"{type(e).__name__}: {e}"[:300]} for m in ms]
            torch.cuda.empty_cache()
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "cute_fp4": cf.__version__}
    (args.out / "shards.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# Layer API per TP shard ({env['gpu']}, {env['date']})", "",
             "| model | TP | layer | shard | M | layout | NVFP4 us | BF16 us | x BF16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tp']} | {r['layer']} | | {r['m']} | | "
                         f"{r['error'][:60]} | | |")
            continue
        lines.append(f"| {r['model']} | {r['tp']} | {r['layer']} | {r['shape']} | {r['m']} | "
                     f"{r['layout']} | {r['nvfp4_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['speedup']:.2f} |")
    (args.out / "shards.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
