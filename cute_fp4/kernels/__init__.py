"""CuTe DSL kernels. Nothing here imports the torch-facing API, the host layer or the CLI.

Shared components (each exists once and serves every kernel family):

* ``scheduler.py``: work units (output tile x K split), one split-K rule, persistent or
  one CTA per unit, grouped raster; the protocol every scheduler follows
  (``UnitScheduler``: ``prepare``, ``total``, ``first_unit``, ``coords`` -> ``WorkTile``,
  the seam a grouped (MoE) scheduler plugs into) and the one persistent loop of every
  kernel (``for_each_unit``).
* ``roles.py``: warp placement (producer first, consumers after it), named-barrier ids,
  setmaxnreg from the plan, the mainloop pipeline with its arrive counts derived from the
  roles (checked at trace time), the named pingpong turns.
* ``loads.py``: TMA partitions of A and B, scale factors by TMA boxes or cp.async.
* ``epilogue.py``: alpha, a fused-op hook, conversion; TMA store through shared memory or a
  masked store from registers (through a transposed view for swap-AB).
* ``launch.py``: the one compiled signature, ``fake_args``/``runtime_args``, and the global
  tensors built from raw pointers.

Kernel classes: ``sm120.Sm120Gemm`` (block-scaled warp MMA, SM120/SM121; its MMA warps'
mainloop is ``sm120_mainloop.py``), ``sm90.Sm90Gemm`` (in-kernel FP4 -> 16-bit conversion +
WGMMA; the register-sourced mainloops are ``sm90_rs.py`` and ``sm90_rs_wide.py``) and
``stream.StreamGemm`` (the weight-streaming decode GEMM, both families). Each takes its
arguments as one NamedTuple (``Sm120Params``, ``Sm90Params``, ``StreamParams``), an
absent operand as None. Contract every kernel class follows (the host layer,
``cute_fp4.compile``, relies on it):

``Kernel(schedule, problem)``
    Static choices only. ``plan(schedule, problem)`` has already accepted the pair.
``kernel.fake_args() -> tuple``
    Arguments for ``cute.compile(kernel, *args, options="--gpu-arch sm_XXXa")``; M, N, K
    are runtime values (one compile serves every shape). See ``launch.py``.
``kernel.runtime_args(a, a_scale, b, b_scale, out, alpha, workspace, stream) -> tuple``
    The same arguments from torch tensors, reading only ``data_ptr()`` and ``shape`` (no
    DLPack). The caller (``cute_fp4.operands.check_operands``) must have checked dtypes,
    shapes, contiguity and 16-byte alignment: the pointers carry no layout.
``kernel.smem_bytes``
    Dynamic shared memory of the launch, set while tracing; equals ``plan(...).smem_bytes``.

The kernels that are not GEMMs are made from a frozen spec each (a kernel class with
``fake_args``, ``runtime_args`` and ``raw_args``, compiled through
``cute_fp4.quant.cached_spec_build``): ``quantize.py`` and ``dequantize.py`` (the
activation codecs), ``route.py`` (the MoE routing sort) and ``combine.py`` (the MoE
combine).
"""
