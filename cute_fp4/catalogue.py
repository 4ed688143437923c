"""The schedule catalogue: one file per idea under ``schedules/``.

Each file defines ``SCHEDULE = Schedule(...)`` and opens with a docstring saying what it
changes and why; the file name is the schedule's name. A schedule says nothing of the
operands; a file whose schedule is meant for other formats than NVFP4 also defines
``PROBLEM = Problem(a_format=..., b_format=...)`` (sizes left open): what ``plan()``,
``compile_report()`` and the CLI take for it when no problem, or bare ``(m, n, k)``, is
given.

Extra directories can be added with the ``CUTE_FP4_SCHEDULES`` environment variable
(``os.pathsep``-separated); a schedule of an extra directory replaces a built-in one of the
same name, and says so once (a :class:`CatalogueWarning` naming both files). An entry that
is not a directory (missing, or a file) is warned about once and ignored.

Where the built-in files live: in a source checkout (editable install or ``PYTHONPATH``)
they are the top-level ``schedules/`` folder next to the package; a wheel or a non-editable
install maps that folder into the package as ``cute_fp4/schedules`` (see pyproject.toml).

A file that fails to load (a typo, a missing ``SCHEDULE``) is reported once, as a
:class:`CatalogueWarning` naming its path, and left out; the rest of the catalogue works.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
import warnings
from pathlib import Path
from typing import NamedTuple

from cute_fp4.errors import CuteFp4Warning, InputError, InputTypeError
from cute_fp4.schedule import Problem, Schedule

PACKAGE_DIR = Path(__file__).resolve().parent


class CatalogueWarning(CuteFp4Warning):
    """A schedule file could not be loaded, a ``CUTE_FP4_SCHEDULES`` entry is not a
    directory, or a user's schedule replaces a built-in one (the message names the files)."""


class LoadError(NamedTuple):
    path: Path
    error: str  # "ExceptionType: message"


