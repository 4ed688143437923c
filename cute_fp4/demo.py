"""The default job: the catalogue planned and compiled for every target; on a GPU host,
validation against the exact reference and a short perf table."""

from __future__ import annotations

import sys
import time

from cute_fp4.targets import TARGETS, detect_device


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def demo(quick: bool = False) -> int:
    from cute_fp4 import catalogue
    from cute_fp4.cli import _table
    from cute_fp4.compile import compile_report

    ok = True
    t0 = time.perf_counter()
    for target in TARGETS.values():
        scheds = catalogue.all_schedules(target.family)
        if quick:
            scheds = scheds[:3]
        _section(f"catalogue compiled for {target.name} ({', '.join(target.gpus)}; "
                 f"{target.smem_per_block:,} B shared memory per block)")
        rows = []
        for s in scheds:
            print(f"  compiling {s.name} ...", file=sys.stderr, flush=True)
            r = compile_report(s, target.name)
            refused_on_purpose = not r["ok"] and s.name.startswith("sm100_style")
            ok &= r["ok"] or refused_on_purpose
            rows.append({"name": s.name, "tile": "x".join(map(str, r["tile"])),
                         "roles": r["roles"], "stages": r["stages"], "smem": r["smem_bytes"],
                         "regs": r.get("registers", "-"), "spills": r.get("spills", "-"),
                         "tensor-core SASS": f"{r.get('mma_count', 0)}x "
                         + ",".join(r.get("mma_instructions", [])),
                         "compile s": r.get("compile_s", "-"),
                         "status": "ok" if r["ok"] else "refused: " + r["reason"][:90]})
        print(_table(rows))
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
    from cute_fp4.cli import _table

    _section(f"validation on {dev.name} ({dev.target.name}) against the exact reference")
    formats = ["nvfp4", "bf16"] if dev.target.family == "sm90" else ["nvfp4"]
    for s in catalogue.all_schedules(dev.target.family):
        if s.name.startswith("sm100_style"):
            continue
        for fmt in formats:
            rep = validate(s, a_format=fmt)
            print(rep, flush=True)
            ok &= rep.passed
    _section("perf (median of 20, L2 flushed; ratios vs torch measured in this run)")
    shapes = [(1, 8192, 8192), (16, 8192, 8192), (4096, 8192, 8192)]
    if not quick:
        shapes += [(256, 8192, 8192), (8192, 8192, 8192)]
    rows = run_bench(None, shapes, formats=formats)
    print(_table(rows))
    return 0 if ok else 1
