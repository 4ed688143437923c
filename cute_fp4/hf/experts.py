"""transformers' fused MoE experts on the grouped NVFP4 kernels.

transformers v5 stores a MoE layer's experts as one module holding fused tensors,
``gate_up_proj [E, 2I, H]`` (gate rows, then up) and ``down_proj [E, H, I]``, and picks the
function that runs them by name through its experts interface
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, ``config._experts_implementation``).
This module registers one more, ``"cute_fp4"`` (:func:`experts_forward`): the module keeps
its class and routing, and its experts run on a :class:`~cute_fp4.moe.NVFP4MoE` held as its
child ``nvfp4``.

Loading merges the per-expert checkpoint tensors with transformers' own weight
conversions (:func:`nvfp4_converters`: the model's expert converters, repeated for the
four NVFP4 tensors) into buffers named after the fused tensor (:data:`SUFFIXES`), e.g.
``gate_up_proj`` uint8 ``[E, 2I, H/2]``, ``gate_up_proj_weight_scale`` float8 ``[E, 2I, H/16]``,
``gate_up_proj_weight_scale_2`` float32 ``[E, 2]`` (gate, up), ``gate_up_proj_input_scale``
``[E, 2]``; ``down_proj*`` likewise with ``[E]`` scales. :func:`finalize` turns them into the
``NVFP4MoE`` (``cute_fp4.layers.Experts.from_modelopt``: an up projection with another
global scale than its gate's is corrected after the GEMM; W4A4 takes the largest input
scale of each GEMM) and keeps the checkpoint's per-expert scales for saving
(:func:`checkpoint_tensors`, bit-exact).
"""

from __future__ import annotations

import copy
import re

import torch
from transformers.core_model_loading import ConversionOps, MergeModulelist, WeightConverter

from cute_fp4.errors import FormatError
from cute_fp4.formats import MXFP4, NVFP4
from cute_fp4.hf import tp
from cute_fp4.layers import Experts
from cute_fp4.moe import NVFP4MoE, expert

__all__ = ["IMPLEMENTATION", "PROJECTIONS", "SUFFIXES", "attach", "checkpoint_tensors",
           "expert_names", "experts_forward", "finalize", "holds_nvfp4", "install_placeholders",
           "is_experts", "nvfp4_converters", "unsupported"]

IMPLEMENTATION = "cute_fp4"  # the name registered in transformers' experts interface
ATTRIBUTE = NVFP4.name  # the experts module's child that runs NVFP4 experts (MXFP4: "mxfp4")
PROJECTIONS = ("gate_up_proj", "down_proj")
# checkpoint tensor of one expert -> suffix of the fused buffer on the experts module
SUFFIXES = {"weight": "", "weight_scale": "_weight_scale", "weight_scale_2": "_weight_scale_2",
            "input_scale": "_input_scale"}
_META = ("gate_up_proj_weight_scale_2", "gate_up_proj_input_scale", "down_proj_input_scale")


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers fused-experts module: 3-D ``gate_up_proj`` and ``down_proj``."""
    t = [getattr(module, p, None) for p in PROJECTIONS]
    return (all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in t)
            and hasattr(module, "num_experts"))


def holds_nvfp4(module: torch.nn.Module) -> bool:
    """An experts module running on an ``NVFP4MoE`` (its child ``nvfp4``)."""
    return isinstance(getattr(module, ATTRIBUTE, None), NVFP4MoE)


def unsupported(module: torch.nn.Module) -> str | None:
    """Why ``NVFP4MoE`` cannot run these experts, None when it can (gated SiLU, [gate; up]
    concatenated, [out, in] weights, no bias)."""
    if getattr(module, "is_transposed", False):
        return "its weights are stored transposed ([E, in, out])"
    if getattr(module, "has_bias", False):
        return "its projections have biases"
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        return "it is not a gated [gate; up] MLP"
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"its activation is {act!r} (the NVFP4 experts compute silu(gate) * up)"
    return None


# ----------------------------------------------------------------------------- conversions

def _clean(pattern: str) -> str:
    return pattern.replace("\\", "").removeprefix("^").removesuffix("$")


def moe_converter(conv) -> bool:
    """A model's converter that merges per-expert ``.weight`` tensors (MergeModulelist)."""
    return (isinstance(conv, WeightConverter)
            and any(isinstance(op, MergeModulelist) for op in conv.operations)
            and len(conv.target_patterns) == 1 and len(conv.source_patterns) in (1, 2)
            and all("*" in s and _clean(s).endswith(".weight") for s in conv.source_patterns))


class StackPair(ConversionOps):
    """Conversion op: the merged ``[E]`` scales of gate and up stacked into ``[E, 2]``
    (Concatenate's counterpart for per-expert scalars)."""

    @torch.no_grad
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        parts = [input_dict.pop(p) for p in source_patterns if p in input_dict]
        parts = [p if isinstance(p, torch.Tensor) else torch.stack(p) for p in parts]
        return {target_patterns[0]: torch.stack(parts, dim=1)}


