"""The package's layering, from its source: every import statement of every module under
``cute_fp4/`` (function-level ones included) is an edge; the graph has no cycle and no
edge from a lower layer to a higher one:

    core (format, targets, schedule, plan, catalogue, operands, tables)
      <- kernels <- host (compile, cache, inspect, run) <- api (gemm, ops, tune, bench)
      <- front end (cli, demo, the package facade)

A module may import its own layer and any lower one. Importing a submodule is an edge to
that module only (not to the packages above it, which Python also runs). The checker is
tested on synthetic graphs so it can fail. Also: importing the package registers no torch
op and loads no CuTe DSL, and torch.compile of ``gemm`` registers the op while tracing."""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cute_fp4"
LAYERS: list[tuple[str, tuple[str, ...]]] = [  # lowest first; fnmatch patterns
    ("core", ("cute_fp4.errors", "cute_fp4.formats", "cute_fp4.blockscaled", "cute_fp4.nvfp4",
              "cute_fp4.mxfp4", "cute_fp4.packed",
              "cute_fp4.reference", "cute_fp4.fused",
              "cute_fp4.targets", "cute_fp4.schedule", "cute_fp4.families", "cute_fp4.plan",
              "cute_fp4.planning",
              "cute_fp4.planning.*", "cute_fp4.catalogue", "cute_fp4.schedules",
              "cute_fp4.schedules.*", "cute_fp4.operands", "cute_fp4.tables",
              "cute_fp4.oplib")),
    ("kernels", ("cute_fp4.kernels", "cute_fp4.kernels.*")),
    ("host", ("cute_fp4.compile", "cute_fp4.cache", "cute_fp4.inspect", "cute_fp4.run",
              "cute_fp4.quant", "cute_fp4.sorting", "cute_fp4.combining", "cute_fp4.tuning",
              "cute_fp4.workspaces", "cute_fp4.bindings")),
    ("api", ("cute_fp4.api", "cute_fp4.ops", "cute_fp4.tune", "cute_fp4.bench",
             "cute_fp4.grouped", "cute_fp4.emulation", "cute_fp4.layers", "cute_fp4.layers.*")),
    ("modules", ("cute_fp4.nn", "cute_fp4.mlp", "cute_fp4.moe", "cute_fp4.conversion")),
    ("integrations", ("cute_fp4.hf", "cute_fp4.hf.*", "cute_fp4.vllm", "cute_fp4.vllm.*",
                      "cute_fp4.serving")),
    ("front", ("cute_fp4", "cute_fp4.__main__", "cute_fp4.cli", "cute_fp4.demo")),
]


# ----------------------------------------------------------------------------- checker

def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Package modules ``source`` imports anywhere (module level, functions, branches):
    ``import x``, ``from x import y`` (``x.y`` when that is a module), relative imports
    and ``importlib.import_module("literal")``; not the imports under ``if TYPE_CHECKING:``
    (for annotations only: they never run)."""
    found: set[str] = set()
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) ==
                   "TYPE_CHECKING" for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    root = module.split(".")[0]
    return {_known_prefix(n, known) for n in found
            if n == root or n.startswith(root + ".")} - {module}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known_prefix(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", known)
            for m, p in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a self-import
    (Tarjan's algorithm, iterative), each sorted; sorted by first member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    out.append(sorted(comp))
    return sorted(out)


def layer_of(module: str, layers=LAYERS) -> int | None:
    for rank, (_, patterns) in enumerate(layers):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return rank
    return None


def back_edges(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """``"a (host) -> b (api)"`` for every import of a higher layer than the importer's."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} ({layers[la][0]}) -> {b} ({layers[lb][0]})")
    return out


# ----------------------------------------------------------------------------- the package

@pytest.fixture(scope="module")
def graph():
    return import_graph(PKG)


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"assign a layer in tests/test_layers.py LAYERS to: {missing}"


def test_every_pattern_names_a_module(graph):
    """LAYERS holds no module that is gone (a stale entry would excuse a future one)."""
    stale = [p for _, patterns in LAYERS for p in patterns
             if not any(fnmatch.fnmatchcase(m, p) for m in graph)
             and p not in ("cute_fp4.schedules", "cute_fp4.schedules.*")]
    assert not stale, stale


