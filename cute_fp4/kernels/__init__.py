"""CuTe DSL kernels. Nothing here imports the torch-facing API or the CLI.

Contract every kernel class follows (the host layer, ``cute_fp4.compile``, relies on it):

``Kernel(schedule, problem)``
    Static choices only. ``plan(schedule, problem)`` has already accepted the pair;
    ``problem.m/n/k`` are 0 (symbolic: one compile serves every shape) or fixed.
``kernel.fake_args() -> tuple``
    Arguments for ``cute.compile(kernel, *args, options="--gpu-arch sm_XXXa")`` built from
    ``cutlass.cute.runtime.make_fake_tensor`` with symbolic M, N, K and a fake stream.
``kernel.runtime_args(a, a_scale, b, b_scale, out, alpha, workspace, stream) -> tuple``
    The same arguments built from torch CUDA tensors: ``a`` uint8 [M, K/2] (W4A4) or
    bf16/fp16 [M, K] (W4A16), ``a_scale``/``b_scale`` float8_e4m3fn in the 128x4 blocked
    layout (flat, cuBLAS order), ``b`` uint8 [N, K/2], ``out`` [M, N] row-major,
    ``alpha`` a float32 tensor of one element on the GPU, ``workspace`` float32
    [split_k, M, N] or None, ``stream`` a CUstream.
``kernel.smem_bytes``
    Dynamic shared memory of the launch, set while tracing; equals ``plan(...).smem_bytes``.
"""
