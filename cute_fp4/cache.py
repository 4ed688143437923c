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
* Trust: the cache loads native code, so it loads only from where no one but the current
  user can write, as ssh and pip do. A cache directory, an entry or an entry's file
  (the object and ``meta.json`` with its SHA-256) that is not owned by the current user,
  or is writable by its group or by others, is refused: one warning, then every kernel
  is compiled in memory only (nothing loaded or stored there). Directories the cache
  makes are ``0o700``, the files of an entry it stores lose group and other write.

Environment: ``CUTE_FP4_CACHE_DIR`` (default ``~/.cache/cute_fp4/kernels``),
``CUTE_FP4_CACHE=0`` turns the disk cache off.

The **build cache** (:class:`BuildCache`, off unless ``CUTE_FP4_BUILD_CACHE`` names a
directory; the tests and CI set it to ``.cache/builds``) keeps what a cross-compile writes
(cubin, PTX), so compile-only work (``compile_report``, the tests, ``cute-fp4 compile``)
builds each kernel once. Its entries are :class:`DiskCache` entries (the files in one
archive), keyed by the kernel class, its schedule or spec, the problem, the compile options
(target) and :func:`kernel_fingerprint` (the sources of the kernel's module and of what it
imports, the DSL and CUDA tool wheels, Python), under a folder per fingerprint; the
outputs of ``cuobjdump`` on a cubin are kept beside them by content (:func:`tool_output`).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import tempfile
import warnings
import zipfile
import zlib
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

    object_name = OBJECT  # the one file of an entry that ``export`` writes

    def __init__(self, root: Path | None = None, fingerprint: str | None = None):
        self.root = Path(root) if root is not None else cache_dir()
        self.fingerprint = fingerprint or source_fingerprint()

    def get_or_build(self, key: str, build: Callable[[], object],
                     export: Callable[[object, Path], None],
                     load: Callable[[Path], object]) -> tuple[object, str]:
        """Returns (artefact, how) with ``how`` in {"loaded", "built", "built-uncached"}."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = untrusted(self.root)
            lock = None if why else open(self.root / f"{key}.lock", "a+")  # noqa: SIM115
        except OSError as e:
            _say_once("unwritable", f"cache directory {self.root} is not usable ({e}); "
                      "running uncached")
            return build(), "built-uncached"
        if lock is None:
            return self._distrusted(why, build)
        with lock, _locked(lock):
            why = self._untrusted_entry(key)
            if why:
                return self._distrusted(why, build)
            hit = self._load(key, load)
            if hit is not None:
                return hit, "loaded"
            art = build()
            self._store(key, art, export)
            return art, "built"

    def _distrusted(self, why: str, build: Callable[[], object]) -> tuple[object, str]:
        _say_once("untrusted", f"refusing {why}: others could replace the native code loaded "
                  f"from there; compiling in memory only (make it the current user's and "
                  f"writable by no one else, e.g. chmod go-w, or set CUTE_FP4_CACHE_DIR)")
        return build(), "built-uncached"

    def _untrusted_entry(self, key: str) -> str | None:
        """Why entry ``key`` (its folder and files) must not be used, None when it is
        absent or only the current user can write it."""
        entry = self.root / key
        try:
            if not entry.exists():
                return None
            return untrusted(entry) or next(
                filter(None, (untrusted(p) for p in sorted(entry.iterdir()))), None)
        except OSError as e:  # vanished or unreadable: _load discards and rebuilds it
            return None if not entry.exists() else f"entry {entry} ({e})"

    def _load(self, key: str, load: Callable[[Path], object]):
        entry = self.root / key
        if not entry.exists():
            return None
        problem = self._check(entry)
        if problem is None:
            try:
                return load(entry / self.object_name)
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
        obj = entry / self.object_name
        if not obj.is_file() or _sha256(obj) != meta.get("sha256"):
            return (f"{self.object_name} is missing, truncated or corrupted "
                    "(checksum mismatch)")
        return None

    def _store(self, key: str, art: object, export: Callable[[object, Path], None]) -> None:
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
            export(art, tmp)
            meta = {"fingerprint": self.fingerprint,
                    "sha256": _sha256(tmp / self.object_name)}
            (tmp / META).write_text(json.dumps(meta))
            for p in tmp.iterdir():  # only the owner writes (whatever the umask)
                os.chmod(p, p.stat().st_mode & ~0o022)
            final = self.root / key
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except Exception as e:  # a full disk, or an exporter that cannot export this kernel
            _say_once("store", f"could not store entry {key} in {self.root} "
                      f"({type(e).__name__}: {e}); it will be compiled again next time")
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def untrusted(path: Path) -> str | None:
    """Why ``path`` (followed if a link: a link to another user's folder is theirs) is not
    to be trusted: not owned by the current user, or writable by its group or others; None
    when only the owner can write it, or where there are no POSIX owners (Windows)."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    st = os.stat(path)
    uid = getuid()
    if st.st_uid != uid:
        return f"{path}: it is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others"))
                           if st.st_mode & bit)
        return f"{path}: it is writable by {who} (mode {st.st_mode & 0o777:o})"
    return None


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


