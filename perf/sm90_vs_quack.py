"""Issue 11's table: cute_fp4 NVFP4 W4A16 and W4A4 on SM90 against QuACK's NVFP4 W4A16
kernel, torch BF16 and torch FP8, in one process, on the same NVFP4 weights, with the
same timing (``cute_fp4.bench.Timer``: CUDA-graph replay, device time, L2 flushed).

    python perf/sm90_vs_quack.py --out DIR [--quick] [--candidates regime|all|none]
        [--schedules NAME ...] [--budget-s 330] [--reps 20] [--warm-l2]

Cases: N x K in {8192 x 8192, 28672 x 4096, 4096 x 14336}, M in {1, 16, 64, 256, 1024,
4096, 8192} (``--quick``: 8192 x 8192, M in {1, 16, 256, 4096}, no candidates). Two passes,
so a run cut short by ``--budget-s`` still has the headline numbers of every case:

1. every case: the peers (``cute_fp4.bench.PEERS``) and cute_fp4 ``schedule="auto"``,
   W4A16 and W4A4;
2. every case: the candidate schedules (``--candidates regime``: 2-3 catalogue schedules
   per M regime, plus ``--schedules``; ``all``: every SM90 catalogue schedule that
   ``plan()`` accepts), each timed and checked. "best" is the fastest schedule whose
   output passed the check: what a tuner would pick.

Each output is the one the last CUDA-graph replay wrote into a NaN-poisoned buffer, checked
against the exact reference. Kernels compile once per schedule signature (symbolic M, N,
K) and QuACK once per tile config; ``setup_s`` in the JSON includes those compiles.

Writes ``DIR/sm90_vs_quack.json`` and ``DIR/sm90_vs_quack.md`` (rewritten after every case,
so an interrupted run keeps what it measured) and prints a compact table. The markdown
states the GPU, driver, versions, date, the FLOP and byte formulas and each of issue 11's
bars, met or missed, by how much.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((8192, 8192), (28672, 4096), (4096, 14336))  # (N, K)
MS = (1, 16, 64, 256, 1024, 4096, 8192)
QUICK_SHAPES = ((8192, 8192),)
QUICK_MS = (1, 16, 256, 4096)
FORMATS = (("w4a16", "bf16"), ("w4a4", "nvfp4"))
# (largest M of the regime, catalogue schedules tried there besides "auto")
REGIME_CANDIDATES = (
    (32, ("sm90_decode_swapab", "sm90_decode", "sm90_decode_64x128_splitk2")),
    (128, ("sm90_decode", "sm90_decode_64x128_splitk2", "sm90_128x128x64")),
    (512, ("sm90_128x128x64", "sm90_default", "sm90_decode")),
    (None, ("sm90_default", "sm90_128x128x64")),
)
METHOD = ("CUDA-graph replay of one call, timed with CUDA events (device time), median of "
          "{reps}; before each repetition L2 is {l2}; every provider prepared once outside "
          "the timed region (QuACK's weight repack, torch's BF16/FP8 weight copies, "
          "cute_fp4's compile) from the same NVFP4 weight; W4A4 times exclude quantizing "
          "the activations, and cute_fp4 gets alpha (the product of the global scales) "
          "made once, as a static activation scale allows")


# ----------------------------------------------------------------------------- cases

def cases(quick: bool) -> list[tuple[int, int, int]]:
    """(N, K, M) in run order: shape by shape, M ascending."""
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if quick else (SHAPES, MS)
    return [(n, k, m) for n, k in shapes for m in ms]


def regime_names(m: int) -> tuple[str, ...]:
    for top, names in REGIME_CANDIDATES:
        if top is None or m <= top:
            return names
    raise AssertionError("unreachable: the last regime has no upper bound")


def candidates(m: int, n: int, k: int, a_format: str, mode: str, extra=()) -> list:
    """Catalogue schedules to try beside "auto" for one case, each writing BF16, that
    ``plan()`` accepts (CPU only: no compile). ``mode``: "none", "regime" or "all"."""
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem
    from cute_fp4.tune import candidates as all_candidates

    problem = Problem(m, n, k, a_format)
    if mode == "none":
        picked = []
    elif mode == "all":
        picked = all_candidates("sm90", problem)
    elif mode == "regime":
        known = set(catalogue.names())
        picked = [catalogue.get(x) for x in regime_names(m) if x in known]
    else:
        raise ValueError(f"--candidates must be none, regime or all, got {mode!r}")
    picked += [catalogue.get(x) for x in extra]
    out = {}
    for s in picked:
        s = s.replace(out_dtype="bf16", name=s.name)
        if s.key() not in out and plan(s, problem).ok:
            out[s.key()] = s
    return list(out.values())


# ----------------------------------------------------------------------------- ratios, bars

def _us(row: dict | None) -> float | None:
    """The time of a cute_fp4 row whose output did not fail its check."""
    if not row or "us" not in row or row.get("check") == "FAIL":
        return None
    return row["us"]


def _peer_us(row: dict | None) -> float | None:
    """A peer's time, whatever its check said: it is what its users get (the table marks
    an output that failed the exact rule with '!')."""
    return row.get("us") if row else None


def best_of(rows: list[dict]) -> dict | None:
    """The fastest row whose check passed (what a tuner would keep)."""
    ok = [r for r in rows if r.get("check") == "ok" and "us" in r]
    return min(ok, key=lambda r: r["us"]) if ok else None


def ratios(case: dict) -> dict:
    """Same-run ratios of one case (None where a side is missing or failed its check)."""
    peers, cute = case["peers"], case["cute"]

    def ratio(num, den):
        return round(num / den, 3) if num is not None and den is not None else None

    out = {}
    for variant in ("auto", "best"):
        a16 = _us(cute["w4a16"].get(variant))
        a4 = _us(cute["w4a4"].get(variant))
        for label, us in (("w4a16", a16), ("w4a4", a4)):
            out[f"{label}_{variant}_x_quack"] = ratio(_peer_us(peers.get("quack_w4a16")), us)
            out[f"{label}_{variant}_x_bf16"] = ratio(_peer_us(peers.get("torch_bf16")), us)
            out[f"{label}_{variant}_x_fp8"] = ratio(_peer_us(peers.get("torch_fp8")), us)
        out[f"w4a4_over_w4a16_{variant}"] = ratio(a4, a16)
    return out


BARS = (
    # (name, applies to M, value key, target, higher is better)
    ("W4A16 >= 1.10x QuACK W4A16", lambda m: True, "x_quack", 1.10, True),
    ("M <= 16: W4A16 >= 2.2x torch BF16", lambda m: m <= 16, "x_bf16", 2.2, True),
    ("M <= 16: W4A16 >= 3.3 TB/s of weight", lambda m: m <= 16, "weight_TB/s", 3.3, True),
    ("M >= 1024: W4A16 >= 1.05x torch BF16", lambda m: m >= 1024, "x_bf16", 1.05, True),
    ("W4A4 within 10% of W4A16 (time ratio <= 1.10)", lambda m: True, "a4_over_a16", 1.10,
     False),
)


def _bar_value(case: dict, variant: str, key: str):
    r = case["ratios"]
    if key == "weight_TB/s":
        row = case["cute"]["w4a16"].get(variant)
        return row.get("weight_TB/s") if _us(row) is not None else None
    if key == "a4_over_a16":
        return r.get(f"w4a4_over_w4a16_{variant}")
    return r.get(f"w4a16_{variant}_{key}")


def _bar_rows_of(case: dict, variant: str) -> list[dict]:
    rows = []
    a16 = case["cute"]["w4a16"].get(variant) or {}
    a4 = case["cute"]["w4a4"].get(variant) or {}
    for name, applies, key, target, higher in BARS:
        if not applies(case["M"]):
            continue
        value = _bar_value(case, variant, key)
        involved = [a16] + ([a4] if key == "a4_over_a16" else [])
        if any(r.get("check") == "FAIL" for r in involved):
            verdict = "invalid (cute_fp4 output failed its check)"
        elif value is None:
            verdict = "n/a (a side is missing: see the table)"
        else:
            verdict = "met" if (value >= target if higher else value <= target) else "missed"
        rows.append({"bar": name, "variant": variant, "N": case["N"], "K": case["K"],
                     "M": case["M"], "value": value, "target": target, "verdict": verdict,
                     "by": None if value is None else round(value / target, 3)})
    return rows


def bars(case_list: list[dict]) -> list[dict]:
    """Issue 11's bars for every case, for "auto" and for "best"."""
    return [b for c in case_list for v in ("auto", "best") for b in _bar_rows_of(c, v)]


