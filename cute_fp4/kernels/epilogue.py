"""Epilogues shared by every kernel family: accumulator -> alpha -> fused op -> conversion ->
global memory, through shared memory and TMA, or straight from registers (masked).

Both stores take the FP32 accumulator of one output tile and a ``scale`` (alpha, times the
conversion offset of the SM90 mainloops), then convert to the stored element type.
:func:`store_direct` (and so split-K) also applies the schedule's fused operations
(:class:`FusedOps`, ``Epilogue.ops``): a per-column FP32 bias before the conversion, and
SiLU-and-mul or gpt-oss's clamped SwiGLU of interleaved gate/up columns (see
:func:`silu_mul_pairs` for why the pairs are always in one thread's registers), and the
NVFP4 output (per-16 block amax over the
lanes of a quad, UE4M3 scale, E2M1 codes and the 128x4 scale layout: :func:`nvfp4_blocks`);
``cute_fp4.schedule.EPILOGUE_OPS`` gives the rounding points, which are the unfused
pipeline's. Kernels store from registers whenever a schedule has fused operations.

* :class:`SmemEpilogue` (16-bit outputs, and SM120 FP32): the tile is cut into epilogue
  tiles; each is gathered from the accumulator, converted, copied register -> shared
  memory with the MMA's own C layout (``stmatrix`` for 16-bit types) into one of
  ``epi_stages`` buffers, and stored by one warp with a TMA bulk tensor store. Which
  accumulator values form which epilogue tile is derived from the layouts while tracing
  (:func:`subtile_sources`; a CPU trace checks every element's position for both
  families, tests/test_epilogue.py).
* :func:`store_direct`: every thread writes its accumulator values to global memory,
  masked against the problem's rows and columns; used for 32-bit results on SM90 and for
  the swap-AB kernel, whose ``gD`` is a transposed view (D^T).
* :func:`store_split_k`: split-K, reduced in the kernel. Every split of a tile runs the
  same MMA partition, so thread ``t``'s accumulator holds the same output elements in
  every split: each thread stores its FP32 partial (in register order, contiguous
  vectors, no masks), then increments its own arrival
  counter (one per tile and thread slot) with a GPU-scope acquire-release atomic; the
  thread that arrives last adds the partials of all splits in split order (deterministic,
  whichever split finishes last), resets its counter to zero and stores the result. No
  barrier, no shared memory, no spinning (a split never waits for another), and no second
  kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync

from cute_fp4.formats import NVFP4, sf_offset_shifts
from cute_fp4.kernels.e2m1 import m2_sum
from cute_fp4.schedule import SWIGLU_ALPHA, SWIGLU_LIMIT, gated_op


def subtile_sources(r2s, tiled_mma, tile_mn, epi_tile) -> list:
    """Which accumulator values make up each epilogue tile, in store order.

    Returns ``[((epi_m, epi_n), [(d, a), ...]), ...]``: value ``d`` (flat index) of the
    staged epilogue tile ``(epi_m, epi_n)`` is accumulator value ``a`` (flat index of the
    accumulator retiled to ``r2s``). Computed while tracing from thread 0's identity
    partitions (the indices are the same for every thread; the CPU trace,
    tests/test_epilogue.py, checks every thread of both families), so it holds for any
    MMA/copy layout: SM120's warp MMA keeps epilogue sub-tiles in the rest modes, SM90's
    WGMMA folds them into the value mode.
    """
    (tm, tn), (em, en) = tile_mn, epi_tile
    acc = r2s.retile(tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn)))
    epi = r2s.get_slice(0).partition_S(cute.make_identity_tensor(epi_tile))
    where = {tuple(acc[i]): i for i in range(cute.size(acc))}
    plan = []
    for bm in range(tm // em):
        for bn in range(tn // en):
            coords = [(bm * em + epi[d][0], bn * en + epi[d][1]) for d in range(cute.size(epi))]
            missing = [c for c in coords if c not in where]
            if missing:
                raise AssertionError(f"epilogue tile ({bm}, {bn}): thread 0 holds no "
                                     f"accumulator value for {missing[:4]}")
            plan.append(((bm, bn), [(d, where[c]) for d, c in enumerate(coords)]))
    return plan


class NvOut(NamedTuple):
    """The launch's ``"nvfp4_out"`` tensors (``launch.global_tensors``)."""

    mQ: Any  # uint8 (M, N_out / 2): packed E2M1 codes, element 2j in the low nibble
    mSF: Any  # uint8 flat: UE4M3 block scales, 128x4 blocked over round_up(M, 128) rows
    mGS: Any  # (1,) float32: the given global scale (decode form)


