"""SM120 MMA warps' mainloop: register fragments, ldmatrix copies and block-scaled MMAs.

The methods of :class:`~cute_fp4.kernels.sm120.Sm120Gemm` that run between a stage's
arrival and its release: :meth:`Sm120Mainloop._mma_fragments` builds what an MMA warp
holds (:class:`MmaFragments`: register fragments, the shared -> register copies feeding
them, the accumulator), :meth:`Sm120Mainloop.mainloop` walks one work unit's K tiles with
``ldmatrix`` + ``OMMA.SF`` per 64-wide K block, software pipelined across stages (see its
docstring), and :meth:`Sm120Mainloop.mma_k_block` is the one place the emulated build
(kernels/mma_emulation.py) differs. The kernel's Constraints are sm120.py's; the CPU trace
tests/sm120_mainloop_trace.py runs these methods on stand-ins.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm120_utils
from cutlass.cute.nvgpu import warp

from cute_fp4.kernels import mma_emulation, sf_layout


def _mma_ptx(fmt, byte_id: int) -> str:
    """``mma.sync`` of ``fmt``'s block-scaled kind with scale selectors ``{byte_id, 0}``:
    ``{$w0..3}`` D, ``{$r0..3}`` A, ``{$r4, $r5}`` B, ``{$r6..9}`` C, ``{$r10}`` / ``{$r11}``
    the A / B scale words (thread-id 0, as ``cute.gemm`` issues it)."""
    def regs(p, first, n):
        return "{" + ", ".join(f"{{${p}{i}}}" for i in range(first, first + n)) + "}"

    return (f"mma.sync.aligned.kind::{fmt.mma_kind}.block_scale.scale_vec::{fmt.scale_vec}"
            f".m16n8k64.row.col.f32.e2m1.e2m1.f32.{fmt.scale.name} {regs('w', 0, 4)}, "
            f"{regs('r', 0, 4)}, {regs('r', 4, 2)}, {regs('r', 6, 4)}, {{$r10}}, "
            f"{{{byte_id}, 0}}, {{$r11}}, {{{byte_id}, 0}};")


@cute.jit
def mma_selected(tCrA, tCrB, acc, words, byte_id: cutlass.Constexpr, fmt: cutlass.Constexpr):
    """The block-scaled MMAs of one K block with whole scale words and ``byte-id``
    ``byte_id`` (:meth:`Sm120Mainloop._paired_scales`): ``tCrA`` (values, MMA rows) and
    ``tCrB`` (values, MMA columns) the K block's E2M1 fragments, ``words`` the scale words
    ``(per MMA row, per MMA column)``, ``acc`` (4, rows, columns) the accumulator. The same
    instruction ``cute.gemm`` issues (its A / B registers are the fragments' 32-bit words,
    value ``i`` nibble ``i % 8`` of register ``i // 8``), with the selector set."""
    ptx = _mma_ptx(fmt, byte_id)
    for mi in cutlass.range_constexpr(cute.size(tCrA, mode=[1])):
        a = mma_emulation.fp4_registers(tCrA[None, mi], "A")
        for ni in cutlass.range_constexpr(cute.size(tCrB, mode=[1])):
            b = mma_emulation.fp4_registers(tCrB[None, ni], "B")
            d = cute.arch.inline_ptx(
                ptx, write_only_types=[cutlass.Float32] * 4,
                read_only_args=[*(a[r] for r in range(4)), b[0], b[1],
                                *(acc[i, mi, ni] for i in range(4)),
                                words[0][mi], words[1][ni]])
            for i in cutlass.range_constexpr(4):
                acc[i, mi, ni] = d[i]


class MmaFragments(NamedTuple):
    """What an MMA warp holds for the mainloop: register fragments, the smem -> register
    copies feeding them, and the accumulator. The stable seam the CPU traces read."""

    acc: cute.Tensor  # FP32 accumulator (V, MMA rows, MMA cols)
    copy_a: cute.TiledCopy  # ldmatrix tiled copies of A and B
    copy_b: cute.TiledCopy
    copy_sfa: cute.TiledCopy  # scale-factor tiled copies (universal byte copies)
    copy_sfb: cute.TiledCopy
    tCsA: cute.Tensor  # (V, rows, k block, stage) smem sources of this thread
    tCrA_v: cute.Tensor  # A fragment as the copy sees it
    tCrA: cute.Tensor  # A fragment as the MMA sees it (V, MMA rows, k block)
    tCsB: cute.Tensor
    tCrB_v: cute.Tensor
    tCrB: cute.Tensor
    thr_sfa: cute.ThrCopy  # this thread's slices of the scale copies
    thr_sfb: cute.ThrCopy
    tCrSFA: cute.Tensor  # scale fragments (V, MMA rows, k block)
    tCrSFB: cute.Tensor
    sfa_ptr: cute.Pointer  # start of the staged scales (a view of the format's scale type)
    sfb_ptr: cute.Pointer


class Sm120Mainloop:
    """Mainloop methods of :class:`~cute_fp4.kernels.sm120.Sm120Gemm` (which sets
    ``tiled_mma``, ``tile_mnk``, the stage layouts, ``warps_mn``, ``pingpong``, ``emulate``
    and ``fmt``, the block format)."""

    def _k_slots(self) -> int:
        """K blocks of register fragments: the tile's K blocks, or two register buffers
        when a cooperative tile has a single one (tile K 64), so that the next stage's
        fragments load while the current ones feed the MMAs."""
        n_kb = self.tile_mnk[2] // sf_layout.MMA_K
        return 2 if n_kb == 1 and not self.pingpong else n_kb

    def _copy_b(self, tiled_mma):
        """ldmatrix copy of B. An ``.x4`` loads two MMAs' B (16 columns x 64 K): with 2
        warps along N a warp's columns of one MMA permutation step (32 columns, SM120's
        (8, 2, 2):(1, 16, 8)) are 16 contiguous rows, the MMA's own tiling. With 4 warps
        they are 8 rows: tiled like the MMA, an ``.x4`` loaded the same 8 rows twice (half
        its registers never read), so its two halves take two consecutive steps instead
        (``.x2`` where the tile has a single step)."""
        def atom(matrices):
            return cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=matrices),
                cutlass.Float4E2M1FN)

        perm_n = cute.size(tiled_mma.permutation_mnk[1])
        if perm_n // self.warps_mn[1] >= 16:
            return cute.make_tiled_copy_B(atom(4), tiled_mma)
        if self.tile_mnk[1] % (2 * perm_n):
            return cute.make_tiled_copy_B(atom(2), tiled_mma)
        # the MMA's (thread, value) -> n + perm_n * k, re-indexed into a tile of two steps
        # (n + 2 perm_n * k), with the step as the last value mode
        two_steps = cute.make_layout((perm_n, sf_layout.MMA_K), stride=(1, 2 * perm_n))
        tv = cute.composition(two_steps, tiled_mma.tv_layout_B_tiled)
        tv = cute.make_layout((tv.shape[0], (tv.shape[1], 2)),
                              stride=(tv.stride[0], (tv.stride[1], perm_n)))
        return cute.make_tiled_copy(atom(4), tv, (2 * perm_n, sf_layout.MMA_K))

    @cute.jit
    def _mma_fragments(self, storage, gtid) -> MmaFragments:
        """Register fragments and smem->register copies of A, B, SFA, SFB; the accumulator.

        The fragments' K mode has :meth:`_k_slots` K blocks (register buffers)."""
        tiled_mma = self.tiled_mma
        thr_mma = tiled_mma.get_slice(gtid)
        tm, tn, _ = self.tile_mnk
        k_regs = self._k_slots() * sf_layout.MMA_K
        sA = storage.sA.get_tensor(self.sA_layout.outer, swizzle=self.sA_layout.inner)
        sB = storage.sB.get_tensor(self.sB_layout.outer, swizzle=self.sB_layout.inner)
        # register fragments of K = k_regs, K-major like the stages (only the layouts of
        # these views are used: nothing is read through them)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(cute.make_tensor(
            sA.iterator, cute.make_layout((tm, k_regs), stride=(k_regs, 1)))))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(cute.make_tensor(
            sB.iterator, cute.make_layout((tn, k_regs), stride=(k_regs, 1)))))
        sf_dtype = getattr(cutlass, self.fmt.scale.dsl_name)
        sfa_ptr = cute.recast_ptr(storage.sSFA.data_ptr(), dtype=sf_dtype)
        sfb_ptr = cute.recast_ptr(storage.sSFB.data_ptr(), dtype=sf_dtype)
        sfa0 = cute.make_tensor(sfa_ptr, sf_layout.sf_smem_layout(tm, k_regs, 1, self.fmt))
        sfb0 = cute.make_tensor(sfb_ptr, sf_layout.sf_smem_layout(tn, k_regs, 1, self.fmt))
        tCrSFA = sm120_utils.partition_fragment_SFA(sfa0[None, None, 0], thr_mma, gtid)
        tCrSFB = sm120_utils.partition_fragment_SFB(sfb0[None, None, 0], thr_mma, gtid)
        ldsm_a = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        copy_a = cute.make_tiled_copy_A(
            cute.make_copy_atom(ldsm_a, cutlass.Float4E2M1FN), tiled_mma)
        copy_b = self._copy_b(tiled_mma)
        perm = tiled_mma.permutation_mnk
        sf_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sf_dtype)
        copy_sfa = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFA_TV(tiled_mma),
            (cute.size(perm[0]), cute.size(perm[2])))
        copy_sfb = cute.make_tiled_copy(
            sf_atom, sm120_utils.get_layoutSFB_TV(tiled_mma),
            (cute.size(perm[1]), cute.size(perm[2])))
        thr_a, thr_b = copy_a.get_slice(gtid), copy_b.get_slice(gtid)
        acc_shape = tiled_mma.partition_shape_C(self.tile_mnk[:2])
        return MmaFragments(
            acc=cute.make_rmem_tensor(acc_shape, cutlass.Float32),
            copy_a=copy_a, copy_b=copy_b, copy_sfa=copy_sfa, copy_sfb=copy_sfb,
            tCsA=thr_a.partition_S(sA), tCrA_v=thr_a.retile(tCrA), tCrA=tCrA,
            tCsB=thr_b.partition_S(sB), tCrB_v=thr_b.retile(tCrB), tCrB=tCrB,
            thr_sfa=copy_sfa.get_slice(gtid), thr_sfb=copy_sfb.get_slice(gtid),
            tCrSFA=self._sf_fragment_vmk(tCrSFA), tCrSFB=self._sf_fragment_vmk(tCrSFB),
            sfa_ptr=sfa_ptr, sfb_ptr=sfb_ptr)

    @staticmethod
    def _sf_fragment_vmk(frag):
        """Scale fragment as (value, rest rows, K blocks), like the A/B fragments.

        The DSL helpers return the rest modes flattened differently per warp layout:
        (V, M, (K...)) for some, (V, (N, K)) when N has a single rest mode.
        """
        if cutlass.const_expr(cute.rank(frag) > 2):
            return cute.group_modes(frag, 2, cute.rank(frag))
        shape, stride = frag.layout.shape, frag.layout.stride
        if cutlass.const_expr(isinstance(shape[1], int)):
            layout = cute.make_layout((shape[0], shape[1], 1), stride=(stride[0], stride[1], 0))
        else:
            layout = cute.make_layout((shape[0], shape[1][0], shape[1][1]),
                                      stride=(stride[0], stride[1][0], stride[1][1]))
        return cute.make_tensor(frag.iterator, layout)

    @staticmethod
    def _sub_atom(ptr, tile_idx, tile_rows):
        """Start of a sub-128-row tile's rows inside the stage's 128-row scale atom."""
        if cutlass.const_expr(tile_rows >= sf_layout.ATOM_ROWS):
            return ptr
        step = sf_layout.sf_view_offset(tile_rows, 1)
        off = (tile_idx % (sf_layout.ATOM_ROWS // tile_rows)) * step
        return ptr + cute.assume(off, divby=step)

    @cute.jit
    def _sf_sources(self, f: MmaFragments, cm, cn):
        """(smem view, register view) pairs of the scale factors of this work unit."""
        tm, tn, _ = self.tile_mnk
        sfa = cute.make_tensor(self._sub_atom(f.sfa_ptr, cm, tm), self.sSFA_view)
        sfb = cute.make_tensor(self._sub_atom(f.sfb_ptr, cn, tn), self.sSFB_view)
        return (cute.filter_zeros(f.thr_sfa.partition_S(sfa)),
                cute.filter_zeros(f.thr_sfa.retile(f.tCrSFA)),
                cute.filter_zeros(f.thr_sfb.partition_S(sfb)),
                cute.filter_zeros(f.thr_sfb.retile(f.tCrSFB)))

    @staticmethod
    def _kb_sources(f: MmaFragments, sf, n_kb):
        """Per K block of a stage: the A, B, SFA, SFB shared-memory sources (V, rows, stage).

        Sliced at the (static) K block first, so that the stage is the only dynamic offset
        left: it is a multiple of the swizzle period, which the DSL then adds after the
        swizzle, to a per-thread address computed once (sliced stage first, the K block's
        offset joins the stage's and the swizzle is redone per load: 97 against 82
        instructions per 128x128x128 K tile, sm_120a, 2026-12-01)."""
        tCsSFA, _, tCsSFB, _ = sf
        return [(f.tCsA[None, None, kb, None], f.tCsB[None, None, kb, None],
                 tCsSFA[None, None, kb, None], tCsSFB[None, None, kb, None])
                for kb in range(n_kb)]

    def _paired_scales(self) -> bool:
        """Whether two consecutive MMA K blocks share one 32-bit scale word per row: the
        ``scale_vec::2X`` formats (MXFP4), whose MMA reads two scale bytes. A row's four
        bytes of one atom column group are then K blocks ``2p`` (bytes 0, 1) and ``2p + 1``
        (bytes 2, 3), in shared memory and in the byte copies' register fragments alike
        (slot stride 2 bytes, row stride 4): the word is loaded once, at the pair's first K
        block (:meth:`_sf_words`, in place of the byte copies), and both MMAs take it whole,
        the selector ``byte-id`` 0 or 2 picking the half (PTX ISA, "Block Scaling for
        mma.sync": for ``.scale_vec::2X`` the value 0 selects the lower two bytes, 2 the
        upper two; the MMA issued by :func:`mma_selected`). The K tile is a multiple of 128
        (``fmt.atom_k``), so a tile holds whole pairs. MXFP4 128x128x128: 75 instead of
        100 SASS instructions per K tile (sm_120a, 2026-12-06)."""
        return self.fmt.scales_per_mma == 2

    @cute.jit
    def _load_k_block(self, f: MmaFragments, sf, srcs, s, kb, slot):
        """K block ``kb`` of stage ``s`` into register K block ``slot`` (paired scales:
        A and B only, the scale words load per pair, :meth:`_sf_words`)."""
        _, tCrSFA_v, _, tCrSFB_v = sf
        src = srcs[kb]
        cute.copy(f.copy_a, src[0][None, None, s], f.tCrA_v[None, None, slot])
        cute.copy(f.copy_b, src[1][None, None, s], f.tCrB_v[None, None, slot])
        if not self._paired_scales():  # static (the CPU trace runs this with stand-ins)
            cute.copy(f.copy_sfa, src[2][None, None, s], tCrSFA_v[None, None, slot])
            cute.copy(f.copy_sfb, src[3][None, None, s], tCrSFB_v[None, None, slot])

    @staticmethod
    def sf_word_offsets(frag, src, dst_v, slot):
        """Paired scales, at trace time: per MMA row (column) of ``frag`` (``tCrSFA`` /
        ``tCrSFB``), the shared-memory offset of its scale word of register K blocks
        ``slot`` (even) and ``slot + 1`` in ``src``, the byte copy's filtered source
        partition ``(V, rows, K block, stage)``, at stage 0 (``dst_v``: the retiled
        fragment it copies into). The proof that the word holds what the byte copy of
        those two K blocks put into the registers the MMA reads (bytes ``2 j``, ``2 j + 1``
        of the word: values 0 and 32 of K block ``slot + j``): the four fragment bytes
        are ``o .. o + 3`` (``o`` a multiple of 4) and the copy takes them from shared
        bytes ``w .. w + 3``; AssertionError otherwise."""
        def offsets(layout, k):  # absolute offsets of K block k's flat elements
            tail = (0,) * (cute.rank(layout) - 3)  # the stage of src
            sub = cute.slice_(layout, (None, None, k) + tail)
            return [layout((0, 0, k) + tail) + sub(e) for e in range(cute.size(sub))]

        out = []
        for r in range(cute.size(frag, mode=[1])):
            offs = [frag.layout((v, r, slot + j)) for j in range(2) for v in (0, 32)]
            src_bytes = []
            for b, o in enumerate(offs):
                dst = offsets(dst_v.layout, slot + b // 2)
                if o in dst:
                    src_bytes.append(offsets(src.layout, slot + b // 2)[dst.index(o)])
            w = src_bytes[0] if src_bytes else -1
            if (offs[0] % 4 or offs != [offs[0] + b for b in range(4)]
                    or src_bytes != [w + b for b in range(4)] or w % 4):
                raise AssertionError(f"scale fragment {frag.layout}: K blocks {slot}, "
                                     f"{slot + 1} of row {r} are not one 32-bit word")
            out.append(w)
        return out

    def _sf_words(self, f: MmaFragments, sf, s, kb):
        """Paired scales: the scale words of K blocks ``kb`` (even) and ``kb + 1`` of stage
        ``s``, one 32-bit shared-memory load each (:meth:`sf_word_offsets`), as values
        ``(A rows, B columns)``. They live from their pair's first MMAs to its last, never
        across the loop's back edge (loaded a K tile ahead into a register fragment, ptxas
        copied the next tile's words over those the last MMAs read: 10 MOVs per K tile, and
        128x128x256 spilled 8 registers around the loop; sm_120a, 2026-12-06)."""
        out = []
        for frag, i, dst_v in ((f.tCrSFA, 0, sf[1]), (f.tCrSFB, 2, sf[3])):
            src_s = sf[i][None, None, None, s]  # (V, rows, K block) of stage s
            words = []
            for w in self.sf_word_offsets(frag, sf[i], dst_v, kb):
                ptr = cute.recast_ptr(src_s.iterator + w, dtype=cutlass.Uint32)
                words.append(cute.make_tensor(ptr, cute.make_layout(1))[0])
            out.append(words)
        return tuple(out)

    def mma_k_block(self, f: MmaFragments, slot, words=None):
        """The MMAs of one 64-wide K block (register K block ``slot``): OMMA.SF, or its
        exact emulation (SM90 runs). Paired scales (:meth:`_paired_scales`): ``words``,
        the pair's scale words ``(A rows, B columns)`` loaded at its first K block, and
        byte-id ``2 (slot % 2)``; the emulation reads the same words and bytes.

        Plain Python, run while tracing (``emulate`` is a static choice), so the CPU trace
        records the ``cute.gemm`` of the shipping build through its stand-ins."""
        if words is not None:
            byte_id = 2 * (slot % 2)
            if self.emulate:
                mma_emulation.mma_k_block(f.tCrA[None, None, slot], None,
                                          f.tCrB[None, None, slot], None, f.acc, self.fmt,
                                          words, byte_id)
            else:
                mma_selected(f.tCrA[None, None, slot], f.tCrB[None, None, slot], f.acc,
                             words, byte_id, self.fmt)
        elif self.emulate:
            mma_emulation.mma_k_block(f.tCrA[None, None, slot], f.tCrSFA[None, None, slot],
                                      f.tCrB[None, None, slot], f.tCrSFB[None, None, slot],
                                      f.acc, self.fmt)
        else:
            cute.gemm(self.tiled_mma, f.acc,
                      [f.tCrA[None, None, slot], f.tCrSFA[None, None, slot]],
                      [f.tCrB[None, None, slot], f.tCrSFB[None, None, slot]], f.acc)

    def _tile(self, mainloop, state, f, sf, srcs, more):
        """One K tile of a cooperative mainloop with two or more K blocks, whose first K
        block is in registers: each K block's MMAs run while the next K block loads; at the
        last, the stage is released and, when ``more`` tiles follow, the next stage waited
        for and its first K block loaded before the last MMAs (which use registers loaded
        before that wait). Plain Python (static control flow); returns the state."""
        n_kb = len(srcs)
        words = None  # paired scales: the words of K blocks kb, kb + 1 (kb even)
        for kb in range(n_kb):
            if self._paired_scales() and kb % 2 == 0:
                words = self._sf_words(f, sf, state.index, kb)
            if kb + 1 < n_kb:
                self._load_k_block(f, sf, srcs, state.index, kb + 1, kb + 1)
            else:
                mainloop.consumer_release(state)
                state.advance()
                if more:
                    mainloop.consumer_wait(state)
                    self._load_k_block(f, sf, srcs, state.index, 0, 0)
            self.mma_k_block(f, kb, words)
        return state

    def _tile_buffered(self, mainloop, state, f, sf, srcs, slot, more):
        """One K tile of a single K block, held in register buffer ``slot``: the stage is
        released, the next one (``more``) waited for and loaded into the other buffer, then
        this tile's MMAs run. Plain Python; returns the state."""
        mainloop.consumer_release(state)
        state.advance()
        if more:
            mainloop.consumer_wait(state)
            self._load_k_block(f, sf, srcs, state.index, 0, 1 - slot)
        self.mma_k_block(f, slot)
        return state

    @cute.jit
    def mainloop(self, mainloop, state, f: MmaFragments, k_count, cm, cn):
        """K tiles of one work unit: ldmatrix + OMMA.SF per 64-wide K block, software
        pipelined across stages.

        K block ``kb + 1`` is loaded while the MMAs of ``kb`` run. Cooperative tiles
        release the current stage after loading its last K block, then wait for the next
        stage and load its first K block before the current stage's last K block's MMAs,
        whose fragments are in registers already, so those MMAs hide the next stage's
        latency (release before wait: with a single stage that is the same buffer). The
        last K tile is peeled off the loop, which is then free of conditions. Tiles of one
        K block (tile K 64) alternate two register buffers, the loop unrolled by two so
        that the buffers stay static. Pingpong keeps the stage-at-a-time order: the other
        group's MMAs hide its waits, and in the order above the first K block's fragments
        stay live across the loop's back edge with its 128 accumulators, which spills at
        its 168 registers (54 words, sm_120a, 2026-12-01).
        """
        sf = self._sf_sources(f, cm, cn)
        n_kb = self.tile_mnk[2] // sf_layout.MMA_K
        if cutlass.const_expr(self._paired_scales() and n_kb % 2):
            raise AssertionError(f"paired scales need an even number of K blocks, not {n_kb}")
        srcs = self._kb_sources(f, sf, n_kb)
        if cutlass.const_expr(self.pingpong):
            for _ in cutlass.range(k_count, unroll=1):
                mainloop.consumer_wait(state)
                s = state.index
                self._load_k_block(f, sf, srcs, s, 0, 0)
                words = None
                for kb in cutlass.range_constexpr(n_kb):
                    if cutlass.const_expr(self._paired_scales() and kb % 2 == 0):
                        words = self._sf_words(f, sf, s, kb)
                    if cutlass.const_expr(kb + 1 < n_kb):
                        self._load_k_block(f, sf, srcs, s, kb + 1, kb + 1)
                    else:
                        mainloop.consumer_release(state)
                    self.mma_k_block(f, kb, words)
                state.advance()
        elif cutlass.const_expr(n_kb == 1):
            if k_count > 0:
                mainloop.consumer_wait(state)
                self._load_k_block(f, sf, srcs, state.index, 0, 0)
            for _ in cutlass.range((k_count - 1) // 2, unroll=1):
                state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, True)
                state = self._tile_buffered(mainloop, state, f, sf, srcs, 1, True)
            if k_count > 0:
                if k_count % 2 == 0:
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, True)
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 1, False)
                else:
                    state = self._tile_buffered(mainloop, state, f, sf, srcs, 0, False)
        else:
            # Where the loop sits is ptxas' register allocation, measured (sm_120a, DSL
            # 4.8.1, 2026-12-01): inside the ``k_count > 0`` block, 4 MOVs copy an
            # accumulator at the block's end; outside, with 4 K blocks, ptxas keeps the stage
            # index in a uniform register and moves it back per address (14 MOVs). Inside
            # for 4 K blocks (128x128x256: 145 against 155 instructions per K tile),
            # outside for 2 (128x128x128: 82 against 87).
            inside = n_kb > 2
            if k_count > 0:
                mainloop.consumer_wait(state)
                self._load_k_block(f, sf, srcs, state.index, 0, 0)
                if cutlass.const_expr(inside):
                    for _ in cutlass.range(k_count - 1, unroll=1):
                        state = self._tile(mainloop, state, f, sf, srcs, True)
                    state = self._tile(mainloop, state, f, sf, srcs, False)
            if cutlass.const_expr(not inside):
                for _ in cutlass.range(k_count - 1, unroll=1):
                    state = self._tile(mainloop, state, f, sf, srcs, True)
                if k_count > 0:
                    state = self._tile(mainloop, state, f, sf, srcs, False)
        return state


__all__ = ["MmaFragments", "Sm120Mainloop", "mma_selected"]