def bar_summary(bar_rows: list[dict]) -> list[dict]:
    """Per bar and variant: how many cases met, missed, had no value; the worst case."""
    out = {}
    for b in bar_rows:
        s = out.setdefault((b["bar"], b["variant"]), {"bar": b["bar"], "variant": b["variant"],
                                                      "met": 0, "missed": 0, "other": 0,
                                                      "worst": None})
        kind = b["verdict"] if b["verdict"] in ("met", "missed") else "other"
        s[kind] += 1
        if b["by"] is not None and (s["worst"] is None or _worse(b, s["worst"])):
            s["worst"] = {k: b[k] for k in ("N", "K", "M", "value", "by")}
    order = {name: i for i, (name, *_) in enumerate(BARS)}
    return sorted(out.values(), key=lambda s: (order[s["bar"]], s["variant"]))


def _worse(b: dict, worst: dict) -> bool:
    higher = next(h for name, _, _, _, h in BARS if name == b["bar"])
    return b["by"] < worst["by"] if higher else b["by"] > worst["by"]


# ----------------------------------------------------------------------------- rendering

def _cell(row: dict | None) -> str:
    if not row:
        return "-"
    if "us" not in row:
        status = row.get("status", "")
        return "skip" if status.startswith("skipped") else \
            "-" if status.startswith("unavailable") else "err"
    mark = {"ok": "", "inexact": "~", "FAIL": "!"}.get(row.get("check"), "?")
    return f"{row['us']:.1f}{mark}"


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _name(row: dict | None) -> str:
    return (row or {}).get("schedule_name", "-")