class NvTile(NamedTuple):
    """Where an output tile's NVFP4 goes: the launch's :class:`NvOut`, the tile's first row
    in it (grouped: the unit's ``row0``) and this thread among the ``threads`` of the tiled
    MMA (they zero the scale padding no tile covers)."""

    out: NvOut
    row0: Any
    tid: Any
    threads: int


class FusedOps(NamedTuple):
    """The fused epilogue operations of one output tile (a kernel builds it per tile)."""

    ops: tuple  # Epilogue.ops (static)
    n_mode: int  # the tile mode that is the GEMM's N: 1, or 0 for a D^T tile (swap-AB, stream)
    group: int  # gated ops: gate/up rows per group (planning.common.silu_group)
    gBias: Any = None  # "bias": FP32 values indexed by the tile's N coordinate
    n0: Any = 0  # the tile's first GEMM column
    nv: NvTile | None = None  # "nvfp4_out"


def fused_tile(schedule, n_mode: int, mBias, n0, nv: NvTile | None = None) -> FusedOps | None:
    """The :class:`FusedOps` of an output tile whose N coordinates start at ``n0`` (``mBias``:
    the launch's bias, one group's column of it for grouped kernels; ``nv``: where the
    tile's NVFP4 goes, with ``"nvfp4_out"``); None without ops."""
    from cute_fp4.planning.common import silu_group

    ops = schedule.epilogue.ops
    if not ops:
        return None
    gBias = cute.domain_offset((n0,), mBias) if "bias" in ops else None
    if ("nvfp4_out" in ops) != (nv is not None):
        raise AssertionError("nvfp4_out: the kernel must give fused_tile its NvTile")
    return FusedOps(ops, n_mode, silu_group(schedule), gBias, n0, nv)


