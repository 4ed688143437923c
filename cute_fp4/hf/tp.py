"""Tensor parallelism in transformers: ``cute_fp4.hf.from_pretrained(path, tp_plan="auto")``
(torchrun, one process per device) shards the NVFP4 layers as the model's plan says.

transformers makes a DTensor placeholder of every *parameter* its plan names, so the loader
reads only this rank's shard, and wraps each planned module's ``forward`` with the style's
input and output transforms (the all-reduce after a row-parallel layer). The loading
placeholders therefore hold ``weight`` and ``weight_scale`` (and the experts' stacks) as
parameters, the scalars as buffers (replicated), and say ``_hf_quantized_needs_local_tp``
(their forward runs on local tensors). Once loaded, each layer is prepared from its local
shard (``cute_fp4.layers``) *in place*: replacing the module would drop the wrapper.

Supported: linear layers whose style is column-wise or row-wise (``ColwiseParallel`` /
``RowwiseParallel``: "colwise", "rowwise", and their gathering variants) or that the plan
leaves replicated; experts sharded as ``moe_tp_experts`` with ``gate_up_proj``
"packed_colwise" (each rank gets its gate rows and its up rows) and ``down_proj``
"rowwise". Anything else the plan asks of an NVFP4 layer is a FormatError naming the layer
and the style, raised at load: never run unsharded. A shard the kernels cannot run (K per
rank not a multiple of 32) is the layer API's FormatError, with the rank in the name.
"""

from __future__ import annotations

import torch

from cute_fp4.errors import FormatError

__all__ = ["check_experts_styles", "check_linear_style", "expert_scale_plan", "is_sharded",
           "local", "tp_group", "tp_mesh", "tp_style"]

_EXPERT_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def tp_mesh(model):
    """The model's tensor-parallel mesh, None when it is not tensor parallel."""
    size = getattr(model, "_tp_size", None)
    return getattr(model, "_device_mesh", None) if size and size > 1 else None


def tp_style(model, name: str) -> str | None:
    """The plan's style for module ``name`` (None: not in the plan, replicated)."""
    from transformers.distributed.tensor_parallel import _get_parameter_tp_plan

    return _get_parameter_tp_plan(parameter_name=name, tp_plan=model.tp_plan, is_weight=False)


def local(t):
    """This rank's shard of ``t`` (a DTensor) or ``t``, detached, 16-byte aligned (a tensor
    read from a safetensors file on the CPU may be a view at any offset of the mapping: the
    kernels' operand checks want 16 bytes, so such a one is copied)."""
    from torch.distributed.tensor import DTensor

    t = (t.to_local() if isinstance(t, DTensor) else t).detach()
    return t.clone() if t.data_ptr() % 16 else t


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(not p.is_replicate() for p in t.placements)


def tp_group(t):
    """The process group of a DTensor's (1-D) mesh."""
    return t.device_mesh.get_group()


def check_linear_style(name: str, style: str | None) -> None:
    """A linear layer's style must be column- or row-wise (or none: replicated)."""
    if style is None:
        return
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        ColwiseParallel,
        RowwiseParallel,
    )

    if type(ALL_PARALLEL_STYLES.get(style)) not in (ColwiseParallel, RowwiseParallel):
        raise FormatError(f"{name}: the tensor-parallel plan shards it as {style!r}, which the "
                          "NVFP4 layers do not support (column-wise or row-wise: 'colwise', "
                          "'rowwise'); pass a tp_plan without it, or exclude the layer when "
                          "quantizing")


def check_experts_styles(name: str, module_style: str | None, styles: dict) -> None:
    """Experts: sharded as "moe_tp_experts" with gate_up_proj "packed_colwise" and
    down_proj "rowwise", or not at all. ``styles``: projection -> the plan's style."""
    want = dict(_EXPERT_STYLES)
    if module_style is None and not any(styles.values()):
        return
    if module_style != "moe_tp_experts" or styles != want:
        raise FormatError(f"{name}: the tensor-parallel plan shards the experts as "
                          f"{module_style!r} with {styles}; the NVFP4 experts run sharded "
                          f"as 'moe_tp_experts' with {want} (each rank its gate and up rows "
                          "and its down columns) or replicated")


def expert_scale_plan(plan: dict | None) -> dict:
    """``plan`` with each experts projection's style given to its block scales too
    (``...experts.gate_up_proj_weight_scale``: the placeholders' parameter names)."""
    plan = dict(plan or {})
    for key, style in list(plan.items()):
        if "experts" in key and key.endswith(tuple(f".{p}" for p in _EXPERT_STYLES)):
            plan.setdefault(f"{key}_weight_scale", style)
    return plan


def parameter(shape, dtype) -> torch.nn.Parameter:
    """A loading placeholder transformers may shard: a parameter on the meta device."""
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                              requires_grad=False)
