"""The one launch signature of every GEMM kernel, and its host- and device-side arguments.

Compiled signature (all families)::

    (pA, pSFA, pB, pSFB, pC, pAlpha, pWork, pCount, pBias, pSFOut, pGSOut, m, n, k,
     max_ctas, early, stream)

raw global pointers and Int32 sizes, so one compile serves every shape and a launch reads
only ``data_ptr()`` and ``shape`` of the torch tensors (no DLPack per call). Compiled with
``--enable-tvm-ffi``, the same signature takes plain ints (:func:`raw_args`); otherwise
DSL pointer objects and Int32s (:func:`runtime_args`):

* ``pA``: A, uint8 ``[M, K/2]`` packed NVFP4 (W4A4) or bf16/fp16 ``[M, K]`` (W4A16);
* ``pSFA``/``pSFB``: UE4M3 scales of A/B in the 128x4 blocked layout, flat bytes (W4A16:
  ``pSFA`` repeats ``pSFB`` and is never read);
* ``pB``: B, uint8 ``[N, K/2]``; ``pC``: the output ``[M, N]`` row-major;
* ``pAlpha``: one float32 on the device; ``pWork`` and ``pCount``: the split-K workspace
  (without split-K, ``pAlpha`` again, never read): ``pCount`` a header word (where the
  partials start in ``pWork``) and int32 arrival counters, zero between launches;
  ``pWork`` the FP32 partials (:func:`split_workspace_needs`; the kernel reduces the
  partials itself and stores D, see ``epilogue.store_split_k``). The two are one buffer
  for eager launches and two for a CUDA-graph capture (``cute_fp4.run.split_workspace``);
* ``pBias``: the fused epilogue's per-column bias, float32 ``[N]`` (``Epilogue.ops`` with
  ``"bias"``; otherwise ``pAlpha`` again, never read);
* ``pSFOut``, ``pGSOut`` (``"nvfp4_out"``): the output's UE4M3 block scales (uint8, 128x4
  blocked over ``round_up(M, 128)`` rows and ``round_up(N_out / 16, 4)`` columns) and its
  given global scale (one float32); ``pC`` is then the packed codes, uint8 ``[M, N_out /
  2]`` (otherwise both are ``pAlpha`` again, never read). The host passes an
  ``NVFP4Tensor`` as ``out`` (:func:`raw_args`);
* ``n`` is the GEMM's N (the weight's rows): with a gated activation (``"silu_mul"``,
  ``"swiglu_oai"``) the output has N / 2 columns;
* ``max_ctas``: CTAs a persistent kernel may launch (the device's SM count);
* ``early``: 1 lets the stream kernel read the weight and its scales before
  ``griddepcontrol.wait`` (``Operands.early``; kernels/stream.py states when that is safe),
  0 keeps every global read after the wait; other kernels ignore it.

The caller (``cute_fp4.api.check_operands``) has checked dtypes, shapes, contiguity and
16-byte alignment: the pointers carry no layout. :func:`global_tensors` rebuilds the
compact tensors inside the launcher with the divisibility the checks guarantee (N % 8,
K % 32, 16-byte aligned bases).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from cute_fp4.formats import NVFP4, SF_ATOM_BYTES, SF_ATOM_COLS, BlockFormat
from cute_fp4.kernels.epilogue import NvOut
from cute_fp4.operands import Operands
from cute_fp4.schedule import OutDtype, Schedule, gated_op

_GMEM = cute.AddressSpace.gmem


class PointerTypes(NamedTuple):
    """Element types of the pointer arguments of a kernel (``pWork`` is always FP32,
    ``pCount`` int32)."""

    a: type  # Uint8 (packed NVFP4) or the 16-bit activation type
    c: type  # the output element type


class GemmTensors(NamedTuple):
    """Global tensors of one launch, built by :func:`global_tensors`."""

    mA: cute.Tensor  # uint8 [M, K/2] or 16-bit [M, K]
    mSFA: cute.Tensor  # flat uint8 blocked scales of A (W4A16: those of B)
    mB: cute.Tensor  # uint8 [N, K/2]
    mSFB: cute.Tensor  # flat uint8 blocked scales of B
    mD: cute.Tensor  # (M, N, 1): the output
    mAlpha: cute.Tensor  # (1,) float32
    mWork: cute.Tensor  # split-K: the workspace as flat FP32 (without split-K: unused)
    mCount: cute.Tensor  # split-K: the header and counters, flat int32 (without: unused)
    mBias: cute.Tensor  # (N,) float32: the fused bias (without "bias": unused)
    nv: NvOut | None = None  # "nvfp4_out": codes, blocked scales, global scale
    early: cutlass.Int32 | None = None  # the launch's ``early`` flag (the stream kernel's)


def out_dtype(schedule: Schedule) -> type:
    """Element type of the kernel's output tensor."""
    return {OutDtype.BF16: cutlass.BFloat16, OutDtype.FP16: cutlass.Float16,
            OutDtype.FP32: cutlass.Float32}[schedule.epilogue.out_dtype]


