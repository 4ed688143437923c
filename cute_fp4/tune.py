"""Tuning: time the candidate schedules of a shape, validate the winner, remember it.

Candidates are the catalogue schedules of the device's family that ``plan()`` accepts for
the problem. The fastest one that passes the poisoned check against the exact reference is
stored in the tuning store (``cute_fp4.tuning``), where ``schedule="auto"`` finds it
before falling back to the heuristic. The store keys on the GPU name, the A format, N, K
and the power-of-two bucket of M: a tuning at M = 16 serves M = 9..16 (at M, every M in
``(B/2, B]`` for B the smallest power of two >= M). Entries carry ``schedule.key()`` and
the package source fingerprint; after the sources change they are ignored (said once).
"""

from __future__ import annotations

import sys

from cute_fp4.formats import Operand
from cute_fp4.schedule import Problem, Schedule
from cute_fp4.tuning import bucket_range, load_store, lookup, save_entry, store_path

__all__ = ["candidates", "tune", "load_store", "lookup", "store_path"]


def candidates(family: str, problem: Problem, out_dtype: str = "bf16") -> list[Schedule]:
    """Catalogue schedules of ``family`` that plan() accepts for ``problem``, all writing
    ``out_dtype`` (schedules that differ only in their output dtype collapse into one).
    Each keeps its catalogue name, which is what the tuning store records. Schedules
    that read a packed weight (``mainloop=rs_packed``) are left out: the store serves
    ``gemm`` with the plain NVFP4Tensor, which they do not read."""
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan

    out = {}
    for s in catalogue.all_schedules(family, grouped=False):
        if s.mainloop.value != "standard":
            continue
        s = s.replace(out_dtype=out_dtype, name=s.name)
        if s not in out and plan(s, problem).ok:
            out[s] = s
    return list(out)


def tune(shapes=None, formats=(Operand.NVFP4,), reps: int = 10) -> list[dict]:
    """Time every candidate per shape; store the fastest one that validates.

    A shape (M, N, K) is stored for the bucket of M: the winner at M = 16 is what
    ``schedule="auto"`` uses for M = 9..16 (``serves_M`` in the rows says which); two
    shapes of one bucket leave the later one's winner."""
    import torch

    from cute_fp4.bench import Timer, default_shapes
    from cute_fp4.compile import Signature, compile
    from cute_fp4.operands import make_operands
    from cute_fp4.run import poisoned_check, run_compiled
    from cute_fp4.targets import require_device

    dev = require_device()
    timer = Timer(reps)
    rows = []
    for m, n, k in shapes or default_shapes():
        lo, hi = bucket_range(m)
        for fmt in formats:
            a, b = make_operands(m, n, k, fmt, dist="normal")
            timed = []
            for s in candidates(dev.target.family, Problem(m, n, k, fmt)):
                print(f"tune {m}x{n}x{k} {fmt} {s.name}", file=sys.stderr)
                kern = compile(s, Signature(fmt))
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                timed.append((timer(lambda: run_compiled(kern, a, b, out=out)), s, kern))  # noqa: B023
            row = {"M": m, "N": n, "K": k, "A": fmt, "serves_M": f"{lo}..{hi}",
                   "best": "-", "us": "-", "candidates": len(timed), "validated": "NO"}
            for us, s, kern in sorted(timed, key=lambda t: t[0]):
                if poisoned_check(kern, a, b).passed:
                    save_entry(dev.name, m, n, k, fmt, s, tuned_m=m, us=round(us, 2))
                    row.update(best=s.name, us=round(us, 2), validated="yes")
                    break
            rows.append(row)
    return rows
