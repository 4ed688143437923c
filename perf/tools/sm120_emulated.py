"""The SM120 kernel on an SM90 GPU through the exact emulated MMA (natively on an SM12x GPU):
every SM120 catalogue schedule against the exact reference, NaN-poisoned outputs, every
kernel run under a timeout.

    python perf/tools/sm120_emulated.py --out "$OUT" [--only NAME,...] [--quick]
        [--case-timeout 90] [--deadline-s 540]

What runs, per schedule that ``plan()`` accepts (plus two derived ones: a 64x128 pingpong
and a split-K default), each case a pass/fail with its numbers:

* ``validate/MxNxK``: the validation shapes, M = 1, tails in M, N and K, K = 32, up to
  4096^3 (``reference.check`` after a NaN-filled output; the poison must be detectable);
* ``long_k``: M = N = 256, K = 16384, three runs bit-identical;
* ``ctas/C``: at most C persistent CTAs (``compile.capped``; C = 1: one CTA walks every
  work unit), output bit-identical to the full grid's;
* ``stages/S``: the schedule with ``stages`` forced to 1 and 2 (plan refusals recorded),
  bit-identical to the automatic stage count;
* ``sf_load/X``: the other scale-factor load path (TMA <-> cp.async), bit-identical;
* ``out/fp16``, ``out/fp32``: the other output types;
* ``pingpong/CxU`` (pingpong schedules): U work units on C CTAs (1, 2, 3, 5, 7 units per
  CTA, odd splits), bit-identical to the full grid;
* ``splitk/K`` (split-K schedules): K with fewer K tiles than splits, which ``plan()``
  refuses (recorded); the kernel is then launched directly anyway (NaN-poisoned workspace)
  and must still be right: empty K ranges store zero partials.

Compiles are cases of their own (``compile``, ``<variant>:compile``, 300 s) so that a run's
timeout (``--case-timeout``, 90 s) is a kernel's. Each schedule runs in a child process
(``--child``) that prints one JSON line as each case starts and ends; the parent kills a
child whose case runs past its timeout (a hang: the case fails as ``hang``) or that dies
(``crash``, e.g. an illegal instruction), and starts a new child from the next case (also
after a CUDA error, which may leave the context unusable). Writes
``<out>/sm120_emulated.json`` (every case, the environment, the summary; rewritten after
each schedule) and prints one line per schedule.

What an emulated run does not check: the OMMA instruction itself (the CPU trace covers its
operand model), the sm_120a binary's register allocation, the 99 KiB shared-memory limit
(``plan()`` covers it): see ``cute_fp4/kernels/mma_emulation.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue, reference  # noqa: E402
from cute_fp4.operands import Operands  # noqa: E402
from cute_fp4.plan import plan  # noqa: E402
from cute_fp4.schedule import OutDtype, Problem, Schedule, SFLoad, WarpRoles  # noqa: E402

VALIDATION = [(1, 264, 320), (7, 136, 4096), (16, 512, 8256), (127, 136, 320),
              (128, 256, 448), (129, 264, 832), (1000, 136, 4096), (256, 392, 8256),
              (4096, 256, 4096), (4096, 4096, 4096), (5, 136, 32), (130, 264, 32),
              (200, 72, 96), (1, 8, 32)]
QUICK_VALIDATION = [(1, 264, 320), (129, 264, 832), (5, 136, 32), (1000, 136, 4096)]
VARIANT_SHAPES = [(129, 264, 832), (1, 136, 4096), (300, 392, 2048)]
LONG_K = (256, 256, 16384)
CTAS = (1, 2, 3, 5)
PINGPONG = [(1, 1), (1, 2), (1, 3), (1, 5), (1, 7), (2, 5), (3, 7), (4, 9), (2, 10)]
COMPILE_TIMEOUT = 300.0
START_TIMEOUT = 180.0
RESTART = 86  # a child's exit code after a CUDA error: the context is lost, start a new one


def schedules() -> list[Schedule]:
    """The SM120 schedules this harness runs (the order is the child's index)."""
    out = [s for s in catalogue.all_schedules("sm120", grouped=False) if plan(s).ok]
    out.append(catalogue.get("sm120_decode_64x128").replace(roles="pingpong"))
    out.append(catalogue.get("sm120_default").replace(split_k=2))
    return [s for s in out if plan(s).ok]


# ----------------------------------------------------------------------------- cases

class Case(NamedTuple):
    id: str
    run: Callable[[Ctx], dict]
    timeout: float


class Ctx:
    """One child's state: the schedule, how kernels are built, base outputs to compare."""

    def __init__(self, s: Schedule, emulate: bool):
        self.s, self.emulate = s, emulate
        self._kernels: dict = {}
        self._base: dict = {}

    def kernel(self, s: Schedule | None = None):
        from cute_fp4.compile import compile, compile_emulated  # noqa: A004

        s = s or self.s
        if s not in self._kernels:
            self._kernels[s] = compile_emulated(s) if self.emulate else compile(s)
        return self._kernels[s]

    def base(self, shape, seed):
        """The base schedule's output on ``shape`` (computed once)."""
        key = (shape, seed)
        if key not in self._base:
            self._base[key] = run_poisoned(self.kernel(), shape, seed)[0]
        return self._base[key]


def operands(shape, seed):
    from cute_fp4.operands import make_operands

    return make_operands(*shape, seed=seed)


def run_poisoned(kern, shape, seed, direct=False):
    """(output, CheckResult) of one run into a NaN-filled output. ``direct``: launch without
    the plan check (what ``run_compiled`` would refuse), with a NaN-filled workspace."""
    from cute_fp4.operands import alpha_tensor, out_dtype_of
    from cute_fp4.run import run_compiled

    a, b = operands(shape, seed)
    m, n, _ = shape
    out = torch.full((m, n), float("nan"), dtype=out_dtype_of(kern.schedule), device="cuda")
    if direct:
        sk = kern.schedule.split_k
        alpha = alpha_tensor(a, b, None)
        ws = torch.full((sk, m, n), float("nan"), dtype=torch.float32, device="cuda") \
            if sk > 1 else None
        kern.launch(Operands(a.data, a.scale, b.data, b.scale, out, alpha, ws))
        if ws is not None:
            torch.mul(ws.sum(dim=0), alpha, out=out)
    else:
        run_compiled(kern, a, b, out=out)
    torch.cuda.synchronize()
    return out, reference.check(out, a, b)


def _result(checks, same=None, **extra) -> dict:
    """A case's row from its CheckResults and bit-identity comparisons."""
    worst = max((c.max_err_over_bound for c in checks), default=0.0)
    ok = all(c.passed for c in checks) and (same is None or all(same))
    bad = [str(c) for c in checks if not c.passed]
    if same is not None and not all(same):
        bad.append(f"not bit-identical in {same.count(False)} of {len(same)} comparisons")
    return {"passed": ok, "err_over_bound": round(worst, 4), "detail": "; ".join(bad)[:600],
            **extra}


def case_compile(ctx: Ctx) -> dict:
    t0 = time.perf_counter()
    k = ctx.kernel()
    return {"passed": True, "compile_s": round(time.perf_counter() - t0, 2), "source": k.source}


def case_poison(ctx: Ctx) -> dict:
    a, b = operands((16, 136, 320), 0)
    poison = torch.full((16, 136), float("nan"), dtype=torch.bfloat16, device="cuda")
    caught = not reference.check(poison, a, b).passed
    return {"passed": caught, "detail": "" if caught else "a NaN output passes the check"}


def case_validate(shape, seed):
    def run(ctx: Ctx) -> dict:
        m, n, k = shape
        p = plan(ctx.s, Problem(m=m, n=n, k=k))
        if not p.ok:  # e.g. split-K past the K tiles: refused up front, like the API does
            return {"passed": True, "refused_by_plan": "; ".join(p.reasons)}
        return _result([run_poisoned(ctx.kernel(), shape, seed)[1]])
    return run


def case_long_k(ctx: Ctx) -> dict:
    runs = [run_poisoned(ctx.kernel(), LONG_K, 11) for _ in range(3)]
    return _result([r for _, r in runs], [torch.equal(runs[0][0], o) for o, _ in runs[1:]])


def case_ctas(c: int):
    def run(ctx: Ctx) -> dict:
        from cute_fp4.compile import capped

        shape = (300, 264, 1024)
        out, r = run_poisoned(capped(ctx.kernel(), c), shape, 5)
        note = "" if ctx.s.scheduler.persistent else "one CTA per unit: max_ctas ignored"
        return _result([r], [torch.equal(out, ctx.base(shape, 5))], note=note)
    return run


def case_variant_compile(variant: Schedule):
    """Compile a variant schedule (its own case: a compile may take long, a run may not)."""
    def run(ctx: Ctx) -> dict:
        p = plan(variant)
        if not p.ok:
            return {"passed": True, "refused_by_plan": "; ".join(p.reasons)}
        t0 = time.perf_counter()
        ctx.kernel(variant)
        return {"passed": True, "compile_s": round(time.perf_counter() - t0, 2),
                "stages": p.stages}
    return run


def case_variant(variant: Schedule, compare: bool = True):
    """The variant schedule on VARIANT_SHAPES; bit-identical to the base when ``compare``."""
    def run(ctx: Ctx) -> dict:
        p = plan(variant)
        if not p.ok:
            return {"passed": True, "refused_by_plan": "; ".join(p.reasons)}
        kern = ctx.kernel(variant)
        checks, same = [], []
        for i, shape in enumerate(VARIANT_SHAPES):
            out, r = run_poisoned(kern, shape, 20 + i)
            checks.append(r)
            if compare:
                same.append(torch.equal(out, ctx.base(shape, 20 + i)))
        return _result(checks, same if compare else None, stages=p.stages)
    return run


def case_pingpong(c: int, units: int):
    def run(ctx: Ctx) -> dict:
        from cute_fp4.compile import capped

        tm, tn, _ = ctx.s.tile
        shape = (tm * units - 5 if tm * units > 5 else 1, tn, 512)  # one tile column
        out, r = run_poisoned(capped(ctx.kernel(), c), shape, 30 + units)
        return _result([r], [torch.equal(out, ctx.base(shape, 30 + units))],
                       units_per_cta=[len(range(b, units, c)) for b in range(min(c, units))])
    return run


def case_split_k(k: int):
    def run(ctx: Ctx) -> dict:
        shape = (16, 264, k)
        p = plan(ctx.s, Problem(*shape))
        if not all(r.startswith("split_k") for r in p.reasons):
            return {"passed": False, "detail": "refused by plan: " + "; ".join(p.reasons)}
        _, r = run_poisoned(ctx.kernel(), shape, 40, direct=not p.ok)
        return _result([r], refused_by_plan="; ".join(p.reasons))
    return run


def cases(s: Schedule, quick: bool, t: float = 90.0) -> list[Case]:
    """Every case of one schedule, in order (the child's ``--skip`` counts these); ``t`` is
    the timeout of a case that compiles nothing."""
    out = [Case("compile", case_compile, COMPILE_TIMEOUT), Case("poison", case_poison, t)]
    for i, shape in enumerate(QUICK_VALIDATION if quick else VALIDATION):
        out.append(Case("validate/{}x{}x{}".format(*shape), case_validate(shape, i), t))
    out.append(Case("long_k", case_long_k, t))
    for c in (1,) if quick else CTAS:
        out.append(Case(f"ctas/{c}", case_ctas(c), t))

    def variant(label: str, v: Schedule, compare: bool = True) -> None:
        out.append(Case(f"{label}:compile", case_variant_compile(v), COMPILE_TIMEOUT))
        out.append(Case(label, case_variant(v, compare), t))

    for st in (1, 2):
        variant(f"stages/{st}", s.replace(stages=st))
    other = SFLoad.CP_ASYNC if s.sf_load is SFLoad.TMA else SFLoad.TMA
    variant(f"sf_load/{other.value}", s.replace(sf_load=other))
    if not quick:
        for dt in (OutDtype.FP16, OutDtype.FP32):
            if dt is not s.epilogue.out_dtype:
                variant(f"out/{dt.value}", s.replace(out_dtype=dt), compare=False)
    if s.warps.roles is WarpRoles.PINGPONG:
        for c, u in PINGPONG[:4] if quick else PINGPONG:
            out.append(Case(f"pingpong/{c}x{u}", case_pingpong(c, u), t))
    if s.split_k > 1:
        tk = s.tile.k
        for k in sorted({32, tk, 2 * tk, (s.split_k - 1) * tk, s.split_k * tk}):
            out.append(Case(f"splitk/K={k}", case_split_k(k), t))
    return out


# ----------------------------------------------------------------------------- child

def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def child(index: int, skip: int, quick: bool) -> int:
    from cute_fp4.targets import require_device

    family = require_device().target.family
    if family not in ("sm90", "sm120"):
        raise SystemExit(f"needs an SM90 (emulated) or SM12x GPU, got {family}")
    s = schedules()[index]
    ctx = Ctx(s, emulate=family == "sm90")
    for i, c in enumerate(cases(s, quick)):
        if i < skip:
            continue
        _emit({"event": "start", "index": i, "case": c.id})
        t0 = time.perf_counter()
        sticky = False
        try:
            res = c.run(ctx)
        except Exception as e:  # a failing case is a result, not the end of the run
            res = {"passed": False, "detail": f"{type(e).__name__}: {e}"[:600]}
            sticky = "cuda" in res["detail"].lower()
        res = {"case": c.id, "status": "pass" if res["passed"] else "fail",
               "seconds": round(time.perf_counter() - t0, 2), **res}
        _emit({"event": "done", "index": i, "result": res})
        if sticky:  # the CUDA context may be unusable: the parent starts a fresh child
            sys.stdout.flush()
            os._exit(RESTART)
    return 0


# ----------------------------------------------------------------------------- parent

def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group
    except ProcessLookupError:
        pass
    proc.wait()


def run_schedule(index: int, s: Schedule, args, log_dir: Path) -> list[dict]:
    """Every case of one schedule through children, restarting after a hang or crash."""
    todo = cases(s, args.quick, args.case_timeout)
    rows: list[dict] = []
    skip = 0
    while skip < len(todo):
        err = open(log_dir / f"child-{index}-{skip}.stderr", "w+")
        cmd = [sys.executable, __file__, "--child", str(index), "--skip", str(skip)]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        current = None
        while True:
            timeout = todo[current].timeout if current is not None else START_TIMEOUT
            try:
                line = q.get(timeout=timeout)
            except queue.Empty:
                _kill(proc)
                if current is None:  # the child never started a case
                    err.close()
                    return rows + [_lost(c, "child did not start in time") for c in todo[skip:]]
                rows.append({"case": todo[current].id, "status": "hang", "passed": False,
                             "detail": f"no result after {timeout:.0f} s: killed"})
                skip = current + 1
                break
            if line is None:  # the child ended
                rc = proc.wait()
                if current is not None:  # during a case
                    rows.append({"case": todo[current].id, "status": "crash", "passed": False,
                                 "detail": f"child exited {rc}: {_tail(err)}"})
                    skip = current + 1
                    break
                if rc == RESTART:  # after a CUDA error, from the next case
                    break
                lost = [_lost(c, f"child exited {rc}: {_tail(err)}") for c in todo[skip:]]
                err.close()
                return rows + lost
            ev = json.loads(line)
            if ev["event"] == "start":
                current = ev["index"]
            else:
                rows.append(ev["result"])
                current, skip = None, ev["index"] + 1
        err.close()
    return rows


def _lost(case: Case, why: str) -> dict:
    return {"case": case.id, "status": "not run", "passed": False, "detail": why}


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return " | ".join(f.read().strip().splitlines()[-4:])[-600:]


def env(mode: str) -> dict:
    import cutlass

    from cute_fp4.targets import require_device

    dev = require_device()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": dev.name, "target": dev.target.name, "mode": mode, "nvidia_smi": smi,
            "torch": torch.__version__, "cute_dsl": getattr(cutlass, "__version__", "?"),
            "python": platform.python_version(), "command": " ".join(sys.argv)}


