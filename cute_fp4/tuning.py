"""The tuning store: which schedule won for a GPU, an A format and a shape bucket.

``cute_fp4.tune.tune`` writes it, ``schedule="auto"`` reads it (before the heuristic).

* File: ``$CUTE_FP4_TUNING`` or ``~/.cache/cute_fp4/tuning.json``; JSON, written
  atomically (temporary file + rename); a missing or corrupt file reads as empty.
* Key: ``"<GPU name>|<A format>|<M bucket>x<N>x<K>"``. M is bucketed by powers of two: a
  tuning at M serves every M' in the bucket ``(B/2, B]`` with ``B`` the smallest power of
  two >= M. A tuned M = 16 serves M = 9..16, M = 1 serves only 1, M = 1000 (bucket 1024)
  serves 513..1024. N and K match exactly.
* Entry: the schedule's catalogue name, its ``schedule.key()`` (every code-generating
  field, with the output dtype set to BF16 as it was tuned) and the package source
  fingerprint (``cute_fp4.cache.source_fingerprint``, the one the compile cache uses).
  An entry whose fingerprint differs from the running package's (the sources, the DSL or
  Python changed since the tuning) or whose catalogue schedule no longer has that key is
  stale: it is ignored (the heuristic decides) and that is said once per process.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

from cute_fp4.schedule import OutDtype, Schedule


class TuningWarning(UserWarning):
    """The tuning store has stale entries that are being ignored (said once)."""


_SAID: set[str] = set()
_STORE: dict = {}  # path -> (mtime_ns, parsed store): gemm("auto") must not parse per call
_FOUND: dict = {}  # path -> (mtime_ns, {(key, fingerprint): Schedule | None}): answers


def _say_once(kind: str, message: str) -> None:
    if kind not in _SAID:
        _SAID.add(kind)
        warnings.warn(f"cute_fp4 tuning: {message}", TuningWarning, stacklevel=3)


def store_path() -> Path:
    env = os.environ.get("CUTE_FP4_TUNING")
    return Path(env) if env else Path.home() / ".cache" / "cute_fp4" / "tuning.json"


def m_bucket(m: int) -> int:
    """The power-of-two bucket of M: the smallest power of two >= M (9..16 -> 16)."""
    if m < 1:
        raise ValueError(f"M must be >= 1, got {m}")
    return 1 << (m - 1).bit_length()


def bucket_range(m: int) -> tuple[int, int]:
    """The M values a tuning at ``m`` serves: ``(B/2 + 1, B)`` with B = m_bucket(m)."""
    b = m_bucket(m)
    return b // 2 + 1, b


def store_key(device_name: str, m: int, n: int, k: int, a_format: str) -> str:
    return f"{device_name}|{a_format}|{m_bucket(m)}x{n}x{k}"


def schedule_key(s: Schedule) -> str:
    """``s.key()`` with the output dtype at BF16 (tuning times BF16 outputs; ``gemm``
    changes the output dtype of what it finds to the one asked for)."""
    return (s if s.epilogue.out_dtype is OutDtype.BF16 else s.replace(out_dtype="bf16")).key()


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def load_store() -> dict:
    """The tuning store, parsed again only when the file changed (it is read on every
    ``schedule="auto"`` call). Returns a copy; a missing or corrupt file reads as empty."""
    path = store_path()
    mtime = _mtime(path)
    if mtime is None:
        return {}
    hit = _STORE.get(path)
    if hit is None or hit[0] != mtime:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        hit = _STORE[path] = (mtime, data if isinstance(data, dict) else {})
    return dict(hit[1])


def save_entry(device_name: str, m: int, n: int, k: int, a_format: str, schedule: Schedule,
               **extra) -> str:
    """Store ``schedule`` as the winner for the bucket of ``m``; returns the store key.
    ``extra`` (e.g. the tuned M and its time) is kept in the entry for people to read."""
    from cute_fp4.cache import source_fingerprint

    if not schedule.name:
        raise ValueError("only named (catalogue) schedules can be stored")
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_store()
    key = store_key(device_name, m, n, k, a_format)
    data[key] = {"schedule": schedule.name, "key": schedule_key(schedule),
                 "fingerprint": source_fingerprint(), **extra}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic
    return key


def lookup(device, m: int, n: int, k: int, a_format: str) -> Schedule | None:
    """The tuned schedule for this device (its ``name``) and the bucket of ``m``, if one
    was stored by this package version and its catalogue schedule is unchanged."""
    from cute_fp4.cache import source_fingerprint

    path, key = store_path(), store_key(device.name, m, n, k, a_format)
    mtime = _mtime(path)
    seen = _FOUND.get(path)
    if seen is None or seen[0] != mtime:  # the file changed: forget the old answers
        seen = _FOUND[path] = (mtime, {})
    memo = (key, source_fingerprint())
    if memo not in seen[1]:
        seen[1][memo] = _find(load_store().get(key), key)
    return seen[1][memo]


def _find(entry, key: str) -> Schedule | None:
    from cute_fp4 import catalogue
    from cute_fp4.cache import source_fingerprint
    from cute_fp4.errors import InputError

    if not isinstance(entry, dict) or "schedule" not in entry:
        return None  # absent, or written by an older version (a bare name)
    if entry.get("fingerprint") != source_fingerprint():
        _say_once("stale", f"ignoring entries of {store_path()} tuned with other package "
                  f"sources, DSL or Python (first: {key}); run 'cute-fp4 tune' again")
        return None
    try:
        s = catalogue.get(entry["schedule"])
    except InputError:
        s = None
    if s is None or schedule_key(s) != entry.get("key"):
        _say_once("changed", f"ignoring {key}: catalogue schedule {entry['schedule']!r} is "
                  "gone or changed since it was tuned")
        return None
    return s
