"""Build the cute_fp4 wheel once per state of the sources, and print its path.

    python scripts/build_wheel.py

The sources are the checkout's files as a clean clone would have them (tracked, and
untracked but not ignored: ``git ls-files -co --exclude-standard``; without git, the
package, the catalogue and the build files). They are copied to a temporary folder (so no
stale build/ folder leaks into the wheel), built with ``pip wheel --no-deps
--no-build-isolation`` and the wheel kept in ``.cache/wheel/<hash of the sources>/``: the
second caller of the same sources (CI's ``scripts/check_wheel.sh``, then
``tests/test_packaging.py``) gets the same file without building again. Older folders but
the newest :data:`KEEP` are removed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEEP = 3


def source_files(root: Path = ROOT) -> list[str]:
    """Relative paths of the files a clean clone of ``root`` has (sorted)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True).stdout.decode()
        names = [n for n in out.split("\0") if n and (root / n).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        names = [p.relative_to(root).as_posix() for d in ("cute_fp4", "schedules")
                 for p in (root / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        names += [n for n in ("pyproject.toml", "setup.py", "README.md") if (root / n).is_file()]
    return sorted(names)


def digest(root: Path, names: list[str]) -> str:
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build(root: Path = ROOT) -> Path:
    """The wheel of ``root``'s sources: built once, then found in ``.cache/wheel``."""
    names = source_files(root)
    cache = root / ".cache" / "wheel"
    folder = cache / digest(root, names)
    found = sorted(folder.glob("cute_fp4-*.whl")) if folder.is_dir() else []
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cute_fp4_wheel_") as tmp:
        src = Path(tmp) / "src"
        for name in names:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, src / name)
        dist = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(dist), str(src)], check=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
        for whl in dist.glob("cute_fp4-*.whl"):
            shutil.move(whl, staged / whl.name)
        try:
            os.replace(staged, folder)
        except OSError:  # another process stored the same sources meanwhile
            shutil.rmtree(staged, ignore_errors=True)
    _prune(cache, folder)
    return sorted(folder.glob("cute_fp4-*.whl"))[-1]


def _prune(cache: Path, keep: Path) -> None:
    old = sorted((p for p in cache.iterdir() if p.is_dir() and p != keep
                  and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
    for p in old[:max(0, len(old) - (KEEP - 1))]:
        shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    print(build())
