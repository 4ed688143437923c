"""The schedule catalogue: one file per idea under ``schedules/``.

Each file defines ``SCHEDULE = Schedule(...)`` and opens with a docstring saying what it
changes and why; the file name is the schedule's name. Extra directories can be added with
the ``CUTE_FP4_SCHEDULES`` environment variable (``os.pathsep``-separated).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path

from cute_fp4.errors import InputError
from cute_fp4.schedule import Schedule

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "schedules"


def directories() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("CUTE_FP4_SCHEDULES", "").split(os.pathsep) if p]
    return [d for d in [BUILTIN_DIR, *extra] if d.is_dir()]


def _load_file(path: Path) -> Schedule:
    spec = importlib.util.spec_from_file_location(f"cute_fp4_schedules.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sched = getattr(mod, "SCHEDULE", None)
    if not isinstance(sched, Schedule):
        raise InputError(f"{path} must define SCHEDULE = Schedule(...)")
    doc = (mod.__doc__ or "").strip()
    return dataclasses.replace(sched, name=sched.name or path.stem, doc=sched.doc or doc)


@functools.cache
def _load_all(dirs: tuple[Path, ...]) -> dict[str, Schedule]:
    out: dict[str, Schedule] = {}
    for d in dirs:
        for path in sorted(d.glob("*.py")):
            if path.name.startswith("_"):
                continue
            s = _load_file(path)
            out[s.name] = s
    return out


def all_schedules(family: str | None = None) -> list[Schedule]:
    """Every catalogue schedule (optionally of one family: ``"sm120"`` or ``"sm90"``)."""
    scheds = _load_all(tuple(directories())).values()
    return [s for s in scheds if family is None or s.arch.family == family]


def get(name: str) -> Schedule:
    table = _load_all(tuple(directories()))
    if name not in table:
        raise InputError(f"no schedule named {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def names() -> list[str]:
    return sorted(_load_all(tuple(directories())))
