"""``cute-fp4``: the catalogue, plans, compile reports, validation, benchmarks and tuning.

``schedules``, ``plan`` and ``compile`` work on any machine; ``validate``, ``bench`` and
``tune`` need a GPU of a supported architecture and say so plainly (exit 2) otherwise.
Errors print one line (no traceback) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys

from cute_fp4.errors import CuteFp4Error

EXIT_REFUSED = 1  # a schedule cannot be implemented / validation failed
EXIT_ERROR = 2  # bad arguments, missing GPU, other errors


def columns(rows: list[dict]) -> list[str]:
    """Every key of ``rows``, in order of first appearance."""
    return list(dict.fromkeys(c for r in rows for c in r))


def _table(rows: list[dict], cols: list[str] | None = None) -> str:
    from tabulate import tabulate

    cols = columns(rows) if cols is None else cols
    return tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols,
                    tablefmt="github", floatfmt=".3g", intfmt=",")


def _resolve(names: list[str], all_: bool, family: str | None = None):
    from cute_fp4 import catalogue

    if all_ or not names:
        return catalogue.all_schedules(family)
    return [catalogue.get(n) for n in names]


# ----------------------------------------------------------------------------- commands

def cmd_schedules(args) -> int:
    from cute_fp4.plan import plan

    rows = []
    for s in _resolve([], True):
        p = plan(s)
        rows.append({"name": s.name, "target": s.target, "tile": str(s.tile),
                     "roles": s.warps.roles.value, "stages": p.stages if p.ok else "-",
                     "sf": s.sf_load.value, "split_k": s.split_k,
                     "epi": "x".join(map(str, p.epi_tile)), "smem": p.smem_bytes,
                     "fits": "yes" if p.ok else "NO",
                     "idea": (s.doc.splitlines() or [""])[0][:60]})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_table(rows))
    return 0


def cmd_plan(args) -> int:
    from cute_fp4 import catalogue
    from cute_fp4.compile import retarget
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem

    s = retarget(catalogue.get(args.name), args.target)
    problem = Problem(*args.shape, a_format=args.a_format) if args.shape else \
        Problem(a_format=args.a_format)
    p = plan(s, problem)
    print(p.summary())
    return 0 if p.ok else EXIT_REFUSED


def cmd_compile(args) -> int:
    from cute_fp4.compile import compile_report
    from cute_fp4.targets import get_target

    family = get_target(args.target).family if args.target else None
    scheds = _resolve(args.names, args.all, family)
    rows = []
    for s in scheds:
        print(f"compiling {s.name} for {args.target or s.target} ...", file=sys.stderr)
        rows.append(compile_report(s, args.target, dump_dir=args.dump_dir))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            r["tile"] = "x".join(map(str, r["tile"]))
            r["mma"] = f"{r.get('mma_count', 0)}x {','.join(r.get('mma_instructions', []))}"
            r["k-loop"] = _kloop_cell(r.get("kloop"))
            r["status"] = "ok" if r["ok"] else "REFUSED: " + r.get("reason", "")
        print(_table(rows, ["name", "target", "tile", "roles", "stages", "smem_bytes",
                            "registers", "spills", "compile_s", "mma", "k-loop", "status"]))
    # --all expects the catalogue's deliberate refusals; a compile failure never passes
    expected = args.all
    return 0 if all(r["ok"] or (expected and r.get("refused_by_plan")) for r in rows) \
        else EXIT_REFUSED


def _kloop_cell(k: dict | None) -> str:
    """``instructions / non-MMA per MMA / MMAs overlapping the wait`` of a report's K loop."""
    if not k:
        return "-"
    return f"{k['instructions']} / {k['non_mma_per_mma']:.2f} / {k['mma_overlap']}"


def cmd_validate(args) -> int:
    family = _device_family()
    from cute_fp4.api import validate

    ok = True
    for s in _resolve(args.names, args.all, family):
        for fmt in args.formats:
            rep = validate(s, shapes=_shapes(args.shapes), a_format=fmt)
            print(rep)
            ok &= rep.passed
    return 0 if ok else EXIT_REFUSED