def d_tile(tile_shape: tuple, n_mode: int, ops: tuple) -> tuple:
    """The output's tile for a GEMM tile of ``tile_shape``: half as wide along N with a
    gated activation (``"silu_mul"``, ``"swiglu_oai"``)."""
    if not gated_op(ops):
        return tuple(tile_shape)
    return tuple(v // 2 if m == n_mode else v for m, v in enumerate(tile_shape))


def silu_mul_pairs(thr_mma, tile_shape, n_mode: int, group: int) -> list[tuple[int, int]]:
    """``(gate, up)`` value indices of a thread's accumulator: ``gate`` at N coordinate
    ``n`` with ``n % (2 group) < group`` and ``up`` at ``n + group`` (the weight's rows
    interleave gate and up in groups of ``group``, ``planning.common.silu_group``: 8 for
    WGMMA and D^T tiles, whose threads hold 8-wide groups along N, 32 for the SM120 tiled
    MMA), so both of a pair are in one thread. Computed while tracing from threads 0 and
    the last (value indices are the same for every thread; the CPU test checks them all)."""
    n_thr = thr_mma.size
    pairs = None
    for t in sorted({0, n_thr - 1}):
        part = thr_mma.get_slice(t).partition_C(cute.make_identity_tensor(tile_shape))
        coords = [tuple(part[i]) for i in range(cute.size(part))]
        where = {c: i for i, c in enumerate(coords)}
        mine = []
        for i, c in enumerate(coords):
            if c[n_mode] % (2 * group) < group:
                partner = tuple(v + group if m == n_mode else v for m, v in enumerate(c))
                if partner not in where:
                    raise AssertionError(f"silu_mul: thread {t} holds N coordinate "
                                         f"{c[n_mode]} but not {c[n_mode] + group}")
                mine.append((i, where[partner]))
        if pairs is not None and mine != pairs:
            raise AssertionError(f"silu_mul: thread {t}'s gate/up pairs differ from thread 0's")
        pairs = mine
    return pairs


NV_BLOCK = NVFP4.block  # output columns per NVFP4 block scale


class NvBlock(NamedTuple):
    """One 16-column output block of one row, as a thread holds it (:func:`nvfp4_blocks`)."""

    refs: tuple  # value indices (pairs (gate, up) with silu_mul), in output column order
    cols: tuple  # their output columns, relative to the first one (pairs 2j, 2j + 1)


def _out_entries(part, n_mode: int, pairs) -> dict:
    """``{(row, block): [(output column, ref), ...]}`` of one thread's accumulator ``part``
    (identity coordinates); ``pairs``: silu_mul's (gate, up) indices and group, or None."""
    blocks: dict = {}
    size = cute.size(part)
    items = ([(i, i) for i in range(size)] if pairs is None
             else [(gi, (gi, ui)) for gi, ui in pairs[0]])
    for i, ref in items:
        c = tuple(part[i])
        n, r = c[n_mode], c[1 - n_mode]
        if pairs is not None:
            g = pairs[1]
            n = n // (2 * g) * g + n % g
        blocks.setdefault((r, n // NV_BLOCK), []).append((n, ref))
    return {k: sorted(v) for k, v in blocks.items()}


def nvfp4_blocks(thr_mma, tile_shape, n_mode: int, ops: tuple, group: int,
                 threads=None) -> tuple[list[NvBlock], tuple[int, ...]]:
    """A thread's 16-column output blocks and the lane masks of the shuffle reduction of a
    block's amax: ``([NvBlock, ...], masks)``. The lanes holding one (row, block) must be
    ``lane ^ span(masks)`` for every lane, each with the same value indices and relative
    columns as thread 0 (block by block, in (row, block) order), and cover the block's 16
    columns with adjacent pairs (one byte of codes each). Derived while tracing from the
    threads ``threads`` (default: warp 0; the CPU test walks every warp of every SM120 MMA
    shape); any other layout is an AssertionError at compile time.

    Normal orientation (WGMMA, SM120): a thread holds columns ``2 (lane % 4) + {0, 1}`` of
    each 8-column atom, so a block is the 4 lanes of a quad over 2 atoms (masks 1, 2); with
    ``silu_mul`` the output column of gate column ``c`` is ``c // 2G * G + c % G``, and the
    block's 16 output columns are gate columns of the same quad."""
    pairs = (silu_mul_pairs(thr_mma, tile_shape, n_mode, group), group) \
        if gated_op(ops) else None
    lanes = list(range(32)) if threads is None else list(threads)
    held = {}
    for t in lanes:
        part = thr_mma.get_slice(t).partition_C(cute.make_identity_tensor(tile_shape))
        held[t] = _out_entries(part, n_mode, pairs)

    def shape_of(entries):
        n0 = entries[0][0]
        return tuple(r for _, r in entries), tuple(n - n0 for n, _ in entries)

    keys0 = sorted(held[lanes[0]])
    blocks = [NvBlock(*shape_of(held[lanes[0]][k])) for k in keys0]
    first = keys0[0]
    group0 = sorted(t for t in lanes if first in held[t] and t // 32 == lanes[0] // 32)
    base = group0[0]
    masks = tuple(sorted({(t ^ base) & -(t ^ base) for t in group0 if t != base}))
    span = {0}
    for mk in masks:
        span |= {x ^ mk for x in span}
    per = len(blocks[0].refs)
    for t in lanes:
        keys = sorted(held[t])
        if [NvBlock(*shape_of(held[t][k])) for k in keys] != blocks:
            raise AssertionError(f"nvfp4_out: thread {t}'s blocks differ from thread "
                                 f"{lanes[0]}'s")
        for k in keys:
            if held[t][k][0][0] % 2:
                raise AssertionError(f"nvfp4_out: thread {t}'s block {k} starts at an odd "
                                     "column")
            sharing = {u % 32 for u in lanes if u // 32 == t // 32 and k in held[u]}
            if sharing != {(t % 32) ^ x for x in span} or len(sharing) * per != NV_BLOCK:
                raise AssertionError(f"nvfp4_out: block {k} of thread {t} is held by lanes "
                                     f"{sorted(sharing)}, not a butterfly group of "
                                     f"{NV_BLOCK // per} lanes")
    for b in blocks:
        if any(c % 2 != i % 2 or (i % 2 and c != b.cols[i - 1] + 1)
               for i, c in enumerate(b.cols)) or b.cols[0] != 0:
            raise AssertionError(f"nvfp4_out: a thread's columns {b.cols} of a block are not "
                                 "adjacent pairs (2j, 2j + 1)")
    return blocks, masks


def same_n_values(thr_mma, tile_shape, n_mode: int) -> list[tuple[int, list[int]]]:
    """A thread's accumulator values grouped by their N coordinate: ``[(first, [i, ...])]``
    (the same for every thread: a value's coordinate is the thread's base plus a fixed
    offset; computed from thread 0 while tracing)."""
    part = thr_mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_shape))
    by_n: dict[int, list[int]] = {}
    for i in range(cute.size(part)):
        by_n.setdefault(part[i][n_mode], []).append(i)
    return [(members[0], members) for members in by_n.values()]


def mul_rn(a, b):
    """``a * b`` rounded on its own (``mul.rn.f32``): an explicitly rounded multiply is
    never contracted with a following add into an FMA, whose single rounding would differ
    from the unfused pipeline's (the GEMM's FP32 output, then the bias added)."""
    return cute.arch.inline_ptx("mul.rn.f32 {$w0}, {$r0}, {$r1};",
                                write_only_types=[cutlass.Float32], read_only_args=[a, b])


def silu(x):
    """``x / (1 + exp(-x))`` in FP32 with the accurate ``expf`` and an IEEE division: the
    operations of torch's CUDA SiLU, so the rounded result is the same bits."""
    return x / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=False))


class SmemEpilogue(NamedTuple):
    """Per-thread views of a register -> smem -> TMA epilogue (built by :func:`smem_epilogue`)."""

    plan: list  # subtile_sources(): accumulator values of each epilogue tile
    r2s: cute.TiledCopy  # tiled register -> shared copy
    tRS_sC: cute.Tensor  # (V, M, N, buffer) shared-memory destination of this thread
    tRS_acc: cute.Tensor  # accumulator retiled to the copy: (V, MMA rows, MMA cols)
    tRS_rD: cute.Tensor  # FP32 staging of one epilogue tile
    tRS_out: cute.Tensor  # converted epilogue tile


def smem_epilogue(r2s, tiled_mma, thread, sC, acc, c_dtype, tile_mn, epi_tile) -> SmemEpilogue:
    """Partitions of ``r2s`` (a tiled copy matching the MMA's C layout) for ``thread``."""
    thr = r2s.get_slice(thread)
    rD_shape = cute.shape(thr.partition_S(sC))[:3]
    return SmemEpilogue(subtile_sources(r2s, tiled_mma, tile_mn, epi_tile), r2s,
                        thr.partition_D(sC), r2s.retile(acc),
                        cute.make_rmem_tensor(rD_shape, cutlass.Float32),
                        cute.make_rmem_tensor(rD_shape, c_dtype))


@cute.jit
def store_smem_tma(e: SmemEpilogue, tma_c, gC_tile, sC, scale, epi_tile: cutlass.Constexpr,
                   epi_stages: cutlass.Constexpr,
                   bar: pipeline.NamedBarrier, is_store_warp, c_dtype: cutlass.Constexpr):
    """Store one output tile: epilogue tiles in row-major order through ``epi_stages``
    shared-memory buffers. Returns once every TMA store has read its buffer, so the next
    tile (or another MMA group sharing ``sC``) may overwrite them."""
    bSG_sC, bSG_gC = cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
        cute.zipped_divide(gC_tile, epi_tile))
    for t in cutlass.range_constexpr(len(e.plan)):
        (epi_m, epi_n), pairs = e.plan[t]
        for q in cutlass.range_constexpr(len(pairs)):
            d, a = pairs[q]
            e.tRS_rD[d] = e.tRS_acc[a]
        e.tRS_out.store((e.tRS_rD.load() * scale).to(c_dtype))
        buf = t % epi_stages
        bar.arrive_and_wait()
        cute.copy(e.r2s, e.tRS_out, e.tRS_sC[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (epi_m, epi_n))])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(epi_stages - 1, read=True)
    if is_store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    bar.arrive_and_wait()


