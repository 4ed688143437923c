"""``quantize_model``: a BF16 transformers model quantized to NVFP4 in place, layer by layer,
optionally with activation scales calibrated on given batches; ``save_pretrained`` then
writes it as a ModelOpt NVFP4 checkpoint.

Quantized: every ``nn.Linear`` whose in_features is a multiple of 32 and out_features of 8
(the kernels' limits) and every fused-experts module of a gated SiLU MoE, except what
``exclude`` names (fnmatch patterns or names, a name also excluding what is below it) and
linears tied to the input embeddings. Each weight gets its global scale from its own amax
(an expert stack: one per expert, gate and up together) and the rounding of
``cute_fp4.quantize``. With ``calibration`` (an iterable of batches: ``input_ids`` tensors
or dicts of ``model(**batch)`` arguments), every quantized layer's input amax over the
batches gives its ``input_scale`` (``amax / 2688``; experts: per expert, the tokens routed to
it, for the gate_up and the down projection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.hf import experts as ex
from cute_fp4.hf.checkpoint import excluded
from cute_fp4.hf.quantizer import (
    ModelOptNVFP4Config,
    ModelOptNVFP4Quantizer,
    fuse_mlps,
    register,
    resolve_mode,
)
from cute_fp4.layers.common import mode_of
from cute_fp4.mlp import GateUpLinear, NVFP4GatedMLP
from cute_fp4.moe import NVFP4MoE, expert, route, silu_and_mul
from cute_fp4.nn import NVFP4Linear
from cute_fp4.nvfp4 import E2M1_MAX, E4M3_MAX, NVFP4Tensor, quantize, swizzle_scales

__all__ = ["QuantizeReport", "fake_quantize", "quantize_model"]

_DECODE = E4M3_MAX * E2M1_MAX  # amax / 2688 = the decode-form global scale


@dataclasses.dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_model` did: ``mode`` the layers run, the module names quantized,
    ``(name, reason)`` of those left in BF16, and whether input scales were calibrated."""

    mode: str
    quantized: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    calibrated: bool

    def __str__(self) -> str:
        head = (f"quantized {len(self.quantized)} modules to NVFP4 ({self.mode}"
                f"{', calibrated input scales' if self.calibrated else ''})")
        return "\n  ".join([head, *(f"kept {n}: {r}" for n, r in self.skipped)])


def _tied_to_embeddings(model, module) -> bool:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(module, "weight", None)
    return emb is not None and w is not None and w is getattr(emb, "weight", None)


def _candidates(model, exclude) -> tuple[dict, list]:
    """name -> "linear" or "experts" for what is quantized; (name, reason) for the rest."""
    todo, skipped = {}, []
    for name, m in model.named_modules():
        is_exp = ex.is_experts(m)
        if not name or not (type(m) is torch.nn.Linear or is_exp):
            continue
        pattern = excluded(name, exclude)
        if pattern:
            skipped.append((name, f"matches exclude pattern {pattern!r}"))
        elif is_exp:
            e, n13, h = m.gate_up_proj.shape
            why = ex.unsupported(m) or (None if h % 32 == 0 and n13 % 64 == 0 else
                                        f"hidden {h} / intermediate {n13 // 2} are not "
                                        "multiples of 32")
            (skipped.append((name, why)) if why else todo.__setitem__(name, "experts"))
        elif _tied_to_embeddings(model, m):
            skipped.append((name, "its weight is tied to the input embeddings"))
        elif m.in_features % 32 or m.out_features % 8:
            skipped.append((name, f"[{m.out_features}, {m.in_features}]: in_features must be "
                                  "a multiple of 32 and out_features of 8"))
        else:
            todo[name] = "linear"
    return todo, skipped


# ----------------------------------------------------------------------------- calibration

