"""``cute-fp4``: the catalogue, plans, compile reports, validation, benchmarks and tuning.

``schedules``, ``plan`` and ``compile`` work on any machine; ``validate``, ``bench`` and
``tune`` need a GPU of a supported architecture and say so plainly (exit 2) otherwise.
Tables fit 100 columns (``--json`` has every field in full); progress lines go to stderr.

Exit codes, the same for every command:
  0    done; over the whole catalogue (``--all``, ``demo``) a schedule that plan() refuses
       is reported and does not fail the run: the catalogue keeps such schedules on purpose
  1    refused or failed: a schedule named on the command line that plan() refuses, a
       compile failure, a validation failure
  2    usage: bad arguments or input, no schedule named (``compile``/``validate`` need names
       or ``--all``), an empty catalogue, no suitable GPU, a package the command needs not
       installed (torch, the CuTe DSL); one line on stderr, no traceback
  130  interrupted (Ctrl-C); 141: stdout was closed early (``... | head``), no traceback
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from cute_fp4 import tables
from cute_fp4.errors import CuteFp4Error, InputError
from cute_fp4.formats import Operand

EXIT_OK = 0
EXIT_REFUSED = 1  # a named schedule refused, a compile or validation failure
EXIT_ERROR = 2  # bad arguments, missing GPU, other errors
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def _resolve(names: list[str], all_: bool, family: str | None = None, *, cmd: str = "",
             grouped: bool | None = None):
    """The schedules a command works on: ``names`` or, with ``all_``, the catalogue (of one
    family; ``grouped=False``: its dense schedules only). Neither is a usage error (exit 2);
    so is an empty catalogue."""
    from cute_fp4 import catalogue

    if names and all_:
        raise InputError("give schedule names or --all, not both")
    if not names and not all_:
        raise InputError(f"name the schedules to {cmd} or pass --all (cute-fp4 schedules "
                         "lists them)")
    if names:
        return [catalogue.get(n) for n in names]
    scheds = catalogue.all_schedules(family, grouped)
    if not scheds:
        where = ", ".join(map(str, catalogue.directories())) or "no schedule folder found"
        raise InputError(f"the catalogue{' of ' + family if family else ''} is empty "
                         f"({where})")
    return scheds


def _refused_ok(report_ok: bool, refused_by_plan: bool, all_: bool) -> bool:
    """The one rule for exit codes: a plan refusal passes only in a catalogue-wide run."""
    return report_ok or (all_ and refused_by_plan)


# ----------------------------------------------------------------------------- commands

def cmd_schedules(args) -> int:
    from cute_fp4 import catalogue

    scheds = catalogue.all_schedules()
    if not scheds:
        _resolve([], True)  # raises: the catalogue is empty
    rows = tables.schedule_rows(scheds)
    if args.json:
        docs = {s.name: s.doc for s in scheds}
        print(json.dumps([{**r, "doc": docs.get(r["name"], "")} for r in rows], indent=1))
    else:
        print(tables.schedules_table(rows))
    return EXIT_OK


def cmd_plan(args) -> int:
    from cute_fp4 import catalogue
    from cute_fp4.compile import retarget
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem

    s = retarget(catalogue.get(args.name), args.target)
    if args.a_format is None:  # the formats the schedule's file names (NVFP4 by default)
        problem = tuple(args.shape) if args.shape else None
    else:
        problem = Problem.of((*args.shape, args.a_format)) if args.shape else \
            Problem(a_format=args.a_format)
    p = plan(s, problem)
    print(p.summary())
    return EXIT_OK if p.ok else EXIT_REFUSED


def cmd_compile(args) -> int:
    from cute_fp4.compile import compile_report
    from cute_fp4.targets import get_target

    family = get_target(args.target).family if args.target else None
    scheds = _resolve(args.names, args.all, family, cmd="compile")
    if args.dump_dir:
        _check_dump_dir(args.dump_dir)
    rows = []
    for i, s in enumerate(scheds, 1):
        tables.progress(i, len(scheds), f"compile {s.name} for {args.target or s.target}")
        rows.append(compile_report(s, args.target, dump_dir=args.dump_dir))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        kloop = any(r.get("kloop") for r in rows)
        print(tables.compile_table(
            [{**r, "k-loop": _kloop_cell(r.get("kloop"))} if kloop else r for r in rows]))
    # --all expects the catalogue's deliberate refusals; a compile failure never passes
    ok = all(_refused_ok(r["ok"], bool(r.get("refused_by_plan")), args.all) for r in rows)
    return EXIT_OK if ok else EXIT_REFUSED


def _check_dump_dir(path: str) -> None:
    """``--dump-dir`` made (with its parents) and writable before anything is compiled."""
    import tempfile
    from pathlib import Path

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise InputError(f"--dump-dir {path}: cannot write there ({e.strerror or e}); "
                         "give a folder you can create or write to") from None


def _kloop_cell(k: dict | None) -> str:
    """``instructions / non-MMA per MMA / MMAs overlapping the wait`` of a report's K loop."""
    if not k:
        return "-"
    return f"{k['instructions']} / {k['non_mma_per_mma']:.2f} / {k['mma_overlap']}"


