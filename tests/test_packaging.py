"""The package as built and installed (not the checkout): the wheel carries every module and
the catalogue, and an installed copy finds its schedules. scripts/check_wheel.sh (run by
CI) goes further: a fresh venv and the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The wheel of the checkout's sources (``scripts/build_wheel.py``: built from a copy, so
    no build/ folder of the checkout; once per state of the sources, so in CI this is the
    wheel ``scripts/check_wheel.sh`` built and installed)."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this interpreter")
    spec = importlib.util.spec_from_file_location("build_wheel",
                                                  ROOT / "scripts" / "build_wheel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(ROOT)


def test_wheel_carries_every_module_and_the_catalogue(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cute_fp4").rglob("*.py")
            if "__pycache__" not in p.parts}
    want |= {f"cute_fp4/schedules/{p.name}" for p in (ROOT / "schedules").glob("*.py")}
    missing = sorted(want - names)
    assert not missing, f"the wheel lacks {missing}"
    assert not any(n.startswith("schedules/") for n in names)  # no top-level 'schedules'


def test_installed_copy_finds_its_catalogue(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-index", "--target", str(target), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    code = ("import cute_fp4, json; from cute_fp4 import catalogue; "
            "print(json.dumps([cute_fp4.__file__, str(catalogue.builtin_dir()), "
            "catalogue.names()]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    where, folder, names = json.loads(r.stdout)
    assert Path(where).is_relative_to(target) and Path(folder).is_relative_to(target)
    assert names == sorted(p.stem for p in (ROOT / "schedules").glob("*.py")
                           if not p.name.startswith("_"))
