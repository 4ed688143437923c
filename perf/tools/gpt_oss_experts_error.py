"""How far gpt-oss experts are from float32, ours against transformers' BF16 module, on the
same input and routing: tells a model-level logit difference that comes from the experts'
arithmetic apart from one that random models amplify (routing flips, 8 layers deep).

One gpt-oss-20b-like MoE layer (hidden = expert width = 2880, 32 experts, top-4; MXFP4
weights from N(0, 0.02) by ``quantize(format="mxfp4")``, biases N(0, 0.02) in BF16):
``Experts.from_gpt_oss`` on the checkpoint tensors; transformers' ``GptOssExperts`` holding
the dequantized weights, in BF16 and in float32 (the reference). Relative error =
||y - y_fp32|| / ||y_fp32|| over T tokens (x ~ N(0, 1), router logits ~ N(0, 1)).

    python3 perf/tools/gpt_oss_experts_error.py [--out FILE.json] [--device cpu --small]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cute_fp4 as cf  # noqa: E402
from cute_fp4.layers import Experts, reference_execution  # noqa: E402
from cute_fp4.layers.routing import softmax_topk  # noqa: E402


def tf_experts(e: int, h: int, i: int, w13, w2, b13, b2, dtype):
    """transformers' GptOssExperts with the dequantized weights (its [E, K, N] layout)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
    mod = GptOssExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj.data = w13.transpose(1, 2).contiguous()
        mod.down_proj.data = w2.transpose(1, 2).contiguous()
        mod.gate_up_proj_bias.data = b13.float()
        mod.down_proj_bias.data = b2.float()
    return mod.to(w13.device, dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(dev: torch.device, small: bool = False, tokens=(1, 16, 200)) -> dict:
    """The relative errors of one experts layer (module docstring) at each token count."""
    e, h, i, k = (4, 256, 256, 2) if small else (32, 2880, 2880, 4)
    g = torch.Generator(device=dev).manual_seed(0)
    q13 = cf.quantize(torch.randn(e, 2 * i, h, generator=g, device=dev) * 0.02,
                      format="mxfp4")
    q2 = cf.quantize(torch.randn(e, h, i, generator=g, device=dev) * 0.02, format="mxfp4")
    b13 = (torch.randn(e, 2 * i, generator=g, device=dev) * 0.02).bfloat16()
    b2 = (torch.randn(e, h, generator=g, device=dev) * 0.02).bfloat16()
    ex = Experts.from_gpt_oss(*q13.to_blocks(), b13, *q2.to_blocks(), b2, name="experts")
    w13, w2 = q13.dequantize(torch.float32), q2.dequantize(torch.float32)
    mods = {dt: tf_experts(e, h, i, w13, w2, b13, b2, dt)
            for dt in (torch.bfloat16, torch.float32)}
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=g, device=dev).bfloat16()
        ids, wts = softmax_topk(torch.randn(t, e, generator=g, device=dev).bfloat16(), k)
        with torch.no_grad():
            want = mods[torch.float32](x.float(), ids, wts.float())
            bf16 = mods[torch.bfloat16](x, ids, wts)
            if dev.type == "cpu":
                with reference_execution():
                    ours = ex(x, ids, wts)
            else:
                ours = ex(x, ids, wts)
        rows.append({"tokens": t, "ours_vs_fp32": rel(ours, want),
                     "tf_bf16_vs_fp32": rel(bf16, want), "ours_vs_tf_bf16": rel(ours, bf16),
                     "layout": ex.layout})
    return {"e": e, "h": h, "i": i, "top_k": k, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="E 4, H = I = 256 (a CPU check)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 200])
    args = ap.parse_args(argv)
    res = measure(torch.device(args.device), args.small, args.tokens)
    for row in res["rows"]:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