def cmd_validate(args) -> int:
    import textwrap

    shapes, named = _shapes(args.shapes), _named(args, "validate")
    family = _device_family()
    from cute_fp4.api import validate
    from cute_fp4.compile import EMULATION_NOTE, Signature, compile_emulated
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem

    if args.emulate and family != "sm90":
        raise InputError(f"--emulate runs SM120 schedules on an SM90 GPU; this GPU is {family}")
    scheds = named or _resolve([], True, "sm120" if args.emulate else family, cmd="validate")
    jobs = [(s, fmt) for s in scheds for fmt in args.formats]
    ok, noted = True, False
    for i, (s, fmt) in enumerate(jobs, 1):
        p = plan(s, Problem(a_format=fmt))
        if not p.ok:
            print(f"{s.name} ({fmt}): refused by plan(): {'; '.join(p.reasons)}")
            ok &= _refused_ok(False, True, args.all)
            continue
        # an SM120 schedule on an SM90 GPU runs with its MMA emulated, and says so
        emulate = s.arch.family == "sm120" and family == "sm90"
        if emulate and not noted:
            print(textwrap.fill(EMULATION_NOTE, tables.WIDTH), flush=True)
            noted = True
        tables.progress(i, len(jobs), f"validate {s.name} ({fmt}{', emulated' if emulate else ''})")
        kern = compile_emulated(s, Signature(fmt)) if emulate else s
        rep = validate(kern, shapes=shapes, a_format=fmt)
        print(f"[emulated MMA] {rep}" if emulate else rep, flush=True)
        ok &= rep.passed
    return EXIT_OK if ok else EXIT_REFUSED


def cmd_bench(args) -> int:
    shapes, named = _shapes(args.shapes), _named(args, "bench", required=False)
    family = _device_family()
    from cute_fp4.bench import run_bench

    scheds = named or (_resolve([], True, family, cmd="bench", grouped=False)
                       if args.all else None)
    rows = run_bench(scheds, shapes, formats=args.formats, validate=not args.no_validate)
    return _emit(rows, args)


def cmd_tune(args) -> int:
    shapes = _shapes(args.shapes)
    _device_family()
    from cute_fp4.tune import tune

    rows = tune(shapes, formats=args.formats)
    return _emit(rows, args)


def cmd_demo(args) -> int:
    from cute_fp4.demo import demo

    return demo(quick=args.quick)


# ----------------------------------------------------------------------------- helpers

def _device_family() -> str:
    from cute_fp4.targets import require_device

    return require_device().target.family


def _named(args, cmd: str, required: bool = True):
    """The schedules named on the command line, resolved before a GPU is looked for (a
    mistyped name is a usage error on any machine); None for ``--all`` (and, when names
    are not ``required``, for neither)."""
    if args.names or (required and not args.all):
        return _resolve(args.names, args.all, cmd=cmd)
    return None


def _shapes(specs: list[str] | None):
    """``--shapes`` as (M, N, K) tuples, checked before a GPU is looked for."""
    if not specs:
        return None
    out = []
    for spec in specs:
        try:
            m, n, k = (int(x) for x in spec.split(","))
        except ValueError:
            alt = spec.lower().replace("x", ",").replace(" ", "")
            hint = f" (did you mean {alt}?)" if alt.count(",") == 2 and alt != spec else ""
            raise InputError(f"--shapes {spec!r}: expected M,N,K, three integers separated "
                             f"by commas{hint}") from None
        if min(m, n, k) <= 0:
            raise InputError(f"--shapes {spec!r}: M, N and K must be > 0")
        out.append((m, n, k))
    return out


def _emit(rows: list[dict], args) -> int:
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.csv:
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=tables.columns(rows))
        w.writeheader()
        w.writerows(rows)
    else:
        print(tables.result_table(rows))
    if getattr(args, "plot", None):
        from cute_fp4.bench import plot_roofline

        plot_roofline(rows, args.plot)
    return EXIT_OK if all(r.get("validated", "yes") != "NO" for r in rows) else EXIT_REFUSED