def table_rows(case_list: list[dict]) -> list[list[str]]:
    rows = []
    for c in case_list:
        p, a16, a4, r = c["peers"], c["cute"]["w4a16"], c["cute"]["w4a4"], c["ratios"]
        best16 = a16.get("best") or {}
        rows.append([f"{c['N']}x{c['K']}", str(c["M"]), _cell(p.get("torch_bf16")),
                     _cell(p.get("torch_fp8")), _cell(p.get("quack_w4a16")),
                     _cell(a16.get("auto")), _cell(a16.get("best")), _cell(a4.get("auto")),
                     _cell(a4.get("best")), _num(r.get("w4a16_auto_x_quack")),
                     _num(r.get("w4a16_best_x_quack")), _num(r.get("w4a16_best_x_bf16")),
                     _num(r.get("w4a4_over_w4a16_best")),
                     _num(best16.get("weight_TB/s"), ".2f")])
    return rows


HEADERS = ["N x K", "M", "torch BF16", "torch FP8", "QuACK W4A16", "W4A16 auto",
           "W4A16 best", "W4A4 auto", "W4A4 best", "xQuACK auto", "xQuACK best",
           "xBF16 best", "A4/A16 best", "W4A16 best wTB/s"]
SHORT = ["NxK", "M", "bf16", "fp8", "quack", "a16", "a16*", "a4", "a4*", "xQ", "xQ*", "xBF*",
         "a4/a16*", "wTB/s*"]


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), *(fmt.format(*r) for r in rows)])


def _checks(case_list: list[dict]) -> list[str]:
    """One line per output that failed its check (or could not run)."""
    lines = []
    for c in case_list:
        where = f"{c['N']}x{c['K']} M={c['M']}"
        rows = list(c["peers"].values())
        for fmt in ("w4a16", "w4a4"):
            rows += [c["cute"][fmt].get("auto") or {}, *c["cute"][fmt].get("candidates", [])]
        for r in rows:
            name = f"{r.get('provider', '?')} {r.get('schedule_name', '')}".strip()
            if r.get("check") == "FAIL":
                lines.append(f"- {where} {name}: FAIL, err/bound {r['err_over_bound']}, "
                             f"non-finite {r['nonfinite']}")
            elif r.get("status", "ok").startswith("error"):
                lines.append(f"- {where} {name}: {r['status']}")
    return lines


