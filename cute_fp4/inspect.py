"""Read a cubin: registers, local memory (spills) and the tensor-core instructions.

Uses ``cuobjdump`` from the ``nvidia-cuda-cuobjdump`` wheel (the ``inspect`` extra) or the
PATH. Spills are counted as local-memory stores/loads in the SASS (``STL``/``LDL``), which
is what ptxas' "spill stores" remark counts, plus any LOCAL bytes in the resource report.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


@functools.cache
def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool: the pip wheel's copy first, then the PATH."""
    for base in sys.path:
        p = Path(base) / "nvidia" / "cu13" / "bin" / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


@dataclasses.dataclass(frozen=True)
class CubinReport:
    registers: int
    spill_stores: int
    spill_loads: int
    local_bytes: int
    static_smem: int
    mma_instructions: tuple[str, ...]  # distinct tensor-core opcodes found
    mma_count: int  # how many tensor-core instructions in total

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads + self.local_bytes


_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]+)")


def _run(tool: str, *args: str) -> str:
    exe = find_tool(tool)
    if exe is None:
        raise FileNotFoundError(f"{tool} not found: pip install 'cute-fp4[inspect]' "
                                "(nvidia-cuda-cuobjdump) or put the CUDA toolkit on PATH")
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout


def inspect_cubin(cubin: str | Path, mma_prefixes: tuple[str, ...]) -> CubinReport:
    """Resource usage of the heaviest kernel in ``cubin`` and its tensor-core opcodes."""
    res = _run("cuobjdump", "-res-usage", str(cubin))
    regs = stack = shared = local = 0
    for m in _RES.finditer(res):
        r, s, sh, lo = map(int, m.groups())
        regs, stack, shared, local = max(regs, r), max(stack, s), max(shared, sh), max(local, lo)
    sass = _run("cuobjdump", "-sass", str(cubin))
    ops = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    mma = {op: n for op, n in ops.items() if op.startswith(mma_prefixes)}
    stl = sum(n for op, n in ops.items() if op.startswith("STL"))
    ldl = sum(n for op, n in ops.items() if op.startswith("LDL"))
    return CubinReport(regs, stl, ldl, local, shared, tuple(sorted(mma)), sum(mma.values()))
