"""A mixture-of-experts call's (token, slot) pairs sorted by expert in one CTA: the four
outputs of :func:`cute_fp4.layers.routing.route` (``order``, ``inverse``, ``token``,
``offsets``) from ``topk_ids`` in one launch, where torch takes eight small kernels.

Algorithm: a stable counting sort. Pair ``i`` (``i = t * k + j``, ``n = T * k`` pairs) has
the bucket ``b_i = clamp(id_i, -1, E) + 1``: bucket 0 holds the negative ids, buckets
``1..E`` the experts, bucket ``E + 1`` the ids ``>= E``. The pairs are cut into ``aw``
contiguous chunks of ``32 * rounds`` pairs, one per warp (``rounds = ceil(n / threads)``);
a warp walks its chunk in rounds of 32 pairs, in pair order:

1. Per round, ``match.any`` finds the lanes holding the same bucket; a pair's rank in its
   warp's bucket is the warp's count so far (``sHist[b * aw + w]``, read by every lane of
   the group) plus the group's lanes below it; the group's lowest lane then adds the
   group's size to the count. Only warp ``w`` touches column ``w``: no atomics.
2. One exclusive scan over ``sHist`` in (bucket, warp) order turns each count into the
   number of pairs of lower buckets plus those of the same bucket in earlier warps
   (a thread per contiguous segment, a warp scan by shuffles, the warp totals in shared
   memory).
3. Pair ``i`` sits at row ``p_i = sHist[b_i * aw + w] + rank_i``: ``inverse[i] = p_i``,
   ``order[p_i] = i``, ``token[p_i] = i / k``; ``offsets[e] = sHist[(e + 1) * aw]`` (the
   pairs of buckets below ``e + 1``: the ids below ``e``) for ``e = 0..E``.

Ties keep pair order, so with every id in ``[0, E)`` the outputs equal torch's stable
sort, scatter, division and ``searchsorted`` bit for bit. An id out of range writes only
inside the outputs: ``offsets`` is torch's (the count of ids below each bound, so short
of ``n`` or starting above 0, as there), the negative ids' pairs come first and those
``>= E`` last, each group in pair order (torch orders them by value first).

Cost: per thread, at most ``max_pairs / threads`` pairs and ``ceil((E + 2) * aw /
threads)`` scan entries (``aw <= threads / 32``); four CTA barriers; no global atomics.

Constraints (checked by the host layer, ``cute_fp4.sorting``): ``1 <= n <= max_pairs``,
``1 <= E <= max_experts``, ``k >= 1``; ``topk_ids`` contiguous int32 or int64 (the
spec's), ``order``, ``inverse`` and ``token`` contiguous int64 ``[n]``, ``offsets``
contiguous int32 ``[E + 1]``, none overlapping. One CTA: launched on the current stream,
no host synchronisation, CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.runtime import make_ptr

from cute_fp4.kernels import roles

_GMEM = cute.AddressSpace.gmem
_I32 = cutlass.Int32
_I64 = cutlass.Int64
_FULL = 0xFFFFFFFF
ID_DTYPES = ("int32", "int64")
SMEM_MAX = 48 * 1024  # the static shared-memory limit of a launch without an opt-in


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    """Static choices of one compiled routing kernel."""

    target: str = "sm_90a"
    id_dtype: str = "int64"  # of topk_ids: "int32" or "int64"
    threads: int = 256  # of the one CTA
    max_pairs: int = 1024  # T * top_k at most (a multiple of threads: rounds per warp)
    max_experts: int = 1024  # E at most (the shared-memory histogram's rows)

    def __post_init__(self):
        if self.id_dtype not in ID_DTYPES:
            raise ValueError(f"id_dtype must be one of {ID_DTYPES}, got {self.id_dtype!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {self.threads}")
        if self.max_pairs < self.threads or self.max_pairs % self.threads:
            raise ValueError(f"max_pairs ({self.max_pairs}) must be a positive multiple of "
                             f"threads ({self.threads})")
        if self.max_experts < 1 or self.smem_bytes > SMEM_MAX:
            raise ValueError(f"max_experts must be >= 1 with the histogram in {SMEM_MAX:,} B "
                             f"of shared memory; {self.max_experts} experts x {self.warps} "
                             f"warps take {self.smem_bytes:,} B")

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def rounds(self) -> int:
        """Rounds of 32 pairs per warp at ``max_pairs``."""
        return self.max_pairs // self.threads

    @property
    def hist_words(self) -> int:
        """The histogram's int32 words: buckets ``0..E+1`` (E + 2) x warps."""
        return (self.max_experts + 2) * self.warps

    @property
    def smem_bytes(self) -> int:
        return 4 * (self.hist_words + self.warps)

    def label(self) -> str:
        return (f"route-{self.id_dtype}-t{self.threads}n{self.max_pairs}"
                f"e{self.max_experts}@{self.target}")


