"""SM120 block-scale layouts: global (cuBLAS 128x4 blocked), shared memory, MMA fragment.

Three views of the same scale bytes (one scale per ``fmt.block`` K elements, the format
descriptor :class:`~cute_fp4.formats.BlockFormat` says which):

* Global memory: the cuBLAS "128x4 blocked" order (:func:`blocked_sf_offset`). Rows are
  padded to a multiple of 128, scale columns (K / block) to a multiple of 4; each 512-byte
  atom holds 128 rows x 4 scale columns (``fmt.atom_k`` elements of K: one 64-element K
  block of an m16n8k64 MMA for NVFP4's blocks of 16).
* Shared memory (:func:`sf_smem_layout`): one stage holds ``round_up(tile_rows, 128)`` rows
  and ``tile_k / block`` columns in the very same atom order, so a stage is a contiguous
  copy of ``tile_k / atom_k`` global atoms (TMA bulk tensor or 16-byte cp.async chunks).
  Tiles of fewer than 128 rows (64, 32) load the whole 128-row atom and the MMA reads their
  sub-block through a view with fewer rows (:func:`sf_view_offset` gives the byte offset).
* Registers (:func:`mma_sf_fragment`): which (row, K block) scale each lane of a warp feeds
  to ``mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X``.

Only :func:`sf_smem_layout` needs the CuTe DSL (call it while tracing); the rest is pure
Python so CPU tests can check the kernel's layouts against the formulas here.
"""

from __future__ import annotations

from cute_fp4.formats import MMA_K, NVFP4, SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS, BlockFormat

ATOM_ROWS = SF_ATOM_ROWS  # rows of one 512-byte atom
ATOM_COLS = SF_ATOM_COLS  # scale columns of one atom
ATOM_BYTES = SF_ATOM_BYTES


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_sf_shape(rows: int, k: int, fmt: BlockFormat) -> tuple[int, int]:
    """(rows, scale columns) of the padded global scale tensor for ``rows`` x ``k``."""
    return fmt.scale_shape(rows, k)


def blocked_sf_offset(r: int, c: int, k: int, fmt: BlockFormat) -> int:
    """Byte offset of scale (row ``r``, scale column ``c``) in the cuBLAS blocked layout."""
    return fmt.scale_offset(r, c, k)


def sf_smem_rows(tile_rows: int) -> int:
    """Rows one shared-memory stage holds for a tile of ``tile_rows`` rows."""
    return _ceil_div(tile_rows, ATOM_ROWS) * ATOM_ROWS


def sf_stage_bytes(tile_rows: int, tile_k: int, fmt: BlockFormat) -> int:
    """Bytes of one shared-memory stage of scale factors (what plan.py counts)."""
    return sf_smem_rows(tile_rows) * tile_k // fmt.block


