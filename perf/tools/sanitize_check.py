"""Run every catalogue schedule of the present GPU once per A format on small awkward
shapes, for `compute-sanitizer --tool memcheck` (out-of-bounds or misaligned accesses):

    compute-sanitizer --tool memcheck python3 perf/tools/sanitize_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue, reference  # noqa: E402
from cute_fp4.api import make_operands, out_dtype_of, run_compiled  # noqa: E402
from cute_fp4.compile import Signature, compile  # noqa: E402
from cute_fp4.plan import plan  # noqa: E402
from cute_fp4.targets import require_device  # noqa: E402

SHAPES = [(7, 136, 320), (129, 264, 832)]


def main() -> int:
    fam = require_device().target.family
    fails = 0
    for s in catalogue.all_schedules(fam, grouped=False):
        if not plan(s).ok:
            continue
        for fmt in (["nvfp4", "bf16"] if fam == "sm90" else ["nvfp4"]):
            kern = compile(s, Signature(fmt))
            for i, (m, n, k) in enumerate(SHAPES):
                a, b = make_operands(m, n, k, fmt, seed=i)
                out = torch.full((m, n), float("nan"), dtype=out_dtype_of(s), device="cuda")
                run_compiled(kern, a, b, out=out)
                torch.cuda.synchronize()
                ok = reference.check(out, a, b).passed
                fails += not ok
                print(f"{s.name} {fmt} {m}x{n}x{k}: {'ok' if ok else 'FAIL'}", flush=True)
    print(f"done, {fails} failures", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
