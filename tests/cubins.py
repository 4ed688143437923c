"""The SASS of a cross-compiled one-kernel module (the spec kernels: routing sort, combine):
its compile report and opcodes, for the tests that count instructions."""

from __future__ import annotations

from pathlib import Path

from cute_fp4.inspect import CubinReport, cubin_sass, inspect_cubin, parse_sass


def one_kernel(dump_dir: Path) -> tuple[CubinReport, list[str]]:
    """(report, opcodes in address order, modifiers included) of the newest cubin in
    ``dump_dir``, which must hold exactly one kernel function."""
    cubin = sorted(dump_dir.glob("*.cubin"))[-1]
    funcs = parse_sass(cubin_sass(cubin))
    assert len(funcs) == 1, sorted(funcs)
    return inspect_cubin(cubin, ()), [ins.opcode for ins in next(iter(funcs.values()))]
