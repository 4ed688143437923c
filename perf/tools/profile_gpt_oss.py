"""A few calls of one gpt-oss experts layer's two grouped GEMMs (MXFP4 W4A16), for Nsight
Compute:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 perf/tools/profile_gpt_oss.py [TOKENS] [EXPERTS]

Hidden = expert width = 2880, top-4, gpt-oss routing (seed 0); the gate_up GEMM (bias and
clamped SwiGLU fused) then the down GEMM, as ``Experts`` runs them. Defaults: 1 token, 32
experts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cute_fp4 as cf  # noqa: E402
from cute_fp4.grouped import grouped_gemm  # noqa: E402
from cute_fp4.layers import Experts, softmax_topk  # noqa: E402
from cute_fp4.layers.routing import route  # noqa: E402

H = WIDTH = 2880
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1
experts = int(sys.argv[2]) if len(sys.argv) > 2 else 32
g = torch.Generator(device="cuda").manual_seed(0)
st = {}
for proj, (n, k) in (("gate_up_proj", (2 * WIDTH, H)), ("down_proj", (H, WIDTH))):
    q = cf.quantize(torch.randn(experts, n, k, generator=g, device="cuda") * 0.02,
                    format="mxfp4")
    st[proj] = q.to_blocks()
    st[proj + "_bias"] = (torch.randn(experts, n, generator=g, device="cuda") * 0.02).bfloat16()
ex = Experts.from_gpt_oss(*st["gate_up_proj"], st["gate_up_proj_bias"], *st["down_proj"],
                          st["down_proj_bias"], name="experts")
x = torch.randn(tokens, H, generator=g, device="cuda").bfloat16()
ids, _ = softmax_topk(torch.randn(tokens, experts, generator=g, device="cuda").bfloat16(), 4)
r = route(ids, experts)
xs = x.index_select(0, r.token)
b13, b2 = ex.biases
for _ in range(4):
    act = grouped_gemm(xs, ex.w13, r.offsets, bias=b13, swiglu_oai=True)
    grouped_gemm(act, ex.w2, r.offsets, bias=b2)
torch.cuda.synchronize()
print(f"gpt-oss experts: {tokens} tokens x top-4 over {experts} experts, "
      f"{int(torch.unique(ids).numel())} routed")
