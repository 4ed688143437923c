"""Every Python snippet of docs/*.md is self-contained (every name defined or imported in
it, every ``cf.x.y`` reachable through the package) and runs: a CPU one as written, a GPU
one on the CPU (the device and sizes swapped) under the exact-reference execution; one that
needs a checkpoint or the hub is compiled only. The architecture page draws the layers
``tests/test_layers.py`` checks, no more and no fewer."""

from __future__ import annotations

import ast
import re

import pytest
from snippets import NEEDS_FILES, ROOT, blocks, check_package_attributes, free_names, on_cpu
from test_layers import LAYERS

SNIPPETS = [(path.name, i, code) for path in sorted((ROOT / "docs").glob("*.md"))
            for i, code in enumerate(blocks(path))]


def test_the_docs_have_snippets():
    assert len(SNIPPETS) >= 7


@pytest.mark.parametrize("name, i, code", SNIPPETS, ids=[f"{n}[{i}]" for n, i, _ in SNIPPETS])
def test_snippet_is_self_contained_and_runs(name, i, code, tmp_path, monkeypatch):
    from cute_fp4.targets import reference_execution

    tree = ast.parse(code)
    assert not free_names(tree), free_names(tree)
    check_package_attributes(tree)
    if any(needle in code for needle in NEEDS_FILES):
        compile(code, f"{name} block {i}", "exec")
        return
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    with reference_execution():
        exec(compile(on_cpu(code), f"{name} block {i}", "exec"), {})


def test_the_architecture_page_draws_the_checked_layers():
    """docs/architecture.md's layer table names every layer of LAYERS, in order, with the
    modules LAYERS puts there (as patterns)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|", page, flags=re.M)
    assert [name for name, _ in rows] == [name for name, _ in LAYERS]
    for (name, modules), (_, cell) in zip(LAYERS, rows):
        assert sorted(re.findall(r"`([\w.*]+)`", cell)) == sorted(modules), name