def cmd_bench(args) -> int:
    family = _device_family()
    from cute_fp4.bench import run_bench

    scheds = _resolve(args.names, args.all, family) if (args.names or args.all) else None
    rows = run_bench(scheds, _shapes(args.shapes),
                     formats=args.formats, validate=not args.no_validate)
    return _emit(rows, args)


def cmd_tune(args) -> int:
    _device_family()
    from cute_fp4.tune import tune

    rows = tune(_shapes(args.shapes), formats=args.formats)
    return _emit(rows, args)


def cmd_demo(args) -> int:
    from cute_fp4.demo import demo

    return demo(quick=args.quick)


# ----------------------------------------------------------------------------- helpers

def _device_family() -> str:
    from cute_fp4.targets import require_device

    return require_device().target.family


def _shapes(specs: list[str] | None):
    if not specs:
        return None
    out = []
    for spec in specs:
        try:
            m, n, k = (int(x) for x in spec.split(","))
        except ValueError:
            raise CuteFp4Error(f"bad shape {spec!r}: expected M,N,K (three integers)") from None
        out.append((m, n, k))
    return out


def _emit(rows: list[dict], args) -> int:
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.csv:
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=columns(rows))
        w.writeheader()
        w.writerows(rows)
    else:
        print(_table(rows))
    if getattr(args, "plot", None):
        from cute_fp4.bench import plot_roofline

        plot_roofline(rows, args.plot)
    return 0 if all(r.get("validated", "yes") != "NO" for r in rows) else EXIT_REFUSED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cute-fp4", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("schedules", help="the catalogue as a table")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_schedules)

    s = sub.add_parser("plan", help="shared-memory breakdown of a schedule; exit 1 if refused")
    s.add_argument("name")
    s.add_argument("--target", help="another target of the same family (e.g. sm_121a)")
    s.add_argument("--shape", type=int, nargs=3, metavar=("M", "N", "K"))
    s.add_argument("--a-format", default="nvfp4", choices=["nvfp4", "bf16", "fp16"])
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("compile", help="compile-only report (no GPU needed)")
    s.add_argument("names", nargs="*")
    s.add_argument("--all", action="store_true", help="every catalogue schedule of the target")
    s.add_argument("--target", help="sm_120a, sm_121a or sm_90a (default: each schedule's)")
    s.add_argument("--json", action="store_true",
                   help="one JSON row per schedule, the K-loop measures under 'kloop'")
    s.add_argument("--dump-dir", metavar="DIR",
                   help="keep each schedule's cubin, PTX and SASS in DIR")
    s.set_defaults(func=cmd_compile)

    for name, func, hlp in (("validate", cmd_validate, "run against the exact reference"),
                            ("bench", cmd_bench, "perf table vs torch BF16/FP8"),
                            ("tune", cmd_tune, "pick the fastest valid schedule per shape")):
        s = sub.add_parser(name, help=hlp + " (needs a GPU)")
        if name != "tune":
            s.add_argument("names", nargs="*")
            s.add_argument("--all", action="store_true")
        s.add_argument("--shapes", nargs="+", metavar="M,N,K")
        s.add_argument("--formats", nargs="+", default=["nvfp4"],
                       choices=["nvfp4", "bf16"], help="A operand: nvfp4 (W4A4), bf16 (W4A16)")
        if name != "validate":
            s.add_argument("--json", action="store_true")
            s.add_argument("--csv", action="store_true")
        if name == "bench":
            s.add_argument("--plot", metavar="FILE.png", help="roofline chart (matplotlib)")
            s.add_argument("--no-validate", action="store_true")
        s.set_defaults(func=func)

    s = sub.add_parser("demo", help="the default job: plan + compile every target, run on a GPU")
    s.add_argument("--quick", action="store_true", help="fewer schedules and shapes")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CuteFp4Error as e:
        print(f"cute-fp4 {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_REFUSED if type(e).__name__ == "ScheduleError" else EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
