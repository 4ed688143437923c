"""The torch custom op ``cute_fp4::mm``: what ``cute_fp4.gemm`` becomes under torch.compile.

Importing ``cute_fp4`` (or ``cute_fp4.api``) registers nothing. The op is registered on
first use, once per process:

* by the first ``cute_fp4.gemm`` call, eager or traced: ``torch.compile(fullgraph=True)``
  of a function (or an ``NVFP4Linear`` model) that calls ``gemm`` works on its own, with
  ``gemm`` captured as one ``cute_fp4::mm`` node;
* by :func:`register`, which code that calls ``torch.ops.cute_fp4.mm`` directly (or
  builds graphs holding it without going through ``gemm``) calls first::

      import cute_fp4.ops
      mm = cute_fp4.ops.register().mm
      y = mm(a.data, a.scale, w.data, w.scale, alpha, k, torch.bfloat16, "auto")

The op's schema and arguments are documented on ``cute_fp4.api.register_op``.
"""

from __future__ import annotations

from cute_fp4.api import register_op

__all__ = ["register"]


def register():
    """Register the ``cute_fp4::mm`` / ``mm_packed`` / ``quantize`` / ``quantize_dynamic`` /
    ``grouped_mm`` ops (idempotent); returns the ``torch.ops.cute_fp4`` namespace."""
    return register_op()