def split_workspace_needs(split_k: int, m: int, n: int, tile_mn: tuple[int, int],
                          slots: int, values: int) -> tuple[int, int]:
    """(int32 counters, FP32 partial values) a split-K launch uses: one counter per (output
    tile, thread slot), ``values`` partials per slot, tile and split. ``slots`` and
    ``values`` are the kernel's ``split_slots`` (consumer threads times accumulators per
    thread) and ``split_values`` (accumulator values per thread). The workspace layout is
    ``epilogue.store_split_k``'s."""
    tiles = -(-m // tile_mn[0]) * -(-n // tile_mn[1])
    return tiles * slots, tiles * slots * split_k * values


def _ptr(dtype, address, align):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, address, _GMEM, assumed_align=align)


N_POINTERS = 11  # pointer arguments of the signature (then m, n, k, max_ctas, early, stream)


def pointer_slots(types: PointerTypes, split_k: int) -> tuple[tuple[type, int], ...]:
    """(element type, assumed alignment in bytes) of the :data:`N_POINTERS` pointer
    arguments, as :func:`fake_args` compiles them and :func:`runtime_args` makes them."""
    u8, f32, i32 = cutlass.Uint8, cutlass.Float32, cutlass.Int32
    work = 16 if split_k > 1 else 4
    return ((types.a, 16), (u8, 16), (u8, 16), (u8, 16), (types.c, 16), (f32, 4),
            (f32, work), (i32, work), (f32, 4), (u8, 4), (f32, 4))


def fake_args(types: PointerTypes, split_k: int, max_ctas: int) -> tuple:
    """Placeholder arguments for ``cute.compile`` (symbolic M, N, K)."""
    from cutlass.cute.runtime import make_fake_stream

    i32 = cutlass.Int32
    ptrs = tuple(_ptr(dtype, 0, align) for dtype, align in pointer_slots(types, split_k))
    return (*ptrs, i32(0), i32(0), i32(0), i32(max_ctas), i32(0), make_fake_stream())


def runtime_args(types: PointerTypes, split_k: int, ops: Operands, stream,
                 out_cols: int = 1) -> tuple:
    """The compiled signature's arguments from a launch's checked :class:`Operands`."""
    dev = nv_parts(ops.out, 0)[0].device
    raw = raw_args(split_k, ops, sm_count(dev.index) if dev.type == "cuda" else 1, 0,
                   out_cols)
    slots = pointer_slots(types, split_k)
    ptrs = tuple(_ptr(dtype, v, align) for (dtype, align), v in zip(slots, raw))
    return (*ptrs, *(cutlass.Int32(v) for v in raw[N_POINTERS:-1]), stream)


def raw_args(split_k: int, ops: Operands, max_ctas: int, stream: int,
             out_cols: int = 1) -> tuple[int, ...]:
    """The compiled signature's arguments as plain ints (addresses, sizes, the raw stream
    handle), for a kernel compiled with ``--enable-tvm-ffi``: its TVM-FFI entry takes ints
    for pointers, Int32s and the stream, so no DSL object is built per launch. An absent
    operand passes an address that is never read (W4A16's ``pSFA``: B's scales; without
    split-K ``pWork``/``pCount``, without bias ``pBias``, without NVFP4 output ``pSFOut``/
    ``pGSOut``: alpha's). ``out_cols``: GEMM columns per output column (2 with
    ``"silu_mul"``). ``ops.out``: a tensor, or with ``"nvfp4_out"`` the ``NVFP4Tensor``
    the kernel writes (codes, scales, its global scale read)."""
    sfb = ops.b_scale.data_ptr()
    pal = ops.alpha.data_ptr()
    out, sfo, gso, per = nv_parts(ops.out, pal)
    cols = out.shape[-1] * per  # out: [M, N], or [..., N] contiguous (a layer's N-D output)
    m = out.numel() // out.shape[-1] if out.dim() != 2 else out.shape[0]
    ws = ops.workspace
    count, work = (ws[0].data_ptr(), ws[1].data_ptr()) if split_k > 1 else (pal, pal)
    return (ops.a.data_ptr(), sfb if ops.a_scale is None else ops.a_scale.data_ptr(),
            ops.b.data_ptr(), sfb, out.data_ptr(), pal, work, count,
            pal if ops.bias is None else ops.bias.data_ptr(), sfo, gso, m, cols * out_cols,
            ops.b.shape[-1] * 2, max_ctas, int(ops.early), stream)


