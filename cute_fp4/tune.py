"""Tuning: time the candidate schedules of a shape, validate the winner, remember it.

Candidates are the catalogue schedules of the device's family that ``plan()`` accepts for
the problem. Winners are stored in a JSON file (``$CUTE_FP4_TUNING`` or
``~/.cache/cute_fp4/tuning.json``) keyed by GPU name, A format and M, N, K;
``schedule="auto"`` consults it before falling back to the heuristic.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from cute_fp4.schedule import Problem, Schedule


def store_path() -> Path:
    env = os.environ.get("CUTE_FP4_TUNING")
    return Path(env) if env else Path.home() / ".cache" / "cute_fp4" / "tuning.json"


def _key(device_name: str, m: int, n: int, k: int, a_format: str) -> str:
    return f"{device_name}|{a_format}|{m}x{n}x{k}"


_STORE: dict = {}  # path -> (mtime_ns, parsed store): gemm("auto") must not parse per call


def load_store() -> dict:
    """The tuning store, parsed again only when the file changed (it is read on every
    ``schedule="auto"`` call). Returns a copy; a missing or corrupt file reads as empty."""
    path = store_path()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    hit = _STORE.get(path)
    if hit is None or hit[0] != mtime:
        try:
            hit = _STORE[path] = (mtime, json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}
    return dict(hit[1])


def save_entry(key: str, name: str) -> None:
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_store()
    data[key] = name
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic


def lookup(device, m: int, n: int, k: int, a_format: str) -> Schedule | None:
    """The tuned schedule for this device and shape, if one was stored and still exists."""
    from cute_fp4 import catalogue
    from cute_fp4.errors import InputError

    name = load_store().get(_key(device.name, m, n, k, a_format))
    if name is None:
        return None
    try:
        return catalogue.get(name)
    except InputError:
        return None


def candidates(family: str, problem: Problem, out_dtype: str = "bf16") -> list[Schedule]:
    """Catalogue schedules of ``family`` that plan() accepts for ``problem``, all writing
    ``out_dtype`` (schedules that differ only in their output dtype collapse into one)."""
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan

    out = {}
    for s in catalogue.all_schedules(family):
        s = s.replace(out_dtype=out_dtype)
        if s not in out and plan(s, problem).ok:
            out[s] = s
    return list(out)


def tune(shapes=None, formats=("nvfp4",), reps: int = 10) -> list[dict]:
    """Time every candidate per shape; store the fastest one that validates."""
    import torch

    from cute_fp4.api import make_operands, poisoned_check, run_compiled
    from cute_fp4.bench import Timer, default_shapes
    from cute_fp4.compile import Signature, compile
    from cute_fp4.targets import require_device

    dev = require_device()
    timer = Timer(reps)
    rows = []
    for m, n, k in shapes or default_shapes():
        for fmt in formats:
            a, b = make_operands(m, n, k, fmt, dist="normal")
            timed = []
            for s in candidates(dev.target.family, Problem(m, n, k, fmt)):
                print(f"tune {m}x{n}x{k} {fmt} {s.name}", file=sys.stderr)
                kern = compile(s, Signature(fmt))
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                timed.append((timer(lambda: run_compiled(kern, a, b, out=out)), s, kern))  # noqa: B023
            for us, s, kern in sorted(timed, key=lambda t: t[0]):
                if poisoned_check(kern, a, b).passed:
                    save_entry(_key(dev.name, m, n, k, fmt), s.name)
                    rows.append({"M": m, "N": n, "K": k, "A": fmt, "best": s.name,
                                 "us": round(us, 2), "candidates": len(timed),
                                 "validated": "yes"})
                    break
            else:
                rows.append({"M": m, "N": n, "K": k, "A": fmt, "best": "-", "us": "-",
                             "candidates": len(timed), "validated": "NO"})
    return rows
