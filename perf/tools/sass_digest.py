"""A digest of every catalogue schedule's SASS, to show that a host-side change left the
kernels as they were: run it on two commits and compare the JSON (``--compare A B``).

For each catalogue schedule and each target it names (``--targets``; default the
schedule's own), the schedule is cross-compiled (``cute_fp4.compile_report`` with a dump
directory, no GPU) and its SASS normalised: the kernel's mangled name (which follows the
Python class and module names), comments, addresses and blank lines are dropped, so two
builds digest alike exactly when their instruction streams are the same. The JSON holds
``{"<name>@<target>": {"sha256": ..., "instructions": n, "registers": r, "spills": s}}``.

    python perf/tools/sass_digest.py --out before.json          # on the old commit
    python perf/tools/sass_digest.py --out after.json           # on the new one
    python perf/tools/sass_digest.py --compare before.json after.json

Run it with ``CUTE_FP4_CACHE_DIR`` pointing at a directory of its own per commit: the
build cache is keyed on the package's sources, so a shared one is safe but fills up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")
_COMMENT = re.compile(r"/\*.*?\*/")
_NAME_LINE = re.compile(r"(Function|\.text\.|\.section|\.global|\.type|\.size)")


def normalise(sass: str) -> list[str]:
    """The SASS's instructions, one a line, without addresses, encodings or names."""
    out = []
    for line in sass.splitlines():
        if _NAME_LINE.search(line) or line.strip().startswith("//"):
            continue
        line = _COMMENT.sub("", _ADDR.sub("", line)).strip().rstrip(";").strip()
        if line and not line.startswith(".") and not line.endswith(":"):
            out.append(" ".join(line.split()))
    return out


def digest(targets: list[str] | None, names: list[str] | None = None) -> dict:
    from cute_fp4 import catalogue
    from cute_fp4.compile import compile_report

    rows = {}
    for s in catalogue.all_schedules():
        if names and s.name not in names:
            continue
        for target in targets or [s.target]:
            with tempfile.TemporaryDirectory() as d:
                rep = compile_report(s.name, target, dump_dir=d)
                key = f"{s.name}@{target}"
                if not rep.get("ok"):
                    rows[key] = {"ok": False, "reason": rep.get("reason", "")[:200]}
                    continue
                sass = next(Path(d).glob("*.sass")).read_text()
                lines = normalise(sass)
                rows[key] = {"sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
                             "instructions": len(lines), "registers": rep["registers"],
                             "spills": rep["spills"]}
            print(key, rows[key].get("sha256", rows[key].get("reason"))[:16], flush=True)
    return rows


def compare(a: dict, b: dict) -> int:
    """Prints every schedule whose SASS differs or that only one side has; 1 if any differ."""
    same, differ = 0, []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"only in {'after' if key not in a else 'before'}: {key}")
            continue
        if a[key].get("sha256") == b[key].get("sha256"):
            same += 1
        else:
            differ.append(key)
            print(f"DIFFERS {key}: {a[key].get('instructions')} -> "
                  f"{b[key].get('instructions')} instructions, registers "
                  f"{a[key].get('registers')} -> {b[key].get('registers')}")
    print(f"{same} identical, {len(differ)} differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the digests as JSON here")
    p.add_argument("--targets", nargs="*", help="targets to compile for (default: each "
                   "schedule's own)")
    p.add_argument("--names", nargs="*", help="only these catalogue schedules")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(f.read_text()) for f in args.compare))
    rows = digest(args.targets, args.names)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