def sf_view_offset(tile_rows: int, sub_tile: int) -> int:
    """Byte offset of sub-tile ``sub_tile`` (of ``tile_rows`` < 128 rows) in a 128-row atom.

    Row ``r`` of an atom lives at ``(r % 32) * 16 + (r // 32) * 4``: a sub-tile of 64 rows
    starting at row 64 begins 8 bytes in; one of 32 rows starting at row 96, 12 bytes in.
    """
    if tile_rows >= ATOM_ROWS:
        return 0
    return sub_tile * (tile_rows // 32) * 4


def sf_smem_layout(view_rows: int, tile_k: int, stages: int, fmt: BlockFormat):
    """CuTe layout ``((rows), (K), stage) -> byte`` of the scale factors in shared memory.

    ``view_rows`` is the number of rows the layout exposes: the CTA tile's rows for the MMA
    view, ``sf_smem_rows(tile_rows)`` for the copy (TMA / cp.async) view. The allocation is
    always ``sf_smem_rows`` rows per stage; the K mode has the mode structure that the DSL's
    SM120 fragment helpers (``partition_fragment_SFA/SFB``) expect: per 64-element MMA K
    block ``n = 64 / block`` scales (``fmt.scales_per_mma``), ``4 / n`` MMA K blocks per
    atom, then the atoms: ``((block, n), 4 / n, tile_k / atom_k) : ((0, 1), n, row_atoms *
    512)``; NVFP4 ``((16, 4), 1, tile_k / 64) : ((0, 1), 4, row_atoms * 512)``.
    """
    import cutlass.cute as cute

    alloc_rows = sf_smem_rows(view_rows)
    row_atoms = alloc_rows // ATOM_ROWS
    if view_rows >= ATOM_ROWS:
        shape_m = ((32, 4), view_rows // ATOM_ROWS)
        stride_m = ((16, 4), ATOM_BYTES)
    else:
        if view_rows % 32:
            raise ValueError(f"scale-factor view of {view_rows} rows: need a multiple of 32")
        shape_m = ((32, view_rows // 32), 1)
        stride_m = ((16, 4), ATOM_BYTES)
    per_mma = fmt.scales_per_mma
    shape_k = ((fmt.block, per_mma), ATOM_COLS // per_mma, tile_k // fmt.atom_k)
    stride_k = ((0, 1), per_mma, row_atoms * ATOM_BYTES)
    per_stage = alloc_rows * tile_k // fmt.block
    return cute.make_layout((shape_m, shape_k, stages),
                            stride=(stride_m, stride_k, per_stage))


def stage_rows_layout(rows: int, k_blocks: int):
    """CuTe layout ``(row, scale column) -> byte`` of one stage of ``rows`` rows (within a
    128-row atom when ``rows`` < 128) and ``k_blocks`` 64-element K blocks: the blocked
    order of :func:`cute_fp4.formats.sf_offset` as a static layout, so index arithmetic folds
    into the kernels' addressing (tests/test_sf_layout.py checks it against sf_offset)."""
    import cutlass.cute as cute

    if rows >= ATOM_ROWS:
        return cute.make_layout(((32, 4, rows // ATOM_ROWS), (ATOM_COLS, k_blocks)),
                                stride=((16, 4, k_blocks * ATOM_BYTES), (1, ATOM_BYTES)))
    return cute.make_layout(((32, rows // 32), (ATOM_COLS, k_blocks)),
                            stride=((16, 4), (1, ATOM_BYTES)))


def mma_sf_fragment(lane: int, operand: str, thread_id_sel: int = 0) -> list[tuple[int, int]]:
    """Scale factors lane ``lane`` supplies to one ``m16n8k64 ... scale_vec::4X`` MMA.

    Returns ``[(row, k_block) for byte 0..3]`` of the lane's 32-bit scale register, where
    ``row`` is the M row (operand ``"A"``, 0..15) or N column (operand ``"B"``, 0..7) of the
    MMA and ``k_block`` the 16-element K block (0..3); an empty list when the selector
    (``thread-id-a``/``thread-id-b``) does not pick this lane.

    Source: PTX ISA 9.x, section 9.7.14.3 "Block Scaling for mma.sync" (found via a mirror
    of the ISA, ptx.poole.ai/docs/09-instruction-set/14-warp-level-mma/block-scaling-mma-sync;
    the figures with the per-lane table could not be retrieved as text, so the table below
    is written from the ISA's description and checked against CUTLASS's ``SM120`` traits,
    ``SFALayout = ((2,2,8),64):((8,0,1),16)`` and ``SFBLayout = ((4,8),64):((0,1),8)`` in
    ``cute/atom/mma_traits_sm120.hpp`` / the DSL's ``thrfrg_SFA/SFB``):

    * ``.scale_vec::4X``: every selected lane provides all 4 bytes, byte ``i`` = K block
      ``i``; ``byte-id`` must be 0.
    * scale_A (16 rows): of each quad (lanes ``4g .. 4g+3``), the pair
      ``{2*thread_id_sel, 2*thread_id_sel + 1}`` is selected; lane ``4g + 2s`` holds row
      ``g`` and lane ``4g + 2s + 1`` holds row ``g + 8``.
    * scale_B (8 columns): of each quad, lane ``4g + thread_id_sel`` holds column ``g``.
    """
    if not 0 <= lane < 32:
        raise ValueError(f"lane {lane} out of range")
    g, t = lane // 4, lane % 4
    if operand == "A":
        if not 0 <= thread_id_sel < 2:
            raise ValueError("thread-id-a must be 0 or 1 for scale_vec::4X")
        if t // 2 != thread_id_sel:
            return []
        row = g + 8 * (t % 2)
    elif operand == "B":
        if not 0 <= thread_id_sel < 4:
            raise ValueError("thread-id-b must be 0..3")
        if t != thread_id_sel:
            return []
        row = g
    else:
        raise ValueError(f"operand must be 'A' or 'B', got {operand!r}")
    return [(row, kb) for kb in range(4)]


def cute_sf_fragment(lane: int, operand: str) -> list[tuple[int, int]]:
    """The same table read off the CUTLASS SM120 thread-value layouts quoted above.

    ``SFALayout``: thread ``(t0, t1, t2)`` = ``(lane % 2, lane // 2 % 2, lane // 4)``, value
    ``v`` (K element 0..63) -> linear (m + 16 k) coordinate ``8 t0 + t2 + 16 v``;
    ``SFBLayout``: thread ``(lane % 4, lane // 4)`` -> ``n + 8 k`` = ``lane // 4 + 8 v``.
    Distinct K blocks are ``v // 16``. Unlike the ISA table, every lane of the quad holds
    a copy (stride 0 modes); the selector picks which copy the hardware reads.
    """
    if operand == "A":
        rows = {((lane % 2) * 8 + lane // 4 + 16 * v) % 16 for v in range(64)}
        blocks = sorted({v // NVFP4.block for v in range(MMA_K)})
    elif operand == "B":
        rows = {(lane // 4 + 8 * v) % 8 for v in range(64)}
        blocks = sorted({v // NVFP4.block for v in range(MMA_K)})
    else:
        raise ValueError(f"operand must be 'A' or 'B', got {operand!r}")
    (row,) = rows
    return [(row, kb) for kb in blocks]


_DSL_TV_CACHE: dict = {}


def dsl_sf_fragment(lane: int, operand: str, tile=(128, 128, 128), warps=(4, 2),
                    arch: str = "sm_120a") -> list[tuple[int, int]]:
    """What the kernel's register copies give lane ``lane`` of warp 0 for its first MMA.

    Traces (no GPU needed) the tiled MMA the kernel builds for ``tile``/``warps`` and reads
    ``get_layoutSFA_TV`` / ``get_layoutSFB_TV`` (thread, value) -> (row, K) off it: the
    values of the first 64-wide K step of warp 0's first atom. Compare with
    :func:`mma_sf_fragment` (the ISA table) in CPU tests.
    """
    key = (operand, tuple(tile), tuple(warps), arch)
    if key not in _DSL_TV_CACHE:
        _DSL_TV_CACHE[key] = _trace_sf_tv(operand, tuple(tile), tuple(warps), arch)
    rows_of, perm_rows = _DSL_TV_CACHE[key]
    pairs = set()
    for idx in rows_of[lane]:
        row, k = idx % perm_rows, idx // perm_rows
        if k < MMA_K and row < (16 if operand == "A" else 8):
            pairs.add((row, k // NVFP4.block))
    return sorted(pairs)


def _trace_sf_tv(operand, tile, warps, arch):
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm120_utils
    from cutlass.cute.nvgpu import warp

    out = {}
    is_a = operand == "A"

    @cute.jit
    def probe():
        op = warp.MmaMXF4NVF4Op(cutlass.Float4E2M1FN, cutlass.Float32, cutlass.Float8E4M3FN)
        perm = sm120_utils.get_permutation_mnk(tile, NVFP4.block, False)
        mma = cute.make_tiled_mma(op, cute.make_layout((*warps, 1)), permutation_mnk=perm)
        get_tv = sm120_utils.get_layoutSFA_TV if is_a else sm120_utils.get_layoutSFB_TV
        tv = get_tv(mma)
        out["rows"] = cute.size(perm[0] if is_a else perm[1])
        n_val = cute.size(tv, mode=[1])
        out["idx"] = [[tv((t, v)) for v in range(n_val)] for t in range(32)]

    cute.compile(probe, options=f"--gpu-arch {arch}")
    return out["idx"], out["rows"]


__all__ = ["MMA_K", "ATOM_ROWS", "padded_sf_shape", "blocked_sf_offset", "sf_smem_rows",
           "stage_rows_layout",
           "sf_stage_bytes", "sf_view_offset", "sf_smem_layout", "mma_sf_fragment",
           "cute_sf_fragment", "dsl_sf_fragment"]
