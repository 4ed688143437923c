"""gpt-oss's MXFP4 experts on the grouped kernels: what :meth:`Experts.from_gpt_oss
<cute_fp4.layers.Experts.from_gpt_oss>` prepares and how such a layer runs.

The checkpoint (transformers' ``GptOssExperts``, ``quantization_config.quant_method ==
"mxfp4"``), per MoE layer: ``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` and
``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]`` (the weight ``[2I, H]`` of each expert as
rows of packed E2M1 bytes and their UE8M0 codes, ``cute_fp4.mxfp4.MXFP4Tensor.from_blocks``),
``gate_up_proj_bias`` ``[E, 2I]``, and ``down_proj_blocks`` ``[E, H, I/32, 16]``,
``down_proj_scales`` ``[E, H, I/32]``, ``down_proj_bias`` ``[E, H]``. Gate and up rows
alternate: output column ``2j`` of the gate_up projection is gate ``j``, ``2j + 1`` up ``j``
(``GptOssExperts._apply_gate``: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]``).

Per routed token and expert (transformers' ``GptOssExperts.forward``)::

    gate_up = x @ W13^T + b13
    h       = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g),  g = min(gate, 7)
    out    += w * (h @ W2^T + b2)

Fused (where the rows split into the kernels' gate/up groups: always for gpt-oss's sizes),
the bias and the activation run in the gate_up GEMM's epilogue (``grouped_gemm(bias=,
swiglu_oai=True)``: the bits of the GEMM to FP32, + bias, rounded, then
``cute_fp4.fused.swiglu_oai_unfused``) and the down bias in the down GEMM's; the gate/up
rows and the bias are regrouped once, at preparation (``cute_fp4.fused.regroup_gate_up``,
the group of the kernels that read the layout on its device: ``fused.device_group``, the
CPU's under the exact reference). :func:`oai_stages` is that pipeline unfused (and what
runs under ``torch.compile``, whose grouped op takes no epilogue operands).
"""

from __future__ import annotations

import torch

from cute_fp4.errors import FormatError, InputError
from cute_fp4.formats import MXFP4
from cute_fp4.fused import device_group, regroup_gate_up, swiglu_oai_unfused
from cute_fp4.grouped import grouped_gemm
from cute_fp4.layers.common import mxfp4_tensor, where
from cute_fp4.layers.routing import Stages, combine, expert, route
from cute_fp4.layers.stacks import check_stacks, pack_by_expert, pick_layout
from cute_fp4.mxfp4 import MXFP4Tensor

__all__ = ["gpt_oss_checkpoint", "gpt_oss_experts", "oai_forward", "oai_group", "oai_stages"]


def mxfp4_stack(what: str, blocks, scales) -> MXFP4Tensor:
    """An expert stack from a checkpoint's ``*_blocks`` ``[E, N, K/32, 16]`` and
    ``*_scales`` ``[E, N, K/32]``; a FormatError naming ``what`` otherwise."""
    return mxfp4_tensor(blocks, scales, ("E", "N"), f"{what}_", f"{what}: ")


def oai_group(fused, layout: str, dev: torch.device, i: int) -> int:
    """The gate/up group the gate_up rows are stored in: the kernels' (``fused`` "auto" or
    True, where I splits into it), else gpt-oss's own 1 (unfused)."""
    if fused not in ("auto", True, False):
        raise InputError(f"fused must be 'auto', True or False, got {fused!r}")
    if fused is False:
        return 1
    group = device_group(dev, layout)
    if i % group:
        if fused is True:
            raise FormatError(f"fused=True: intermediate {i} does not split into gate/up "
                              f"groups of {group} rows")
        return 1
    return group


