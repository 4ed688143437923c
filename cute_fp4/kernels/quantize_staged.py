"""Fused activation quantization with the input staged through shared memory
(``QuantSpec.staging = "bulk"``): the arithmetic of :mod:`cute_fp4.kernels.quantize`
(the same block PTX, so bit-identical to ``cute_fp4.quantize``), a different way of
feeding it.

Why. Loading straight into registers, each warp waits for its loads, then computes, then
stores, and the GPU's memory stream stops while warps compute: on an H200 the kernel
reaches 64% of 4.8 TB/s at 4096^2 BF16 where the same kernel with its arithmetic removed
reaches 77% (``perf/results/2026-12-02-h200.md``). Here one producer warp per CTA keeps
``stages`` chunks in flight by bulk copies (``cp.async.bulk``, one instruction per chunk,
completion counted on an mbarrier), independently of the arithmetic, and the other warps
quantize chunk after chunk out of shared memory.

Work split. A persistent grid (``ctas_per_sm`` CTAs per SM) of ``threads`` consumer
threads plus one producer warp. Chunk ``i`` of a CTA is chunk ``bid + i * grid`` of the
input, ``threads * items`` consecutive 16-element blocks (the input is row-major, so a
chunk is one contiguous range of bytes); it goes to stage ``i % stages``. Consumer thread
``t`` quantizes blocks ``j * threads + t`` of each chunk: two 16-byte shared loads, then
it releases the stage (every consumer thread arrives on the stage's "empty" barrier) and
computes and stores as the register-staged kernel does. Items are data blocks in row
order; the thread of a row's last data column also zeroes that row's padding columns, and
extra CTAs at the end of the grid zero the padding rows (as ``order = "rows"``).

Barriers (per stage): "full" (count 1: the producer's arrive with the chunk's byte count;
the copy's completion finishes the phase) and "empty" (count ``threads``). Phase parity of
chunk ``i``: ``(i // stages) % 2``; the producer waits on "empty" with the opposite parity,
which a fresh barrier passes.

Constraints (checked by ``QuantSpec`` and the host layer): static global scale, row order,
``ctas_per_sm >= 1``; as ``kernels.quantize`` otherwise (K a multiple of 16, input 16-byte
aligned, ``M * K < 2^31``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync

from cute_fp4.kernels import roles
from cute_fp4.kernels.quantize import (
    _CONSTS_PTX,
    _FAST_GS_MAX,
    _FAST_GS_MIN,
    _I32,
    _U32,
    QuantizeKernel,
    _Grid,
    _ptxf,
)
from cute_fp4.nvfp4 import sf_offset_shifts

BLOCK_WORDS = 8  # one 16-element block of 16-bit values: 32 bytes


class StagedQuantizeKernel(QuantizeKernel):
    """BF16/FP16 -> NVFP4 with a producer warp and shared-memory stages (module docstring).
    Entry point and arguments as :class:`QuantizeKernel`'s."""

    def __init__(self, spec):
        super().__init__(spec)
        self.stages = spec.stages
        self.chunk_blocks = self.threads * self.items
        self.chunk_words = self.chunk_blocks * BLOCK_WORDS
        # the last chunk is copied in pieces of 2^p blocks, p < this (copy sizes are static)
        self.pieces = self.chunk_blocks.bit_length()

    @cute.jit
    def __call__(self, pX: cute.Pointer, pQ: cute.Pointer, pSF: cute.Pointer,
                 pGS: cute.Pointer, pPart: cute.Pointer, m: cutlass.Int32, k: cutlass.Int32,
                 max_ctas: cutlass.Int32, stream: cuda.CUstream):
        kb, kbp, mp, _, (mX, mQ, mSF, mSF4, mGS) = self._views(pX, pQ, pSF, pGS, m, k)
        n_blocks = m * kb
        n_chunks = (n_blocks + self.chunk_blocks - 1) // self.chunk_blocks
        n_item_ctas = cutlass.min(n_chunks, max_ctas)
        n_pad_ctas = self._pad_ctas(m, mp, kbp)
        fdd = cute.fast_divmod_create_divisor_v2(kb)
        self.staged_kernel(mX, mQ, mSF, mSF4, mGS, m, kb, kbp, n_blocks, n_chunks,
                           n_item_ctas, n_pad_ctas, fdd).launch(
            grid=[n_item_ctas + n_pad_ctas, 1, 1], block=[self.threads + 32, 1, 1],
            stream=stream, use_pdl=roles.PDL)

    @cute.kernel
    def staged_kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mSF: cute.Tensor,
                      mSF4: cute.Tensor, mGS: cute.Tensor, m: cutlass.Int32,
                      kb: cutlass.Int32, kbp: cutlass.Int32, n_blocks: cutlass.Int32,
                      n_chunks: cutlass.Int32, n_item_ctas: cutlass.Int32,
                      n_pad_ctas: cutlass.Int32, fdd: cute.FastDivmodDivisorV2):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sBuf = smem.allocate_tensor(_U32, cute.make_layout((self.stages * self.chunk_words,)),
                                    byte_alignment=128)
        bars = smem.allocate_tensor(cutlass.Int64, cute.make_layout((2 * self.stages,)),
                                    byte_alignment=8)
        full, empty = bars.iterator, bars.iterator + self.stages
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, self.threads)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        roles.wait_for_inputs()
        roles.release_dependents()  # the dequantize or GEMM after it launches during it
        if bid < n_item_ctas:
            grid = _Grid(m, kb, kbp, n_blocks, n_chunks, n_item_ctas, fdd)
            if tidx == self.threads:
                self._produce(mX, sBuf, full, empty, grid, bid)
            elif tidx < self.threads:
                gs = mGS[0]
                args = (mQ, mSF, sBuf, full, empty, gs, grid, bid, tidx)
                if cutlass.const_expr(self.spec.force_general):
                    self._consume(self._general, *args)
                else:
                    if (gs >= _FAST_GS_MIN) & (gs <= _FAST_GS_MAX):  # uniform
                        self._consume(self._fast, *args)
                    else:
                        self._consume(self._general, *args)
        elif tidx < self.threads:
            self._pad_rows(mSF4, m, kbp, (bid - n_item_ctas) * self.threads + tidx,
                           n_pad_ctas * self.threads)

    def _mine(self, grid, bid):
        """How many chunks CTA ``bid`` takes: ``bid, bid + grid, ...``."""
        return (grid.n_chunks - bid + grid.stride - 1) // grid.stride

    @cute.jit
    def _produce(self, mX, sBuf, full, empty, grid, bid):
        """One thread: every chunk of this CTA into its stage, once the stage is free."""
        cw = self.chunk_words
        whole = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), _U32, num_bits_per_copy=cw * 32)
        pieces = [cute.make_copy_atom(cpasync.CopyBulkG2SOp(), _U32,
                                      num_bits_per_copy=(BLOCK_WORDS << p) * 32)
                  for p in range(self.pieces)]
        n_words = grid.n_items * BLOCK_WORDS
        for i in cutlass.range(0, self._mine(grid, bid), unroll=1):
            chunk = bid + i * grid.stride
            s = i % self.stages
            cute.arch.mbarrier_wait(empty + s, ((i // self.stages) % 2) ^ 1)
            base = chunk * cw
            nw = cutlass.min(cw, n_words - base)
            cute.arch.mbarrier_arrive_and_expect_tx(full + s, nw * 4)
            if nw == cw:
                cute.copy(whole, cute.local_tile(mX, (cw,), (chunk,)),
                          cute.local_tile(sBuf, (cw,), (s,)), mbar_ptr=full + s)
            else:  # the last chunk (nw < cw words): its binary digits in blocks, largest first
                off = _I32(0)
                for p in cutlass.range_constexpr(self.pieces - 1, -1, -1):
                    piece = BLOCK_WORDS << p
                    if nw & piece:
                        src = cute.make_tensor(mX.iterator + base + off,
                                               cute.make_layout((piece,)))
                        dst = cute.make_tensor(sBuf.iterator + s * cw + off,
                                               cute.make_layout((piece,)))
                        cute.copy(pieces[p], src, dst, mbar_ptr=full + s)
                        off = off + piece

    @cute.jit
    def _consume(self, code: str, mQ, mSF, sBuf, full, empty, gs, grid, bid, tidx):
        """A consumer thread: its blocks of every chunk of this CTA, stage after stage."""
        consts = _ptxf(_CONSTS_PTX, 2, gs)
        u, t = self.items, self.threads
        rW = [cute.make_rmem_tensor((8,), _U32) for _ in range(u)]
        for i in cutlass.range(0, self._mine(grid, bid), unroll=1):
            chunk = bid + i * grid.stride
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            for j in cutlass.range_constexpr(u):
                vec = (s * self.chunk_blocks + j * t + tidx) * 2  # 16-byte vectors
                for h in cutlass.range_constexpr(2):
                    cute.autovec_copy(cute.local_tile(sBuf, (4,), (vec + h,)),
                                      cute.local_tile(rW[j], (4,), (h,)))
            cute.arch.mbarrier_arrive(empty + s)  # the stage may be refilled
            self._staged_items(code, mQ, mSF, rW, gs, consts, grid, chunk, tidx)

    @cute.jit
    def _staged_items(self, code: str, mQ, mSF, rW, gs, consts, grid, chunk, tidx):
        """Quantize and store this thread's blocks of ``chunk`` (input words in ``rW``)."""
        u = self.items
        rO = self._block_codes(code, rW, gs, consts)
        for j in cutlass.range_constexpr(u):
            gd = self._item_index(chunk, j, tidx)  # blocks j * threads + tidx of the chunk
            if gd < grid.n_items:
                r, c = divmod(gd, grid.fdd)
                cute.autovec_copy(cute.local_tile(rO[j], (2,), (0,)),
                                  cute.local_tile(mQ, (2,), (gd,)))
                mSF[sf_offset_shifts(r, c, grid.kbp)] = cutlass.Uint8(rO[j][2])
                if c == grid.kb - 1:  # this row's padding columns
                    for e in cutlass.range_constexpr(1, 4):
                        if c + e < grid.kbp:
                            mSF[sf_offset_shifts(r, c + e, grid.kbp)] = cutlass.Uint8(0)


__all__ = ["StagedQuantizeKernel"]