def _calibrate(model, todo: dict, batches: Iterable
               ) -> dict[str, float | tuple[torch.Tensor, torch.Tensor]]:
    """name -> input amax (a linear: a float; experts: (amax [E] of gate_up's input, amax
    [E] of down's input)) over ``batches`` run through the BF16 model."""
    amax: dict[str, float | tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []

    def linear_hook(name):
        def hook(mod, args):
            a = float(args[0].detach().abs().amax())
            amax[name] = max(amax.get(name, 0.0), a)
        return hook

    def experts_hook(name):
        def hook(mod, args):
            x, ids = args[0].detach(), args[1]
            a13, a2 = _expert_amax(mod, x, ids)
            old = amax.get(name)
            amax[name] = (a13, a2) if old is None else (torch.maximum(old[0], a13),
                                                        torch.maximum(old[1], a2))
        return hook

    for name, kind in todo.items():
        mod = model.get_submodule(name)
        hook = linear_hook(name) if kind == "linear" else experts_hook(name)
        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                if isinstance(batch, dict):
                    _check_token_ids(model, batch.get("input_ids"), i)
                    model(**batch)
                elif isinstance(batch, torch.Tensor):
                    _check_token_ids(model, batch, i)
                    model(input_ids=batch)
                else:
                    raise InputTypeError("calibration batches must be input_ids tensors or "
                                         f"dicts of model arguments, got {type(batch).__name__}")
    finally:
        for h in hooks:
            h.remove()
    return amax


def _check_token_ids(model, ids, i: int) -> None:
    """Calibration batch ``i``'s ``input_ids`` (when it has them): integers within the
    model's vocabulary (the embedding's rows), checked before the model runs."""
    if ids is None:
        return
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool:
        got = getattr(ids, "dtype", type(ids).__name__)
        raise InputTypeError(f"calibration batch {i}: input_ids must be an integer tensor of "
                             f"token ids, got {got}")
    if vocab is None or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InputError(f"calibration batch {i}: token id {bad} is outside the model's "
                         f"vocabulary of {vocab} (ids 0 .. {vocab - 1}); tokenize with the "
                         "model's own tokenizer")


def _expert_amax(mod, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per expert: the amax of the tokens routed to it, and of its activation
    ``silu(gate) * up`` (the down projection's input), in the module's BF16 weights."""
    from cute_fp4.moe import _bf16_grouped

    e = mod.num_experts
    flat = ids.reshape(-1).long()
    r = route(ids, e)
    row_expert = flat.index_select(0, r.order)
    xs = x.index_select(0, r.token)
    act = silu_and_mul(_bf16_grouped(xs, mod.gate_up_proj.to(x.dtype), r.offsets))
    out = []
    for rows in (xs, act):
        a = torch.zeros(e, dtype=torch.float32, device=x.device)
        out.append(a.scatter_reduce(0, row_expert, rows.abs().amax(-1).float(), "amax").cpu())
    return tuple(out)


def _fill(a: torch.Tensor) -> torch.Tensor:
    """Experts no batch reached take the largest amax of the module's other experts."""
    return torch.where(a > 0, a, a.max())


# ----------------------------------------------------------------------------- quantize

def quantize_model(model: torch.nn.Module, *, exclude: Iterable[str] = ("lm_head",),
                   calibration: Iterable | None = None, mode: str = "auto",
                   layout: str = "auto", fuse_mlp: bool = True) -> QuantizeReport:
    """Quantize the BF16 transformers model ``model`` to NVFP4 in place (module
    docstring), one layer at a time, on the device each layer is on. ``mode``: what the
    layers run ("auto": W4A4 on an SM12x GPU with calibrated input scales, else W4A16).
    A gated MLP's gate and up projections get one global scale (their joint amax);
    ``fuse_mlp``: on a GPU, such an MLP then runs as ``NVFP4GatedMLP``
    (``model.cute_fp4_mlps`` says which). The model can run, and
    :func:`cute_fp4.hf.save_pretrained` write it."""
    mode = mode_of(mode)
    if isinstance(exclude, str):
        exclude = (exclude,)
    exclude = tuple(exclude)
    todo, skipped = _candidates(model, exclude)
    amax = _calibrate(model, todo, calibration) if calibration is not None else {}
    dev = next(model.parameters()).device
    mode = resolve_mode(mode, dev, bool(amax))
    shared = _gate_up_scales(model, todo)
    for name, kind in todo.items():
        module = model.get_submodule(name)
        if kind == "linear":
            a = amax.get(name, 0.0)
            w = quantize(module.weight.detach(), shared.get(name))
            bias = None if module.bias is None else module.bias.detach()
            layer = NVFP4Linear(w, bias, mode, "auto", a / _DECODE if a > 0 else None, layout)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)
        else:
            _quantize_experts(module, amax.get(name), mode, layout)
    method = register()
    _mark_quantized(model, todo, skipped, method, mode)
    model.cute_fp4_mlps = fuse_mlps(model, fuse_mlp, None)
    return QuantizeReport(mode, tuple(todo), tuple(skipped), bool(amax))


def _gate_up_scales(model, todo: dict) -> dict[str, torch.Tensor]:
    """name -> global scale for the gate and up projections of each gated MLP quantized
    together: one scale from their joint amax (what ModelOpt exports for a fused gate_up,
    and what lets ``NVFP4GatedMLP`` run them as one GEMM)."""
    from cute_fp4.mlp import gated_mlp_projections

    out = {}
    for name, m in model.named_modules():
        projs = gated_mlp_projections(m) if name else None
        names = [f"{name}.gate_proj", f"{name}.up_proj"]
        if projs is None or any(todo.get(n) != "linear" for n in names):
            continue
        joint = torch.stack([projs[0].weight.detach().abs().amax(),
                             projs[1].weight.detach().abs().amax()]).amax()
        gs = quantize(joint.reshape(1, 1).expand(1, 16).contiguous()).global_scale
        for n in names:  # one tensor each: the layers' buffers must not share memory
            out[n] = gs.to(projs[0].weight.device).clone()
    return out


def _quantize_experts(module, amax, mode: str, layout: str) -> None:
    w13, w2 = quantize(module.gate_up_proj.detach()), quantize(module.down_proj.detach())
    gs = w13.global_scale
    in13 = in2 = None
    scales = (None, None)
    if amax is not None:
        in13 = (_fill(amax[0]) / _DECODE).to(gs.device)
        in2 = (_fill(amax[1]) / _DECODE).to(gs.device)
        if mode == "w4a4":
            scales = (in13.max(), in2.max())
        in13 = torch.stack((in13, in13), dim=1)
    moe = NVFP4MoE(w13, w2, mode, "auto", scales, layout)
    ex.attach(module, (), (), torch.stack((gs, gs), dim=1), in13, in2, mode, layout, moe)


def _mark_quantized(model, todo, skipped, method: str, mode: str) -> None:
    """What from_pretrained leaves on a model: its quantization config (the exclusions),
    the quantizer (transformers asks it about compile and saving), the experts
    implementation."""
    config = ModelOptNVFP4Config(quant_algo="NVFP4", exclude_modules=[n for n, _ in skipped],
                                 quant_method=method, cute_fp4={"mode": mode})
    model.config.quantization_config = config
    quantizer = ModelOptNVFP4Quantizer(config, pre_quantized=True)
    model.hf_quantizer = quantizer
    model.is_quantized = True
    model.cute_fp4_mode = mode
    if any(kind == "experts" for kind in todo.values()):
        model.set_experts_implementation(ex.IMPLEMENTATION)


# ----------------------------------------------------------------------------- reference

def fake_quantize(bf16_model: torch.nn.Module, nvfp4_model: torch.nn.Module) -> torch.nn.Module:
    """The fake-quantized reference, in place: every weight of ``bf16_model`` (the model
    before :func:`quantize_model`, or one of the same architecture) whose module is NVFP4 in
    ``nvfp4_model`` takes that layer's exact values (``e2m1 * block scale * global scale``,
    each expert projection with its own global scale), rounded once to its dtype. Returns
    ``bf16_model``."""
    with torch.no_grad():
        for name, m in nvfp4_model.named_modules():
            if isinstance(m, NVFP4GatedMLP):  # gate and up; its down_proj comes next
                target = bf16_model.get_submodule(name)
                w = m.gate_up_proj.weight
                data, scale = m.natural_gate_up()
                v = NVFP4Tensor(data, swizzle_scales(scale.contiguous()), w.global_scale,
                                w.shape).dequantize(torch.float64)
                for j, p in enumerate((target.gate_proj, target.up_proj)):
                    p.weight.copy_(v[j * m.intermediate:(j + 1) * m.intermediate].to(
                        p.weight.device, p.weight.dtype))
            elif isinstance(m, GateUpLinear):
                continue
            elif isinstance(m, NVFP4Linear):
                w = bf16_model.get_submodule(name).weight
                w.copy_(m.weight.dequantize(torch.float64).to(w.device, w.dtype))
            elif ex.holds_nvfp4(m):
                target = bf16_model.get_submodule(name)
                gs13 = m._buffers["gate_up_proj_weight_scale_2"].double()
                moe, i = m.nvfp4, m.nvfp4.intermediate
                for e in range(moe.num_experts):
                    v = moe.gate_up_expert(e).block_values(torch.float64)
                    v[:i] *= gs13[e, 0]
                    v[i:] *= gs13[e, 1]
                    target.gate_up_proj[e].copy_(v.to(target.gate_up_proj.dtype))
                    target.down_proj[e].copy_(expert(moe.w2, e).dequantize(
                        torch.float64).to(target.down_proj.dtype))
    return bf16_model
