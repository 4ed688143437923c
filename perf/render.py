"""Render a GPU session's JSON files (from perf/gpu_session.py) as a markdown report.

    python perf/render.py DIR > perf/results/2026-11-29-h200.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_fp4.bench import __doc__ as FORMULAS  # noqa: E402


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    return tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols,
                    tablefmt="github", floatfmt=".4g", intfmt=",")


def _section(title: str, res: dict | None, body) -> list[str]:
    if res is None:
        return []
    out = [f"## {title}", ""]
    if "error" in res:
        return out + [f"ERROR: `{res['error']}`", "", "```", res.get("trace", ""), "```", ""]
    return out + body(res) + [f"(section took {res.get('section_s', '?')} s)", ""]


def render(d: Path) -> str:
    env = _load(d, "env") or {}
    lines = [f"# GPU session {env.get('date', '?')}: {env.get('gpu', '?')}", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k != "section_s"] + [""]
    lines += _section("Validation against the exact reference", _load(d, "validate"),
                      lambda r: [f"M in {r['M']}, N in {r['N']}, K in {r['K']}; outputs "
                                 f"poisoned with NaN before each run. Failures: "
                                 f"{r['failures']}.", "", _table(r["rows"]), "",
                                 f"Error rule (docs/correctness.md): `{r['rule']}`", ""])
    lines += _section("Fuzzing", _load(d, "fuzz"),
                      lambda r: [f"{r['count']} random (schedule, A format, M, N, K, "
                                 f"distribution) cases, seed {r['seed']}: "
                                 f"{r['mismatches']} mismatches.", "",
                                 *[f"- {c}" for c in r["failures"]], ""])
    lines += _section("Determinism", _load(d, "determinism"),
                      lambda r: [_table(r["rows"]), ""])
    lines += _section("Compile cache: cold vs warm process", _load(d, "cache"),
                      lambda r: [f"schedule {r['schedule']}; child prints: source, seconds "
                                 "to a ready kernel, compile-or-load seconds", "",
                                 _table([{"run": k, **v} for k, v in r.items()
                                         if isinstance(v, dict)]), ""])
    lines += _section("Cost of the per-call checks", _load(d, "checks"),
                      lambda r: ["Host microseconds per call (M = 16, N = K = 8192), and the "
                                 "device time of the same call under a CUDA graph.", "",
                                 _table(r["rows"]), ""])
    lines += _section("Performance", _load(d, "bench"),
                      lambda r: ["```", FORMULAS.strip(), "```", "", _table(r["rows"]), ""])
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(Path(sys.argv[1])))
