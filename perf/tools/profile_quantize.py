"""One activation-quantizer launch for Nsight Compute: the kernel of a ``QuantSpec`` (fields
from the command line) on a BF16 ``[M, K]`` input, bracketed by ``cudaProfilerStart/Stop``.

    ncu --profile-from-start off ... python perf/tools/profile_quantize.py 4096 4096 items=2

Fields are ``name=value`` (ints as ints); the target is the present GPU's. ``gs=cal`` takes
the input's amax / 2688 as the static global scale (no block scale saturates), ``gs=F`` a
given one; the default, 2 / 2688, saturates about half of randn's blocks.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import quant  # noqa: E402
from cute_fp4.nvfp4 import scale_shape  # noqa: E402


def main(argv: list[str]) -> int:
    m, k = int(argv[0]), int(argv[1])
    fields = {}
    gs_value = str(2 / 2688)  # "gs=cal": the input's amax / 2688 (no block saturates)
    for item in argv[2:]:
        name, value = item.split("=", 1)
        if name == "gs":
            gs_value = value
            continue
        fields[name] = int(value) if value.isdigit() else value
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cal = gs_value == "cal"
    gs = torch.tensor([x.float().abs().max().item() / 2688 if cal else float(gs_value)],
                      device="cuda")
    spec = dataclasses.replace(quant._spec_for(x, "static"), **fields)
    kern = quant.compile_quantize(spec)
    q = torch.empty(m, k // 2, device="cuda", dtype=torch.uint8)
    rows, cols = scale_shape(m, k)
    sf = torch.empty(rows * cols, device="cuda", dtype=torch.uint8)
    for _ in range(3):
        kern.launch(x, q, sf, gs, None)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kern.launch(x, q, sf, gs, None)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(spec.label())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
