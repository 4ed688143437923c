"""Every SM120 catalogue schedule's emulated build (``compile.cross_compile_emulated``)
compiles for sm_90a, without a GPU, with the MMA its only difference.

Per schedule: the emulated sm_90a binary has exactly 4 ``HMMA.16816.F32.BF16`` per
``OMMA.SF`` of the sm_120a build of the same schedule, no OMMA, the plan's shared memory,
and its PTX differs from the sm_120a one only in the MMA (the same ``cp.async.bulk.tensor``
loads and stores, ``ldmatrix`` count and ``mbarrier`` operations). Spills of the emulated
build are reported, not required to be 0 (its 4x MMAs and conversions need more registers
than the OMMA; only speed depends on it).
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from cute_fp4 import catalogue
from cute_fp4.compile import EMULATION_TARGET, cross_compile, cross_compile_emulated
from cute_fp4.errors import InputError
from cute_fp4.inspect import cubin_sass, inspect_cubin
from cute_fp4.plan import plan

pytestmark = pytest.mark.compile

# Sm120Gemm's schedules (the stream kernel, kernels/stream.py, has no emulated build)
SCHEDULES = [s for s in catalogue.all_schedules("sm120") if plan(s).ok
             and s.mainloop.value != "stream"]

# PTX instructions that must be the same in both builds (counted by opcode prefix)
SAME = ("cp.async.bulk.tensor", "ldmatrix", "mbarrier", "cp.async.ca", "cp.async.cg",
        "stmatrix", "setmaxnreg", "bar.sync")


def _build(compile_fn, s):
    """(registers, {SASS MMA opcode: count}, kernel, PTX) of one build."""
    with tempfile.TemporaryDirectory(prefix="cute_fp4_emu_") as d:
        _, kernel, _ = compile_fn(s, dump_dir=d)
        cubin = sorted(Path(d).glob("*.cubin"))[-1]
        sass = cubin_sass(cubin)
        rep = inspect_cubin(cubin, ("OMMA", "HMMA"), sass)
        ptx = sorted(Path(d).glob("*.ptx"))[-1].read_text()
    ops = Counter(re.findall(r"\b([OH]MMA\.[A-Z0-9_.]+)", sass))
    return rep.registers, dict(ops), kernel, ptx


def _counts(ptx: str) -> dict[str, int]:
    ops = re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][\w.:]*)", ptx, flags=re.M)
    return {p: sum(op.startswith(p) for op in ops) for p in SAME}


@pytest.mark.parametrize("s", SCHEDULES, ids=lambda s: s.name)
def test_emulated_build_compiles_for_sm90(s):
    _, native, _, native_ptx = _build(cross_compile, s)
    regs, emu, kernel, emu_ptx = _build(cross_compile_emulated, s)
    omma = sum(n for op, n in native.items() if op.startswith("OMMA.SF"))
    assert omma > 0 and native == {op: n for op, n in native.items() if op.startswith("OMMA.SF")}
    assert emu == {"HMMA.16816.F32.BF16": 4 * omma}, (native, emu)
    assert kernel.emulate and kernel.smem_bytes == plan(s).smem_bytes
    assert regs <= 255
    assert _counts(emu_ptx) == _counts(native_ptx)
    assert emu_ptx.count("shfl.sync") > native_ptx.count("shfl.sync")  # scale shuffles
    assert f".target {EMULATION_TARGET}" in emu_ptx


def test_only_sm120_schedules_emulate():
    with pytest.raises(InputError, match="only SM120 schedules"):
        cross_compile_emulated(catalogue.get("sm90_default"))
