"""The SM120 kernel's A/B TMA writes bytes exactly where ldmatrix reads FP4 elements, on the CPU.

The A/B TMA is built on uint8 ``[rows, K/2]`` tensors with a byte-typed swizzled
shared-memory layout (``Sm120Gemm.sA_tma_layout``/``sB_tma_layout``, K/2 byte columns),
because Hopper's TMA rejects 4-bit element types (what lets the emulated build run on an
H200, with one load path for both builds); the MMA side reads the same storage through the
FP4 layout (``sA_layout``/``sB_layout``). For every tile K (64, 128, 192, 256), the tile rows
in use and every stage, element by element: the byte address of FP4 element (r, k) under the
FP4 layout (swizzle applied to the byte address, as TMA and ldmatrix see it) must be the
address of byte (r, k // 2) under the byte layout, nibble k % 2, and both images must fill
the allocation exactly once.
"""

from __future__ import annotations

import re

import pytest
import torch

from cute_fp4 import catalogue
from cute_fp4.schedule import Schedule, Tile, Warps

pytestmark = pytest.mark.compile

TILE_K = (64, 128, 192, 256)
ROWS = (32, 64, 128)
STAGES = 3


def _leaves(x):
    return [y for e in x for y in _leaves(e)] if isinstance(x, tuple) else [x]


def _offsets(layout, shape) -> torch.Tensor:
    """Offsets of a static (rows, cols, stages) CuTe layout over every coordinate, as a
    tensor indexed [r, c, s] (colexicographic decomposition inside each mode)."""
    grids = torch.meshgrid(*(torch.arange(n, dtype=torch.int64) for n in shape), indexing="ij")
    out = torch.zeros(shape, dtype=torch.int64)
    for coord, mode_shape, mode_stride in zip(grids, layout.shape, layout.stride):
        c = coord.clone()
        for s, d in zip(_leaves(mode_shape), _leaves(mode_stride)):
            out += (c % s) * d
            c //= s
    return out


def _swizzle(sw, x: torch.Tensor) -> torch.Tensor:
    b, m, s = (int(v) for v in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", str(sw)).groups())
    mask = ((1 << b) - 1) << (m + s)
    return x ^ ((x & mask) >> s)


class Plain:
    """A swizzled CuTe layout as plain Python values (readable outside the trace)."""

    def __init__(self, composed):
        self.shape = composed.outer.shape
        self.stride = composed.outer.stride
        self.swizzle = str(composed.inner)


def _mismatches(fp4: Plain, byte: Plain, rows, tk, stages) -> list[str]:
    """Compare the two images of one operand's staged tile; [] when identical."""
    fo = _offsets(fp4, (rows, tk, stages))
    bo = _offsets(byte, (rows, tk // 2, stages))
    fp4_addr = _swizzle(fp4.swizzle, fo // 2)
    byte_addr = _swizzle(byte.swizzle, bo).repeat_interleave(2, dim=1)
    errors = []
    n_bytes = rows * tk // 2 * stages
    if not torch.equal(torch.sort(bo.flatten()).values, torch.arange(n_bytes)):
        errors.append("byte layout does not cover its allocation once")
    if not torch.equal(torch.sort(fo.flatten()).values, torch.arange(2 * n_bytes)):
        errors.append("FP4 layout does not cover its allocation once")
    odd = (torch.arange(tk) % 2).view(1, tk, 1).expand(rows, tk, stages)
    if not torch.equal(fo % 2, odd):
        errors.append("FP4 element k is not nibble k % 2 of its byte")
    bad = (fp4_addr != byte_addr).nonzero()
    errors += [f"FP4 ({r}, {k}, stage {s}) at byte {int(fp4_addr[r, k, s])}, TMA writes byte "
               f"(r, k // 2) at {int(byte_addr[r, k, s])}" for r, k, s in bad[:5].tolist()]
    return errors


def _layouts(pairs):
    """{(rows, tk): (fp4 layout, byte layout)} built by the kernel's own helper."""
    import cutlass
    import cutlass.cute as cute

    from cute_fp4.kernels.sm120 import Sm120Gemm

    out = {}

    @cute.jit
    def probe():
        for rows, tk in pairs:
            out[rows, tk] = (
                Plain(Sm120Gemm._operand_layout(rows, tk, cutlass.Float4E2M1FN, STAGES)),
                Plain(Sm120Gemm._operand_layout(rows, tk // 2, cutlass.Uint8, STAGES)))

    cute.compile(probe, options="--gpu-arch sm_120a")
    return out


_PAIRS = [(r, k) for r in ROWS for k in TILE_K]


@pytest.fixture(scope="module")
def layouts():
    return _layouts(_PAIRS)


@pytest.mark.parametrize("rows, tk", _PAIRS, ids=[f"{r}x{k}" for r, k in _PAIRS])
def test_byte_image_equals_fp4_image(layouts, rows, tk):
    fp4, byte = layouts[rows, tk]
    assert _mismatches(fp4, byte, rows, tk, STAGES) == []


def test_check_catches_a_different_swizzle(layouts):
    """A byte layout with another swizzle width puts bytes elsewhere: caught."""
    fp4, _ = layouts[128, 128]
    _, other = layouts[128, 256]  # 128-byte swizzle vs the 64-byte one of K = 128
    assert other.swizzle != fp4.swizzle
    assert _mismatches(fp4, other, 128, 128, 1)


def _kernel_schedules():
    # Sm120Gemm's schedules (the stream kernel has no A/B TMA stages: kernels/stream.py)
    out = [s for s in catalogue.all_schedules("sm120") if not s.name.startswith("sm100")
           and s.mainloop.value != "stream"]
    out.append(Schedule(tile=Tile(64, 128, 192), warps=Warps(mma=(2, 4)), name="k192"))
    return out


@pytest.mark.parametrize("s", _kernel_schedules(), ids=lambda s: s.name)
def test_kernel_uses_the_checked_layouts(s):
    """What ``Sm120Gemm._setup`` builds for the schedule: the byte layout of each operand
    equals the FP4 one's image, with the kernel's own stage count."""
    import cutlass.cute as cute

    from cute_fp4.kernels.sm120 import Sm120Gemm

    k = Sm120Gemm(s)
    res = {}

    @cute.jit
    def probe():
        k._setup()
        tm, tn, tk = k.tile_mnk
        res["a"] = _mismatches(Plain(k.sA_layout), Plain(k.sA_tma_layout), tm, tk, k.stages)
        res["b"] = _mismatches(Plain(k.sB_layout), Plain(k.sB_tma_layout), tn, tk, k.stages)

    cute.compile(probe, options="--gpu-arch sm_120a")
    assert res == {"a": [], "b": []}