# ----------------------------------------------------------------------------- build cache

BUILD_CACHE_ENV = "CUTE_FP4_BUILD_CACHE"  # a directory; unset, "" or "0": no build cache
KEEP_FINGERPRINTS = 32  # fingerprint folders kept at most (the most recently used) ...
KEEP_DAYS = 7  # ... and only those used within this many days
BUILD_STATS: collections.Counter = collections.Counter()  # this process's fetches by outcome
FACTS = "facts.json"  # in an entry's archive, beside files/<the products>


def build_cache_dir() -> Path | None:
    """The build cache's directory (``CUTE_FP4_BUILD_CACHE``), or None when it is off."""
    env = os.environ.get(BUILD_CACHE_ENV, "")
    return None if env.lower() in ("", "0", "false", "off") else Path(env)


@functools.cache
def kernel_sources(module: str | None = None) -> tuple[Path, ...]:
    """The package files generated code depends on: the kernel module ``module`` (dotted,
    e.g. ``cute_fp4.kernels.sm120``; None: every module of ``cute_fp4/kernels``) and every
    ``cute_fp4`` module it imports, transitively, at any depth of a function (read from
    the import statements, so a new import is followed without a list to update). The
    package facade (``cute_fp4/__init__.py``, lazy exports) decides no code: not followed."""
    root = Path(__file__).resolve().parent
    todo = (_module_files(root, module) if module is not None
            else sorted((root / "kernels").rglob("*.py")))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_bytes())):
            for name in _imported(node, path.relative_to(root)):
                todo += _module_files(root, name)
    return tuple(sorted(seen))


def _imported(node: ast.AST, rel: Path) -> list[str]:
    """Dotted names below ``cute_fp4`` that an import statement may load (a ``from X
    import y`` names both X and X.y: y may be a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "cute_fp4"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the file's package
        pkg = ["cute_fp4", *rel.parent.parts][:len(rel.parent.parts) + 2 - node.level]
        base = ".".join(pkg + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "cute_fp4":
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _module_files(root: Path, dotted: str) -> list[Path]:
    """The files importing ``dotted`` runs: every subpackage ``__init__`` on the way, and
    the module itself (absent names, e.g. a function of a module, give nothing)."""
    parts = dotted.split(".")[1:]
    out = []
    for i in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        out += [base / "__init__.py", base.with_suffix(".py")]
    return [p for p in out if p.is_file()]


@functools.cache
def toolchain() -> str:
    """Versions of the DSL, the CUDA tool wheels (ptxas, cuobjdump: ``nvidia-*``,
    ``cuda-*``) and Python: what besides the sources decides a cubin and its SASS text."""
    from importlib import metadata

    names = set()
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("nvidia-", "cuda-")):
            names.add(f"{name}={dist.version}")
    return ";".join(sorted(names)) + f";python={platform.python_version()}"


@functools.cache
def kernel_fingerprint(module: str | None = None) -> str:
    """SHA-256 over :func:`kernel_sources` of ``module`` (paths inside the package and
    contents) and :func:`toolchain`: the same in a checkout and in an installed wheel of it;
    an edit to one kernel module leaves the other kernels' fingerprints alone."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in kernel_sources(module):
        h.update(str(path.relative_to(root).as_posix()).encode() + b"\0")
        h.update(path.read_bytes())
    h.update(toolchain().encode())
    return h.hexdigest()


