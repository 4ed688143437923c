"""A dense gated MLP (Llama-8B-like: hidden 4096, intermediate 14336) at decode, fused
against unfused, with torch BF16 in the same run.

    python perf/mlp_bench.py --out DIR [--tokens 1,16] [--hidden 4096 --inter 14336]

Providers (W4A16, CUDA graphs, L2 flushed before each replay: ``cute_fp4.bench.Timer``):

* ``torch_bf16``: ``down(F.silu(gate(x)) * up(x))`` with three ``F.linear`` on the
  dequantized weights;
* ``unfused``: three ``NVFP4Linear`` (gate and up cut from the same quantized gate_up
  weight, so both sides share every weight byte) and ``F.silu(g) * u``;
* ``fused``: ``cute_fp4.mlp.NVFP4GatedMLP``: one gate_up GEMM with SiLU-and-mul in its
  epilogue, then the down ``NVFP4Linear``.

Checks: both NVFP4 MLPs against the float64 MLP on the same dequantized weights (relative
Frobenius error). Writes ``mlp.json`` (with the environment) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMULAS = {"weight_bytes": "3 * H * I / 2 (E2M1) + 3 * H * I / 16 (UE4M3 scales)",
            "floor_us": "weight_bytes / 4.8 TB/s (H200 HBM3e)"}


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device,
                          dtype=w.dtype)
    lin.weight.data.copy_(w)
    return lin


def build(h: int, i: int, seed: int):
    from cute_fp4.fused import natural_gate_up
    from cute_fp4.mlp import NVFP4GatedMLP
    from cute_fp4.nn import NVFP4Linear

    g = torch.Generator(device="cuda").manual_seed(seed)
    gate = torch.randn(i, h, generator=g, device="cuda") * h ** -0.5
    up = torch.randn(i, h, generator=g, device="cuda") * h ** -0.5
    down = torch.randn(h, i, generator=g, device="cuda") * i ** -0.5
    fused = NVFP4GatedMLP.from_linears(_linear(gate), _linear(up), _linear(down))
    w13 = natural_gate_up(fused.gate_up.unpack() if hasattr(fused.gate_up, "unpack")
                          else fused.gate_up, fused.group)
    from cute_fp4.nvfp4 import NVFP4Tensor

    def rows(lo, hi):
        from cute_fp4.nvfp4 import swizzle_scales

        lin = w13.scale_linear()[lo:hi]
        return NVFP4Tensor(w13.data[lo:hi].contiguous(), swizzle_scales(lin), w13.global_scale)

    lin_gate, lin_up = NVFP4Linear(rows(0, i)), NVFP4Linear(rows(i, 2 * i))
    lin_down = fused.down
    deq = (w13.dequantize(torch.float64), lin_down.weight.dequantize(torch.float64))

    def unfused(x):
        return lin_down(F.silu(lin_gate(x)) * lin_up(x))

    w13_b, down_b = deq[0].to(torch.bfloat16), deq[1].to(torch.bfloat16)

    def torch_bf16(x):
        gu = F.linear(x, w13_b)
        return F.linear(F.silu(gu[:, :i]) * gu[:, i:], down_b)

    return {"torch_bf16": torch_bf16, "unfused": unfused, "fused": fused}, deq


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="perf-out")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    from cute_fp4.bench import Timer, environment

    h, i = args.hidden, args.inter
    fns, (w13, w2) = build(h, i, 0)
    timer = Timer(args.reps)
    rows = []
    wbytes = 3 * h * i // 2 + 3 * h * i // 16
    for m in (int(t) for t in args.tokens.split(",")):
        x = (torch.randn(m, h, device="cuda") * 0.5).to(torch.bfloat16)
        xd = x.double()
        gu = xd @ w13.T
        ref = (F.silu(gu[:, :i]) * gu[:, i:]) @ w2.T
        times = {}
        for name, fn in fns.items():
            with torch.no_grad():
                out = fn(x)
                err = float((out.double() - ref).norm() / ref.norm())
                times[name] = timer(lambda fn=fn, x=x: fn(x))
            rows.append({"tokens": m, "provider": name, "us": round(times[name], 2),
                         "rel_err": round(err, 5),
                         "weight_TB/s": round(wbytes / times[name] / 1e6, 3)})
        for r in rows[-3:]:
            r["x_unfused"] = round(times["unfused"] / r["us"], 3)
            r["x_torch"] = round(times["torch_bf16"] / r["us"], 3)
            print(json.dumps(r))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mlp.json").write_text(json.dumps(
        {"env": environment(), "hidden": h, "inter": i, "formulas": FORMULAS,
         "floor_us": round(wbytes / 4.8e6, 2), "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