def builtin_dir(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The built-in catalogue folder: ``<package>/schedules`` in an installed wheel, else
    ``<package>/../schedules`` in a source checkout (recognised by its pyproject.toml, so
    an unrelated ``site-packages/schedules`` is never taken); None when neither exists."""
    installed, checkout = package_dir / "schedules", package_dir.parent / "schedules"
    if installed.is_dir():
        return installed
    if checkout.is_dir() and (package_dir.parent / "pyproject.toml").is_file():
        return checkout
    return None


def directories() -> list[Path]:
    """The catalogue folders in load order (built-in first, then ``CUTE_FP4_SCHEDULES``;
    an entry that is not a directory is warned about once and left out)."""
    extra = [Path(p) for p in os.environ.get("CUTE_FP4_SCHEDULES", "").split(os.pathsep) if p]
    for d in extra:
        if not d.is_dir():
            _warn_not_a_directory(str(d))
    return [d for d in [builtin_dir(), *extra] if d is not None and d.is_dir()]


@functools.cache
def _warn_not_a_directory(entry: str) -> None:
    p = Path(entry)
    what = ("is a file" + ("; name the folder that holds it" if p.suffix == ".py" else "")
            if p.is_file() else "does not exist")
    warnings.warn(f"CUTE_FP4_SCHEDULES entry {entry!r} {what}: ignored (it takes folders of "
                  f"schedule files, separated by {os.pathsep!r})", CatalogueWarning,
                  stacklevel=4)


def _load_file(path: Path) -> tuple[Schedule, Problem | None]:
    spec = importlib.util.spec_from_file_location(f"cute_fp4_schedules.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sched = getattr(mod, "SCHEDULE", None)
    if not isinstance(sched, Schedule):
        raise InputError(f"{path} must define SCHEDULE = Schedule(...)")
    problem = getattr(mod, "PROBLEM", None)
    if problem is not None and not isinstance(problem, Problem):
        raise InputError(f"{path}: PROBLEM must be a Problem (the operand formats), got "
                         f"{type(problem).__name__}")
    if problem is not None and (problem.m or problem.n or problem.k):
        raise InputError(f"{path}: PROBLEM names the operand formats only; leave its sizes "
                         f"open, got m={problem.m}, n={problem.n}, k={problem.k}")
    doc = (mod.__doc__ or "").strip()
    sched = dataclasses.replace(sched, name=sched.name or path.stem, doc=sched.doc or doc)
    return sched, problem


class _Loaded(NamedTuple):
    table: dict[str, Schedule]
    errors: tuple[LoadError, ...]
    problems: dict[str, Problem]  # the files' PROBLEM: operand formats other than NVFP4


@functools.cache
def _load_all(dirs: tuple[Path, ...]) -> _Loaded:
    table: dict[str, Schedule] = {}
    problems: dict[str, Problem] = {}
    origin: dict[str, Path] = {}
    errors: list[LoadError] = []
    for d in dirs:
        for path in sorted(d.glob("*.py")):
            if path.name.startswith("_"):
                continue
            try:
                s, problem = _load_file(path)
            except Exception as e:  # any error in a user's file: report it, keep the rest
                err = LoadError(path, f"{type(e).__name__}: {e}")
                errors.append(err)
                warnings.warn(f"schedule file {path} was skipped: {err.error}",
                              CatalogueWarning, stacklevel=4)
                continue
            if s.name in origin and origin[s.name] != path:
                warnings.warn(f"schedule {s.name!r} from {path} replaces the one from "
                              f"{origin[s.name]} (a CUTE_FP4_SCHEDULES folder overrides "
                              "the catalogue; rename the file to keep both)",
                              CatalogueWarning, stacklevel=4)
            table[s.name], origin[s.name] = s, path
            problems.pop(s.name, None)
            if problem is not None:
                problems[s.name] = problem
    return _Loaded(table, tuple(errors), problems)


def _loaded() -> _Loaded:
    return _load_all(tuple(directories()))


def load_errors() -> tuple[LoadError, ...]:
    """The schedule files that failed to load (each was warned about once)."""
    return _loaded().errors


def all_schedules(family: str | None = None, grouped: bool | None = None) -> list[Schedule]:
    """Every catalogue schedule, optionally of one family (``"sm120"`` or ``"sm90"``) and
    only the dense (``grouped=False``) or only the grouped (MoE, ``True``) ones."""
    scheds = _loaded().table.values()
    return [s for s in scheds if (family is None or s.arch.family == family)
            and (grouped is None or s.scheduler.grouped is grouped)]


def get(name: str) -> Schedule:
    """The catalogue schedule ``name``; an unknown name is an InputError suggesting the
    closest names (or saying that its file failed to load, and why)."""
    if not isinstance(name, str):
        raise InputTypeError(f"catalogue.get() takes a schedule name (str), got "
                             f"{type(name).__name__} {name!r}")
    loaded = _loaded()
    if name in loaded.table:
        return loaded.table[name]
    broken = [e for e in loaded.errors if e.path.stem == name]
    if broken:
        raise InputError(f"schedule {name!r} did not load: {broken[0].path}: "
                         f"{broken[0].error}")
    known = sorted(loaded.table)
    if not known:
        raise InputError(f"no schedule named {name!r}: the catalogue is empty (no schedule "
                         "files found; is the package installed with its schedules/?)")
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        quoted = [repr(c) for c in close]
        alts = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        raise InputError(f"no schedule named {name!r}; did you mean {alts}? "
                         f"({len(known)} schedules: catalogue.names() lists them)")
    raise InputError(f"no schedule named {name!r}; known: {', '.join(known)}")


def names() -> list[str]:
    return sorted(_loaded().table)


def resolve(schedule: Schedule | str,
            problem: Problem | tuple | None = None) -> tuple[Schedule, Problem | None]:
    """What ``plan()`` and ``compile_report()`` accept, as a Schedule and a Problem:
    a schedule or a catalogue name; a Problem, ``None`` or an ``(m, n, k[, a_format])``
    tuple. ``None`` and a bare ``(m, n, k)`` take the operand formats of the schedule's
    file (:func:`formats_of`; NVFP4 where it names none)."""
    if isinstance(schedule, str):
        schedule = get(schedule)
    elif not isinstance(schedule, Schedule):
        raise InputTypeError(f"a schedule must be a Schedule or a catalogue name, got "
                             f"{type(schedule).__name__}")
    given = Problem.of(problem)
    bare = problem is None or isinstance(problem, (tuple, list)) and len(problem) == 3
    meant = formats_of(schedule) if bare else None  # a Problem or formats given: as given
    if meant is None:
        return schedule, given
    if given is None:
        return schedule, meant
    return schedule, dataclasses.replace(given, a_format=meant.a_format,
                                         b_format=meant.b_format)


def formats_of(schedule: Schedule) -> Problem | None:
    """The operand formats a catalogue schedule's file names (``PROBLEM``), for the
    schedule or a variant of it (``name+field=value``); None: NVFP4, the default."""
    return _loaded().problems.get((schedule.name or "").split("+")[0])
