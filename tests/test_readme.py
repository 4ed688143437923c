"""README.md, the front door: at most 120 lines, no issue numbers, every file it names
exists, and every Python snippet uses only names it defines or imports (attributes of
cute_fp4 included) and runs: the CPU one as written, the GPU ones on the CPU with the
device and the sizes swapped (a GPU call must then stop at a DeviceError, nothing else),
the checkpoint one only checked (it needs a checkpoint)."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
# GPU snippets on the CPU: the device, and sizes a CPU quantizes in well under a second
ON_CPU = [('device="cuda"', 'device="cpu"'), ('.to("cuda",', '.to("cpu",'),
          ("14336", "512"), ("4096", "256"), ("2048", "256"), ("768", "128")]


def test_short_with_no_history_and_every_path_exists():
    assert len(README.splitlines()) <= 120
    assert not re.search(r"[Ii]ssue \d|#\d+\b|[Ii]t was \d", README)
    for path in set(re.findall(r"`((?:docs|perf|scripts|tests)/[\w./-]+)`", README)):
        assert (ROOT / path).exists(), path
    assert len(BLOCKS) >= 5


def _free_names(tree: ast.AST) -> set[str]:
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}
    return used - bound


def _package_attributes(tree: ast.AST) -> list[str]:
    """``cf.x`` / ``cute_fp4.x.y`` chains (aliases of the package resolved)."""
    alias = {"cute_fp4": "cute_fp4"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            alias.update({a.asname: a.name for a in node.names if a.asname})
    chains = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            parts, v = [node.attr], node.value
            while isinstance(v, ast.Attribute):
                parts.insert(0, v.attr)
                v = v.value
            if isinstance(v, ast.Name) and alias.get(v.id) == "cute_fp4":
                chains.append(".".join(["cute_fp4", *parts]))
    return chains


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_snippet_names_are_defined(i):
    tree = ast.parse(BLOCKS[i])
    assert not _free_names(tree), _free_names(tree)
    for chain in _package_attributes(tree):
        obj = importlib.import_module("cute_fp4")
        for part in chain.split(".")[1:]:
            if not hasattr(obj, part) and isinstance(obj, type(builtins)):
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            obj = getattr(obj, part)  # AttributeError: the README names something absent


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_snippet_runs(i, capsys):
    from cute_fp4.errors import DeviceError

    code = BLOCKS[i]
    if "from_pretrained(" in code:
        pytest.skip("needs a checkpoint; its names are checked above, its run in tests/test_hf")
    gpu = "cuda" in code
    for old, new in ON_CPU if gpu else []:
        code = code.replace(old, new)
    run = compile(code, f"README block {i}", "exec")
    if not gpu:
        exec(run, {})
        return
    with pytest.raises(DeviceError):  # at the first kernel call, nothing else before it
        exec(run, {})
