"""README.md, the front door: at most 120 lines, no issue numbers, every file it names
exists, and every Python snippet uses only names it defines or imports (attributes of
cute_fp4 reached as a user reaches them) and runs: the CPU one as written; a GPU one on the
CPU with the device and the sizes swapped, where a kernel call stops at a DeviceError
(nothing else before it) and, under the exact-reference execution, the whole snippet runs;
the checkpoint one only checked (it needs a checkpoint)."""

from __future__ import annotations

import ast
import re

import pytest
from snippets import NEEDS_FILES, ROOT, check_package_attributes, free_names, on_cpu

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_short_with_no_history_and_every_path_exists():
    assert len(README.splitlines()) <= 120
    assert not re.search(r"[Ii]ssue \d|#\d+\b|[Ii]t was \d", README)
    for path in set(re.findall(r"`((?:docs|perf|scripts|tests)/[\w./-]+)`", README)):
        assert (ROOT / path).exists(), path
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_snippet_names_are_defined(i):
    tree = ast.parse(BLOCKS[i])
    assert not free_names(tree), free_names(tree)
    check_package_attributes(tree)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_snippet_runs(i, capsys):
    from cute_fp4.errors import DeviceError
    from cute_fp4.targets import reference_execution

    code = BLOCKS[i]
    if any(needle in code for needle in NEEDS_FILES):
        pytest.skip("needs a checkpoint; its names are checked above, its run in tests/test_hf")
    gpu = "cuda" in code
    run = compile(on_cpu(code) if gpu else code, f"README block {i}", "exec")
    if not gpu:
        exec(run, {})
        return
    with pytest.raises(DeviceError):  # at the first kernel call, nothing else before it
        exec(run, {})
    with reference_execution():  # the same snippet through the exact reference
        exec(run, {})