class BuildCache(DiskCache):
    """Cross-compile products by key: :meth:`fetch` puts the files a build wrote (cubin,
    PTX) into a directory, building them only on a miss. One folder per
    :func:`kernel_fingerprint` (of ``module``, the kernel's) under the root; a folder
    unused for :data:`KEEP_DAYS`, or beyond the :data:`KEEP_FINGERPRINTS` most recently
    used, is removed."""

    object_name = "products.zip"

    def __init__(self, root: Path | None = None, fingerprint: str | None = None,
                 module: str | None = None):
        fp = fingerprint or kernel_fingerprint(module)
        self.base = Path(root) if root is not None else build_cache_dir()
        if self.base is None:
            raise ValueError(f"no build cache: {BUILD_CACHE_ENV} is not set")
        super().__init__(self.base / fp[:16], fp)

    def fetch(self, key: str, dump_dir: str | Path, build: Callable[[Path], tuple[object, dict]]
              ) -> tuple[object | None, dict, str]:
        """Fill ``dump_dir`` with the products of ``key``; on a miss ``build(directory)``
        compiles into an empty directory first and returns (its result, facts: a JSON-ready
        dict kept with the files, e.g. what the kernel learnt while tracing). Returns (the
        result, or None when the products were loaded; the facts; "loaded", "built" or
        "built-uncached")."""
        dump_dir = Path(dump_dir)
        self._prune()

        def make():
            with tempfile.TemporaryDirectory(prefix="cute_fp4_build_") as d:
                result, facts = build(Path(d))
                return result, facts, {p.name: p.read_bytes() for p in Path(d).iterdir()
                                       if p.is_file()}

        def export(art, directory: Path) -> None:
            with zipfile.ZipFile(directory / self.object_name, "w", zipfile.ZIP_DEFLATED) as z:
                z.writestr(FACTS, json.dumps(art[1]))
                for name, data in sorted(art[2].items()):
                    z.writestr(f"files/{name}", data)

        def load(path: Path):
            with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as z:
                return (None, json.loads(z.read(FACTS)),
                        {n[len("files/"):]: z.read(n) for n in z.namelist()
                         if n.startswith("files/")})

        (result, facts, files), how = self.get_or_build(key, make, export, load)
        BUILD_STATS[how] += 1
        dump_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (dump_dir / name).write_bytes(data)
        return result, facts, how

    def _prune(self) -> None:
        """Remove the fingerprint folders not used lately (see the class docstring)."""
        import time

        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.utime(self.root)
            folders = sorted((p for p in self.base.iterdir()
                              if p.is_dir() and p.name != "tools"),
                             key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return  # get_or_build says so once, and runs uncached
        old = time.time() - KEEP_DAYS * 86400
        for i, folder in enumerate(folders):
            try:
                stale = i >= KEEP_FINGERPRINTS or folder.stat().st_mtime < old
            except OSError:
                continue
            if stale and folder != self.root:
                shutil.rmtree(folder, ignore_errors=True)


def build_cache(module: str | None = None) -> BuildCache | None:
    """The build cache ``CUTE_FP4_BUILD_CACHE`` names, for the kernels of ``module`` (None:
    fingerprinted by every kernel module), or None when it is off."""
    root = build_cache_dir()
    return None if root is None else BuildCache(root, module=module)


def tool_output(tool: str, args: tuple[str, ...], path: str | Path,
                run: Callable[[], str]) -> str:
    """``run()`` (a tool's text output on the file ``path``), kept in the build cache by the
    tool, its arguments and the file's content: the same cubin is disassembled once.
    Without a build cache, just ``run()``."""
    base = build_cache_dir()
    if base is None:
        return run()
    h = hashlib.sha256("\x1f".join((toolchain(), tool, *args)).encode())
    h.update(Path(path).read_bytes())
    memo = base / "tools" / f"{h.hexdigest()[:32]}.txt.gz"
    try:
        text = gzip.decompress(memo.read_bytes()).decode()
        os.utime(memo)  # used: kept another KEEP_DAYS
        return text
    except (OSError, EOFError, UnicodeDecodeError, zlib.error):  # absent or damaged: run it
        pass
    text = run()
    try:
        _prune_tools(memo.parent)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_bytes(gzip.compress(text.encode(), 6))
        os.replace(tmp, memo)
    except OSError:
        pass  # an unwritable cache: the text is still right
    return text


def _prune_tools(folder: Path) -> None:
    """Remove kept tool outputs unused for :data:`KEEP_DAYS` (they are keyed by content and
    never go stale, only old), at most once a day."""
    import time

    stamp = folder / ".pruned"
    try:
        if stamp.exists() and time.time() - stamp.stat().st_mtime < 86400:
            return
        for p in folder.glob("*.txt.gz"):
            if time.time() - p.stat().st_mtime > KEEP_DAYS * 86400:
                p.unlink(missing_ok=True)
        stamp.touch()
    except OSError:
        pass
