"""A few launches of one grouped (MoE) schedule on one expert GEMM, for Nsight Compute:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 perf/tools/profile_grouped.py [SCHEDULE] [TOKENS EXPERTS N K] [bf16|nvfp4]

Routing: each token's 8 experts drawn uniformly (seed 0), as in perf/tools/grouped_tiles.py;
defaults: sm90_grouped_decode, DeepSeek-V3's down projection at 16 tokens (256 experts,
N = 7168, K = 2048).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import (
    catalogue,  # noqa: E402
    run,
)
from cute_fp4.compile import Signature, compile  # noqa: E402
from cute_fp4.nvfp4 import quantize  # noqa: E402
from cute_fp4.packed import repack  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "sm90_grouped_decode"
tokens, experts, n, k = ((int(x) for x in sys.argv[2:6]) if len(sys.argv) > 5
                         else (16, 256, 7168, 2048))
fmt = sys.argv[6] if len(sys.argv) > 6 else "bf16"
g = torch.Generator().manual_seed(0)
ids = torch.rand(tokens, experts, generator=g).topk(8, dim=1).indices
counts = torch.bincount(ids.flatten(), minlength=experts)
offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int().cuda()
s = catalogue.get(name)
w = quantize(torch.randn(experts, n, k, device="cuda"))
b = repack(w) if s.mainloop.reads_packed else w
x = torch.randn(int(counts.sum()), k, device="cuda")
a = quantize(x) if fmt == "nvfp4" else x.to(torch.bfloat16)
kern = compile(s, Signature(fmt))
for _ in range(4):
    run.run_grouped(kern, a, b, offs)
torch.cuda.synchronize()
print(f"ran {name} {fmt}: {tokens} tokens x top-8 over {experts} experts, N={n} K={k}")