def render_md(res: dict) -> str:
    env, cfg = res["env"], res["config"]
    out = [f"# SM90 NVFP4 GEMM: cute_fp4 vs QuACK vs torch (issue 11), {env.get('date')}", ""]
    out += [f"- {k}: {env.get(k)}" for k in ("gpu", "driver", "torch", "cuda", "cute_dsl",
                                             "quack_kernels", "triton", "python",
                                             "git_commit", "cute_fp4_sources", "host")]
    out += ["", f"Method: {res['method']}.", "",
            f"FLOP = {res['formulas']['flop']}. Bytes moved per provider:", ""]
    out += [f"- {who}: {f}" for who, f in res["formulas"]["bytes"].items()]
    out += ["- weight bytes (wTB/s): " + ", ".join(
        f"{who} {f}" for who, f in res["formulas"]["weight_bytes"].items()), ""]
    out += ["Providers:", ""]
    out += [f"- `{name}`: {p['what']}" + (f" (**{p['status']}**)" if p["status"] else "")
            for name, p in res["providers"].items()]
    out += ["", f"Candidates: `{cfg['candidates']}` (+ {cfg['schedules'] or 'none'}); "
            "'best' = the fastest cute_fp4 schedule whose output passed the check. "
            "Cells: microseconds; `~` inexact by design (FP8), `!` failed the exact check, "
            "`skip` not run (time budget), `err` raised (see the checks).", "",
            "## Device time (us) and same-run ratios", "",
            md_table(HEADERS, table_rows(res["cases"])), "", "## Schedules", "",
            md_table(["N x K", "M", "W4A16 auto", "W4A16 best", "W4A4 auto", "W4A4 best"],
                     [[f"{c['N']}x{c['K']}", c["M"], _name(c["cute"]["w4a16"].get("auto")),
                       _name(c["cute"]["w4a16"].get("best")),
                       _name(c["cute"]["w4a4"].get("auto")),
                       _name(c["cute"]["w4a4"].get("best"))] for c in res["cases"]]),
            "", "## Issue 11's bars", "",
            "'auto' is what `schedule=\"auto\"` ran; 'best' the fastest validated "
            "schedule tried. Value: the same-run ratio (or TB/s) of the bar.", "",
            md_table(["bar", "variant", "met", "missed", "n/a", "worst case (value, x target)",
                      "not met (value)"],
                     [[s["bar"], s["variant"], s["met"], s["missed"], s["other"],
                       _worst(s["worst"]), _not_met(res["bars"], s)]
                      for s in res["bar_summary"]])]
    out += ["", "## Checks", ""] + (_checks(res["cases"]) or [
        "Every exact provider's output passed the exact reference's error rule."])
    out += ["", f"Run: {res['elapsed_s']} s, {len(res['skipped'])} measurements skipped by "
            f"the {cfg['budget_s']} s budget.", ""]
    return "\n".join(out)


def _not_met(bar_rows: list[dict], summary: dict) -> str:
    """The cases where one bar (of one variant) was not met, compactly."""
    bad = [b for b in bar_rows if b["bar"] == summary["bar"]
           and b["variant"] == summary["variant"] and b["verdict"] != "met"]
    return "; ".join(f"{b['N']}x{b['K']} M={b['M']}: "
                     + (_num(b["value"], ".3g") if b["verdict"] == "missed" else
                        b["verdict"].split(" ")[0]) for b in bad) or "-"


def _worst(w: dict | None) -> str:
    if not w:
        return "-"
    return f"{w['N']}x{w['K']} M={w['M']}: {_num(w['value'], '.3g')} ({w['by']}x)"


# ----------------------------------------------------------------------------- running

