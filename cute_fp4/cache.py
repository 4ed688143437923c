"""The on-disk compile cache: compiled kernels survive the process.

An entry is a directory ``<cache>/<key>/`` with the exported object file (host launcher and
cubin, from the DSL's ``export_to_c``) and ``meta.json`` (the fingerprint and the file's
SHA-256). The key hashes the kernel class, the schedule, the operand signature and a
fingerprint of everything that changes generated code: this package's sources, the CuTe DSL
version, the Python version and the target.

* Writes are atomic: an entry is built in a temporary directory and renamed into place.
* One process compiles a given key at a time (an ``flock`` on ``<key>.lock``); a second
  process waits, then loads what the first stored.
* A truncated, corrupted or stale entry is discarded and rebuilt; an unwritable cache
  directory means running uncached. Each of these is said once per process (a warning).

Environment: ``CUTE_FP4_CACHE_DIR`` (default ``~/.cache/cute_fp4/kernels``),
``CUTE_FP4_CACHE=0`` turns the disk cache off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

OBJECT = "kernel.o"
META = "meta.json"
_SAID: set[str] = set()


class CacheWarning(UserWarning):
    """The disk cache recovered from a problem (said once per kind of problem)."""


def _say_once(kind: str, message: str) -> None:
    if kind not in _SAID:
        _SAID.add(kind)
        warnings.warn(f"cute_fp4 cache: {message}", CacheWarning, stacklevel=3)


def enabled() -> bool:
    return os.environ.get("CUTE_FP4_CACHE", "1") not in ("0", "false", "off", "")


def cache_dir() -> Path:
    env = os.environ.get("CUTE_FP4_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "cute_fp4" / "kernels"


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 over this package's Python sources, the DSL version and the Python version."""
    from importlib import metadata

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        import cutlass

        dsl = getattr(cutlass, "__version__", "unknown")
    h.update(f"dsl={dsl} python={platform.python_version()}".encode())
    return h.hexdigest()


def entry_key(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class DiskCache:
    """get-or-build of compiled artefacts; ``export``/``load`` adapt it to the DSL."""

    def __init__(self, root: Path | None = None, fingerprint: str | None = None):
        self.root = Path(root) if root is not None else cache_dir()
        self.fingerprint = fingerprint or source_fingerprint()

    def get_or_build(self, key: str, build: Callable[[], object],
                     export: Callable[[object, Path], None],
                     load: Callable[[Path], object]) -> tuple[object, str]:
        """Returns (artefact, how) with ``how`` in {"loaded", "built", "built-uncached"}."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / f"{key}.lock", "a+")  # noqa: SIM115
        except OSError as e:
            _say_once("unwritable", f"cache directory {self.root} is not usable ({e}); "
                      "running uncached")
            return build(), "built-uncached"
        with lock, _locked(lock):
            hit = self._load(key, load)
            if hit is not None:
                return hit, "loaded"
            art = build()
            self._store(key, art, export)
            return art, "built"

    def _load(self, key: str, load: Callable[[Path], object]):
        entry = self.root / key
        if not entry.exists():
            return None
        problem = self._check(entry)
        if problem is None:
            try:
                return load(entry / OBJECT)
            except Exception as e:  # a damaged object file the checksum did not catch
                problem = f"it failed to load ({type(e).__name__}: {e})"
        _say_once("discarded", f"discarded entry {entry.name}: {problem}; rebuilding")
        shutil.rmtree(entry, ignore_errors=True)
        return None

    def _check(self, entry: Path) -> str | None:
        try:
            meta = json.loads((entry / META).read_text())
        except (OSError, ValueError) as e:
            return f"unreadable {META} ({type(e).__name__})"
        if meta.get("fingerprint") != self.fingerprint:
            return "stale (package sources, DSL or Python changed)"
        obj = entry / OBJECT
        if not obj.is_file() or _sha256(obj) != meta.get("sha256"):
            return f"{OBJECT} is missing, truncated or corrupted (checksum mismatch)"
        return None

    def _store(self, key: str, art: object, export: Callable[[object, Path], None]) -> None:
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
            export(art, tmp)
            meta = {"fingerprint": self.fingerprint, "sha256": _sha256(tmp / OBJECT)}
            (tmp / META).write_text(json.dumps(meta))
            final = self.root / key
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except Exception as e:  # a full disk, or an exporter that cannot export this kernel
            _say_once("store", f"could not store entry {key} in {self.root} "
                      f"({type(e).__name__}: {e}); it will be compiled again next time")
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(f):
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
