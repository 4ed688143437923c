"""The SM120 kernel's scale-factor layouts on the CPU.

* global memory: the kernel's blocked offsets equal the cuBLAS formula and the format
  module's swizzle (the bytes quantize() writes);
* shared memory: the kernel's CuTe layout (traced without a GPU) puts every
  (row, k, stage) at the byte a contiguous copy of the global atoms gives it, for 32-, 64-
  and 128-row tiles and every sub-tile offset;
* registers: each lane's scale fragment, as the DSL's thread-value layouts give it for the
  kernel's tiled MMA, is the one the PTX ISA documents for
  ``mma.sync.m16n8k64 ... block_scale.scale_vec::4X``;
* split-K work units partition every output tile's K range exactly once.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cute_fp4 import formats, nvfp4
from cute_fp4.formats import NVFP4
from cute_fp4.kernels import sf_layout as L
from cute_fp4.kernels.scheduler import unit_coords


@pytest.mark.parametrize("rows, k", [(1, 32), (130, 96), (256, 128), (300, 1040)])
def test_global_offsets_match_cublas_formula_and_swizzle(rows, k):
    cols = k // 16
    lin = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = nvfp4.swizzle_scales(lin).reshape(-1)
    for r, c in itertools.product(range(rows), range(cols)):
        off = L.blocked_sf_offset(r, c, k, NVFP4)
        assert off == nvfp4.scale_offset(r, c, k)
        assert int(flat[off]) == int(lin[r, c])
    assert L.padded_sf_shape(rows, k, NVFP4) == nvfp4.scale_shape(rows, k)


def test_isa_fragment_table_shape():
    # scale_vec::4X: selected lanes hold 4 bytes = K blocks 0..3 of one row / column
    for sel in (0, 1):
        lanes = [ln for ln in range(32) if L.mma_sf_fragment(ln, "A", sel)]
        rows = sorted(L.mma_sf_fragment(ln, "A", sel)[0][0] for ln in lanes)
        assert len(lanes) == 16 and rows == list(range(16))
    for sel in range(4):
        lanes = [ln for ln in range(32) if L.mma_sf_fragment(ln, "B", sel)]
        assert sorted(L.mma_sf_fragment(ln, "B", sel)[0][0] for ln in lanes) == list(range(8))
    assert L.mma_sf_fragment(5, "A", 0) == [(9, 0), (9, 1), (9, 2), (9, 3)]


def _selector(lane, op):
    return (lane % 4) // 2 if op == "A" else lane % 4


@pytest.mark.compile
@pytest.mark.parametrize("tile, warps", [((128, 128, 128), (4, 2)), ((64, 128, 128), (2, 4)),
                                         ((128, 64, 128), (4, 2)), ((128, 128, 128), (2, 2))])
@pytest.mark.parametrize("op", ["A", "B"])
def test_kernel_fragments_are_the_isa_table(tile, warps, op):
    for lane in range(32):
        isa = L.mma_sf_fragment(lane, op, _selector(lane, op))
        assert L.dsl_sf_fragment(lane, op, tile, warps) == isa, lane
        assert L.cute_sf_fragment(lane, op) == isa, lane


@pytest.mark.compile
def test_smem_layout_is_a_copy_of_global_atoms():
    import cutlass.cute as cute

    probes = {}

    @cute.jit
    def probe():
        for rows in (32, 64, 128):
            for tk in (64, 128, 256):
                lay = L.sf_smem_layout(rows, tk, 2, NVFP4)
                probes[(rows, tk)] = [[[lay((m, k, s)) for k in range(0, tk, 16)]
                                       for m in range(rows)] for s in range(2)]

    cute.compile(probe, options="--gpu-arch sm_120a")
    for (rows, tk), vals in probes.items():
        for sub in range(max(1, 128 // rows)):
            for s, m, kb in itertools.product(range(2), range(rows), range(tk // 16)):
                got = int(vals[s][m][kb]) + L.sf_view_offset(rows, sub)
                want = s * L.sf_stage_bytes(rows, tk, NVFP4) + L.blocked_sf_offset(
                    sub * rows + m, kb, tk, NVFP4)
                assert got == want, (rows, tk, sub, s, m, kb)


MXFP4_TILES = [((128, 128, 128), (4, 2), False), ((128, 128, 256), (4, 2), False),
               ((128, 128, 128), (2, 2), True), ((64, 128, 128), (2, 4), False),
               ((32, 128, 128), (2, 4), False)]


@pytest.mark.compile
@pytest.mark.parametrize("tile, warps, pingpong", MXFP4_TILES)
def test_mxfp4_scale_words_are_the_byte_copies_pairs(tile, warps, pingpong):
    """MXFP4 (``scale_vec::2X``): the SM120 mainloop loads a row's scales of two MMA K
    blocks as one 32-bit word (``Sm120Mainloop._paired_scales``) where the byte copies
    loaded two 16-bit halves. ``sf_word_offsets`` is the proof, per thread, MMA row and
    pair: the registers the MMAs read (values 0 and 32 of K blocks ``2p``, ``2p + 1``) are
    one aligned word and the byte copy fills them from four consecutive shared bytes, the
    word's. Here: it holds for the threads of the MXFP4 tiles, each MMA row or column has
    its own word, and it refuses a fragment whose K blocks are not paired so (lanes of the
    first and the last MMA warp)."""
    import cutlass.cute as cute
    from sm120_mainloop_trace import _Storage

    from cute_fp4.kernels.sm120 import Sm120Gemm
    from cute_fp4.schedule import Problem, Schedule, Tile, WarpRoles, Warps

    roles = WarpRoles.PINGPONG if pingpong else WarpRoles.COOPERATIVE
    k = Sm120Gemm(Schedule(target="sm_120a", tile=Tile(*tile), warps=Warps(roles=roles,
                                                                            mma=warps)),
                  Problem(a_format="mxfp4", b_format="mxfp4"))
    found, refused = {}, []

    def walk():  # plain Python (a loop in a @cute.jit body would be staged)
        k._setup()
        assert k._paired_scales()
        nt = k.group_threads
        lanes = [*range(5), *range(28, 32)]  # every lane % 4, quads 0, 1 and 7
        for t in sorted({w + lane for w in (0, nt - 32) for lane in lanes}):
            f = k._mma_fragments(_Storage(), t)
            sf = k._sf_sources(f, 0, 0)
            for op, frag, src, dst in (("A", f.tCrSFA, sf[0], sf[1]),
                                       ("B", f.tCrSFB, sf[2], sf[3])):
                for kb in range(0, tile[2] // 64, 2):
                    found[t, op, kb] = k.sf_word_offsets(frag, src, dst, kb)
                if t == 0:  # K blocks 1 and 2 are not one word
                    try:
                        k.sf_word_offsets(frag, src, dst, 1)
                    except AssertionError:
                        refused.append(op)

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options="--gpu-arch sm_120a")
    rows = {"A": tile[0] // (16 * warps[0]), "B": tile[1] // (8 * warps[1])}  # per warp
    for (t, op, kb), offs in found.items():
        assert len(offs) == rows[op] and all(w % 4 == 0 for w in offs), (t, op, kb)
        assert len(set(offs)) == len(offs), (t, op, kb, offs)
    assert refused == ["A", "B"]


def test_stage_bytes_agree_with_plan():
    from cute_fp4.plan import stage_bytes
    from cute_fp4.schedule import Problem, Schedule, Tile

    for m, n, k in [(128, 128, 128), (64, 128, 256), (128, 64, 64), (32, 128, 128)]:
        per = stage_bytes(Schedule(tile=Tile(m, n, k)), Problem())
        assert per["SFA"] == L.sf_stage_bytes(m, k, NVFP4)
        assert per["SFB"] == L.sf_stage_bytes(n, k, NVFP4)


@pytest.mark.parametrize("tiles_m, tiles_n, k_tiles, splits, group, along_m", [
    p for p in itertools.product([1, 3, 9], [1, 2, 17], [1, 4, 7], [1, 2, 4], [1, 8],
                                 [True, False]) if p[3] <= p[2]])
def test_work_units_cover_every_tile_and_k_once(tiles_m, tiles_n, k_tiles, splits, group,
                                                along_m):
    seen = {}
    for u in range(tiles_m * tiles_n * splits):
        w = unit_coords(u, tiles_m, tiles_n, k_tiles, splits, group, along_m)
        cm, cn, s, k0, kc = w.m, w.n, w.split, w.k_begin, w.k_count
        assert 0 <= cm < tiles_m and 0 <= cn < tiles_n and kc >= 1
        seen.setdefault((cm, cn), []).append((s, k0, kc))
    assert len(seen) == tiles_m * tiles_n
    for parts in seen.values():
        parts.sort()
        assert [p[0] for p in parts] == list(range(splits))
        pos = 0
        for _, k0, kc in parts:
            assert k0 == pos
            pos += kc
        assert pos == k_tiles


@pytest.mark.parametrize("rows, k_blocks", [(32, 1), (64, 2), (128, 1), (128, 4), (256, 2)])
def test_stage_rows_layout_is_the_blocked_formula(rows, k_blocks):
    """The CuTe form of one stage (SM90 conversion) equals formats.sf_offset everywhere."""
    import cutlass.cute as cute

    out = {}

    @cute.jit
    def probe():
        lay = L.stage_rows_layout(rows, k_blocks)
        out["bad"] = [(r, c) for r in range(rows) for c in range(4 * k_blocks)
                      if lay((r, c)) != formats.sf_offset(r, c, k_blocks)]

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert out["bad"] == []