def test_the_walk_sees_the_package(graph):
    assert {"cute_fp4.compile", "cute_fp4.api", "cute_fp4.kernels.sm120"} <= set(graph)
    assert "cute_fp4.cache" in graph["cute_fp4.compile"]  # a function-level import
    assert "cute_fp4.run" not in graph["cute_fp4.compile"]  # the launch path sits above it
    assert "cute_fp4.tuning" in graph["cute_fp4.api"]


def test_no_import_cycles(graph):
    assert find_cycles(graph) == []


def test_no_import_from_a_higher_layer(graph):
    assert back_edges(graph) == []


# ----------------------------------------------------------------------------- the checker

def test_checker_finds_cycles():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}}
    assert find_cycles(g) == [["a", "b", "c"], ["f"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    # the cycle the layering once had: host -> api -> host through a function-level import
    assert find_cycles({"cute_fp4.compile": {"cute_fp4.api"},
                        "cute_fp4.api": {"cute_fp4.compile"}}) == [
        ["cute_fp4.api", "cute_fp4.compile"]]


def test_checker_finds_back_edges():
    g = {"cute_fp4.kernels.sm90": {"cute_fp4.plan", "cute_fp4.api"},
         "cute_fp4.compile": {"cute_fp4.kernels.sm90", "cute_fp4.cli"},
         "cute_fp4.demo": {"cute_fp4.cli", "cute_fp4.compile"}}
    assert back_edges(g) == ["cute_fp4.compile (host) -> cute_fp4.cli (front)",
                             "cute_fp4.kernels.sm90 (kernels) -> cute_fp4.api (api)"]
    assert layer_of("cute_fp4.somewhere_new") is None


def test_imports_are_found_anywhere_in_a_module():
    known = {"cute_fp4", "cute_fp4.api", "cute_fp4.cache", "cute_fp4.cli", "cute_fp4.demo",
             "cute_fp4.kernels", "cute_fp4.kernels.sm120", "cute_fp4.kernels.sm90",
             "cute_fp4.compile", "cute_fp4.catalogue"}
    src = '''
import importlib
import torch
from cute_fp4 import catalogue
from . import cache
from .kernels import sm120


def f():
    from cute_fp4.api import gemm
    if True:
        import cute_fp4.cli
    return importlib.import_module("cute_fp4.demo")


class K:
    def m(self):
        from .kernels.sm90 import Sm90Gemm
        from cute_fp4 import compile as c
'''
    assert imports_of(src, "cute_fp4.compile", False, known) == {
        "cute_fp4.catalogue", "cute_fp4.cache", "cute_fp4.kernels.sm120", "cute_fp4.api",
        "cute_fp4.cli", "cute_fp4.demo", "cute_fp4.kernels.sm90"}  # itself left out
    # in a package's __init__, "." is the package itself
    assert imports_of("from . import sm90\n", "cute_fp4.kernels", True, known) == {
        "cute_fp4.kernels.sm90"}


# ----------------------------------------------------------------------------- side effects

_FRESH = r"""
import sys
import torch
import cute_fp4, cute_fp4.api, cute_fp4.ops, cute_fp4.tune, cute_fp4.bench, cute_fp4.run
from cute_fp4.api import _op_exists
print("registered", _op_exists())
print("dsl", any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules))
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
a, b = cute_fp4.quantize(torch.randn(16, 64)), cute_fp4.quantize(torch.randn(64, 64))
f = torch.compile(lambda x, w: cute_fp4.gemm(x, w) * 2, backend=backend, fullgraph=True)
try:
    f(a, b)
except cute_fp4.errors.DeviceError:
    pass  # traced fine; the op runs only on a GPU
print("graphs", len(graphs), "op in graph", "cute_fp4.mm" in graphs[0].code)
print("registered", _op_exists())
"""


def test_import_registers_nothing_and_compile_registers_while_tracing():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True,
                         timeout=300, cwd=PKG.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == ["registered False", "dsl False",
                                          "graphs 1 op in graph True", "registered True"]
