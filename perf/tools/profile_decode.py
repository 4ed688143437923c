"""A few launches of one schedule at one shape, for Nsight Compute:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 perf/tools/profile_decode.py [SCHEDULE] [M N K] [nvfp4|bf16]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.api import make_operands, run_compiled  # noqa: E402
from cute_fp4.compile import Signature, compile  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "sm90_decode_swapab"
m, n, k = (int(x) for x in sys.argv[2:5]) if len(sys.argv) > 4 else (1, 8192, 8192)
fmt = sys.argv[5] if len(sys.argv) > 5 else "nvfp4"
kern = compile(catalogue.get(name), Signature(fmt))
a, b = make_operands(m, n, k, fmt, dist="normal")
for _ in range(4):
    run_compiled(kern, a, b)
torch.cuda.synchronize()
print(f"ran {name} {fmt} {m}x{n}x{k}")
