"""The default job: the catalogue planned and compiled for every target; on a GPU host,
validation against the exact reference and a short perf table.

Exit 0 when every kernel compiles (schedules that plan() refuses are reported and pass:
the catalogue keeps them on purpose) and, on a GPU, every validation passes; 1 otherwise.
Tables fit 100 columns; progress lines go to stderr.
"""

from __future__ import annotations

import time

from cute_fp4 import tables
from cute_fp4.formats import Operand
from cute_fp4.targets import TARGETS, detect_device


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def demo(quick: bool = False) -> int:
    from cute_fp4 import catalogue
    from cute_fp4.compile import compile_report

    ok = True
    t0 = time.perf_counter()
    for target in TARGETS.values():
        scheds = catalogue.all_schedules(target.family)
        if quick:
            scheds = scheds[:3]
        _section(f"catalogue compiled for {target.name}")
        reports = []
        for i, s in enumerate(scheds, 1):
            tables.progress(i, len(scheds), f"compile {s.name} for {target.name}")
            r = compile_report(s, target.name)
            ok &= r["ok"] or bool(r.get("refused_by_plan"))
            reports.append(r)
        print(tables.compile_table(reports), flush=True)
    print(f"\n(compiled in {time.perf_counter() - t0:.1f} s)")
    dev = detect_device()
    if dev is None or dev.target is None:
        _section("no supported GPU here: validation and timing skipped")
        return 0 if ok else 1
    return _gpu_part(dev, quick, ok)


def _gpu_part(dev, quick: bool, ok: bool) -> int:
    from cute_fp4 import catalogue
    from cute_fp4.api import validate
    from cute_fp4.bench import run_bench
    from cute_fp4.plan import plan

    _section(f"validation on {dev.name} ({dev.target.name}) against the exact reference")
    formats = ([Operand.NVFP4, Operand.BF16] if dev.target.family == "sm90"
               else [Operand.NVFP4])
    jobs = [(s, fmt) for s in catalogue.all_schedules(dev.target.family, grouped=False)
            if plan(s).ok for fmt in formats]
    for i, (s, fmt) in enumerate(jobs, 1):
        tables.progress(i, len(jobs), f"validate {s.name} ({fmt})")
        rep = validate(s, a_format=fmt)
        print(rep, flush=True)
        ok &= rep.passed
    _section("perf (median of 20, L2 flushed; ratios vs torch measured in this run)")
    shapes = [(1, 8192, 8192), (16, 8192, 8192), (4096, 8192, 8192)]
    if not quick:
        shapes += [(256, 8192, 8192), (8192, 8192, 8192)]
    rows = run_bench(None, shapes, formats=formats)
    print(tables.result_table(rows))
    return 0 if ok else 1