def nvfp4_converters(conv) -> list:
    """The model's expert converter ``conv`` as four converters, one per NVFP4 tensor of
    an expert, each anchored so that it takes only its own tensor; all merge on the CPU
    (``force_cpu``), so a layer's experts reach the device once, merged."""
    out = []
    for tensor, suffix in SUFFIXES.items():
        sources = [_clean(s)[: -len("weight")] + tensor + "$" for s in conv.source_patterns]
        if tensor in ("weight", "weight_scale"):
            ops = copy.deepcopy(conv.operations)
        else:
            ops = [MergeModulelist(dim=0)] + ([StackPair()] if len(sources) == 2 else [])
        new = WeightConverter(sources, _clean(conv.target_patterns[0]) + suffix, ops,
                              force_cpu=True)
        new.scope_prefix, new.base_model_prefix = conv.scope_prefix, conv.base_model_prefix
        out.append(new)
    return out


def expert_names(conversions, experts_name: str) -> dict[str, list[tuple[str, str]]]:
    """``projection -> [(template, source), ...]`` (gate, up; down) for the ``.weight``
    tensors of experts module ``experts_name``: ``template`` the model-naming key with
    ``{e}`` for the expert, ``source`` the converter's pattern it ends with (``{e}`` too):
    the first expert converter of ``conversions`` whose target is that module's tensor."""
    out = {}
    for proj in PROJECTIONS:
        full = f"{experts_name}.{proj}"
        for conv in conversions:
            if not moe_converter(conv):
                continue
            target = _clean(conv.target_patterns[0])
            hit = re.search(re.escape(target).replace(r"\*", r"[^.]+") + "$", full)
            if hit is None:
                continue
            sources = [_clean(s).replace("*", "{e}") for s in conv.source_patterns]
            out[proj] = [(full[:hit.start()] + s, s) for s in sources]
            break
    return out


def expert_of(source: str, key: str) -> tuple[int, int] | None:
    """``(expert, start of its digits)`` of checkpoint ``key`` ending with ``source`` (a
    pattern with ``{e}``), None if it does not."""
    head, _, tail = source.partition("{e}")
    m = re.search(re.escape(head) + r"(\d+)" + re.escape(tail) + "$", key)
    return None if m is None else (int(m.group(1)), m.start(1))


# ----------------------------------------------------------------------------- placeholders

