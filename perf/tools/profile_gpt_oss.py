"""A few calls of one gpt-oss experts layer's two grouped GEMMs (MXFP4 W4A16), for Nsight
Compute:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 perf/tools/profile_gpt_oss.py [TOKENS] [EXPERTS] [SCHEDULE [STAGES]]

The layer and routing of perf/gpt_oss.py's grouped section (hidden = expert width = 2880,
top-4); the gate_up GEMM (bias and clamped SwiGLU fused) then the down GEMM, as ``Experts``
runs them. Defaults: 1 token, 32 experts, "auto"; SCHEDULE: a catalogue name, STAGES
that schedule with so many K units per batch of its ring (a stream kernel).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

import gpt_oss as bench  # noqa: E402

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.grouped import grouped_gemm  # noqa: E402

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1
experts = int(sys.argv[2]) if len(sys.argv) > 2 else 32
schedule = sys.argv[3] if len(sys.argv) > 3 else "auto"
if len(sys.argv) > 4:
    schedule = catalogue.get(schedule).replace(stages=int(sys.argv[4]))
st = bench._stacks(experts, 0)
ex = bench._experts(st)
c = bench._routing(experts, tokens, 0)
b13, b2 = ex.biases
for _ in range(4):
    act = grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=b13, swiglu_oai=True,
                       schedule=schedule)
    grouped_gemm(act, ex.w2, c["r"].offsets, bias=b2, schedule=schedule)
torch.cuda.synchronize()
print(f"gpt-oss experts: {tokens} tokens x top-4 over {experts} experts, "
      f"{int(torch.unique(c['ids']).numel())} routed, schedule {sys.argv[3:] or 'auto'}")
