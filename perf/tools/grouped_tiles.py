"""Tile sweep of the grouped (MoE) kernels on MoE layer shapes, against torch BF16
``torch._grouped_mm`` in the same run: which grouped schedule to pick per shape.

    python perf/tools/grouped_tiles.py --out "$OUT" [--quick]

Shapes: the expert GEMMs of a Qwen3-30B-A3B-like layer (hidden 2048, expert intermediate
768, 128 experts) and a DeepSeek-V3-like one (hidden 7168, intermediate 2048, 256 experts):
gate_up ``N = 2 I, K = H`` and down ``N = H, K = I``, for 16 and 64 tokens (decode) and 4096
(prefill), top-8, routing: each token's 8 experts drawn uniformly without replacement
(``torch.Generator`` seed 0, recorded). Every variant's output is checked against the
exact reference on a sample of experts (``reference.check_grouped`` when present, else
per expert) before it is timed. Device time: CUDA-graph replay, L2 flushed
(``cute_fp4.bench.Timer``). Bytes: the routed experts' weights (NVFP4 0.5625 B/element
with scales; BF16 2 B) plus activations and output; FLOP = 2 x rows x N x K.
Writes ``<out>/grouped_tiles.json`` and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.bench import Timer  # noqa: E402
from cute_fp4.compile import Signature, compile  # noqa: A004, E402
from cute_fp4.nvfp4 import quantize  # noqa: E402
from cute_fp4.operands import Operands  # noqa: E402
from cute_fp4.packed import pack  # noqa: E402

LAYERS = {"qwen3-30b-a3b": (2048, 768, 128), "deepseek-v3": (7168, 2048, 256)}
TOP_K = 8


def routing(tokens: int, experts: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g).topk(TOP_K, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=experts).tolist()


def variants(quick: bool, tiles: str = "") -> list:
    """The catalogue's grouped sm_90a schedules, plus ``tiles`` ("MxNxK:W,...": tile and
    consumer warpgroups) derived from sm90_grouped."""
    base = catalogue.get("sm90_grouped")
    out = [catalogue.get("sm90_grouped_decode"), base]
    for spec in filter(None, tiles.split(",")) if not quick else ():
        shape, _, wgs = spec.partition(":")
        out.append(base.replace(tile=tuple(int(x) for x in shape.split("x")),
                                mma=(int(wgs or 2), 1)))
    return out


def operands(counts, n, k, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = len(counts)
    total = sum(counts)
    w = torch.randn(e, n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    qs = [quantize(w[i].float()) for i in range(e)]
    b_data = torch.stack([pack(q.data) for q in qs])
    b_scale = torch.stack([q.scale.view(torch.uint8) for q in qs])
    alpha = torch.stack([q.global_scale for q in qs]).float()
    x = torch.randn(total, k, device="cuda", generator=g, dtype=torch.bfloat16)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    return dict(x=x, w=w, qs=qs, b_data=b_data, b_scale=b_scale, alpha=alpha, offs=offs,
                total=total)


def check_some(out, ops, counts, experts=4) -> float:
    """Max err/bound over a few non-empty experts (exact reference, float64)."""
    from cute_fp4 import reference

    worst = 0.0
    offs = ops["offs"].tolist()
    live = [e for e, c in enumerate(counts) if c][:experts]
    for e in live:
        lo, hi = offs[e], offs[e + 1]
        r = reference.check(out[lo:hi], ops["x"][lo:hi], ops["qs"][e])
        worst = max(worst, r.max_err_over_bound if r.nonfinite == 0 else float("inf"))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", default="16,64,4096", help="tokens per case, comma-separated")
    ap.add_argument("--tiles", default="32x128x128:2,128x128x64:2,256x128x64:2",
                    help="extra tiles MxNxK:warpgroups to time")
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    timer = Timer(reps=10 if args.quick else 20)
    rows = []
    kerns = {}
    for s in variants(args.quick, args.tiles):
        try:
            kerns[s.name] = compile(s, Signature("bf16"))
        except Exception as e:  # a refusal or compile failure is a row, not a crash
            rows.append({"schedule": s.name, "error": f"{type(e).__name__}: {e}"[:500]})
    tokens = [int(t) for t in args.tokens.split(",")] if not args.quick else (16, 4096)
    for layer in args.layers.split(","):
        h, inter, e = LAYERS[layer]
        for t in tokens:
            counts = routing(t, e)
            for gemm, (n, k) in (("gate_up", (2 * inter, h)), ("down", (h, inter))):
                ops = operands(counts, n, k)
                total, live = ops["total"], sum(1 for c in counts if c)
                offs_end = ops["offs"][1:]
                wt = ops["w"].transpose(1, 2)
                base = dict(layer=layer, gemm=gemm, tokens=t, rows=total, experts=e,
                            live_experts=live, n=n, k=k)
                try:
                    t_torch = timer(lambda x=ops["x"], wt=wt, o=offs_end:
                                    torch._grouped_mm(x, wt, offs=o))
                except Exception as err:
                    t_torch = None
                    base["torch_error"] = f"{type(err).__name__}: {err}"[:300]
                base["torch_bf16_us"] = t_torch
                for name, kern in kerns.items():
                    out = torch.full((total, n), float("nan"), dtype=torch.bfloat16,
                                     device="cuda")

                    def run(kern=kern, out=out, ops=ops):
                        kern.launch(Operands(ops["x"], None, ops["b_data"], ops["b_scale"],
                                             out, ops["alpha"], offsets=ops["offs"]))
                        return out

                    row = dict(base, schedule=name)
                    try:
                        run()
                        torch.cuda.synchronize()
                        row["err_over_bound"] = check_some(out, ops, counts)
                        us, _ = timer.timed(run)
                        row["us"] = us
                        wbytes = live * n * k * 0.5625
                        row["weight_tb_s"] = wbytes / us / 1e6
                        row["vs_torch"] = t_torch / us if t_torch else None
                    except Exception as err:
                        row["error"] = f"{type(err).__name__}: {err}"[:500]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del ops
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, routing_seed=0, top_k=TOP_K)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "grouped_tiles.json").write_text(json.dumps({"env": env, "rows": rows},
                                                           indent=1))
    print("| layer | gemm | tokens | rows | schedule | us | torch us | x torch | TB/s |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "us" in r:
            print(f"| {r['layer']} | {r['gemm']} | {r['tokens']} | {r['rows']} | "
                  f"{r['schedule']} | {r['us']:.1f} | {r['torch_bf16_us'] or 0:.1f} | "
                  f"{r['vs_torch'] or 0:.2f} | {r['weight_tb_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