_NAMES_HELP = "catalogue schedule names (cute-fp4 schedules lists them)"
# a top-level module a command may miss -> what to install
_PACKAGES = {"torch": "torch (https://pytorch.org: the build for your CUDA)",
             "cutlass": "nvidia-cutlass-dsl==4.8.1 (the CuTe DSL)",
             "cuda": "cuda-python (installed with nvidia-cutlass-dsl)",
             "numpy": "numpy", "tvm_ffi": "apache-tvm-ffi"}


def _missing_package(e: ModuleNotFoundError) -> str:
    top = (e.name or "").split(".")[0]
    what = _PACKAGES.get(top, top or str(e))
    return f"needs the Python package {what}, which is not installed: pip install " \
        f"{what.split(' ')[0]}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cute-fp4", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("schedules", help="the catalogue as a table (design, plan, idea)")
    s.add_argument("--json", action="store_true",
                   help="one JSON row per schedule, with its full docstring under 'doc'")
    s.set_defaults(func=cmd_schedules)

    s = sub.add_parser("plan", help="shared-memory breakdown of a schedule; exit 1 if refused")
    s.add_argument("name", help="a catalogue schedule name")
    s.add_argument("--target", help="another target of the same family (e.g. sm_121a)")
    s.add_argument("--shape", type=int, nargs=3, metavar=("M", "N", "K"),
                   help="plan for this problem too (K and N alignment, split-K ranges)")
    s.add_argument("--a-format", choices=[Operand.NVFP4, Operand.BF16, Operand.FP16],
                   help="the A operand: nvfp4 (W4A4) or 16-bit (W4A16); default: what the "
                   "schedule's file names (PROBLEM), else nvfp4")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("compile", help="compile-only report (no GPU needed); exit 1 if a "
                       "named schedule is refused or any compile fails")
    s.add_argument("names", nargs="*", help=_NAMES_HELP + "; or use --all")
    s.add_argument("--all", action="store_true",
                   help="every catalogue schedule of the target (plan refusals pass)")
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
            default = "; or use --all" if name == "validate" else \
                " (default: the schedule='auto' pick per shape)"
            s.add_argument("names", nargs="*", help=_NAMES_HELP + default)
            s.add_argument("--all", action="store_true",
                           help="every catalogue schedule of this GPU's family "
                           "(plan refusals pass)")
        s.add_argument("--shapes", nargs="+", metavar="M,N,K",
                       help="problem sizes (default: the command's standard set)")
        s.add_argument("--formats", nargs="+", default=[Operand.NVFP4],
                       choices=[Operand.NVFP4, Operand.BF16],
                       help="A operand: nvfp4 (W4A4), bf16 (W4A16)")
        if name == "validate":
            s.add_argument("--emulate", action="store_true",
                           help="on an SM90 GPU: SM120 schedules (--all: the SM120 catalogue) "
                           "with an exact emulated MMA, a data-path check, not the OMMA "
                           "(automatic for SM120 names)")
        if name != "validate":
            s.add_argument("--json", action="store_true", help="rows as JSON")
            s.add_argument("--csv", action="store_true", help="rows as CSV")
        if name == "bench":
            s.add_argument("--plot", metavar="FILE.png", help="roofline chart (matplotlib)")
            s.add_argument("--no-validate", action="store_true",
                           help="skip the poisoned-output check of each kernel")
        s.set_defaults(func=func)

    s = sub.add_parser("demo", help="the default job: plan + compile every target, run on a GPU")
    s.add_argument("--quick", action="store_true", help="fewer schedules and shapes")
    s.set_defaults(func=cmd_demo)
    return p


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as ``cute-fp4: warning: ...`` on stderr (no source line)."""
    print(f"cute-fp4: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler
        return code
    except CuteFp4Error as e:
        print(f"cute-fp4 {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_REFUSED if type(e).__name__ == "ScheduleError" else EXIT_ERROR
    except ModuleNotFoundError as e:  # a wheel installed without torch or the CuTe DSL
        if (e.name or "").split(".")[0] == "cute_fp4":
            raise  # a module of this package missing is a bug, not an install problem
        print(f"cute-fp4 {args.cmd}: {_missing_package(e)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # the reader left (e.g. `| head`): stop quietly; send the rest of stdout nowhere so
        # the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