class BoundArgs:
    """A launch's raw arguments (:func:`raw_args`, or a grouped kernel's
    ``GroupedLaunch.raw_args``: both begin ``pA, pSFA, pB, pSFB, pC, pAlpha`` and end with
    the stream) with the ones that change between calls left open: A's data and block
    scales, the output, alpha and the stream (``cute_fp4.bindings.BoundLaunch`` fills them
    per call). ``b``: B's address, which a binding holds to; ``stream``: the bound one.
    ``aliases``: how many slots after alpha repeat its address (2 for an unsplit dense
    launch: its workspace slots, never read), so a new alpha replaces them too."""

    __slots__ = ("b", "stream", "_sfa", "_mid", "_alpha", "_after", "_aliases")

    def __init__(self, raw: tuple[int, ...], aliases: int):
        self.b, self.stream = raw[2], raw[-1]
        self._sfa, self._mid, self._alpha = raw[1], raw[2:4], raw[5]
        self._after, self._aliases = raw[6:-1], aliases

    def __call__(self, a_ptr: int, a_scale_ptr: int | None, out_ptr: int,
                 alpha_ptr: int | None, stream: int) -> tuple[int, ...]:
        sfa = self._sfa if a_scale_ptr is None else a_scale_ptr
        if alpha_ptr is None:
            return (a_ptr, sfa, *self._mid, out_ptr, self._alpha, *self._after, stream)
        n = self._aliases
        return (a_ptr, sfa, *self._mid, out_ptr, alpha_ptr, *((alpha_ptr,) * n),
                *self._after[n:], stream)


def nv_parts(out, pal: int) -> tuple:
    """``(tensor, scale address, global scale address, output columns per element of the
    tensor)`` of a launch's ``out``: an ``NVFP4Tensor`` (``"nvfp4_out"``: its packed codes,
    two columns per byte) or a plain tensor (both addresses ``pal``, never read)."""
    if hasattr(out, "global_scale"):
        return out.data, out.scale.data_ptr(), out.global_scale.data_ptr(), 2
    return out, pal, pal, 1


@functools.cache
def sm_count(device_index) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows(ptr, rows, cols, ld):
    return cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(ld, 1)))


def sf_tensor_bytes(rows, half_k, fmt: BlockFormat):
    """Bytes of ``fmt``'s padded blocked scales of ``rows`` rows of ``half_k`` packed bytes
    (plain integer arithmetic: DSL integers while tracing)."""
    return (rows + 127) // 128 * fmt.atom_cols(half_k) * SF_ATOM_BYTES


def _sf_bytes(ptr, rows, half_k, fmt: BlockFormat):
    size = cute.assume(sf_tensor_bytes(rows, half_k, fmt), divby=SF_ATOM_BYTES)
    return cute.make_tensor(ptr, cute.make_layout((size,), stride=(1,)))


