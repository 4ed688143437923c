"""The Python snippets of the README and docs/: what makes one self-contained (every name
defined or imported in it, every ``cf.x.y`` reachable through the package as a user's
code reaches it) and how one runs on a CPU (a GPU snippet with the device and its sizes
swapped, under the exact-reference execution, ``CUTE_FP4_REFERENCE``)."""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# GPU snippets on the CPU: the device, and sizes a CPU computes in well under a second
ON_CPU = [('device="cuda"', 'device="cpu"'), ('.to("cuda",', '.to("cpu",'),
          ("14336", "512"), ("4096", "256"), ("2048", "128"), ("1024", "64"), ("768", "128")]
NEEDS_FILES = ("from_pretrained(", "path/to/", "org/model")  # a checkpoint or the hub


def blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def on_cpu(code: str) -> str:
    for old, new in ON_CPU:
        code = code.replace(old, new)
    return code


def free_names(tree: ast.AST) -> set[str]:
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Load)}
    return used - bound


def package_attributes(tree: ast.AST) -> list[str]:
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


def check_package_attributes(tree: ast.AST) -> None:
    """Every ``cf.x.y`` chain resolves as a user's code resolves it: through the package's
    attributes (its facade imports the submodules it exposes), in a fresh interpreter so
    that no module another test imported stands in for one the facade lacks."""

    chains = sorted(set(package_attributes(tree)))
    if not chains:
        return
    code = ("import functools, cute_fp4\n"
            f"for chain in {chains!r}:\n"
            "    functools.reduce(getattr, chain.split('.')[1:], cute_fp4)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-800:]
