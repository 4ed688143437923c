"""Prepared NVFP4 and MXFP4 layers: the API every integration builds on (``cute_fp4.nn``,
``cute_fp4.moe``, ``cute_fp4.hf``, ``cute_fp4.vllm``; an SGLang adapter would be one more).

Prepare once from a checkpoint's tensors (any tensor-parallel shard of them), apply per
call: :class:`Linear` (``Linear.from_modelopt(weight, weight_scale, weight_scale_2, ...)``,
or an MXFP4 checkpoint's ``Linear.from_mxfp4(blocks, scales, bias)``, then ``lin(x)``) and
:class:`Experts` (``Experts.from_modelopt(w13, w2, ...)``, or gpt-oss's
``Experts.from_gpt_oss(...)`` with :func:`softmax_topk` its routing, then
``ex(x, topk_ids, topk_weights)``). Mode and layout are chosen per GPU; a call syncs
nothing, is CUDA-graph capturable and traces under ``torch.compile``. With
``CUTE_FP4_REFERENCE=1`` (or inside :class:`reference_execution`) the layers compute with
the exact reference on any device, the CPU included (``targets.reference_mode``).
"""

from cute_fp4.layers.common import LAYOUTS, MODES, Layout, Mode, resolve_mode
from cute_fp4.layers.experts import (
    Experts,
    Routing,
    Stages,
    combine,
    route,
    silu_and_mul,
    softmax_topk,
)
from cute_fp4.layers.linear import Linear
from cute_fp4.targets import REFERENCE_ENV, reference_execution, reference_mode

__all__ = ["LAYOUTS", "MODES", "REFERENCE_ENV", "Experts", "Layout", "Linear", "Mode", "Routing",
           "Stages", "combine", "reference_execution", "reference_mode", "resolve_mode", "route",
           "silu_and_mul", "softmax_topk"]