def global_tensors(fmt: BlockFormat, w4a16: bool, split_k: int, pA, pSFA, pB, pSFB, pC,
                   pAlpha, pWork, pCount, pBias, m, n, k, ops: tuple = (), pSFOut=None,
                   pGSOut=None, early=None) -> GemmTensors:
    """The launch's global tensors over the raw pointers (call while tracing); ``fmt``:
    the operands' block format (their scale tensors' sizes); ``ops``: the schedule's fused
    epilogue operations (``"silu_mul"``: D has N / 2 columns)."""
    n = cute.assume(n, divby=8)
    half_k = cute.assume(k // 2, divby=16)
    ld_b = cute.assume(cutlass.Int64(half_k), divby=16)
    if w4a16:
        kk = cute.assume(k, divby=32)
        mA = _rows(pA, m, kk, cute.assume(cutlass.Int64(kk), divby=8))
    else:
        mA = _rows(pA, m, half_k, ld_b)
    n_d = n // 2 if gated_op(ops) else n  # plan(): N % 16 == 0 with a gated activation
    ld_c = cute.assume(cutlass.Int64(n_d), divby=8)
    plane = cute.assume(ld_c * m, divby=8)
    mD = cute.make_tensor(pC, cute.make_layout((m, n_d, 1), stride=(ld_c, 1, plane)))
    mAlpha = cute.make_tensor(pAlpha, cute.make_layout((1,), stride=(1,)))
    mWork = mCount = mBias = mAlpha
    if split_k > 1:
        mWork = cute.make_tensor(pWork, cute.make_layout((1 << 30,)))
        mCount = cute.make_tensor(pCount, cute.make_layout((1 << 30,)))
    if "bias" in ops:
        mBias = cute.make_tensor(pBias, cute.make_layout((n,)))
    nv = None
    if "nvfp4_out" in ops:  # plan(): N_out % 32 == 0; mD: the codes' shape in elements
        half_d = cute.assume(n_d // 2, divby=16)
        mQ = cute.make_tensor(cute.recast_ptr(pC, dtype=cutlass.Uint8), cute.make_layout(
            (m, half_d), stride=(cute.assume(cutlass.Int64(half_d), divby=16), 1)))
        # the output's scales, NVFP4's: scale columns padded to whole atoms
        kbp = (n_d // NVFP4.block + (SF_ATOM_COLS - 1)) // SF_ATOM_COLS * SF_ATOM_COLS
        sf_len = cute.assume((m + 127) // 128 * 128 * kbp, divby=SF_ATOM_BYTES)
        nv = NvOut(mQ, cute.make_tensor(pSFOut, cute.make_layout((sf_len,))),
                   cute.make_tensor(pGSOut, cute.make_layout((1,))))
    return GemmTensors(mA, _sf_bytes(pSFA, m, half_k, fmt), _rows(pB, n, half_k, ld_b),
                       _sf_bytes(pSFB, n, half_k, fmt), mD, mAlpha, mWork, mCount, mBias, nv,
                       early)


class GemmLaunch:
    """Mixin of every GEMM kernel class: the compiled entry point and its arguments.

    A kernel class sets ``self.schedule``, ``self.fmt`` (the block format), ``self.ptr_types``
    (:class:`PointerTypes`), ``self.w4a16``, ``self.split_k`` and ``self.sm_count`` in
    ``__init__`` and implements
    ``_launch(tensors: GemmTensors, max_ctas, stream)``.
    """

    @property
    def ops(self) -> tuple[str, ...]:
        """The schedule's fused epilogue operations."""
        return self.schedule.epilogue.ops

    @property
    def out_cols(self) -> int:
        """GEMM columns per output column (2 with ``"silu_mul"``)."""
        return 2 if gated_op(self.ops) else 1

    @cute.jit
    def __call__(self, pA: cute.Pointer, pSFA: cute.Pointer, pB: cute.Pointer,
                 pSFB: cute.Pointer, pC: cute.Pointer, pAlpha: cute.Pointer,
                 pWork: cute.Pointer, pCount: cute.Pointer, pBias: cute.Pointer,
                 pSFOut: cute.Pointer, pGSOut: cute.Pointer,
                 m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 max_ctas: cutlass.Int32, early: cutlass.Int32, stream: cuda.CUstream):
        """Entry point: raw global pointers and sizes (see the module docstring)."""
        self._launch(global_tensors(self.fmt, self.w4a16, self.split_k, pA, pSFA, pB, pSFB, pC,
                                    pAlpha, pWork, pCount, pBias, m, n, k, self.ops,
                                    pSFOut, pGSOut, early),
                     max_ctas, stream)

    def fake_args(self) -> tuple:
        """Arguments for ``cute.compile`` (M, N, K symbolic)."""
        return fake_args(self.ptr_types, self.split_k, self.sm_count)

    def runtime_args(self, ops: Operands, stream) -> tuple:
        """The same arguments from a launch's checked operands (pointers and sizes only)."""
        return runtime_args(self.ptr_types, self.split_k, ops, stream, self.out_cols)

    def raw_args(self, ops: Operands, max_ctas: int, stream: int) -> tuple[int, ...]:
        """The same arguments as ints, for the TVM-FFI entry (:func:`raw_args`)."""
        return raw_args(self.split_k, ops, max_ctas, stream, self.out_cols)

    def bound_args(self, raw: tuple[int, ...]) -> BoundArgs:
        """``raw`` (:meth:`raw_args`) with the per-call arguments left open."""
        return BoundArgs(raw, 0 if self.split_k > 1 else 2)

    def pointer_slots(self) -> tuple[tuple[type, int], ...]:
        """The pointer arguments' element types and alignments (:func:`pointer_slots`)."""
        return pointer_slots(self.ptr_types, self.split_k)


class NoopLaunch:
    """A host-only CuTe DSL function with the launch signature of every GEMM kernel and an
    empty body: compiled, its entry decodes the arguments like a kernel's and launches
    nothing. What the host side of a launch costs is measured with it (perf/host_overhead.py,
    tests/test_launch_path.py)."""

    @cute.jit
    def __call__(self, pA: cute.Pointer, pSFA: cute.Pointer, pB: cute.Pointer,
                 pSFB: cute.Pointer, pC: cute.Pointer, pAlpha: cute.Pointer,
                 pWork: cute.Pointer, pCount: cute.Pointer, pBias: cute.Pointer,
                 pSFOut: cute.Pointer, pGSOut: cute.Pointer,
                 m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32,
                 max_ctas: cutlass.Int32, early: cutlass.Int32, stream):
        pass


# ----------------------------------------------------------------------------- grouped

class GroupedTensors(NamedTuple):
    """Global tensors of one grouped launch (:func:`grouped_tensors`)."""

    mA: cute.Tensor  # uint8 [M_total, K/2] or 16-bit [M_total, K]: rows sorted by group
    mSFA: cute.Tensor  # flat uint8 blocked scales of A's M_total rows (W4A16: B's)
    mB: cute.Tensor  # uint8 (rows, K/2, groups): each group's weight
    mSFB: cute.Tensor  # uint8 (bytes, groups): each group's blocked scales
    mD: cute.Tensor  # (M_total, N, 1)
    mAlpha: cute.Tensor  # (groups,) float32
    mOffsets: cute.Tensor  # (groups + 1,) int32: group g owns rows offsets[g] .. [g + 1]
    mBias: cute.Tensor  # (N, groups) float32: each group's fused bias (without "bias": unused)
    nv: NvOut | None = None  # "nvfp4_out": over the M_total rows (as quantize of D has it)


def grouped_tensors(fmt: BlockFormat, w4a16: bool, b_row_align: int, pA, pSFA, pB, pSFB, pC,
                    pAlpha, pOffsets, pBias, m, n, k, groups, ops: tuple = (), pSFOut=None,
                    pGSOut=None) -> GroupedTensors:
    """The grouped launch's global tensors over the raw pointers (call while tracing).
    ``b_row_align``: the weight's stored rows per group are ``n`` rounded up to it (64 for
    the fragment-order packed weight, 1 for the plain one)."""
    dense = global_tensors(fmt, w4a16, 1, pA, pSFA, pB, pSFB, pC, pAlpha, pAlpha, pAlpha,
                           pAlpha, m, n, k, ops, pSFOut, pGSOut)
    n = cute.assume(n, divby=8)
    half_k = cute.assume(k // 2, divby=16)
    rows = (n + b_row_align - 1) // b_row_align * b_row_align
    mB = cute.make_tensor(pB, cute.make_layout(
        (n, half_k, groups),
        stride=(cute.assume(cutlass.Int64(half_k), divby=16), 1,
                cute.assume(cutlass.Int64(rows) * half_k, divby=128))))
    sf_bytes = cute.assume(sf_tensor_bytes(n, half_k, fmt), divby=SF_ATOM_BYTES)
    mSFB = cute.make_tensor(pSFB, cute.make_layout((sf_bytes, groups), stride=(1, sf_bytes)))
    mAlpha = cute.make_tensor(pAlpha, cute.make_layout((groups,)))
    mBias = mAlpha
    if "bias" in ops:
        mBias = cute.make_tensor(pBias, cute.make_layout((n, groups), stride=(1, n)))
    return GroupedTensors(dense.mA, dense.mSFA, mB, mSFB, dense.mD, mAlpha,
                          cute.make_tensor(pOffsets, cute.make_layout((groups + 1,))), mBias,
                          dense.nv)


class GroupedLaunch(GemmLaunch):
    """Mixin of the grouped kernels: the grouped entry point and its arguments.

    Compiled signature ``(pA, pSFA, pB, pSFB, pC, pAlpha, pOffsets, pBias, pSFOut, pGSOut, m,
    n, k, groups, max_ctas, stream)``: the dense one with ``pWork`` replaced by the int32
    group offsets ``[groups + 1]``, ``pAlpha`` one float32 per group, ``pBias`` float32
    ``[groups, N]`` (or ``pAlpha``, unread), ``m`` the total rows and ``groups`` added;
    ``pSFOut``/``pGSOut`` as the dense one's (NVFP4 over all ``M_total`` rows).
    ``self.b_row_align`` as in :func:`grouped_tensors`.
    """

    @cute.jit
    def __call__(self, pA: cute.Pointer, pSFA: cute.Pointer, pB: cute.Pointer,
                 pSFB: cute.Pointer, pC: cute.Pointer, pAlpha: cute.Pointer,
                 pOffsets: cute.Pointer, pBias: cute.Pointer, pSFOut: cute.Pointer,
                 pGSOut: cute.Pointer, m: cutlass.Int32,
                 n: cutlass.Int32, k: cutlass.Int32, groups: cutlass.Int32,
                 max_ctas: cutlass.Int32, stream: cuda.CUstream):
        self._launch(grouped_tensors(self.fmt, self.w4a16, self.b_row_align, pA, pSFA, pB,
                                     pSFB, pC, pAlpha, pOffsets, pBias, m, n, k, groups,
                                     self.ops, pSFOut, pGSOut),
                     max_ctas, stream)

    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_stream

        ptrs = [_ptr(dtype, 0, align) for dtype, align in self.pointer_slots()]
        i32 = cutlass.Int32
        return (*ptrs, i32(0), i32(0), i32(0), i32(0), i32(self.sm_count), make_fake_stream())

    def runtime_args(self, ops: Operands, stream) -> tuple:
        dev = nv_parts(ops.out, 0)[0].device
        raw = self.raw_args(ops, sm_count(dev.index) if dev.type == "cuda" else 1, stream)
        slots = self.pointer_slots()
        ptrs = [_ptr(dtype, v, align) for (dtype, align), v in zip(slots, raw)]
        return (*ptrs, *(cutlass.Int32(v) for v in raw[len(slots):-1]), stream)

    def raw_args(self, ops: Operands, max_ctas: int, stream: int) -> tuple[int, ...]:
        """``(pointers..., m, n, k, groups, max_ctas, stream)`` as ints (W4A16: ``pSFA``
        repeats ``pSFB``, never read; no bias: ``pBias`` repeats ``pAlpha``; ``ops.out`` an
        ``NVFP4Tensor`` with ``"nvfp4_out"``, see :func:`nv_parts`)."""
        sfb, pal = ops.b_scale.data_ptr(), ops.alpha.data_ptr()
        out, sfo, gso, per = nv_parts(ops.out, pal)
        m, cols = out.shape
        return (ops.a.data_ptr(), sfb if ops.a_scale is None else ops.a_scale.data_ptr(),
                ops.b.data_ptr(), sfb, out.data_ptr(), pal, ops.offsets.data_ptr(),
                pal if ops.bias is None else ops.bias.data_ptr(), sfo, gso, m,
                cols * per * self.out_cols, ops.b.shape[-1] * 2, ops.offsets.shape[0] - 1,
                max_ctas, stream)

    def bound_args(self, raw: tuple[int, ...]) -> BoundArgs:
        return BoundArgs(raw, 0)

    def pointer_slots(self) -> tuple[tuple[type, int], ...]:
        u8, f32 = cutlass.Uint8, cutlass.Float32
        return ((self.ptr_types.a, 16), (u8, 16), (u8, 16), (u8, 16), (self.ptr_types.c, 16),
                (f32, 4), (cutlass.Int32, 4), (f32, 4), (u8, 4), (f32, 4))


__all__ = ["N_POINTERS", "BoundArgs", "GemmLaunch", "GemmTensors", "GroupedLaunch",
           "GroupedTensors",
           "NoopLaunch", "PointerTypes", "fake_args", "global_tensors", "grouped_tensors",
           "nv_parts", "out_dtype", "pointer_slots", "raw_args", "runtime_args", "sm_count",
           "split_workspace_needs"]
