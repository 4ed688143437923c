"""The SM120 mainloop feeds every MMA the operands and scales the PTX ISA says, on the CPU.

Run through tests/test_sm120_mainloop.py, in a fresh process.

Traces (no GPU) the kernel's own register fragments and shared-memory -> register copies
(``Sm120Gemm._mma_fragments`` / ``_sf_sources`` over a fake shared-memory storage) and
simulates ``Sm120Gemm.mainloop`` (the copies and MMAs, and which K block / stage each
reads, are recorded by running the kernel's own mainloop body on stand-ins):

* Protocol, for 0 to 5 K tiles (``_schedule_of``): waits / releases in order, copies only
  between a stage's wait and release, no wait on a stage before the same ring buffer's
  previous turn was released (deadlock), every MMA reading registers last loaded from its
  own tile's stage, cooperative tiles waiting for the next stage before the current
  one's last MMAs.
* A / B, per K tile that uses its own registers (the first; the second too with tile
  K 64, whose two tiles alternate register buffers): each lane's ``ldmatrix`` row
  address is taken from the copy's source partition; the 16 bytes there are checked
  contiguous through the byte-address swizzle, and the hardware's ldmatrix rule (lane
  ``l``, register ``j`` <- 32-bit word ``l % 4`` of the row supplied by lane
  ``8 j + l // 4``; ``.x4``: j < 4, ``.x2``: j < 2) fills the registers the copy's retiled
  destination names. Each MMA then reads ``tCrA[None, mi, kb]`` / ``tCrB[None, ni, kb]``.
* The register contents are compared with the ISA fragment layout of
  ``mma.m16n8k64 ... .e2m1`` (independent model below): every MMA row / column / K must be
  one consistent tile coordinate, A and B must agree on K, the K steps of a tile must
  cover every k once, the warps' MMAs every (m, n) once, and the accumulator's (m, n)
  (``partition_C``, what the epilogue stores) must be the ISA's C fragment of that MMA.
* Scales: the universal byte copies (``filter_zeros`` on both sides, as the kernel does)
  from the stage's shared-memory bytes (whose (row, scale column) follows from the layout
  TMA / cp.async write, ``sSFA_layout``) into ``tCrSFA``; byte ``j`` of each MMA's scale
  register must be the scale of that lane's ISA row / column and of the j-th 16-wide K
  block of the K the MMA's A / B registers hold, for every sub-tile of the 128-row atom.

The ISA model (``isa_*``) is CUTLASS's ``MMA_Traits<SM120_16x8x64_TN_VS>`` ALayout
``((4,8),(8,2,2)):((128,1),(16,8,512))``, BLayout ``((4,8),(8,2)):((64,1),(8,256))``, the
SM80 16x8 C layout and ``SFALayout``/``SFBLayout`` (sf_layout.py), written out per lane.
Facts read off the PTX (``--keep-ptx``, 128x128x128) that the model relies on: the MMA is
issued with ``{bidA, tidA} = {bidB, tidB} = {0, 0}``, and each lane's SFA register is one
``ld.shared.b32`` of its 4 contiguous scale bytes (byte j = fragment offset j).

With 4 MMA warps along N (64x128 and 32x128, warps 2x4) a warp's B columns of one MMA
permutation step are 8 rows: each B ``ldmatrix.x4`` takes two consecutive steps
(``Sm120Gemm._copy_b``; tiled like the MMA, an ``.x4`` loaded the same 8 rows twice, its
retiled destination aliasing registers 2, 3 onto 0, 1).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from cute_fp4.kernels import sf_layout
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem, Schedule, Tile, WarpRoles, Warps

pytestmark = pytest.mark.compile

CASES = {
    "default_128x128x128": Schedule(tile=Tile(128, 128, 128)),
    "k64": Schedule(tile=Tile(128, 128, 64)),
    "k256": Schedule(tile=Tile(128, 128, 256)),
    "64x128_w2x4": Schedule(tile=Tile(64, 128, 128), warps=Warps(mma=(2, 4))),
    "128x64": Schedule(tile=Tile(128, 64, 128)),
    "pingpong_w2x2": Schedule(warps=Warps(roles=WarpRoles.PINGPONG, mma=(2, 2))),
    # grouped decode's tile (B: one ldmatrix.x4 per two MMA steps, one MMA row per warp)
    "32x128_w2x4": Schedule(tile=Tile(32, 128, 128), warps=Warps(mma=(2, 4))),
    # a single MMA step along N for 4 warps: B by ldmatrix.x2
    "64x32_w2x4": Schedule(tile=Tile(64, 32, 128), warps=Warps(mma=(2, 4))),
    # two register buffers, B paired over two MMA steps, scale sub-atoms
    "64x128x64_w2x4": Schedule(tile=Tile(64, 128, 64), warps=Warps(mma=(2, 4))),
}


# ----------------------------------------------------------------------------- ISA model
# PTX ISA, mma.m16n8k64 with .e2m1 (".kind::mxf4nvf4"): groupID = lane >> 2,
# threadID_in_group = lane % 4; element i of a fragment is nibble i % 8 of register i // 8.

def isa_a(lane, i):
    """(row, k) of a_i (i < 32; 4 registers)."""
    g, t = lane // 4, lane % 4
    return g + 8 * ((i // 8) % 2), 8 * t + i % 8 + 32 * (i // 16)


def isa_b(lane, i):
    """(k, col) of b_i (i < 16; 2 registers)."""
    g, t = lane // 4, lane % 4
    return 8 * t + i % 8 + 32 * (i // 8), g


def isa_c(lane, i):
    """(row, col) of c_i (i < 4; f32)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + i % 2