class RouteKernel:
    """The routing sort; see the module docstring.

    Entry point ``(pIds, pOrder, pInverse, pToken, pOffsets, n, k, e, stream)``: the
    expert ids (``n`` of the spec's dtype), the int64 outputs (``n`` each), the int32
    offsets (``e + 1``), the pair count, top-k and the expert count.
    """

    def __init__(self, spec: RouteSpec):
        self.spec = spec
        self.threads = spec.threads
        self._id_type = _I32 if spec.id_dtype == "int32" else _I64
        self._id_align = 4 if spec.id_dtype == "int32" else 8

    # ------------------------------------------------------------------ host side
    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_stream

        return (make_ptr(self._id_type, 0, _GMEM, assumed_align=self._id_align),
                *(make_ptr(_I64, 0, _GMEM, assumed_align=8) for _ in range(3)),
                make_ptr(_I32, 0, _GMEM, assumed_align=4),
                _I32(0), _I32(0), _I32(0), make_fake_stream())

    def runtime_args(self, ids, order, inverse, token, offsets, k: int, stream) -> tuple:
        """The entry point's arguments from checked torch tensors (``ids`` flat)."""
        return self._args(ids, order, inverse, token, offsets, k, stream,
                          lambda dt, t, a: make_ptr(dt, t.data_ptr(), _GMEM, assumed_align=a),
                          _I32)

    def raw_args(self, ids, order, inverse, token, offsets, k: int, stream: int) -> tuple:
        """:meth:`runtime_args` as plain ints, for a kernel compiled with
        ``--enable-tvm-ffi``."""
        return self._args(ids, order, inverse, token, offsets, k, stream,
                          lambda dt, t, a: t.data_ptr(), int)

    def _args(self, ids, order, inverse, token, offsets, k, stream, ptr, num) -> tuple:
        return (ptr(self._id_type, ids, self._id_align), ptr(_I64, order, 8),
                ptr(_I64, inverse, 8), ptr(_I64, token, 8), ptr(_I32, offsets, 4),
                num(ids.numel()), num(k), num(offsets.numel() - 1), stream)

    @cute.jit
    def __call__(self, pIds: cute.Pointer, pOrder: cute.Pointer, pInverse: cute.Pointer,
                 pToken: cute.Pointer, pOffsets: cute.Pointer, n: cutlass.Int32,
                 k: cutlass.Int32, e: cutlass.Int32, stream: cuda.CUstream):
        mIds, mOrder, mInverse, mToken = (cute.make_tensor(p, cute.make_layout((n,)))
                                          for p in (pIds, pOrder, pInverse, pToken))
        mOffsets = cute.make_tensor(pOffsets, cute.make_layout((e + 1,)))
        self.kernel(mIds, mOrder, mInverse, mToken, mOffsets, n, k, e).launch(
            grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=roles.PDL)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mOrder: cute.Tensor, mInverse: cute.Tensor,
               mToken: cute.Tensor, mOffsets: cute.Tensor, n: cutlass.Int32,
               k: cutlass.Int32, e: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        t = self.threads
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(_I32, cute.make_layout((self.spec.hist_words,)),
                                     byte_alignment=16)
        sWarp = smem.allocate_tensor(_I32, cute.make_layout((self.spec.warps,)),
                                     byte_alignment=16)
        rounds = (n + t - 1) // t
        chunk = 32 * rounds  # pairs per warp
        aw = (n + chunk - 1) // chunk  # warps holding pairs: the histogram's columns
        n_hist = (e + 2) * aw
        for j in cutlass.range(tidx, n_hist, t, unroll=1):
            sHist[j] = _I32(0)
        first = warp * chunk + lane
        roles.wait_for_inputs()
        roles.release_dependents()
        rKey = self._load_buckets(mIds, first, rounds, n, e)
        cute.arch.sync_threads()  # the histogram is zero
        rRank = self._warp_ranks(sHist, rKey, rounds, aw, warp)
        cute.arch.sync_threads()  # every warp's counts are in
        self._scan(sHist, sWarp, n_hist, tidx, lane, warp)
        cute.arch.sync_threads()  # the starts are in
        for r in cutlass.range_constexpr(self.spec.rounds):
            key = rKey[r]
            if key >= 0:
                i = first + r * 32
                p = sHist[key * aw + warp] + rRank[r]
                mInverse[i] = _I64(p)
                mOrder[p] = _I64(i)
                mToken[p] = _I64(i // k)
        for j in cutlass.range(tidx, e + 1, t, unroll=1):
            mOffsets[j] = sHist[(j + 1) * aw]

    @cute.jit
    def _load_buckets(self, mIds: cute.Tensor, first, rounds, n, e) -> cute.Tensor:
        """The buckets of this thread's pairs ``first + 32 r`` (r < rounds), -1 for none:
        every load issued before any is used (pair 0 stands in for a missing pair)."""
        rounds_max = self.spec.rounds
        rId = cute.make_rmem_tensor((rounds_max,), self._id_type)
        rKey = cute.make_rmem_tensor((rounds_max,), _I32)
        for r in cutlass.range_constexpr(rounds_max):
            i = first + r * 32
            rId[r] = mIds[cutlass.select_((r < rounds) & (i < n), i, 0)]
        hi = self._id_type(e)
        for r in cutlass.range_constexpr(rounds_max):
            i = first + r * 32
            b = _I32(cutlass.min(cutlass.max(rId[r], self._id_type(-1)), hi)) + 1
            rKey[r] = cutlass.select_((r < rounds) & (i < n), b, _I32(-1))
        return rKey

    @cute.jit
    def _warp_ranks(self, sHist: cute.Tensor, rKey: cute.Tensor, rounds, aw,
                    warp) -> cute.Tensor:
        """Each pair's rank among the earlier pairs of its warp in its bucket, the warp's
        counts left in ``sHist[b * aw + warp]``."""
        rRank = cute.make_rmem_tensor((self.spec.rounds,), _I32)
        below = cute.arch.lanemask_lt()
        for r in cutlass.range_constexpr(self.spec.rounds):
            rRank[r] = _I32(0)
            if r < rounds:  # uniform over the CTA: every lane meets match.any
                key = rKey[r]
                peers = cute.arch.match_sync(_FULL, key)
                lower = _I32(cute.arch.popc(peers & below))
                slot = cutlass.select_(key >= 0, key * aw + warp, 0)
                base = _I32(0)
                if key >= 0:
                    base = sHist[slot]
                cute.arch.sync_warp()  # every lane of the group has read the count
                if (key >= 0) & (lower == 0):
                    sHist[slot] = base + _I32(cute.arch.popc(peers))
                cute.arch.sync_warp()  # the count is in for the next round
                rRank[r] = base + lower
        return rRank

    @cute.jit
    def _scan(self, sHist: cute.Tensor, sWarp: cute.Tensor, n_hist, tidx, lane, warp):
        """``sHist[0:n_hist]`` -> its exclusive prefix sums (in place)."""
        t = self.threads
        seg = (n_hist + t - 1) // t
        lo = tidx * seg
        hi = cutlass.min(lo + seg, n_hist)
        total = _I32(0)
        for j in cutlass.range(lo, hi, unroll=1):
            total += sHist[j]
        x = total  # inclusive scan over the warp
        for d in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, 1 << d)
            x += cutlass.select_(lane >= (1 << d), y, _I32(0))
        if lane == 31:
            sWarp[warp] = x
        cute.arch.sync_threads()
        run = x - total
        for w in cutlass.range_constexpr(self.spec.warps):
            run += cutlass.select_(w < warp, sWarp[w], _I32(0))
        for j in cutlass.range(lo, hi, unroll=1):
            c = sHist[j]
            sHist[j] = run
            run += c


__all__ = ["ID_DTYPES", "RouteKernel", "RouteSpec"]
