"""CuTe DSL kernels. Nothing here imports the torch-facing API or the CLI.

Contract every kernel class follows (the host layer, ``cute_fp4.compile``, relies on it):

``Kernel(schedule, problem)``
    Static choices only. ``plan(schedule, problem)`` has already accepted the pair;
    ``problem.m/n/k`` are 0 (symbolic: one compile serves every shape) or fixed.
``kernel.fake_args() -> tuple``
    Arguments for ``cute.compile(kernel, *args, options="--gpu-arch sm_XXXa")``: placeholder
    global pointers (``cutlass.cute.runtime.make_ptr(dtype, 0, AddressSpace.gmem,
    assumed_align=...)``), ``cutlass.Int32`` sizes and a fake stream, so M, N, K are
    runtime values (one compile serves every shape). The ``@cute.jit`` ``__call__`` builds
    the compact row-major global tensors from the pointers and sizes (with the divisibility
    the host layer guarantees: N % 8, K % 32, 16-byte aligned bases) and launches.
``kernel.runtime_args(a, a_scale, b, b_scale, out, alpha, workspace, stream) -> tuple``
    The same arguments from torch tensors, reading only ``data_ptr()`` and ``shape`` (no
    DLPack): ``a`` uint8 [M, K/2] (W4A4) or bf16/fp16 [M, K] (W4A16), ``a_scale``/
    ``b_scale`` float8_e4m3fn in the 128x4 blocked layout (flat, cuBLAS order; ``a_scale``
    None for W4A16), ``b`` uint8 [N, K/2], ``out`` [M, N] row-major, ``alpha`` a float32
    tensor of one element on the GPU, ``workspace`` float32 [split_k, M, N] or None,
    ``stream`` a CUstream. The caller (``cute_fp4.api.check_operands``) must have checked
    dtypes, shapes, contiguity and 16-byte alignment: the pointers carry no layout.
    SM90 (Sm90Gemm, Sm90SwapAB): ``(pA, pSFA, pB, pSFB, pOut, pAlpha, pWork, M, N, K,
    stream)``; SM120: ``(pA, pSFA, pB, pSFB, pC, pAlpha, M, N, K, L, max_ctas, stream)``.
``kernel.smem_bytes``
    Dynamic shared memory of the launch, set while tracing; equals ``plan(...).smem_bytes``.
"""