class Budget:
    """Wall-clock budget of the run: measurements after the deadline are skipped."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)


def _measure(provider, ops, timer, budget: Budget, skipped: list, label: str) -> dict:
    from cute_fp4.bench import measure

    m, n, k = ops.mnk
    if budget.left() <= 0:
        skipped.append(f"{n}x{k} M={m} {label}")
        return {"M": m, "N": n, "K": k, "provider": provider.name,
                "status": "skipped: time budget"}
    row = measure(provider, ops, timer)
    print(f"  {n}x{k} M={m} {label}: {_cell(row)} {row.get('check', row.get('status'))} "
          f"({budget.elapsed()} s)", file=sys.stderr, flush=True)
    return row


def _first_pass(n, k, m, timer, budget, skipped) -> dict:
    from cute_fp4.bench import PEERS, bench_operands, cute_fp4_provider

    ops = bench_operands(m, n, k)
    peers = {p.name: _measure(p, ops, timer, budget, skipped, p.name) for p in PEERS}
    cute = {label: {"auto": _measure(cute_fp4_provider("auto", fmt), ops, timer, budget,
                                     skipped, f"cute_fp4 {label} auto"), "candidates": []}
            for label, fmt in FORMATS}
    return {"N": n, "K": k, "M": m, "peers": peers, "cute": cute}


def _second_pass(case: dict, timer, budget, skipped, mode: str, extra) -> None:
    from cute_fp4.bench import bench_operands, cute_fp4_provider

    n, k, m = case["N"], case["K"], case["M"]
    ops = None
    for label, fmt in FORMATS:
        slot = case["cute"][label]
        auto_key = (slot["auto"] or {}).get("schedule_key")
        for s in candidates(m, n, k, fmt, mode, extra):
            if s.key() == auto_key:
                continue
            ops = ops or bench_operands(m, n, k)  # the same operands: same seed
            slot["candidates"].append(_measure(cute_fp4_provider(s, fmt), ops, timer,
                                               budget, skipped, f"cute_fp4 {label} {s.name}"))


def _finish(case: dict) -> dict:
    for label, _ in FORMATS:
        slot = case["cute"][label]
        slot["best"] = best_of([slot["auto"], *slot["candidates"]])
    case["ratios"] = ratios(case)
    return case


def _write(out: Path, res: dict) -> None:
    res["bars"] = bars(res["cases"])
    res["bar_summary"] = bar_summary(res["bars"])
    (out / "sm90_vs_quack.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "sm90_vs_quack.md").write_text(render_md(res))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the JSON and markdown")
    ap.add_argument("--quick", action="store_true", help="8192x8192, 4 M values, auto only")
    ap.add_argument("--candidates", choices=("none", "regime", "all"), default=None,
                    help="schedules tried beside auto (default: regime; --quick: none)")
    ap.add_argument("--schedules", nargs="*", default=[], metavar="NAME",
                    help="more catalogue schedules to try in every case")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="wall-clock budget; later measurements are skipped (default 330)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    ap.add_argument("--warm-l2", action="store_true", help="do not flush L2 between reps")
    args = ap.parse_args(argv)
    if args.candidates is None:
        args.candidates = "none" if args.quick else "regime"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    from cute_fp4.targets import detect_device

    dev = detect_device()
    if dev is None or dev.target is None or dev.target.family != "sm90":
        print(f"sm90_vs_quack: needs an SM90 GPU (H100/H200); found "
              f"{dev.name if dev else 'no CUDA GPU'}", file=sys.stderr)
        return 2
    from cute_fp4 import catalogue
    from cute_fp4.bench import FORMULAS, PEERS, Timer, environment, provider_status
    from cute_fp4.errors import InputError

    try:
        for name in args.schedules:
            catalogue.get(name)  # an unknown name fails now, with suggestions
    except InputError as e:
        print(f"sm90_vs_quack: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = provider_status()
    res = {"env": environment(), "formulas": FORMULAS,
           "method": METHOD.format(reps=args.reps, l2="left warm" if args.warm_l2 else
                                   "flushed by reading a 256 MiB buffer"),
           "providers": {p.name: {"what": p.what, "status": status[p.name]} for p in PEERS},
           "config": {"cases": cases(args.quick), "candidates": args.candidates,
                      "schedules": args.schedules, "reps": args.reps,
                      "budget_s": args.budget_s, "warm_l2": args.warm_l2},
           "cases": [], "skipped": [], "elapsed_s": 0.0}
    for name, why in status.items():
        print(f"{name}: {'available' if why is None else why}", file=sys.stderr)
    timer = Timer(args.reps, flush=not args.warm_l2)
    for n, k, m in cases(args.quick):
        res["cases"].append(_finish(_first_pass(n, k, m, timer, budget, res["skipped"])))
        res["elapsed_s"] = budget.elapsed()
        _write(out, res)
    for case in res["cases"]:
        if args.candidates != "none" or args.schedules:
            _second_pass(case, timer, budget, res["skipped"], args.candidates, args.schedules)
            _finish(case)
            res["elapsed_s"] = budget.elapsed()
            _write(out, res)
    res["elapsed_s"] = budget.elapsed()
    _write(out, res)
    print(text_table(SHORT, table_rows(res["cases"])))
    for s in res["bar_summary"]:
        print(f"{s['bar']} [{s['variant']}]: met {s['met']}, missed {s['missed']}, "
              f"n/a {s['other']}; worst {_worst(s['worst'])}")
    print(f"wrote {out / 'sm90_vs_quack.json'} and .md ({res['elapsed_s']} s, "
          f"{len(res['skipped'])} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