def isa_sf(lane, operand):
    """Row (A, 0..15) / column (B, 0..7) of the lane's scale register (every lane of the
    quad carries it; the thread-id selector picks which copy is read)."""
    return (lane // 4 + 8 * (lane % 2)) if operand == "A" else lane // 4


# ----------------------------------------------------------------------------- helpers

def _leaves(x):
    if isinstance(x, tuple):
        return [y for e in x for y in _leaves(e)]
    return [x]


_MODES: dict = {}


def _modes(layout):
    """[(leaf shapes, leaf strides)] per top-level mode."""
    key = id(layout)
    hit = _MODES.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    out = _modes_uncached(layout)
    _MODES[key] = (layout, out)
    return out


def _modes_uncached(layout):
    shp, std = layout.shape, layout.stride
    if not isinstance(shp, tuple):
        shp, std = (shp,), (std,)

    def conv(d):  # ScaledBasis (identity tensors) -> (mode path, value)
        return (tuple(d.mode), int(d.value)) if hasattr(d, "mode") else d

    return [(_leaves(s), [conv(d) for d in _leaves(t)]) for s, t in zip(shp, std)]


def _size(ms):
    n = 1
    for s in ms:
        n *= s
    return n


def _flat_index(layout, coord):
    """Flat (colexicographic) index of a top-level coordinate (ints per top mode)."""
    i, mul = 0, 1
    for (ms, _), c in zip(_modes(layout), coord):
        i += c * mul
        mul *= _size(ms)
    return i


def _leaf_coords(layout, i):
    out = []
    for ms, _ in _modes(layout):
        for s in ms:
            out.append(i % s)
            i //= s
    return out


_TABLE: dict = {}


def _offset(layout, i):
    """Integer layout at flat index ``i``."""
    key = id(layout)
    hit = _TABLE.get(key)
    if hit is None or hit[0] is not layout:
        strides = [d for _, ds in _modes(layout) for d in ds]
        n = _size([s for ms, _ in _modes(layout) for s in ms])
        hit = (layout, [sum(c * d for c, d in zip(_leaf_coords(layout, j), strides))
                        for j in range(n)])
        _TABLE[key] = hit
    return hit[1][i]


def _paths(x, pre=()):
    if isinstance(x, tuple):
        return [p for i, e in enumerate(x) for p in _paths(e, pre + (i,))]
    return [pre]


_IDENT: dict = {}


def _ident_prep(tensor):
    hit = _IDENT.get(id(tensor))
    if hit is not None and hit[0] is tensor:
        return hit[1]
    it = tensor.iterator
    pos = {p: n for n, p in enumerate(_paths(it))}
    layout = tensor.layout
    strides = [(0, 0) if d == 0 else (pos[d[0]], d[1]) for _, ds in _modes(layout) for d in ds]
    prep = (list(_leaves(it)), layout, strides)
    _IDENT[id(tensor)] = (tensor, prep)
    return prep


def _ident_leaves(tensor, i):
    """Leaf coordinates of element ``i`` of a partitioned identity tensor."""
    base, layout, strides = _ident_prep(tensor)
    base = list(base)
    for c, (p, v) in zip(_leaf_coords(layout, i), strides):
        if c:
            base[p] += c * v
    return base


def _ident(tensor, i):
    """Coordinate (flat tuple) of element ``i`` of a partitioned flat identity tensor."""
    return tuple(_ident_leaves(tensor, i))


def _eval_flat(layout, coord):
    """Layout (hierarchical modes) at a coordinate with one int per top-level mode."""
    off = 0
    for (ms, ds), c in zip(_modes(layout), coord):
        for s, d in zip(ms, ds):
            off += (c % s) * d
            c //= s
    return off


def _swizzle(sw):
    b, m, s = (int(v) for v in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", str(sw)).groups())
    mask = ((1 << b) - 1) << (m + s)
    return lambda x: x ^ ((x & mask) >> s)


def _filtered_order(full_layout, filtered_layout, fixed):
    """Flat indices of ``full_layout`` in the element order of ``filter_zeros`` of it,
    restricted to the given top-mode coordinates ``fixed`` ({mode: coord})."""
    full, filt = _modes(full_layout), _modes(filtered_layout)
    key = (tuple(tuple(a) for a, _ in full), tuple(tuple(a) for a, _ in filt),
           tuple(sorted(fixed.items())))
    if key not in _ORDER:
        _ORDER[key] = _filtered_order_uncached(full_layout, full, filt, fixed)
    return _ORDER[key]


_ORDER: dict = {}


def _filtered_order_uncached(full_layout, full, filt, fixed):
    assert [len(a) for a, _ in full] == [len(a) for a, _ in filt], (full, filt)
    keep = []
    for (fs, _), (gs, _) in zip(full, filt):
        for a, b in zip(fs, gs):
            assert b in (a, 1)
            keep.append(b == a)
    out = []
    for i in range(_size([s for ms, _ in full for s in ms])):
        lc = _leaf_coords(full_layout, i)
        if any(c and not k for c, k in zip(lc, keep)):
            continue
        top, pos = [], 0
        for ms, _ in full:
            c, mul = 0, 1
            for s in ms:
                c += lc[pos] * mul
                mul *= s
                pos += 1
            top.append(c)
        if all(top[m] == v for m, v in fixed.items()):
            out.append(i)
    return out


class _Range:
    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        import cutlass.cute as cute
        return cute.make_ptr(self.dtype, 0, cute.AddressSpace.smem, assumed_align=1024)

    def get_tensor(self, layout, swizzle=None):
        # The swizzle (on the pointer, byte addresses, as TMA and ldmatrix see them) is
        # applied by the test itself (_swizzle); the partitions only need the layout.
        import cutlass.cute as cute
        return cute.make_tensor(self.data_ptr(), layout)


class _Storage:
    def __init__(self):
        import cutlass
        self.sA = _Range(cutlass.Float4E2M1FN)
        self.sB = _Range(cutlass.Float4E2M1FN)
        self.sSFA = _Range(cutlass.Uint8)
        self.sSFB = _Range(cutlass.Uint8)


# ----------------------------------------------------------------------------- tracing

def _ldmatrix_regs(k, f, thr_copy, ident, src_key, dst_key, n_threads, stage, pairs,
                   errors):
    """{thread: {register offset: (row, k)}} after the kernel's ldmatrix copies of one
    stage, simulated with the hardware rule from the copy's per-lane row addresses."""
    import cutlass.cute as cute

    outer = k.sA_layout.outer if src_key == "tCsA" else k.sB_layout.outer
    inner = k.sA_layout.inner if src_key == "tCsA" else k.sB_layout.inner
    swz = _swizzle(inner)
    rows = {}
    regs = {}
    calls = None
    for t in range(n_threads):
        src_i = thr_copy[t].partition_S(ident)
        src_k = getattr(f[t], src_key)
        assert cute.size(src_i) == cute.size(src_k)
        sl = _ident_prep(src_i)[1]
        _, n_cm, n_ck, _ = (_size(ms) for ms, _ in _modes(sl))
        n_v = _size(_modes(sl)[0][0])
        assert n_v % 32 == 0
        calls = n_v // 32  # ldmatrix issues per (rows, k block): one 16-byte row per lane
        for cm in range(n_cm):
            for ck in {src_ck for src_ck, _ in pairs}:
                for q in range(calls):
                    coords, nibs = [], []
                    for e in range(32):
                        c = _ident(src_i, _flat_index(sl, (32 * q + e, cm, ck, stage)))
                        o = _eval_flat(outer, c)
                        nibs.append(2 * swz(o // 2) + o % 2)
                        coords.append(c)
                    if nibs != list(range(nibs[0], nibs[0] + 32)) or nibs[0] % 32:
                        errors.append(f"{src_key} t{t}: ldmatrix row not 16 contiguous "
                                      f"aligned bytes")
                    rows[t, cm, ck, q] = coords
    for t in range(n_threads):
        w, lane = divmod(t, 32)
        rl = getattr(f[t], dst_key).layout
        per_call = _size(_modes(rl)[0][0]) // calls  # 8 nibbles per register
        n_mat = per_call // 8  # .x4 or .x2
        if n_mat not in (2, 4) or per_call % 8:
            errors.append(f"{dst_key}: {per_call} values per ldmatrix")
            return regs
        _, n_cm, n_ck = (_size(ms) for ms, _ in _modes(rl))
        r = regs.setdefault(t, {})
        for cm in range(n_cm):
            for src_ck, ck in pairs:
                for q in range(calls):
                    for j in range(n_mat):
                        src = rows[32 * w + 8 * j + lane // 4, cm, src_ck, q]
                        for e in range(8):
                            off = _offset(rl, _flat_index(
                                rl, (per_call * q + 8 * j + e, cm, ck)))
                            if off in r and r[off] != src[8 * (lane % 4) + e]:
                                errors.append(f"{dst_key} t{t}: register {off} written twice "
                                              f"with different data")
                            r[off] = src[8 * (lane % 4) + e]
    return regs


def _sf_regs(k, f, thr_copy, ident, frag_key, src_f, dst_f, alloc_layout, stage, sub,
             view_off, n_threads, pairs):
    """{thread: {register byte: (atom row, scale column)}} after the scale copies."""
    import cutlass.cute as cute

    inverse = {}
    rows = cute.size(alloc_layout, mode=[0])
    for r in range(rows):
        for kk in range(0, k.tile_mnk[2], k.fmt.block):
            inverse[_eval_flat(alloc_layout, (r, kk, stage))] = (r, kk // k.fmt.block)
    out = {}
    view_strides = [d for _, ds in _modes(sub) for d in ds]
    for t in range(n_threads):
        thr = thr_copy[t]
        src_i = thr.partition_S(ident)
        dst_full = thr.retile(getattr(f[t], frag_key))
        sl, dl = _ident_prep(src_i)[1], dst_full.layout
        _, n_cm, n_kb, _ = (_size(ms) for ms, _ in _modes(sl))
        r = out.setdefault(t, {})
        for src_kb, kb in pairs:
            s_idx = _filtered_order(sl, src_f[t].layout, {2: src_kb, 3: stage})
            d_idx = _filtered_order(dl, dst_f[t].layout, {2: kb})
            assert len(s_idx) == len(d_idx) > 0
            for a, b in zip(s_idx, d_idx):
                c = _ident_leaves(src_i, a)
                byte = view_off + sum(x * d for x, d in zip(c, view_strides))
                r[_offset(dl, b)] = inverse.get(byte, ("not this stage's scales", byte))
    return out


class _Off:
    """Pointer stand-in: records the offset ``Sm120Gemm._sub_atom`` adds."""

    def __init__(self, off=0):
        self.off = off

    def __add__(self, x):
        return _Off(self.off + x)


class _Tok:
    """Stands for one of the kernel's tensors in the recorded mainloop; indexing records."""

    def __init__(self, name, real=None, idx=None):
        self.name, self.real, self.idx = name, real, idx

    def __getitem__(self, idx):
        """Slicing a slice fills the earlier slice's free (None) modes in order, as CuTe
        does: ``t[None, None, kb, None][None, None, s]`` is ``t[None, None, kb, s]``."""
        if self.idx is not None:
            rest = iter(idx)
            idx = tuple(next(rest) if i is None else i for i in self.idx)
        return _Tok(self.name, None, idx)


STAGE = "stage"
K_TILES = 2  # the ISA check records two K tiles: stage0, then stage1 (both register buffers)
PROTOCOL_K_TILES = range(6)  # the protocol check: no tile, the peeled tail, odd, even, loops


def _record_mainloop(k, f, k_tiles=K_TILES):
    """The copies and MMAs ``Sm120Gemm.mainloop`` issues for ``k_tiles`` K tiles, in order.

    Runs the kernel's own mainloop body (undecorated) on stand-ins: ``cute.copy`` /
    ``cute.gemm`` record which slices they get, the pipeline records wait / release of
    each stage (``stage0``, ``stage1``, ...).
    """
    import cutlass
    import cutlass.cute as cute

    import cute_fp4.kernels.sm120_mainloop as mod  # where Sm120Gemm.mainloop lives

    calls = []

    class Cute:
        def __getattr__(self, a):
            return getattr(cute, a)

        def copy(self, atom, src, dst, **kw):
            calls.append(("copy", atom.name, src.name, src.idx, dst.name, dst.idx))

        def gemm(self, mma, d, a, b, c):
            calls.append(("gemm", tuple((x.name, x.idx) for x in a),
                          tuple((x.name, x.idx) for x in b), d.name, c.name))

        def size(self, x, mode=None):
            return cute.size(x.real if isinstance(x, _Tok) else x, mode=mode)

    class Cutlass:
        def __getattr__(self, a):
            return getattr(cutlass, a)

        def range(self, n, unroll=None):
            return range(n)

        def range_constexpr(self, *n):
            return range(*n)

        def const_expr(self, x):
            return x

        def select_(self, cond, a, b):
            return a if cond else b

    class State:
        def __init__(self, n=0):
            self.n = n

        @property
        def index(self):
            return f"{STAGE}{self.n}"

        def advance(self):
            calls.append(("advance", self.index))
            self.n += 1

        def clone(self):
            return State(self.n)

    class Pipe:
        def consumer_wait(self, state):
            calls.append(("wait", state.index))

        def consumer_release(self, state):
            calls.append(("release", state.index))

    toks = type(f)(**{key: _Tok(key, v) for key, v in f._asdict().items()})
    sf_names = ("tCsSFA", "tCrSFA_v", "tCsSFB", "tCrSFB_v")
    k._sf_sources = lambda f, cm, cn: tuple(_Tok(n) for n in sf_names)
    saved = mod.cute, mod.cutlass
    mod.cute, mod.cutlass = Cute(), Cutlass()
    try:
        type(k).mainloop.__wrapped__(k, Pipe(), State(), toks, k_tiles, 0, 0)
    finally:
        mod.cute, mod.cutlass = saved
        del k._sf_sources
    return calls


def _schedule_of(calls, errors, n_kb, early, k_tiles=K_TILES, n_stages=None):
    """Per K tile: (copies {dst name: [(src k block, dst register k block)]} from its stage,
    MMAs [{operand: register k block}]), checking the pipeline protocol on the way:

    * a stage is copied from only between its wait and its release, each stage is waited
      for and released once, in order;
    * ``n_stages``: stage t is waited for only after stage t - n_stages (the same buffer,
      one turn of the ring earlier) was released; otherwise the producer can never refill
      it and the kernel hangs (what the emulated H200 run found with one stage);
    * every MMA of K tile t reads, for each operand, fragments whose latest load came from
      stage t (a later load into the same registers before the MMA is caught);
    * ``early`` (cooperative tiles): the next stage is waited for before the current
      stage's last MMAs, which use fragments loaded before that wait.
    """
    copies = [{} for _ in range(k_tiles)]
    mmas = [[] for _ in range(k_tiles)]
    latest = {}
    waits, releases = [], []
    expect = {"tCrA_v": "tCsA", "tCrB_v": "tCsB", "tCrSFA_v": "tCsSFA",
              "tCrSFB_v": "tCsSFB"}
    frag_of = {"tCrA": "tCrA_v", "tCrB": "tCrB_v", "tCrSFA": "tCrSFA_v",
               "tCrSFB": "tCrSFB_v"}
    tile_of = {f"{STAGE}{t}": t for t in range(k_tiles)}
    gemm_at, wait_at = [], {}
    for pos, c in enumerate(calls):
        if c[0] == "wait":
            t = tile_of.get(c[1], -1)
            if n_stages and t >= n_stages and f"{STAGE}{t - n_stages}" not in releases:
                errors.append(f"{c[1]} waited for before {STAGE}{t - n_stages} (the same "
                              f"buffer of {n_stages} stages) was released: deadlock")
            waits.append(c[1])
            wait_at[c[1]] = pos
        elif c[0] == "release":
            if c[1] not in waits:
                errors.append(f"{c[1]} released before its wait")
            releases.append(c[1])
        elif c[0] == "copy":
            _, _, src, si, dst, di = c
            if expect.get(dst) != src or si[:2] != (None, None) or di[:2] != (None, None) \
                    or len(si) != 4 or len(di) != 3:
                errors.append(f"unexpected copy {c}")
                continue
            if si[3] not in waits or si[3] in releases:
                errors.append(f"copy {c} outside its stage's wait .. release")
            latest[(dst, di[2])] = (si[3], si[2])
            if si[3] in tile_of:
                copies[tile_of[si[3]]].setdefault(dst, []).append((si[2], di[2]))
        elif c[0] == "gemm":
            _, a, b, d, cc = c
            tile = len(gemm_at) // n_kb
            gemm_at.append(pos)
            if (d, cc) != ("acc", "acc"):
                errors.append(f"gemm does not accumulate in place: {c}")
            mma = {}
            for name, idx in a + b:
                if idx[:2] != (None, None) or len(idx) != 3:
                    errors.append(f"unexpected gemm operand {name}{idx}")
                mma[name] = idx[2]
                got = latest.get((frag_of[name], idx[2]))
                if got is None or got[0] != f"{STAGE}{tile}":
                    errors.append(f"K tile {tile}: gemm reads {name}[{idx[2]}] loaded from "
                                  f"{got}")
            if sorted(mma) != ["tCrA", "tCrB", "tCrSFA", "tCrSFB"]:
                errors.append(f"gemm operands {sorted(mma)}")
            if tile < k_tiles:
                mmas[tile].append(mma)
    want = [f"{STAGE}{t}" for t in range(k_tiles)]
    if waits != want or releases != want:
        errors.append(f"waits {waits} / releases {releases}, expected each of {want} once")
    if len(gemm_at) != k_tiles * n_kb:
        errors.append(f"{len(gemm_at)} gemms for {k_tiles} K tiles of {n_kb} K blocks")
    for t in range(k_tiles - 1):
        nxt = wait_at.get(f"{STAGE}{t + 1}")
        last = (t + 1) * n_kb - 1
        if early and nxt is not None and last < len(gemm_at) and nxt > gemm_at[last]:
            errors.append(f"stage{t + 1} is waited for after K tile {t}'s last MMAs")
    return copies, mmas


def _trace(schedule, corrupt=None):
    import cutlass.cute as cute

    from cute_fp4.kernels.sm120 import Sm120Gemm

    k = Sm120Gemm(schedule)
    res = {"errors": []}

    def walk():
        k._setup()
        errors = res["errors"]
        nt = k.group_threads
        f = res["fragments"] = [k._mma_fragments(_Storage(), t) for t in range(nt)]
        n_kb = k.tile_mnk[2] // sf_layout.MMA_K
        early = not k.pingpong
        for kt in PROTOCOL_K_TILES:
            slips = []
            _schedule_of(_record_mainloop(k, f[0], kt), slips, n_kb, early, kt, k.stages)
            errors.extend(f"{kt} K tiles: {e}" for e in slips)
        copies, mmas = _schedule_of(_record_mainloop(k, f[0]), errors, n_kb, early,
                                    K_TILES, k.stages)
        if corrupt:
            corrupt(copies[0], mmas[0])
        # recorded stage t is ring stage (last + t) % stages (the stage index must be
        # honoured); a later tile is checked when it uses other registers (tile K 64:
        # two register buffers)
        for t in range(K_TILES):
            if t == 0 or (copies[t], mmas[t]) != (copies[0], mmas[0]):
                check_tile(copies[t], mmas[t], (k.stages - 1 + t) % k.stages)

    def check_tile(copies, mmas, stage):
        """The ISA check of one recorded K tile (its copies and MMAs) from ring ``stage``."""
        errors = res["errors"]
        tm, tn, tk = k.tile_mnk
        nt = k.group_threads
        f = res["fragments"]
        mma = k.tiled_mma
        ca = [f[t].copy_a.get_slice(t) for t in range(nt)]
        cb = [f[t].copy_b.get_slice(t) for t in range(nt)]
        regs_a = _ldmatrix_regs(k, f, ca, cute.make_identity_tensor((tm, tk, k.stages)),
                                "tCsA", "tCrA_v", nt, stage, copies["tCrA_v"], errors)
        regs_b = _ldmatrix_regs(k, f, cb, cute.make_identity_tensor((tn, tk, k.stages)),
                                "tCsB", "tCrB_v", nt, stage, copies["tCrB_v"], errors)

        # Per MMA (warp, mi / ni, g-th gemm): the tile row / column / k of each ISA index.
        m_of, n_of, ka_of, kb_of = {}, {}, {}, {}

        def note(table, key, idx, val, what):
            cur = table.setdefault(key, {})
            if cur.setdefault(idx, val) != val:
                errors.append(f"{what} {key} index {idx}: {cur[idx]} vs {val}")

        def reg(regs, t, off, what):
            if off not in regs[t]:
                errors.append(f"{what} t{t}: register {off} read but never loaded")
                return None
            return regs[t][off]

        for t in range(nt):
            w, lane = divmod(t, 32)
            fa, fb = f[t].tCrA.layout, f[t].tCrB.layout
            (va, _), (ma, _), _ = _modes(fa)
            (vb, _), (nb, _), _ = _modes(fb)
            for g, mm in enumerate(mmas):
                for mi in range(_size(ma)):
                    for i in range(_size(va)):
                        got = reg(regs_a, t, _offset(fa, _flat_index(fa, (i, mi, mm["tCrA"]))),
                                  "A")
                        if got is None:
                            continue
                        m, kk, s = got
                        row, col = isa_a(lane, i)
                        if s != stage:
                            errors.append(f"A t{t}: stage {s}")
                        note(m_of, (w, mi), row, m, "A row")
                        note(ka_of, (w, mi, g), col, kk, "A k")
                for ni in range(_size(nb)):
                    for i in range(_size(vb)):
                        got = reg(regs_b, t, _offset(fb, _flat_index(fb, (i, ni, mm["tCrB"]))),
                                  "B")
                        if got is None:
                            continue
                        n, kk, s = got
                        krow, col = isa_b(lane, i)
                        if s != stage:
                            errors.append(f"B t{t}: stage {s}")
                        note(n_of, (w, ni), col, n, "B col")
                        note(kb_of, (w, ni, g), krow, kk, "B k")
        if errors:
            return

        n_mi = max(mi for _, mi in m_of) + 1
        n_ni = max(ni for _, ni in n_of) + 1
        warps = nt // 32
        # K: A and B agree per MMA; a K tile's MMAs cover every k once.
        for w in range(warps):
            for mi in range(n_mi):
                ks = [ka_of[w, mi, g][c] for g in range(len(mmas)) for c in range(64)]
                if sorted(ks) != list(range(tk)):
                    errors.append(f"A warp {w} mi {mi}: the MMAs do not cover K once")
                for ni in range(n_ni):
                    for g in range(len(mmas)):
                        if ka_of[w, mi, g] != kb_of[w, ni, g]:
                            errors.append(f"warp {w} mi {mi} ni {ni} MMA {g}: A/B K differ")
            for ni in range(n_ni):
                ks = [kb_of[w, ni, g][c] for g in range(len(mmas)) for c in range(64)]
                if sorted(ks) != list(range(tk)):
                    errors.append(f"B warp {w} ni {ni}: the MMAs do not cover K once")
        # (m, n): every output once over all warps' MMAs.
        cover = Counter((m_of[w, mi][r], n_of[w, ni][c]) for w in range(warps)
                        for mi in range(n_mi) for ni in range(n_ni)
                        for r in range(16) for c in range(8))
        if set(cover.values()) != {1} or len(cover) != tm * tn:
            errors.append(f"MMAs cover {len(cover)} of {tm * tn} outputs, "
                          f"max {max(cover.values())} times")
        # Accumulator: partition_C's (m, n) is the ISA's C element of that MMA.
        ident_c = cute.make_identity_tensor((tm, tn))
        for t in range(nt):
            w, lane = divmod(t, 32)
            pc = mma.get_slice(t).partition_C(ident_c)
            acc = f[t].acc.layout
            pl = _ident_prep(pc)[1]
            assert [_size(ms) for ms, _ in _modes(pl)] == [
                _size(ms) for ms, _ in _modes(acc)]
            for mi in range(n_mi):
                for ni in range(n_ni):
                    for i in range(4):
                        row, col = isa_c(lane, i)
                        want = (m_of[w, mi][row], n_of[w, ni][col])
                        got = _ident(pc, _flat_index(pl, (i, mi, ni)))
                        if got != want:
                            errors.append(f"acc t{t} ({i},{mi},{ni}): epilogue {got}, "
                                          f"MMA {want}")

        # Scale factors, for every sub-tile of the 128-row atom.
        for op, tile_rows, key, m_tab in (("A", tm, "tCrSFA", m_of), ("B", tn, "tCrSFB", n_of)):
            view = k.sSFA_view if op == "A" else k.sSFB_view
            alloc = k.sSFA_layout if op == "A" else k.sSFB_layout
            thr = [getattr(f[t], "thr_sfa" if op == "A" else "thr_sfb") for t in range(nt)]
            ident = cute.make_identity_tensor(cute.shape(view))
            ratio = sf_layout.ATOM_ROWS // tile_rows
            k_of = ka_of if op == "A" else kb_of
            for sub in range(ratio):
                srcs = [k._sf_sources(f[t], sub, sub) for t in range(nt)]
                s_f = [s[0] if op == "A" else s[2] for s in srcs]
                d_f = [s[1] if op == "A" else s[3] for s in srcs]
                off = Sm120Gemm._sub_atom(_Off(), sub, tile_rows).off  # kernel's offset
                if off != sf_layout.sf_view_offset(tile_rows, sub):
                    errors.append(f"SF{op} sub-tile {sub}: view offset {off}")
                regs = _sf_regs(k, f, thr, ident, key, s_f, d_f, alloc, stage, view, off, nt,
                                copies[key + "_v"])
                for t in range(nt):
                    w, lane = divmod(t, 32)
                    frag = getattr(f[t], key).layout
                    (_, _), (rm, _), _ = _modes(frag)
                    for mi in range(_size(rm)):
                        for g, mm in enumerate(mmas):
                            ks = k_of[w, mi, g]
                            r_isa = isa_sf(lane, op)
                            for j in range(4):
                                blocks = {ks[c] // k.fmt.block
                                          for c in range(16 * j, 16 * j + 16)}
                                offs = {_offset(frag, _flat_index(frag, (v, mi, mm[key])))
                                        for v in range(16 * j, 16 * j + 16)}
                                if len(blocks) != 1 or len(offs) != 1:
                                    errors.append(f"SF{op} t{t}: byte {j} spans {blocks}")
                                    continue
                                want = (sub * tile_rows + m_tab[w, mi][r_isa], blocks.pop())
                                got = regs[t].get(offs.pop())
                                if got != want:
                                    errors.append(f"SF{op} t{t} MMA ({mi},{g}) byte {j} "
                                                  f"sub {sub}: has {got}, needs {want}")
        res["n_mma"] = warps * n_mi * n_ni * len(mmas)

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options="--gpu-arch sm_120a")
    return res


def _protocol(schedule):
    """Protocol errors of the mainloop for 0 .. 5 K tiles (no ISA check: one thread)."""
    import cutlass.cute as cute

    from cute_fp4.kernels.sm120 import Sm120Gemm

    k = Sm120Gemm(schedule)
    errors = []

    @cute.jit
    def probe():
        k._setup()
        f = k._mma_fragments(_Storage(), 0)
        for kt in PROTOCOL_K_TILES:
            slips = []
            _schedule_of(_record_mainloop(k, f, kt), slips, k.tile_mnk[2] // sf_layout.MMA_K,
                         not k.pingpong, kt, k.stages)
            errors.extend(f"{kt} K tiles: {e}" for e in slips)

    cute.compile(probe, options="--gpu-arch sm_120a")
    return k.stages, errors


STAGE_CASES = {f"{name}_stages{n}": CASES[name].replace(stages=n)
               for name in ("default_128x128x128", "k64", "k256", "pingpong_w2x2")
               for n in (1, 2) if plan(CASES[name].replace(stages=n), Problem()).ok}


@pytest.mark.parametrize("name", list(STAGE_CASES))
def test_mainloop_protocol_with_few_stages(name):
    """One or two stages (the emulated runs force them): no wait before the same buffer's
    release (the hang the H200 found), the rest of the protocol as above."""
    stages, errors = _protocol(STAGE_CASES[name])
    assert stages == STAGE_CASES[name].stages and errors == []


@pytest.mark.parametrize("name", list(CASES))
def test_mainloop_operands_match_isa(name):
    res = _trace(CASES[name])
    assert res["errors"][:10] == [] and res["n_mma"] > 0


def _swap_sfb_k_blocks(copies, mmas):
    """A plausible slip: the scale copy of B fed from the wrong K block of the stage."""
    copies["tCrSFB_v"] = [(1 - src, dst) for src, dst in copies["tCrSFB_v"]]


def _skip_a_k_block(copies, mmas):
    """Another: the A copy of the last K step reads the previous step's data."""
    copies["tCrA_v"] = [(min(src, 1 - dst % 2), dst) for src, dst in copies["tCrA_v"]]


@pytest.mark.parametrize("corrupt", [_swap_sfb_k_blocks, _skip_a_k_block])
def test_mainloop_check_catches_mistakes(corrupt):
    res = _trace(CASES["pingpong_w2x2"], corrupt)
    assert res["errors"]


def test_schedule_check_catches_protocol_slips():
    """The pipeline-protocol checks fail on a recorded schedule with a slip."""
    def cp(frag, stage, kb):
        src = {"tCrA_v": "tCsA", "tCrB_v": "tCsB", "tCrSFA_v": "tCsSFA",
               "tCrSFB_v": "tCsSFB"}[frag]
        return ("copy", "atom", src, (None, None, kb, f"{STAGE}{stage}"), frag,
                (None, None, kb))

    def loads(stage, kb):
        return [cp(x, stage, kb) for x in ("tCrA_v", "tCrB_v", "tCrSFA_v", "tCrSFB_v")]

    def gemm(kb):
        return ("gemm", (("tCrA", (None, None, kb)), ("tCrSFA", (None, None, kb))),
                (("tCrB", (None, None, kb)), ("tCrSFB", (None, None, kb))), "acc", "acc")

    good = ([("wait", "stage0")] + loads(0, 0) + loads(0, 1) + [gemm(0)]
            + [("wait", "stage1")] + loads(1, 0) + [("release", "stage0"), gemm(1)]
            + loads(1, 1) + [gemm(0), ("release", "stage1"), gemm(1)])
    errors = []
    _schedule_of(good, errors, 2, True)
    assert errors == []
    # the next stage's first block lands in registers the current MMA still reads
    clobber = good[:11] + loads(1, 1) + good[11:]
    errors = []
    _schedule_of(clobber, errors, 2, True)
    assert any("loaded from ('stage1'" in e for e in errors), errors
    # a copy after its stage was released
    late = good[:-1] + loads(0, 0) + good[-1:]
    errors = []
    _schedule_of(late, errors, 2, True)
    assert any("outside its stage's wait" in e for e in errors), errors
    # the next stage waited for only after the current stage's last MMAs
    by_stage = ([("wait", "stage0")] + loads(0, 0) + loads(0, 1)
                + [gemm(0), ("release", "stage0"), gemm(1), ("wait", "stage1")]
                + loads(1, 0) + loads(1, 1) + [gemm(0), ("release", "stage1"), gemm(1)])
    errors = []
    _schedule_of(by_stage, errors, 2, True)
    assert errors == ["stage1 is waited for after K tile 0's last MMAs"]
    errors = []
    _schedule_of(by_stage, errors, 2, False)  # pingpong's order is fine there
    assert errors == []
    # with a single stage, waiting for the next tile before releasing the current one
    errors = []
    _schedule_of(good, errors, 2, True, n_stages=1)
    assert len(errors) == 1 and "deadlock" in errors[0], errors
    errors = []
    _schedule_of(good, errors, 2, True, n_stages=2)
    assert errors == []