def summary(rows_by_schedule: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rows in rows_by_schedule.items():
        statuses = [r["status"] for r in rows]
        out[name] = {"cases": len(rows), "passed": statuses.count("pass"),
                     **{k: statuses.count(k) for k in ("fail", "hang", "crash", "not run")},
                     "worst_err_over_bound": max((r.get("err_over_bound", 0.0) for r in rows),
                                                 default=0.0)}
    return out


def parent(args) -> int:
    from cute_fp4.targets import require_device

    family = require_device().target.family
    mode = {"sm90": "emulated (BF16 mma.sync for OMMA.SF)", "sm120": "native"}.get(family)
    if mode is None:
        print(f"needs an SM90 or SM12x GPU, got {family}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "sm120_emulated_logs"
    log_dir.mkdir(exist_ok=True)
    names = set(args.only.split(",")) if args.only else None
    report = {"env": env(mode), "rows": {}, "summary": {}}
    t0 = time.perf_counter()
    print(f"SM120 kernel, {mode}, on {report['env']['gpu']}", flush=True)
    for i, s in enumerate(schedules()):
        if names and s.name not in names:
            continue
        if time.perf_counter() - t0 > args.deadline_s:
            report["rows"][s.name] = [_lost(c, f"deadline of {args.deadline_s:.0f} s passed")
                                      for c in cases(s, args.quick, args.case_timeout)]
        else:
            report["rows"][s.name] = run_schedule(i, s, args, log_dir)
        report["summary"] = summary(report["rows"])
        report["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "sm120_emulated.json").write_text(json.dumps(report, indent=1, default=str))
        sm = report["summary"][s.name]
        bad = [f"{r['case']}={r['status']}" for r in report["rows"][s.name]
               if r["status"] != "pass"]
        print(f"{s.name}: {sm['passed']}/{sm['cases']} pass, worst err/bound "
              f"{sm['worst_err_over_bound']:.3g}" + (f"; {', '.join(bad)[:300]}" if bad else ""),
              flush=True)
    tot = {k: sum(v[k] for v in report["summary"].values())
           for k in ("cases", "passed", "fail", "hang", "crash", "not run")}
    print(f"total: {tot['passed']}/{tot['cases']} pass, {tot['fail']} fail, {tot['hang']} hang, "
          f"{tot['crash']} crash, {tot['not run']} not run, {report['seconds']} s "
          f"-> {out / 'sm120_emulated.json'}", flush=True)
    return 0 if tot["passed"] == tot["cases"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "perf-out"))
    ap.add_argument("--only", help="comma-separated schedule names (derived names too)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and variants")
    ap.add_argument("--case-timeout", type=float, default=90.0,
                    help="seconds a case that compiles nothing may take (then: hang)")
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="start no new schedule after this many seconds (rest: 'not run')")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.skip, args.quick)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
