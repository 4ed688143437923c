"""The last step of a mixture-of-experts call in one kernel: each token's ``top_k`` rows of
the down projection, weighted by its routing weights and summed,
``out[t] = sum_j w[t, j] * down[inverse[t * k + j]]`` (:func:`cute_fp4.layers.routing.
combine`), where torch takes a gather and a batched matmul.

A thread owns eight consecutive columns (16 bytes) of one token's output row: it reads
the ``k`` rows' 16 bytes in slot order (``inverse`` gives each slot's row of ``down``, the
down GEMM's output in expert order), converts them to float32, multiplies each by its
weight (already rounded to ``down``'s dtype by the caller) with the product rounded on
its own (``mul.rn.f32``: never contracted into an FMA), adds the products in slot order
in float32 and rounds the sum once to ``down``'s dtype: bit for bit what the torch path
of ``combine`` computes with the same operations, so eager, ``torch.compile`` tracing and
the reference agree, and every run gives the same bits.

Across kernel boundaries (programmatic dependent launch, ``roles.PDL``): a thread waits
(``griddepcontrol.wait``) before it reads anything, then releases its dependents; launched
right after the down GEMM, the CTAs become resident while that GEMM drains.

Constraints (checked by the host layer, ``cute_fp4.combining``): ``down`` contiguous
``[P, H]`` of the spec's 16-bit dtype, ``H`` a multiple of 8, 16-byte aligned; ``inverse``
contiguous int64 ``[P]`` with ``P = T * k``, every value in ``[0, P)``; ``weights``
contiguous ``[T, k]`` of ``down``'s dtype; ``out`` contiguous ``[T, H]`` of that dtype,
16-byte aligned, not overlapping the inputs. Grid ``(ceil(H / (8 threads)), T)``; launched
on the current stream, no host synchronisation, CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from cute_fp4.kernels import roles
from cute_fp4.kernels.epilogue import mul_rn

_GMEM = cute.AddressSpace.gmem
_I32 = cutlass.Int32
_U32 = cutlass.Uint32
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
VEC = 8  # columns per thread: 16 bytes of 16-bit values, four 32-bit words


@dataclasses.dataclass(frozen=True)
class CombineSpec:
    """Static choices of one compiled combine kernel."""

    target: str = "sm_90a"
    dtype: str = "bfloat16"  # of down, the weights and the output
    threads: int = 128  # per CTA: 1,024 columns of one token

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in 32..1024, got {self.threads}")

    def label(self) -> str:
        return f"combine-{self.dtype}-t{self.threads}@{self.target}"


class CombineKernel:
    """The weighted sum of each token's down rows; see the module docstring.

    Entry point ``(pDown, pInverse, pWeights, pOut, t, k, h, stream)``: ``down`` ``[T * k,
    H]``, ``inverse`` int64 ``[T * k]``, ``weights`` ``[T * k]``, ``out`` ``[T, H]``.
    """

    def __init__(self, spec: CombineSpec):
        self.spec = spec
        self.threads = spec.threads
        self.dtype = DTYPES[spec.dtype]

    # ------------------------------------------------------------------ host side
    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_stream

        return (make_ptr(_U32, 0, _GMEM, assumed_align=16),
                make_ptr(cutlass.Int64, 0, _GMEM, assumed_align=8),
                make_ptr(self.dtype, 0, _GMEM, assumed_align=2),
                make_ptr(_U32, 0, _GMEM, assumed_align=16),
                _I32(0), _I32(0), _I32(0), make_fake_stream())

    def runtime_args(self, down, inverse, weights, out, k: int, stream) -> tuple:
        """The entry point's arguments from checked torch tensors."""
        return self._args(down, inverse, weights, out, k, stream,
                          lambda dt, t, a: make_ptr(dt, t.data_ptr(), _GMEM, assumed_align=a),
                          _I32)

    def raw_args(self, down, inverse, weights, out, k: int, stream: int) -> tuple:
        """:meth:`runtime_args` as plain ints, for a kernel compiled with
        ``--enable-tvm-ffi``."""
        return self._args(down, inverse, weights, out, k, stream,
                          lambda dt, t, a: t.data_ptr(), int)

    def _args(self, down, inverse, weights, out, k, stream, ptr, num) -> tuple:
        return (ptr(_U32, down, 16), ptr(cutlass.Int64, inverse, 8),
                ptr(self.dtype, weights, 2), ptr(_U32, out, 16),
                num(out.shape[0]), num(k), num(out.shape[1]), stream)

    @cute.jit
    def __call__(self, pDown: cute.Pointer, pInverse: cute.Pointer, pWeights: cute.Pointer,
                 pOut: cute.Pointer, t: cutlass.Int32, k: cutlass.Int32, h: cutlass.Int32,
                 stream: cuda.CUstream):
        words = cute.assume(h // 2, divby=VEC // 2)  # 32-bit words per row
        mDown = cute.make_tensor(pDown, cute.make_layout((t * k, words), stride=(words, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((t, words), stride=(words, 1)))
        mInverse = cute.make_tensor(pInverse, cute.make_layout((t * k,)))
        mWeights = cute.make_tensor(pWeights, cute.make_layout((t * k,)))
        cols = self.threads * VEC
        self.kernel(mDown, mInverse, mWeights, mOut, k, h).launch(
            grid=[(h + cols - 1) // cols, t, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=roles.PDL)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mDown: cute.Tensor, mInverse: cute.Tensor, mWeights: cute.Tensor,
               mOut: cute.Tensor, k: cutlass.Int32, h: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, tok, _ = cute.arch.block_idx()
        v = bx * self.threads + tidx  # this thread's 8-column vector of the row
        roles.wait_for_inputs()  # down comes from the kernel before
        roles.release_dependents()
        if v * VEC < h:
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            acc.fill(0.0)  # slot 0 replaces it (a sum that starts at +0 would turn -0 to +0)
            for j in cutlass.range(k, unroll=1):
                pair = tok * k + j
                row = _I32(mInverse[pair])
                w = mWeights[pair].to(cutlass.Float32)
                rW = cute.make_rmem_tensor((VEC // 2,), _U32)
                cute.autovec_copy(cute.local_tile(mDown[(row, None)], (VEC // 2,), (v,)), rW)
                x = cute.recast_tensor(rW, self.dtype).load().to(cutlass.Float32)
                for i in cutlass.range_constexpr(VEC):
                    term = mul_rn(w, x[i])
                    acc[i] = cutlass.select_(j == 0, term, acc[i] + term)
            rO = cute.make_rmem_tensor((VEC,), self.dtype)
            rO.store(acc.load().to(self.dtype))
            cute.autovec_copy(cute.recast_tensor(rO, _U32),
                              cute.local_tile(mOut[(tok, None)], (VEC // 2,), (v,)))


__all__ = ["CombineKernel", "CombineSpec", "DTYPES", "VEC"]