@cute.jit
def store_direct(thr_mma, acc, scale, gD_tile, tile_shape: cutlass.Constexpr, rows, cols,
                 d_dtype: cutlass.Constexpr, fused: cutlass.Constexpr = None):
    """Registers -> global memory: the values of this thread's accumulator that fall inside
    ``rows x cols`` (the tile's valid extent), scaled, with the ``fused`` operations
    (:class:`FusedOps`; with ``"silu_mul"``, ``gD_tile`` is the output's tile, half as wide
    along N as ``tile_shape``) and converted."""
    tCcD = thr_mma.partition_C(cute.make_identity_tensor(tile_shape))
    if cutlass.const_expr(fused is None or not fused.ops):
        tCgD = thr_mma.partition_C(gD_tile)
        vals = cute.make_rmem_tensor_like(acc, d_dtype)
        vals.store((acc.load() * scale).to(d_dtype))
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = tCcD[i]
            if r < rows and c < cols:
                tCgD[i] = vals[i]
    else:
        _store_fused(thr_mma, acc, scale, gD_tile, tCcD, tile_shape, rows, cols, d_dtype,
                     fused)


@cute.jit
def _store_fused(thr_mma, acc, scale, gD_tile, tCcD, tile_shape: cutlass.Constexpr, rows,
                 cols, d_dtype: cutlass.Constexpr, fused: cutlass.Constexpr):
    """:func:`store_direct` with fused operations: bias in FP32, then SiLU-and-mul of each
    gate/up pair, rounded where the unfused pipeline rounds. ``acc`` is overwritten."""
    nm = fused.n_mode
    n_valid = (rows, cols)[nm]
    vals = acc  # in place: the accumulator is dead after its store (and registers are short)
    for i in cutlass.range_constexpr(cute.size(acc)):
        vals[i] = mul_rn(acc[i], scale)
    if cutlass.const_expr("bias" in fused.ops):
        # one load per distinct column of the thread (a D^T thread has 2 per 64 x M tile),
        # then added to each of its values
        for first, members in same_n_values(thr_mma, tile_shape, nm):
            b = fused.gBias[cutlass.min(tCcD[first][nm], n_valid - 1)]
            for i in members:
                vals[i] = vals[i] + b
    if cutlass.const_expr("nvfp4_out" in fused.ops):
        _store_nvfp4(thr_mma, vals, tCcD, tile_shape, rows, cols, d_dtype, fused)
    elif cutlass.const_expr(not gated_op(fused.ops)):
        tCgD = thr_mma.partition_C(gD_tile)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = tCcD[i]
            if r < rows and c < cols:
                tCgD[i] = vals[i].to(d_dtype)
    else:
        gr = fused.group
        if cutlass.const_expr(nm == 0):  # D^T: the gated coordinate is the output's row
            tHgD = thr_mma.partition_C(gated_view(gD_tile, tile_shape, nm, gr))
        for gi, ui in silu_mul_pairs(thr_mma, tile_shape, nm, gr):
            r, c = tCcD[gi]
            h = _gated_value(vals, gi, ui, d_dtype, fused.ops)
            if r < rows and c < cols:
                if cutlass.const_expr(nm == 1):
                    gD_tile[r, c // (2 * gr) * gr + c % gr] = h
                else:
                    tHgD[gi] = h


def gated_view(gD_tile, tile_shape, n_mode: int, group: int):
    """The gated output tile ``gD_tile`` (half as wide along N) seen over the GEMM tile's
    coordinates: N coordinate ``n`` is output column ``n // (2 group) * group + n %
    group``, a gate and its up (``n + group``) the same element. A layout, so that a
    thread's elements are its base address plus static offsets. D^T tiles store through
    it: there the gated coordinate is the output's row (a runtime stride), and the index
    arithmetic per element (``//`` and ``%`` of a thread-dependent row) made a 64-bit
    address per output row that ptxas computed before the K loop and kept across it
    (sm90_rs_packed + bias + silu_mul: 86 spills, 0 with the view, its K loop 131 -> 126
    instructions; sm_90a, 2026-12-06). Along mode 1 the arithmetic stays: the view there
    changed those kernels' K loops by 0 to +3 instructions (register allocation) and
    removed only sm90_decode_64x128_splitk2 + silu_mul's 2 spills."""
    n = tile_shape[n_mode]
    if n % (2 * group):
        raise AssertionError(f"gated tile: N {n} is not a multiple of 2 x {group}")
    stride = gD_tile.layout.stride
    n_layout = cute.make_layout((group, 2, n // (2 * group)),
                                stride=(stride[n_mode], 0, stride[n_mode] * group))
    other = cute.make_layout(tile_shape[1 - n_mode], stride=stride[1 - n_mode])
    modes = (other, n_layout) if n_mode == 1 else (n_layout, other)
    return cute.make_tensor(gD_tile.iterator, cute.make_layout(
        tuple(m.shape for m in modes), stride=tuple(m.stride for m in modes)))


def _gated_value(vals, gi: int, ui: int, d_dtype, ops: tuple):
    """The gated activation of ``ops`` of the gate and up values ``gi``, ``ui`` in
    ``d_dtype``: ``silu(g) * u`` (``"silu_mul"``) or gpt-oss's clamped SwiGLU
    (``"swiglu_oai"``, :func:`swiglu_oai`), rounded where the unfused pipeline on the
    GEMM's ``d_dtype`` output rounds."""
    f32 = cutlass.Float32
    g = f32(vals[gi].to(d_dtype))
    if cutlass.const_expr(gated_op(ops) == "swiglu_oai"):
        return swiglu_oai(g, f32(vals[ui].to(d_dtype)), d_dtype)
    s = f32(silu(g).to(d_dtype))
    return (s * f32(vals[ui].to(d_dtype))).to(d_dtype)


def swiglu_oai(g, u, d_dtype):
    """gpt-oss's clamped SwiGLU of a gate ``g`` and an up ``u`` (FP32 holding ``d_dtype``
    values), each operation rounded to ``d_dtype`` as torch rounds transformers'
    ``GptOssExperts._apply_gate`` on that type: ``g = min(g, 7)``, ``u = clamp(u, -7, 7)``
    (exact; NaN kept, as ``torch.clamp``), ``t = RN(g * fl32(1.702))``, ``s =
    RN(1 / (1 + exp(-t)))`` (torch's CUDA sigmoid: the accurate ``expf`` and an IEEE
    division in FP32), ``glu = RN(g * s)``, ``v = RN(u + 1)``, ``h = RN(v * glu)``; every
    product an explicitly rounded ``mul.rn.f32`` (never contracted into an FMA) before the
    conversion."""
    f32 = cutlass.Float32
    lim = f32(SWIGLU_LIMIT)
    g = cutlass.select_(g > lim, lim, g)
    u = cutlass.select_(u > lim, lim, cutlass.select_(u < -lim, -lim, u))
    t = f32(mul_rn(g, f32(SWIGLU_ALPHA)).to(d_dtype))
    s = f32((f32(1.0) / (f32(1.0) + cute.math.exp(-t, fastmath=False))).to(d_dtype))
    glu = f32(mul_rn(g, s).to(d_dtype))
    v = f32((u + f32(1.0)).to(d_dtype))
    return mul_rn(v, glu).to(d_dtype)


# The block scale of nvfp4's rule (cute_fp4.nvfp4 docstring): $r0 bamax, $r1 gs -> $w0 the
# UE4M3 byte, $w1 d = float(scale) * gs. t = RN(bamax * fl32(1/6)), u = min(RN(t / gs), 448),
# e4m3 by RNE (satfinite), 2^-9 for a non-zero block whose scale rounds to 0.
_NV_SCALE_PTX = "\n".join([
    "{", ".reg .b32 t, u, sfb, sfv;", ".reg .b16 s16, hl, hh;", ".reg .pred p0, p1;",
    "mul.rn.f32 t, {$r0}, 0f3E2AAAAB;", "div.rn.f32 u, t, {$r1};",
    "min.f32 u, u, 0f43E00000;", "cvt.rn.satfinite.e4m3x2.f32 s16, u, u;",
    "cvt.u32.u16 sfb, s16;", "and.b32 sfb, sfb, 255;", "setp.eq.u32 p0, sfb, 0;",
    "setp.gt.f32 p1, {$r0}, 0f00000000;", "and.pred p0, p0, p1;", "@p0 mov.b32 sfb, 1;",
    "cvt.u16.u32 s16, sfb;", "cvt.rn.f16x2.e4m3x2 sfv, s16;", "mov.b32 {hl, hh}, sfv;",
    "cvt.f32.f16 u, hl;", "mul.rn.f32 {$w1}, u, {$r1};", "mov.b32 {$w0}, sfb;", "}"])


def _nv_code_lines(x: str, out: str) -> list[str]:
    """E2M1 code of ``x / d`` into ``out`` (0..15): the IEEE quotient (0 when d is 0), its
    sign from a compare (so -0 gives code 0, as ``quantize``), the magnitude clamped to 6 and
    rounded to the E2M1 grid by one float add (``kernels.quantize``'s M2 constant: the code
    lands in the low mantissa bits)."""
    return [f"@pd div.rn.f32 q, {x}, {{$r2}};", "@!pd mov.b32 q, 0;",
            "setp.lt.f32 ps, q, 0f00000000;", "abs.f32 q, q;", "min.f32 q, q, 0f40C00000;",
            *m2_sum("q"), f"and.b32 {out}, fm, 7;", f"@ps or.b32 {out}, {out}, 8;"]


# $r0, $r1 two adjacent elements (columns 2j, 2j + 1), $r2 d -> $w0 their byte of codes
_NV_PAIR_PTX = "\n".join([
    "{", ".reg .b32 q, ex, em, mg, fm, c0, c1;", ".reg .pred pd, ps;",
    "setp.gt.f32 pd, {$r2}, 0f00000000;", *_nv_code_lines("{$r0}", "c0"),
    *_nv_code_lines("{$r1}", "c1"), "shl.b32 c1, c1, 4;", "or.b32 {$w0}, c0, c1;", "}"])


@cute.jit
def _store_nvfp4(thr_mma, vals, tCcD, tile_shape: cutlass.Constexpr, rows, cols,
                 d_dtype: cutlass.Constexpr, fused: cutlass.Constexpr):
    """``"nvfp4_out"``: each 16-column output block of a row rounded to ``d_dtype`` (after
    bias and the gated activation), then quantized by nvfp4's rule with the given global scale: the
    block amax reduced over the lanes that share the block (:func:`nvfp4_blocks`), the
    scale byte written by the group's first lane into the 128x4 layout, each thread's codes
    as bytes. Scale bytes of padding (rows M .. round_up(M, 128), block columns N_out / 16
    .. round_up(, 4)) are zero, as ``quantize`` leaves them: inside the tile by the block's
    lanes, beyond the last tiles in M and N by every thread of the tile, strided."""
    f32, u8 = cutlass.Float32, cutlass.Uint8
    nm, nv = fused.n_mode, fused.nv
    silu_mul = gated_op(fused.ops) is not None  # a gated activation (silu_mul, swiglu_oai)
    blocks, masks = nvfp4_blocks(thr_mma, tile_shape, nm, fused.ops, fused.group)
    mQ, mSF = nv.out.mQ, nv.out.mSF
    gs = nv.out.mGS[0]
    m_total = mQ.shape[0]
    n_b = mQ.shape[1] // (NV_BLOCK // 2)  # output blocks per row
    kbp = (n_b + 3) // 4 * 4
    out_cols = 2 if silu_mul else 1
    n0_out = fused.n0 // out_cols
    lane = cute.arch.lane_idx()
    leader = (lane & sum(masks)) == 0
    for b in cutlass.range_constexpr(len(blocks)):
        refs, rel = blocks[b].refs, blocks[b].cols
        xs = []
        for j in cutlass.range_constexpr(len(refs)):
            if cutlass.const_expr(silu_mul):
                xs.append(f32(_gated_value(vals, refs[j][0], refs[j][1], d_dtype,
                                           fused.ops)))
            else:
                xs.append(f32(vals[refs[j]].to(d_dtype)))
        amax = abs(xs[0])
        for j in cutlass.range_constexpr(1, len(xs)):
            amax = cute.arch.fmax(amax, abs(xs[j]))
        for mk in cutlass.range_constexpr(len(masks)):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=masks[mk]))
        sfb, d = cute.arch.inline_ptx(_NV_SCALE_PTX, write_only_types=[cutlass.Uint32, f32],
                                      read_only_args=[amax, gs])
        first = refs[0][0] if cutlass.const_expr(silu_mul) else refs[0]
        r, c = tCcD[first][1 - nm], tCcD[first][nm]
        oc = n0_out + (c // (2 * fused.group) * fused.group + c % fused.group
                       if cutlass.const_expr(silu_mul) else c)
        row = nv.row0 + r
        if r < rows and c < cols:
            for j in cutlass.range_constexpr(0, len(xs), 2):
                byte = cute.arch.inline_ptx(_NV_PAIR_PTX, write_only_types=[cutlass.Uint32],
                                            read_only_args=[xs[j], xs[j + 1], d])
                mQ[row, (oc + rel[j]) // 2] = u8(byte)
        blk = oc // NV_BLOCK
        if leader and r < rows and blk < kbp:
            mSF[sf_offset_shifts(row, blk, kbp)] = u8(cutlass.select_(c < cols, sfb,
                                                                      cutlass.Uint32(0)))
    _zero_nvfp4_padding(nv, rows, tile_shape[1 - nm], tile_shape[nm] // out_cols, n0_out,
                        m_total, n_b, kbp)


@cute.jit
def _zero_nvfp4_padding(nv: cutlass.Constexpr, rows, tm: cutlass.Constexpr,
                        tn_out: cutlass.Constexpr, n0_out, m_total, n_b, kbp):
    """Zero the scale bytes of padding no tile holds: rows ``M .. round_up(M, 128)`` below
    the tile that holds row ``M - 1`` (the last tile in M: ``rows <= tm`` valid rows ending
    at M), over its block columns (to ``kbp`` for the last tile in N), and block columns
    past the last tile in N over its valid rows. Every thread of the tile, strided."""
    mSF = nv.out.mSF
    b0 = n0_out // NV_BLOCK
    tb = tn_out // NV_BLOCK
    last_n = b0 + tb >= n_b
    b_hi = cutlass.min(b0 + tb, kbp)
    if last_n:
        b_hi = kbp
    if (rows <= tm) & (nv.row0 + rows == m_total):
        width = b_hi - b0
        for p in cutlass.range(nv.tid, ((m_total + 127) // 128 * 128 - m_total) * width,
                               nv.threads, unroll=1):
            mSF[sf_offset_shifts(m_total + p // width, b0 + p % width, kbp)] = cutlass.Uint8(0)
    if last_n & (b0 + tb < kbp):
        width = kbp - b0 - tb
        for p in cutlass.range(nv.tid, cutlass.min(rows, tm) * width, nv.threads, unroll=1):
            mSF[sf_offset_shifts(nv.row0 + p // width, b0 + tb + p % width, kbp)] = \
                cutlass.Uint8(0)


def split_vector(values: int) -> int:
    """Elements per vector access of a split-K partial of ``values`` per thread slot."""
    return 4 if values % 4 == 0 else 2 if values % 2 == 0 else 1


SPLIT_HEADER = 4  # 32-bit words before a split-K workspace's counters (word 0: see below)


def split_partial_offset(first, tiles, tile, slot, slots: int, split, i, nv: int, vec: int):
    """Word offset in the workspace of value ``i`` (of ``nv``) of thread slot ``slot``'s
    partial for (``split``, ``tile``): the layout of :func:`store_split_k`. Plain integer
    arithmetic: the kernel runs it (``i = 0``, then strides) and the CPU tests check it."""
    row = slots * vec
    return first + ((split * tiles + tile) * (nv // vec) + i // vec) * row + slot * vec + i % vec


def _partial(mWork, first, tiles, tile, slot, slots: int, split, nv: int, vec: int):
    """The ``(vec, nv / vec)`` view of one thread slot's partial (see store_split_k)."""
    base = split_partial_offset(first, tiles, tile, slot, slots, split, 0, nv, vec)
    ptr = mWork.iterator + cute.assume(base, divby=vec)
    return cute.make_tensor(ptr, cute.make_layout((vec, nv // vec), stride=(1, slots * vec)))


@cute.jit
def store_split_k(thr_mma, acc, scale, mWork, mCount, tiles, tile, slot,
                  slots: cutlass.Constexpr, split, split_k: cutlass.Constexpr, gD_tile,
                  tile_shape: cutlass.Constexpr, rows, cols, d_dtype: cutlass.Constexpr,
                  fused: cutlass.Constexpr = None):
    """Split ``split`` of output tile ``tile`` (of ``tiles``): store this thread's partial
    into the workspace, arrive on the counter of this tile and thread ``slot`` (of
    ``slots`` per tile); the last of the ``split_k`` arrivals sums the partials in split
    order and stores ``sum * scale`` (with the ``fused`` operations, converted) into
    ``gD_tile``, masked to
    ``rows x cols``. ``acc`` is overwritten (with the sum, in the last split).

    Workspace (``mWork`` flat FP32 partials, ``mCount`` flat int32: one buffer for eager
    launches, two for a captured one, see ``cute_fp4.run.split_workspace``): ``mCount``
    word 0 holds ``first``, where the partials start in ``mWork`` (a multiple of 4, set
    by the host when it allocates; 0 for a buffer of their own); the counters are words
    ``SPLIT_HEADER ..`` of ``mCount``, zero between launches, ``tile * slots + slot``; in
    one buffer the partials lie past every counter any launch on it uses, so no launch's
    partials ever sit where another's counters are. They
    are kept in the accumulator's own register order, not the output's: value ``i`` of
    slot ``q`` of (split, tile) at ``first + ((split * tiles + tile) * V / v + i / v) *
    slots * v + q * v + i % v`` (``V`` values per slot, ``v`` = :func:`split_vector`), so
    a warp's stores and loads are contiguous 16-byte vectors and need no masks."""
    nv = cute.size(acc)
    vec = split_vector(nv)
    flat = cute.make_rmem_tensor((vec, nv // vec), cutlass.Float32)
    for i in cutlass.range_constexpr(nv):
        flat[i % vec, i // vec] = acc[i]
    first = mCount[0]
    counter = cute.make_tensor(mCount.iterator + (SPLIT_HEADER + tile * slots + slot),
                               cute.make_layout(1))
    cute.autovec_copy(flat, _partial(mWork, first, tiles, tile, slot, slots, split, nv, vec))
    # release: this thread's partial is visible before its arrival; acquire: the partials
    # of the splits that arrived before are visible to the last one
    arrived = cute.arch.atomic_add(counter.iterator, cutlass.Int32(1), sem="acq_rel",
                                   scope="gpu")
    if arrived == split_k - 1:
        for i in cutlass.range_constexpr(nv):
            acc[i] = 0.0
        for s in cutlass.range(split_k, unroll=1):  # a loop: one split's loads live at once
            cute.autovec_copy(_partial(mWork, first, tiles, tile, slot, slots, s, nv, vec),
                              flat)
            for i in cutlass.range_constexpr(nv):
                acc[i] = acc[i] + flat[i % vec, i // vec]
        counter[0] = cutlass.Int32(0)
        store_direct(thr_mma, acc, scale, gD_tile, tile_shape, rows, cols, d_dtype, fused)


__all__ = ["FusedOps", "NvBlock", "NvOut", "NvTile", "SmemEpilogue", "d_tile", "fused_tile",
           "nvfp4_blocks", "silu", "silu_mul_pairs", "smem_epilogue", "store_direct",
           "swiglu_oai", "store_smem_tma", "SPLIT_HEADER", "split_partial_offset", "split_vector",
           "store_split_k", "subtile_sources"]
