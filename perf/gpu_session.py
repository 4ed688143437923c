"""One GPU session's work in one process: validation matrix, fuzzing, determinism, cache
cold/warm, cost of the checks, and the perf table. Writes results under ``--out``.

    python perf/gpu_session.py --out "$OUT" [--only validate,fuzz,...] [--quick]

Sections: env, validate, fuzz, determinism, cache, checks, bench. Each writes one JSON file
(``<section>.json``) and a line of summary to stdout; ``perf/render.py`` turns them into
the markdown tables under ``perf/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_fp4 import catalogue  # noqa: E402
from cute_fp4.api import (  # noqa: E402
    ValidationReport,
    make_operands,
    poisoned_check,
    run_compiled,
)
from cute_fp4.compile import Signature, compile  # noqa: E402
from cute_fp4.plan import plan  # noqa: E402
from cute_fp4.schedule import Problem  # noqa: E402
from cute_fp4.targets import require_device  # noqa: E402

VALID_M = (1, 7, 16, 127, 128, 129, 1000, 4096)
VALID_N = (136, 520)  # neither is a multiple of 64 or 128
VALID_K = (320, 4096, 8256)  # 64 x 5; long; 8256 = 64 x 129 (not a multiple of 128)


def family_schedules():
    fam = require_device().target.family
    return [s for s in catalogue.all_schedules(fam, grouped=False) if plan(s).ok]


def formats():
    return ["nvfp4", "bf16"] if require_device().target.family == "sm90" else ["nvfp4"]


def env() -> dict:
    import cutlass

    dev = require_device()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": dev.name, "target": dev.target.name, "sms": dev.sm_count,
            "nvidia_smi": smi.strip(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cute_dsl": getattr(cutlass, "__version__", "4.8.1"),
            "python": platform.python_version(), "host": platform.node()}


def _run_case(kern, m, n, k, fmt, seed, dist="awkward"):
    a, b = make_operands(m, n, k, fmt, seed=seed, dist=dist)
    return poisoned_check(kern, a, b)


def validate(quick: bool) -> dict:
    rows, fails = [], 0
    ms = VALID_M[:4] if quick else VALID_M
    for s in family_schedules():
        for fmt in formats():
            refused = plan(s, Problem(a_format=fmt))
            if not refused.ok:  # e.g. rs_packed decode tiles: W4A16 only
                rows.append({"schedule": s.name, "A": fmt, "refused": refused.reasons})
                print(f"validate {s.name} {fmt}: refused ({'; '.join(refused.reasons)})")
                continue
            kern = compile(s, Signature(fmt))
            worst, n_ok, n = 0.0, 0, 0
            for i, (m, nn, k) in enumerate((m, nn, k) for m in ms for nn in VALID_N
                                           for k in VALID_K):
                if not plan(s, Problem(m, nn, k, fmt)).ok:
                    continue
                r = _run_case(kern, m, nn, k, fmt, seed=i)
                n += 1
                n_ok += r.passed
                worst = max(worst, r.max_err_over_bound)
                if not r.passed:
                    fails += 1
                    print(f"  FAIL {s.name} {fmt} {r}", flush=True)
            rows.append({"schedule": s.name, "A": fmt, "shapes": n, "passed": n_ok,
                         "max_err_over_bound": round(worst, 4)})
            print(f"validate {s.name} {fmt}: {n_ok}/{n} worst err/bound {worst:.3g}",
                  flush=True)
    return {"rows": rows, "failures": fails, "M": ms, "N": VALID_N, "K": VALID_K,
            "rule": ValidationReport.rule}


def fuzz(count: int, seed: int) -> dict:
    rng = random.Random(seed)
    scheds = family_schedules()
    fails, done, cases = 0, 0, []
    t0 = time.perf_counter()
    while done < count:
        s, fmt = rng.choice(scheds), rng.choice(formats())
        m = rng.choice([1, 2, 3, 7, 8, 15, 16, 17, 31, 64, 100, 127, 128, 129, 255, 300, 513])
        n = 8 * rng.randint(1, 96)
        k = 32 * rng.randint(1, 140)
        dist = rng.choice(["awkward", "normal"])
        if not plan(s, Problem(m, n, k, fmt)).ok:
            continue
        r = _run_case(compile(s, Signature(fmt)), m, n, k, fmt, seed=done, dist=dist)
        done += 1
        if not r.passed:
            fails += 1
            cases.append(f"{s.name} {fmt} {dist} {r}")
            print(f"  FUZZ FAIL {cases[-1]}", flush=True)
    print(f"fuzz: {done} cases, {fails} mismatches, seed {seed}", flush=True)
    return {"seed": seed, "count": done, "mismatches": fails, "failures": cases[:50],
            "seconds": round(time.perf_counter() - t0, 1)}


def determinism() -> dict:
    rows = []
    for s in family_schedules():
        fmt = next((f for f in formats() if plan(s, Problem(16, 1024, 8192, f)).ok), None)
        if fmt is None:
            rows.append({"schedule": s.name, "refused": "no format at 16 x 1024 x 8192"})
            continue
        kern = compile(s, Signature(fmt))
        a, b = make_operands(16, 1024, 8192, fmt, seed=7)
        outs = [run_compiled(kern, a, b).clone() for _ in range(5)]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        rows.append({"schedule": s.name, "A": fmt, "split_k": s.split_k,
                     "bit_identical": same})
    print(f"determinism: {sum(r.get('bit_identical', 0) for r in rows)}/{len(rows)} "
          "bit-identical")
    return {"rows": rows}


_CACHE_CHILD = """
import time, sys; t0 = time.perf_counter()
sys.path.insert(0, {root!r})
import cute_fp4
from cute_fp4 import catalogue
from cute_fp4.api import make_operands, run_compiled
from cute_fp4.compile import compile
k = compile(catalogue.get({name!r}))
t1 = time.perf_counter()
a, b = make_operands(16, 512, 4096)
run_compiled(k, a, b)
print(k.source, round(t1 - t0, 3), round(k.compile_s, 3))
"""


def cache(name: str) -> dict:
    import tempfile

    root = str(Path(__file__).resolve().parent.parent)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        envv = dict(os.environ, CUTE_FP4_CACHE_DIR=d)
        for label in ("cold", "warm"):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", _CACHE_CHILD.format(root=root, name=name)],
                               env=envv, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            line = (r.stdout.strip().splitlines() or ["?"])[-1]
            out[label] = {"process_s": round(wall, 2), "child": line,
                          "stderr": r.stderr[-800:] if r.returncode else ""}
            print(f"cache {label}: {line} (process {wall:.2f} s)", flush=True)
    return {"schedule": name, **out}


def checks_cost() -> dict:
    """Host time per call of each step of ``run_compiled`` (back-to-back, then synchronize):
    the operand checks, building the DSL arguments, the compiled call alone, the whole."""
    from cute_fp4.api import _alpha_tensor, check_operands
    from cute_fp4.bench import Timer
    from cute_fp4.operands import Operands
    from cute_fp4.workspaces import split_workspace

    rows = []
    timer = Timer()
    for s in family_schedules()[:2]:
        kern = compile(s)
        a, b = make_operands(16, 8192, 8192)
        out = torch.empty((16, 8192), dtype=torch.bfloat16, device="cuda")
        alpha = _alpha_tensor(a, b, None)
        ws = split_workspace(kern, 16, 8192, out.device) if s.split_k > 1 else None
        from cuda.bindings import driver

        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        ops = Operands(a.data, a.scale, b.data, b.scale, out, alpha, ws)
        args = kern._kernel.runtime_args(ops, stream)
        row = {"schedule": s.name,
               "check_operands_us": timer.eager(
                   lambda: check_operands(a, b, out, None, torch.bfloat16)),  # noqa: B023
               "runtime_args_us": timer.eager(lambda: kern._kernel.runtime_args(  # noqa: B023
                   ops, stream)),  # noqa: B023
               "compiled_call_us": timer.eager(lambda: kern._compiled(*args)),  # noqa: B023
               "run_compiled_us": timer.eager(lambda: run_compiled(kern, a, b, out=out)),  # noqa: B023
               "device_us (graph)": timer(lambda: run_compiled(kern, a, b, out=out))}  # noqa: B023
        rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(f"checks: {rows[-1]}", flush=True)
    return {"rows": rows}


def bench(quick: bool) -> dict:
    from cute_fp4.bench import default_shapes, run_bench

    shapes = default_shapes()
    if quick:
        shapes = [(m, 8192, 8192) for m in (1, 16, 4096)]
    scheds = family_schedules()
    rows = run_bench(None, shapes, formats=formats())
    rows += run_bench(scheds, [(m, 8192, 8192) for m in (1, 16, 256, 4096, 8192)],
                      formats=["nvfp4"], progress=False)
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "perf-out"))
    ap.add_argument("--only", default="env,validate,fuzz,determinism,cache,checks,bench")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fuzz", type=int, default=500)
    ap.add_argument("--seed", type=int, default=20261129)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {
        "env": env, "validate": lambda: validate(args.quick),
        "fuzz": lambda: fuzz(args.fuzz, args.seed), "determinism": determinism,
        "cache": lambda: cache(family_schedules()[0].name), "checks": checks_cost,
        "bench": lambda: bench(args.quick),
    }
    status = 0
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            res = sections[name]()
        except Exception as e:  # keep going: record what broke
            import traceback

            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(f"{name}: ERROR {res['error']}\n{res['trace']}", flush=True)
            status = 1
        res["section_s"] = round(time.perf_counter() - t0, 1)
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
