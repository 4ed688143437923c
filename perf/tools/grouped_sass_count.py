"""SASS of every grouped catalogue kernel, counted (no GPU: cross-compiled): instructions in
total and by kind, registers, spills and the K loop's measures, as JSON on stdout.

Run once per version of the package to compare them, e.g. the committed tree against an
older one unpacked elsewhere::

    python3 perf/tools/grouped_sass_count.py > new.json
    PYTHONPATH=/tmp/old python3 perf/tools/grouped_sass_count.py > old.json

(the second imports ``cute_fp4`` from ``/tmp/old``; this file itself imports nothing of
the package before that).
"""

from __future__ import annotations

import collections
import json
import re
import sys
import tempfile
from pathlib import Path

_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_]+)")
# opcode -> kind, by prefix (the first match wins)
KINDS = (("IMAD", "int"), ("IADD", "int"), ("VIMNMX", "int"), ("IMNMX", "int"),
         ("ISETP", "int"), ("LOP", "int"), ("SHF", "int"), ("LEA", "int"), ("SEL", "int"),
         ("SHFL", "warp"), ("REDUX", "warp"), ("VOTE", "warp"), ("BRA", "branch"),
         ("LDG", "global"), ("STG", "global"), ("HGMMA", "mma"), ("OMMA", "mma"))


def kind(op: str) -> str:
    return next((k for p, k in KINDS if op.startswith(p)), "other")


def count(name: str) -> dict:
    import cute_fp4
    from cute_fp4 import catalogue
    from cute_fp4.compile import cross_compile
    from cute_fp4.inspect import cubin_sass, inspect_cubin
    from cute_fp4.plan import plan

    s = catalogue.get(name)
    problem = plan(s).problem
    with tempfile.TemporaryDirectory() as d:
        cross_compile(s, problem, dump_dir=d)
        cubin = sorted(Path(d).glob("*.cubin"))[-1]
        sass = cubin_sass(cubin)
        rep = inspect_cubin(cubin, (s.arch.sass_mma_prefix,), sass)
    ops = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    kinds = collections.Counter()
    for op, n in ops.items():
        kinds[kind(op)] += n
    return {"schedule": name, "target": s.target, "a_format": problem.a_format,
            "package": str(Path(cute_fp4.__file__).parent), "instructions": sum(ops.values()),
            "by_kind": dict(sorted(kinds.items())), "registers": rep.registers,
            "spills": rep.spills,
            "kloop_instructions": rep.kloop.instructions if rep.kloop else None}


def main() -> int:
    from cute_fp4 import catalogue

    names = sys.argv[1:] or sorted(s.name for s in catalogue.all_schedules(grouped=True))
    print(json.dumps([count(n) for n in names], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
