"""Graph breaks of a quantized transformers MoE model's decode step under torch.compile
(the candidate for the extra host time per token of NVFP4 MoE generate,
perf/results/2026-12-03-h200-hf.md item 4). One line each: ``torch._dynamo.explain`` of
the forward of a small Qwen3-MoE (and a Llama for comparison), BF16 and NVFP4, a decode
step (1 token, static cache): graphs, graph breaks, and the first reasons.

    python perf/tools/moe_graph_breaks.py --out DIR      # needs a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def explain(model, ids) -> dict:
    torch._dynamo.reset()
    out = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)
    reasons = [str(getattr(b, "reason", b))[:300] for b in out.break_reasons]
    return {"graphs": out.graph_count, "breaks": out.graph_break_count,
            "ops": out.op_count, "reasons": reasons[:8]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="perf-out")
    args = ap.parse_args(argv)
    import hf_tiny

    from cute_fp4.hf.quantize import quantize_model

    res = {}
    for kind in ("qwen3_moe", "llama"):
        bf16 = hf_tiny.build(kind, device="cuda").eval()
        ids = torch.randint(0, 256, (1, 8), device="cuda")
        res[f"{kind}_bf16"] = explain(bf16, ids)
        nv = hf_tiny.build(kind, device="cuda").eval()
        quantize_model(nv)
        res[f"{kind}_nvfp4"] = explain(nv, ids)
        print(kind, json.dumps({k: v for k, v in res.items() if k.startswith(kind)})[:2000])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_breaks.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