def install_placeholders(module: torch.nn.Module, input_scales: bool) -> None:
    """Replace the fused BF16 tensors of ``module`` (on the meta device) by buffers of the
    checkpoint's NVFP4 tensors, merged (module docstring)."""
    e, n13, h = module.gate_up_proj.shape
    i = module.down_proj.shape[2]
    specs = {
        "gate_up_proj": ((e, n13, h // 2), torch.uint8),
        "gate_up_proj_weight_scale": ((e, n13, NVFP4.scale_cols(h)), NVFP4.scale.torch_dtype),
        "gate_up_proj_weight_scale_2": ((e, 2), torch.float32),
        "down_proj": ((e, h, i // 2), torch.uint8),
        "down_proj_weight_scale": ((e, h, NVFP4.scale_cols(i)), NVFP4.scale.torch_dtype),
        "down_proj_weight_scale_2": ((e,), torch.float32),
    }
    if input_scales:
        specs["gate_up_proj_input_scale"] = ((e, 2), torch.float32)
        specs["down_proj_input_scale"] = ((e,), torch.float32)
    for proj in PROJECTIONS:
        delattr(module, proj)
    for name, (shape, dtype) in specs.items():
        if dtype == torch.float32:  # per-expert scalars: buffers, replicated
            module.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))
        else:  # parameters, which a tensor-parallel plan shards (cute_fp4.hf.tp)
            module.register_parameter(name, tp.parameter(shape, dtype))
    module._hf_quantized_needs_local_tp = True


def placeholder_names(module: torch.nn.Module) -> list[str]:
    return [n for n in (*module._parameters, *module._buffers) if n.startswith(PROJECTIONS)
            and getattr(module, n) is not None]


def finalize(module: torch.nn.Module, mode: str, layout: str = "auto", name: str = "") -> None:
    """The loaded placeholders of ``module`` -> its ``NVFP4MoE`` (``attach``). Sharded by
    tensor parallelism: prepared from this rank's shards, and the module all-reduces its
    output over the shards' group (``experts_forward``)."""
    b = {}
    for n in placeholder_names(module):
        t = module._parameters.pop(n, None)
        t = module._buffers.pop(n) if t is None else t
        if tp.is_sharded(t):
            module._cute_fp4_tp_group = tp.tp_group(t)
        b[n] = tp.local(t)
    attach(module, (b["gate_up_proj"], b["gate_up_proj_weight_scale"]),
           (b["down_proj"], b["down_proj_weight_scale"], b["down_proj_weight_scale_2"]),
           b["gate_up_proj_weight_scale_2"], b.get("gate_up_proj_input_scale"),
           b.get("down_proj_input_scale"), mode, layout, name=name)


def attach(module: torch.nn.Module, w13: tuple, w2: tuple, w13_scale_2: torch.Tensor,
           w13_input: torch.Tensor | None, w2_input: torch.Tensor | None, mode: str,
           layout: str = "auto", moe: NVFP4MoE | None = None, name: str = "") -> None:
    """Give ``module`` its ``NVFP4MoE`` (``moe``, or one prepared from the checkpoint
    tensors ``w13 = (weight, weight_scale)``, ``w2 = (weight, weight_scale,
    weight_scale_2)`` by ``cute_fp4.layers.Experts.from_modelopt``: gate and up global
    scales ``w13_scale_2`` ``[E, 2]``, which may differ) and keep the checkpoint's per-expert
    scales: ``w13_scale_2``, the input scales ``[E, 2]`` and ``[E]`` (or None)."""
    if moe is None:
        scales = (None, None)
        if mode == "w4a4" and w13_input is not None and w2_input is not None:
            scales = (w13_input, w2_input)  # one activation scale per GEMM: the largest
        moe = NVFP4MoE(None, None, experts=Experts.from_modelopt(
            (*w13, w13_scale_2), w2, input_scales=scales, mode=mode, layout=layout,
            name=name))
    for proj in PROJECTIONS:
        if proj in module._parameters:
            delattr(module, proj)
    module.nvfp4 = moe
    module.register_buffer("gate_up_proj_weight_scale_2", w13_scale_2, persistent=False)
    module.register_buffer("gate_up_proj_input_scale", w13_input, persistent=False)
    module.register_buffer("down_proj_input_scale", w2_input, persistent=False)


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, list[dict[str, list]]]:
    """The NVFP4 experts of ``module`` as ModelOpt's per-expert tensors on the CPU:
    ``projection -> [one dict per source] -> tensor name -> [expert 0, 1, ...]``, the
    sources ordered as :func:`expert_names` gives them (gate, up; down). Bit for bit what
    was loaded (or quantized)."""
    moe: NVFP4MoE = module.nvfp4
    i = moe.intermediate
    gs13 = module._buffers["gate_up_proj_weight_scale_2"].cpu()
    in13, in2 = module._buffers["gate_up_proj_input_scale"], module._buffers[
        "down_proj_input_scale"]
    gate, up, down = ({"weight": [], "weight_scale": [], "weight_scale_2": [],
                       "input_scale": []} for _ in range(3))
    for e in range(moe.num_experts):
        w13, w2 = moe.gate_up_expert(e), expert(moe.w2, e)
        d13, s13 = w13.data.cpu(), w13.scale_linear().cpu()
        for j, part in enumerate((gate, up)):
            rows = slice(0, i) if j == 0 else slice(i, 2 * i)
            part["weight"].append(d13[rows].clone())
            part["weight_scale"].append(s13[rows].clone())
            part["weight_scale_2"].append(gs13[e, j].clone())
            if in13 is not None:
                part["input_scale"].append(in13[e, j].cpu().clone())
        down["weight"].append(w2.data.cpu().clone())
        down["weight_scale"].append(w2.scale_linear().cpu())
        down["weight_scale_2"].append(w2.global_scale.cpu().reshape(()).clone())
        if in2 is not None:
            down["input_scale"].append(in2[e].cpu().clone())
    return {"gate_up_proj": [gate, up], "down_proj": [down]}


# ----------------------------------------------------------------------------- forward

def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"cute_fp4"`` experts implementation: ``self.nvfp4`` (an NVFP4MoE), or
    ``self.mxfp4`` (gpt-oss's ``MXFP4MoE``, ``cute_fp4.hf.mxfp4``) on the routed tokens;
    experts left in BF16 (excluded) run transformers' grouped_mm."""
    moe: NVFP4MoE | None = getattr(self, ATTRIBUTE, None) or getattr(self, MXFP4.name, None)
    if moe is None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    out = moe(hidden_states, top_k_index, top_k_weights)
    group = getattr(self, "_cute_fp4_tp_group", None)
    if group is not None:  # tensor parallel: this rank's intermediate slice summed over ranks
        torch.distributed.all_reduce(out, group=group)
    return out


def check_shapes(module: torch.nn.Module, name: str) -> None:
    """The kernels' limits on the experts' sizes (hidden and intermediate multiples of
    32), as a FormatError naming the module."""
    e, n13, h = module.gate_up_proj.shape
    if n13 % 2 or h % 32 or (n13 // 2) % 32:
        raise FormatError(f"{name}: hidden {h} and intermediate {n13 // 2} must be multiples "
                          "of 32 for the grouped NVFP4 kernels")