def gpt_oss_experts(cls, gate_up: tuple, down: tuple, layout: str, fused, schedule,
                    name: str):
    """:meth:`Experts.from_gpt_oss` (its docstring): ``gate_up`` = (blocks, scales, bias),
    ``down`` likewise."""
    w13 = mxfp4_stack(f"{where(name)}gate_up_proj", *gate_up[:2])
    w2 = mxfp4_stack(f"{where(name)}down_proj", *down[:2])
    e, h, i = check_stacks(w13, w2, name)
    dev = w13.device
    resolved = pick_layout(layout, w13, w2, h, i, dev, "w4a16", name)
    group = oai_group(fused, resolved, dev, i)
    b13, b2 = gate_up[2], down[2]
    for b, shape, what in ((b13, (e, 2 * i), "gate_up_proj_bias"),
                           (b2, (e, h), "down_proj_bias")):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != shape):
            got = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise FormatError(f"{where(name)}{what} must be {list(shape)}, got {got}")
    if group != 1:
        w13 = regroup_gate_up(w13, group)
        if b13 is not None:
            b13 = regroup_gate_up(b13, group, dim=-1)
    if resolved == "packed":
        w13, w2 = pack_by_expert(w13), pack_by_expert(w2)
    return cls(w13, w2, "w4a16", schedule, (None, None), resolved, name=name,
               gate_up_group=group, activation="swiglu_oai", biases=(b13, b2))


def oai_forward(ex, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
    """A call of swiglu_oai experts ``ex``: two grouped GEMMs with their biases (and the
    activation) fused; unfused (:func:`oai_stages`) under torch.compile or when stored in
    gpt-oss's own row order."""
    if ex.gate_up_group == 1 or torch.compiler.is_compiling():
        return oai_stages(ex, x, topk_ids, topk_weights).out
    ex.check_input(x, topk_ids, topk_weights)
    r = route(topk_ids, ex.num_experts)
    b13, b2 = ex.biases
    act = grouped_gemm(x.index_select(0, r.token), ex.w13, r.offsets, schedule=ex.schedule,
                       out_dtype=x.dtype, bias=b13, swiglu_oai=True)
    down = grouped_gemm(act, ex.w2, r.offsets, schedule=ex.schedule, out_dtype=x.dtype,
                        bias=b2)
    return combine(down, r, topk_weights)


def oai_stages(ex, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
               ) -> Stages:
    """The unfused pipeline of swiglu_oai experts with every intermediate
    (:class:`~cute_fp4.layers.Stages`; ``a13``/``a2`` are the 16-bit activations): each
    GEMM to FP32, + its expert's bias, rounded to x's dtype; the activation on that."""
    ex.check_input(x, topk_ids, topk_weights)
    r = route(topk_ids, ex.num_experts)
    rows = topk_ids.reshape(-1).index_select(0, r.order).long()  # each sorted row's expert
    b13, b2 = ex.biases
    xs = x.index_select(0, r.token)

    def gemm(a, w, bias):
        raw = grouped_gemm(a, w, r.offsets, schedule=ex.schedule, out_dtype=torch.float32)
        return (raw if bias is None else raw + bias.index_select(0, rows)).to(x.dtype)

    gate_up = gemm(xs, ex.w13, b13)
    act = swiglu_oai_unfused(gate_up, ex.gate_up_group)
    down = gemm(act, ex.w2, b2)
    return Stages(r, xs, xs, gate_up, act, act, down, combine(down, r, topk_weights))


def gpt_oss_checkpoint(ex, bias_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """swiglu_oai experts ``ex`` as gpt-oss's checkpoint tensors on the CPU (``*_blocks``,
    ``*_scales`` uint8; ``*_bias`` in ``bias_dtype``, the dtype they were given in: the
    float32 copies convert back exactly), gate and up rows alternating again: bit for bit
    what :meth:`Experts.from_gpt_oss` was given."""
    if ex.activation != "swiglu_oai" or ex.fmt is not MXFP4:
        raise InputError(f"{where(ex.name)}gpt_oss_checkpoint() takes experts made by "
                         "Experts.from_gpt_oss")
    up = [ex.gate_up_expert(e).to("cpu") for e in range(ex.num_experts)]
    dn = [expert(ex.w2, e).to("cpu") for e in range(ex.num_experts)]
    out = {}
    for proj, parts in (("gate_up_proj", up), ("down_proj", dn)):
        blocks, scales = MXFP4Tensor.stack(parts).to_blocks()
        out[f"{proj}_blocks"], out[f"{proj}_scales"] = blocks, scales
    b13, b2 = ex.biases
    if b13 is not None:
        if ex.gate_up_group != 1:
            b13 = regroup_gate_up(b13, 1, ex.gate_up_group, dim=-1)
        out["gate_up_proj_bias"] = b13.to("cpu", bias_dtype)
    if b2 is not None:
        out["down_proj_bias"] = b2.to("cpu", bias_dtype)
    return out
