"""``convert``: a model's ``nn.Linear`` layers replaced in place by
:class:`~cute_fp4.nn.NVFP4Linear`, and its gated SiLU MLPs (gate_proj, up_proj, down_proj and
a SiLU ``act_fn``: transformers' Llama, Qwen2/3, Mistral, ... MLPs) by
:class:`~cute_fp4.mlp.NVFP4GatedMLP` (SiLU-and-mul fused into the gate_up GEMM), where the GPU
allows it; quantized from their own weights or built from a ModelOpt NVFP4 state dict.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import torch

from cute_fp4 import mlp as mlp_mod
from cute_fp4.errors import CuteFp4Warning, FormatError, InputError, InputTypeError
from cute_fp4.layers.common import Layout, check_modelopt, check_schedule, mode_of
from cute_fp4.layers.linear import K_MULTIPLE, N_MULTIPLE
from cute_fp4.nn import CHECKPOINT_KEYS, MODES, NVFP4Linear

__all__ = ["ConvertReport", "convert"]


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertReport:
    """What :func:`convert` did: ``model`` (the same object, unless the model itself was an
    ``nn.Linear``), the qualified names of the linears converted and ``(name, reason)`` of
    those left; ``fused``: the gated MLPs made :class:`~cute_fp4.mlp.NVFP4GatedMLP` (their
    three projections are in ``converted``), ``unfused``: ``(name, reason)`` of the gated
    MLPs whose converted projections stay three ``NVFP4Linear`` layers (or nn.Linear)."""

    model: torch.nn.Module
    mode: str
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    fused: tuple[str, ...] = ()
    unfused: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        total = len(self.converted) + len(self.skipped)
        lines = [f"converted {len(self.converted)} of {total} nn.Linear layers to "
                 f"NVFP4Linear ({self.mode})"]
        if self.fused or self.unfused:
            lines.append(f"fused {len(self.fused)} of {len(self.fused) + len(self.unfused)} "
                         "gated MLPs (SiLU-and-mul in the gate_up GEMM: NVFP4GatedMLP)")
        lines += [f"skipped {n}: {r}" for n, r in self.skipped]
        lines += [f"unfused {n}: {r}" for n, r in self.unfused]
        return "\n  ".join(lines)


SkipRule = str | Callable[[str, torch.nn.Module], bool]


def _skip_rules(skip) -> tuple[SkipRule, ...]:
    if skip is None:
        return ()
    if isinstance(skip, str) or callable(skip):
        return (skip,)
    if not isinstance(skip, Iterable):
        raise InputTypeError(f"skip must be a name pattern, a callable(name, module) or an "
                             f"iterable of them, got {type(skip).__name__}")
    rules = tuple(skip)
    for r in rules:
        if not (isinstance(r, str) or callable(r)):
            raise InputTypeError(f"skip entries must be name patterns (str) or callables, "
                                 f"got {type(r).__name__}")
    return rules


def _skip_reason(name: str, lin: torch.nn.Linear, rules, has_checkpoint: bool) -> str | None:
    for r in rules:
        if isinstance(r, str):
            if fnmatch.fnmatchcase(name, r):
                return f"matches skip pattern {r!r}"
        elif r(name, lin):
            return f"skip callable {getattr(r, '__name__', repr(r))} returned True"
    if type(lin) is not torch.nn.Linear:
        return (f"{type(lin).__name__} is a subclass of nn.Linear whose users may read its "
                "weight directly; only nn.Linear itself is converted")
    if lin.in_features % K_MULTIPLE:
        return (f"in_features = {lin.in_features} is not a multiple of {K_MULTIPLE} "
                "(packed FP4 rows must be 16-byte multiples)")
    if lin.out_features % N_MULTIPLE:
        return (f"out_features = {lin.out_features} is not a multiple of {N_MULTIPLE} "
                "(bf16/fp16 output rows must be 16-byte multiples)")
    if lin.weight.is_meta and not has_checkpoint:
        return "weight is on the meta device and the state_dict has no NVFP4 tensors for it"
    return None


def _layer_tensors(name: str, lin: torch.nn.Linear, state_dict: Mapping) -> dict:
    """The checkpoint tensors of layer ``name`` (ModelOpt's names and ``bias``; None where
    absent), checked against the layer they fill (``nn.check_modelopt``)."""
    sd = {key: state_dict.get(f"{name}.{key}") for key in (*CHECKPOINT_KEYS, "bias")}
    for key, t in sd.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputTypeError(f"state_dict[{name + '.' + key!r}] must be a torch.Tensor, "
                                 f"got {type(t).__name__}")
    if sd["weight_scale_2"] is None:
        raise FormatError(f"state_dict has {name}.weight_scale but no {name}.weight_scale_2")
    if sd["weight"] is None:
        raise FormatError(f"state_dict has {name}.weight_scale but no {name}.weight")
    check_modelopt(name, lin.out_features, lin.in_features, sd["weight"], sd["weight_scale"],
                   sd["weight_scale_2"], sd["input_scale"])
    return sd


def _build(name: str, lin: torch.nn.Linear, mode: str, schedule,
           state_dict: Mapping | None, layout: str) -> NVFP4Linear:
    if state_dict is None or f"{name}.weight_scale" not in state_dict:
        return NVFP4Linear.from_linear(lin, mode, schedule, layout=layout)
    sd = _layer_tensors(name, lin, state_dict)
    bias = sd["bias"] if sd["bias"] is not None else lin.bias
    if bias is not None and bias.is_meta:
        raise FormatError(f"{name}.bias is on the meta device and not in the state_dict")
    if not lin.weight.is_meta:  # built where it will run, so that layout "auto" sees it
        sd = {key: None if t is None else t.to(lin.weight.device) for key, t in sd.items()}
        bias = None if bias is None else bias.to(lin.weight.device)
    layer = NVFP4Linear.from_modelopt(sd["weight"], sd["weight_scale"], sd["weight_scale_2"],
                                      sd["input_scale"] if mode == "w4a4" else None, bias,
                                      mode, schedule, layout)
    return layer if lin.weight.is_meta else layer.to(lin.weight.device)


def convert(model: torch.nn.Module, mode: str = "w4a16", skip=None, *, schedule="auto",
            state_dict: Mapping[str, torch.Tensor] | None = None,
            layout: str = "auto", fuse_mlp: bool = True,
            gate_up_group: int | None = None) -> ConvertReport:
    """Replace the ``nn.Linear`` layers of ``model`` in place by :class:`NVFP4Linear`, and its
    gated SiLU MLPs by :class:`~cute_fp4.mlp.NVFP4GatedMLP`.

    Each layer is quantized from its own weight, or, when ``state_dict`` (a ModelOpt NVFP4
    checkpoint) holds ``<name>.weight_scale``, built from the checkpoint's tensors (W4A4
    takes its ``input_scale``). ``skip``: fnmatch patterns of qualified names (``"lm_head"``,
    ``"*.mlp.*"``), a callable ``(name, linear) -> bool``, or an iterable of both. Layers
    that cannot be converted (in_features not a multiple of 32, out_features not a multiple
    of 8, a subclass of nn.Linear) are left with their reason in the returned report. A
    layer shared under several names is converted once and stays shared. ``layout``:
    every new layer's weight layout (:class:`NVFP4Linear`; "auto": fragment order for W4A16
    on an SM90 GPU).

    ``fuse_mlp``: a module with ``gate_proj``, ``up_proj`` and ``down_proj`` nn.Linear
    children and a SiLU ``act_fn`` becomes one ``NVFP4GatedMLP`` (gate and up quantized
    together: one global scale) when none of the three is skipped, gate and up have no
    bias, and the gate/up group is known: the weights are on a GPU (its kernels' group), or
    ``gate_up_group`` (8 or 32) builds for a target. From a ``state_dict``, gate and up
    must have the same global scale (and W4A4 input scale); otherwise the MLP stays three
    NVFP4Linear layers, never requantized. The report lists the fused MLPs and why others
    were not.
    """
    mode, layout = mode_of(mode, MODES), Layout.of(layout, "layout")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if gate_up_group not in (None, 8, 32):
        raise InputError(f"gate_up_group must be None, 8 or 32, got {gate_up_group!r}")
    check_schedule(schedule)
    rules = _skip_rules(skip)
    done: dict[int, torch.nn.Module | None] = {}
    converted, skipped, fused, unfused = [], [], [], []
    absorbed: set[int] = set()

    def visit(name: str, lin: torch.nn.Linear):
        if id(lin) not in done:
            why = _skip_reason(name, lin, rules,
                               state_dict is not None and f"{name}.weight_scale" in state_dict)
            done[id(lin)] = None if why else _build(name, lin, mode, schedule, state_dict,
                                                    layout)
            (skipped.append((name, why)) if why else converted.append(name))
        return done[id(lin)]

    if isinstance(model, torch.nn.Linear):
        new = visit("", model)
        _warn_unmatched(rules, [""], state_dict)
        return ConvertReport(new or model, mode, tuple(converted), tuple(skipped))
    modules = list(model.named_modules(remove_duplicate=False))  # model order
    uses = Counter(id(m) for _, m in modules)
    names = [n for n, m in modules if n and isinstance(m, torch.nn.Linear)]
    opts = (mode, schedule, state_dict, layout, gate_up_group)
    for name, child in modules:
        if not name:
            continue
        if id(child) in absorbed:  # a projection of a fused MLP
            continue
        if id(child) in done:  # shared under several names
            if done[id(child)] is not None:
                _replace(model, name, done[id(child)])
            continue
        projs = mlp_mod.gated_mlp_projections(child) if fuse_mlp else None
        if projs is not None and all(type(p) is torch.nn.Linear for p in projs):
            why = _unfusable(name, child, projs, rules, uses, opts)
            if why is None:
                new, why = _build_mlp(name, projs, opts)
            if why is not None:
                unfused.append((name, why))
            else:
                for p_name, p in zip(("gate_proj", "up_proj", "down_proj"), projs):
                    absorbed.add(id(p))
                    converted.append(f"{name}.{p_name}")
                done[id(child)] = new
                fused.append(name)
                _replace(model, name, new)
        elif isinstance(child, torch.nn.Linear):
            new = visit(name, child)
            if new is not None:
                _replace(model, name, new)
    _warn_unmatched(rules, names, state_dict)
    return ConvertReport(model, mode, tuple(converted), tuple(skipped), tuple(fused),
                         tuple(unfused))


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def _unfusable(name: str, mlp: torch.nn.Module, projs, rules, uses, opts) -> str | None:
    """Why the gated MLP ``name`` (its projections nn.Linear) is not fused by convert,
    checked before anything is built; the scales of a state dict are checked in
    :func:`_build_mlp`."""
    mode, schedule, state_dict, layout, group = opts
    if not mlp_mod._is_silu(mlp.act_fn):
        return f"its activation is {type(mlp.act_fn).__name__}, not SiLU"
    p_names = [f"{name}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    for p_name, p in zip(p_names, projs):
        has = state_dict is not None and f"{p_name}.weight_scale" in state_dict
        why = _skip_reason(p_name, p, rules, has)
        if why:
            return f"{p_name.rpartition('.')[2]} is not converted ({why})"
        if uses[id(p)] > 1:
            return f"{p_name.rpartition('.')[2]} is shared with another module"
    gate, up, _ = projs
    if gate.bias is not None or up.bias is not None:
        return "gate_proj/up_proj have a bias"
    if gate.weight.shape != up.weight.shape or projs[2].in_features != gate.out_features:
        return "gate_proj, up_proj and down_proj do not have an MLP's shapes"
    if state_dict is not None:
        held = [f"{p}.weight_scale" in state_dict for p in p_names]
        if any(held) and not all(held):
            return "the state_dict has NVFP4 tensors for some of its projections only"
    dev = gate.weight.device
    if group is None and dev.type != "cuda":
        return (f"its weights are on {dev.type}: the gate/up row order depends on the GPU's "
                "kernels (convert on the GPU, or give gate_up_group)")
    return None


def _build_mlp(name: str, projs, opts) -> tuple[torch.nn.Module | None, str | None]:
    """The NVFP4GatedMLP of gated MLP ``name``, or ``(None, reason)`` when its checkpoint
    scales or its intermediate size keep it unfused."""
    mode, schedule, state_dict, layout, group = opts
    gate, up, down = projs
    try:
        if state_dict is None or f"{name}.gate_proj.weight_scale" not in state_dict:
            return mlp_mod.NVFP4GatedMLP.from_linears(gate, up, down, schedule, mode, None,
                                                      layout, group), None
        t = {}
        for p, lin in zip(("gate_proj", "up_proj", "down_proj"), projs):
            sd = _layer_tensors(f"{name}.{p}", lin, state_dict)
            if sd["bias"] is None and lin.bias is not None:
                if lin.bias.is_meta:
                    raise FormatError(f"{name}.{p}.bias is on the meta device and not in "
                                      "the state_dict")
                sd["bias"] = lin.bias.detach()
            if not lin.weight.is_meta:  # built where it will run
                sd = {k: None if v is None else v.to(lin.weight.device) for k, v in sd.items()}
            t[p] = sd
        why = mlp_mod.scale_mismatch(t["gate_proj"], t["up_proj"], mode)
        if why:
            return None, why
        return mlp_mod.NVFP4GatedMLP.from_modelopt(t["gate_proj"], t["up_proj"],
                                                   t["down_proj"], mode, schedule, layout,
                                                   group), None
    except FormatError as e:
        if "gate/up groups" not in str(e):
            raise
        return None, str(e)


def _warn_unmatched(rules, names: list[str], state_dict) -> None:
    """One warning per skip pattern that named no nn.Linear layer, and one when a
    ``state_dict`` was given but no layer found its NVFP4 tensors in it (every layer was
    then quantized from its own weight)."""
    for r in rules:
        if isinstance(r, str) and not any(fnmatch.fnmatchcase(n, r) for n in names):
            warnings.warn(f"convert(): skip pattern {r!r} matched no nn.Linear layer (the "
                          f"model's are named like {names[:3]})", CuteFp4Warning, stacklevel=3)
    if state_dict is not None and not any(f"{n}.weight_scale" in state_dict for n in names):
        first = next(iter(state_dict), None)
        warnings.warn(f"convert(): the state_dict's {len(state_dict)} keys (e.g. {first!r}) "
                      "hold no '<layer>.weight_scale' of the model's nn.Linear layers (named "
                      f"like {names[:3]}): every layer was quantized from its own weight",
                      CuteFp4Warning, stacklevel=3)
