"""A gated (SwiGLU) MLP on NVFP4 weights with the activation fused into the gate_up GEMM:
:class:`NVFP4GatedMLP`, and :func:`fuse_gated_mlps`, which puts it in a model.

``y = down(silu(gate(x)) * up(x))`` (Llama, Qwen, Mistral MLPs). Unfused, a W4A16 decode
step of such an MLP is three GEMMs and two elementwise kernels (``NVFP4Linear`` per
projection, ``F.silu``, the product); here it is two GEMMs: gate and up are one weight
``[2I, H]`` with their rows interleaved in the kernel's gate/up groups
(``cute_fp4.fused``; converted once, at construction), and the gate_up GEMM's epilogue
computes ``silu(gate) * up`` (``gemm(..., silu_mul=True)``: the bits of the unfused
``F.silu(gate) * up`` on the GEMM's own output). The down projection is an
:class:`~cute_fp4.nn.NVFP4Linear`.

One GEMM applies one alpha, so gate and up share one global scale (and, for W4A4, one
input scale): :meth:`NVFP4GatedMLP.from_linears` quantizes them together; a checkpoint
whose gate and up were stored with different global scales cannot be fused without
requantizing, and :func:`fuse_gated_mlps` leaves such a layer as three ``NVFP4Linear``
(with the reason), never requantizing.

The gate/up group (``planning.common.silu_group``) is the GPU's: 8 on sm_90a and for the
SM12x stream kernel (packed layout), 32 for SM12x's block-scaled MMA (plain layout). On the
CPU there is no GPU to choose it from: pass ``group`` to build for a target.

Checkpoints: ``state_dict()`` is ModelOpt's per-projection form, in natural order
(``gate_proj.weight``, ``.weight_scale``, ``.weight_scale_2``, ``.input_scale``, the same for
``up_proj`` and ``down_proj``), bit-exact with what was loaded; ``load_state_dict`` of such
a checkpoint loads in place (gate and up global scales must be equal: a FormatError
otherwise).
"""

from __future__ import annotations

import torch

from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.formats import NVFP4
from cute_fp4.fused import (
    device_group,
    gate_up_order,
    interleave_gate_up,
    interleave_stored,
)
from cute_fp4.layers import Linear
from cute_fp4.layers.common import check_schedule, resolve_layout
from cute_fp4.nn import NVFP4Linear
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import PackedNVFP4Weight

__all__ = ["NVFP4GatedMLP", "fuse_gated_mlps", "gate_up_group", "gated_mlp_projections",
           "scale_mismatch", "unfusable_reason"]

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_KEYS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def gate_up_group(device: torch.device, layout: str, schedule="auto") -> int:
    """Rows per gate/up group for a fused layer with this (resolved) ``layout`` on
    ``device``: ``silu_group`` of the schedule, or, for "auto", of the kernels "auto"
    takes there (8 on sm_90a and for SM12x's packed layout, the stream kernel; 32 for
    SM12x's plain layout, the block-scaled MMA). A DeviceError off a GPU (pass ``group``)."""
    from cute_fp4 import catalogue
    from cute_fp4.planning.common import silu_group

    if not (isinstance(schedule, str) and schedule == "auto"):
        return silu_group(catalogue.get(schedule) if isinstance(schedule, str) else schedule)
    if device.type != "cuda":
        raise DeviceError(f"the weights are on {device}: the gate/up row order depends on the "
                          "GPU's kernels; build on the GPU, or pass group (8 for sm_90a and "
                          "SM12x's packed layout, 32 for SM12x's plain layout)")
    return device_group(device, layout)


def _check_groups(intermediate: int, group: int) -> None:
    """The fused GEMM's rows: the intermediate size in whole gate/up groups."""
    if intermediate % group:
        raise FormatError(f"intermediate size {intermediate} does not split into gate/up "
                          f"groups of {group} rows (the fused GEMM needs a multiple of "
                          f"{group}); use three NVFP4Linear layers")


class GateUpLinear(NVFP4Linear):
    """The interleaved gate_up projection of an :class:`NVFP4GatedMLP` (``[2I, H]``, gate and
    up rows in groups of the parent's ``group``). Its tensors are saved and loaded by the
    parent in ModelOpt's per-projection form, so its own state dict is empty."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        pass


class NVFP4GatedMLP(torch.nn.Module):
    """SwiGLU MLP, the activation fused into the gate_up GEMM (module docstring).

    ``gate_up``: the NVFP4 weight ``[2I, H]`` of gate and up in their natural order (gate
    rows, then up rows; one global scale), ``down``: the down projection's
    ``NVFP4Linear`` (``[H', I]``); ``mode``: "w4a16" or "w4a4" (the activation quantized,
    then the fused GEMM); ``input_scale``: W4A4's calibrated scale of the gate_up input,
    None for a dynamic one; ``layout``: the gate_up weight's (``NVFP4Linear``); ``group``:
    rows per gate/up group, None for the GPU's (:func:`gate_up_group`; a DeviceError on the
    CPU); ``interleaved``: ``gate_up`` is already in the interleaved order of ``group`` (an
    NVFP4Tensor, or a PackedNVFP4Weight for the packed layout: :meth:`from_layers`).
    Children: ``gate_up_proj`` (interleaved) and ``down_proj``. Input bf16/fp16 of
    any leading dims, output ``[..., H']`` in its dtype.
    """

    def __init__(self, gate_up: NVFP4Tensor, down: NVFP4Linear, mode: str = "w4a16",
                 schedule="auto", input_scale=None, layout: str = "auto",
                 group: int | None = None, *, interleaved: bool = False):
        super().__init__()
        if interleaved and group is None:
            raise InputError("interleaved=True needs the group the weight is interleaved in")
        kinds = (NVFP4Tensor, PackedNVFP4Weight) if interleaved else NVFP4Tensor
        if not isinstance(gate_up, kinds) or gate_up.experts is not None:
            raise InputTypeError(f"gate_up must be one NVFP4Tensor [2I, H], got "
                                 f"{type(gate_up).__name__}")
        if not isinstance(down, NVFP4Linear):
            raise InputTypeError(f"down must be an NVFP4Linear, got {type(down).__name__}")
        n13, hidden = gate_up.shape
        if n13 % 2 or down.in_features != n13 // 2:
            raise InputError(f"gate_up [{n13}, {hidden}] and down [{down.out_features}, "
                             f"{down.in_features}] are not an MLP: gate_up must have 2 x "
                             "down's in_features rows")
        check_schedule(schedule)
        layout = resolve_layout(layout, mode, hidden, gate_up.device, schedule)
        if group is None:
            group = gate_up_group(gate_up.device, layout, schedule)
        elif group not in (8, 32):
            raise InputError(f"group must be 8 or 32 (plan.silu_group), got {group!r}")
        elif not (isinstance(schedule, str) and schedule == "auto") and \
                group != gate_up_group(gate_up.device, layout, schedule):
            raise InputError(f"group {group} is not schedule {schedule}'s gate/up group "
                             f"({gate_up_group(gate_up.device, layout, schedule)})")
        _check_groups(n13 // 2, group)
        self.group, self.schedule = group, schedule
        self.hidden, self.intermediate = hidden, n13 // 2
        if not interleaved:
            gate_up = interleave_gate_up(gate_up, group)
        self.gate_up_proj = GateUpLinear(None, layer=Linear(
            gate_up, None, mode, schedule, input_scale, layout, silu_group=group))
        self.down_proj = down

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_linears(cls, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear,
                     schedule="auto", mode: str = "w4a16", input_scale=None,
                     layout: str = "auto", group: int | None = None) -> NVFP4GatedMLP:
        """Quantize a float MLP's three projections (gate and up together: one global
        scale, from their joint amax), on the device they are on."""
        for name, lin in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(lin, torch.nn.Linear):
                raise InputTypeError(f"{name} must be an nn.Linear, got {type(lin).__name__}")
        if gate.bias is not None or up.bias is not None:
            raise InputError("gate/up projections with a bias are not supported by the fused "
                             "MLP (convert them as NVFP4Linear layers)")
        if gate.weight.shape != up.weight.shape:
            raise InputError(f"gate {list(gate.weight.shape)} and up {list(up.weight.shape)} "
                             "must have the same shape")
        w13 = quantize(torch.cat([gate.weight.detach(), up.weight.detach()]))
        w2 = NVFP4Linear.from_linear(down, mode, schedule, input_scale=None, layout=layout)
        return cls(w13, w2, mode, schedule, input_scale, layout, group)

    @classmethod
    def from_modelopt(cls, gate: dict, up: dict, down: dict, mode: str | None = None,
                      schedule="auto", layout: str = "auto",
                      group: int | None = None) -> NVFP4GatedMLP:
        """From a ModelOpt checkpoint's tensors of the three projections, each a dict with
        ``weight``, ``weight_scale``, ``weight_scale_2`` and optionally ``input_scale``
        (``down`` also ``bias``). ``mode`` None: "w4a4" when they have input scales. Gate and
        up must have the same global scale (and W4A4 input scale): a FormatError otherwise
        (:func:`fuse_gated_mlps` keeps such a layer unfused)."""
        for name, t in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(t, dict) or any(k not in t for k in _KEYS[:3]):
                raise InputTypeError(f"{name} must be a dict with {_KEYS[:3]}, got "
                                     f"{sorted(t) if isinstance(t, dict) else type(t).__name__}")
        if mode is None:
            mode = "w4a4" if gate.get("input_scale") is not None else "w4a16"
        _check_shared_scales("NVFP4GatedMLP.from_modelopt", gate, up, mode)
        w13 = NVFP4Tensor.from_modelopt(torch.cat([gate["weight"], up["weight"]]),
                                        torch.cat([gate["weight_scale"], up["weight_scale"]]),
                                        torch.as_tensor(gate["weight_scale_2"]).reshape(()))
        inp = gate.get("input_scale") if mode == "w4a4" else None
        w2 = NVFP4Linear.from_modelopt(down["weight"], down["weight_scale"],
                                       torch.as_tensor(down["weight_scale_2"]).reshape(()),
                                       down.get("input_scale") if mode == "w4a4" else None,
                                       down.get("bias"), mode, schedule, layout)
        return cls(w13, w2, mode, schedule, None if inp is None else
                   torch.as_tensor(inp).reshape(()), layout, group)

    @classmethod
    def from_layers(cls, gate: NVFP4Linear, up: NVFP4Linear, down: NVFP4Linear,
                    group: int | None = None) -> NVFP4GatedMLP:
        """From three ``NVFP4Linear`` layers, their bits kept (no requantization): gate and
        up must share mode, schedule, layout, global scale and input scale, and have no
        bias (:func:`unfusable_reason`); ``down`` is kept as it is."""
        why = unfusable_reason(gate, up, down)
        if why:
            raise FormatError(f"these layers cannot be fused: {why}")
        if group is None:
            group = gate_up_group(gate.weight_packed.device, gate.layout, gate.schedule)
        rows, k = gate.out_features, gate.in_features
        _check_groups(rows, group)  # before the bytes are built, not after
        # from the stored bytes, a chunk at a time: loading onto a GPU fuses there, and the
        # whole weight's unpack/concatenate/interleave/pack would hold several copies of it
        packed = gate.layout == "packed"
        data, scale = interleave_stored(gate.weight_packed, up.weight_packed,
                                        gate.weight_scale, up.weight_scale, (rows, k), group,
                                        packed)
        kind = PackedNVFP4Weight if packed else NVFP4Tensor
        w13 = kind(data, scale, gate.weight_scale_2, (2 * rows, k))
        return cls(w13, down, gate.mode, gate.schedule, gate.input_scale, gate.layout, group,
                   interleaved=True)

    # ------------------------------------------------------------------ views, state

    @property
    def gate_up(self):
        """The interleaved gate_up weight as the fused GEMM reads it (NVFP4Tensor, or
        PackedNVFP4Weight in the packed layout)."""
        return self.gate_up_proj.stored_weight

    @property
    def down(self) -> NVFP4Linear:
        return self.down_proj

    def __getattr__(self, name: str):
        """``mode`` and ``layout``: the gate_up layer's."""
        if name in ("mode", "layout"):
            return getattr(self.gate_up_proj, name)
        return super().__getattr__(name)

    def natural_gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight uint8 [2I, H/2], weight_scale float8 [2I, H/16] row-major)`` of gate
        then up, in the natural order (the checkpoint's bytes)."""
        w = self.gate_up_proj.weight  # plain layout (packed: unpacked)
        order = gate_up_order(2 * self.intermediate, self.group, w.data.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return (w.data.index_select(0, inverse),
                w.scale_linear().index_select(0, inverse.to(w.scale.device)))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        data, scale = self.natural_gate_up()
        gu = self.gate_up_proj
        i = self.intermediate
        for j, name in enumerate(_PROJECTIONS[:2]):
            rows = slice(j * i, (j + 1) * i)
            destination[f"{prefix}{name}.weight"] = data[rows].clone()
            destination[f"{prefix}{name}.weight_scale"] = scale[rows].clone()
            destination[f"{prefix}{name}.weight_scale_2"] = gu.weight_scale_2.detach().clone()
            if gu.input_scale is not None:
                destination[f"{prefix}{name}.input_scale"] = gu.input_scale.detach().clone()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        keys = {(p, k): f"{prefix}{p}.{k}" for p in _PROJECTIONS[:2] for k in _KEYS}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in keys.values()]
        gu = self.gate_up_proj
        need = list(_KEYS[:3]) + (["input_scale"] if gu.mode == "w4a4"
                                  and gu.input_scale is not None else [])
        absent = [keys[p, k] for p in _PROJECTIONS[:2] for k in need
                  if keys[p, k] not in state_dict]
        missing_keys.extend(absent)
        if any(keys[p, k] not in state_dict for p in _PROJECTIONS[:2] for k in _KEYS[:3]):
            return
        t = {p: {k: state_dict.get(keys[p, k]) for k in _KEYS} for p in _PROJECTIONS[:2]}
        want = {"weight": (self.intermediate, NVFP4.data_row_bytes(self.hidden)),
                "weight_scale": (self.intermediate, NVFP4.scale_cols(self.hidden))}
        for p in _PROJECTIONS[:2]:
            for k, shape in want.items():
                if tuple(t[p][k].shape) != shape:
                    error_msgs.append(f"size mismatch for {keys[p, k]}: copying a param with "
                                      f"shape {t[p][k].shape} from checkpoint, the shape in "
                                      f"current model is {torch.Size(shape)}")
        if error_msgs:
            return
        _check_shared_scales(prefix.rstrip(".") or "state_dict", t["gate_proj"],
                             t["up_proj"], gu.mode)
        order = gate_up_order(2 * self.intermediate, self.group)
        data = torch.cat([t["gate_proj"]["weight"], t["up_proj"]["weight"]])
        scale = torch.cat([t["gate_proj"]["weight_scale"], t["up_proj"]["weight_scale"]])
        gu.load_modelopt(data.index_select(0, order.to(data.device)),
                         scale.index_select(0, order.to(scale.device)),
                         torch.as_tensor(t["gate_proj"]["weight_scale_2"]).reshape(()),
                         input_scale=t["gate_proj"]["input_scale"])

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, mode={self.mode}, "
                f"gate_up_group={self.group}, layout={self.layout}")

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``: the gate_up layer returns the activation from its
        GEMM's epilogue (``cute_fp4.layers.Linear`` with ``silu_group``)."""
        return self.down_proj(self.gate_up_proj(x))


def scale_mismatch(gate: dict, up: dict, mode: str) -> str | None:
    """Why gate's and up's scales (dicts of checkpoint tensors) cannot share one GEMM,
    None when they can: one global scale (``weight_scale_2``) and, for W4A4, one
    ``input_scale``. Reads the values (one sync each on a GPU)."""
    keys = ("weight_scale_2", "input_scale") if mode == "w4a4" else ("weight_scale_2",)
    for key in keys:
        g, u = gate.get(key), up.get(key)
        if (g is None) != (u is None) or (g is not None and not torch.equal(
                torch.as_tensor(g).reshape(()).cpu(), torch.as_tensor(u).reshape(()).cpu())):
            show = ["none" if v is None else f"{float(torch.as_tensor(v).reshape(())):g}"
                    for v in (g, u)]
            return (f"gate_proj.{key} = {show[0]} and up_proj.{key} = {show[1]} differ: one "
                    "GEMM applies one (requantizing would change the stored values)")
    return None


def _check_shared_scales(where: str, gate: dict, up: dict, mode: str) -> None:
    why = scale_mismatch(gate, up, mode)
    if why:
        raise FormatError(f"{where}: {why}; keep this MLP as three NVFP4Linear layers "
                          "(convert and from_pretrained do)")


# ----------------------------------------------------------------------------- fusing

def _is_silu(act) -> bool:
    """nn.SiLU, or transformers' SiLUActivation (``ACT2FN["silu"]``)."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def gated_mlp_projections(module: torch.nn.Module) -> tuple | None:
    """``(gate_proj, up_proj, down_proj)`` of a module shaped like transformers' gated MLPs
    (LlamaMLP, Qwen2/3MLP, MistralMLP, ...: those three children and an ``act_fn``,
    computing ``down(act(gate(x)) * up(x))``), else None."""
    if isinstance(module, NVFP4GatedMLP) or not hasattr(module, "act_fn"):
        return None
    mods = module._modules
    projs = tuple(mods.get(p) for p in _PROJECTIONS)
    if any(not isinstance(p, (torch.nn.Linear, NVFP4Linear)) for p in projs):
        return None
    return projs


def unfusable_reason(gate, up, down, act=None) -> str | None:
    """Why these projections cannot become one :class:`NVFP4GatedMLP`, None when they
    can (they are NVFP4Linear layers of one mode, schedule and layout, gate and up without
    bias, with one shape, one global scale and one W4A4 input scale). Reads the global
    scales (one sync per layer on a GPU)."""
    if act is not None and not _is_silu(act):
        return f"its activation is {type(act).__name__}, not SiLU"
    for name, p in zip(_PROJECTIONS, (gate, up, down)):
        if type(p) is not NVFP4Linear:
            return f"{name} is not an NVFP4Linear (not converted: see the skipped layers)"
    if gate.bias is not None or up.bias is not None:
        return "gate_proj/up_proj have a bias"
    if (gate.in_features, gate.out_features) != (up.in_features, up.out_features):
        return "gate_proj and up_proj have different shapes"
    if down.in_features != gate.out_features:
        return f"down_proj takes {down.in_features} features, gate_proj gives {gate.out_features}"
    for what in ("mode", "layout"):
        if getattr(gate, what) != getattr(up, what):
            return f"gate_proj and up_proj have different {what}s"
    if gate.schedule is not up.schedule and gate.schedule != up.schedule:
        return "gate_proj and up_proj have different schedules"
    return scale_mismatch({"weight_scale_2": gate.weight_scale_2,
                           "input_scale": gate.input_scale},
                          {"weight_scale_2": up.weight_scale_2,
                           "input_scale": up.input_scale}, gate.mode)


def fuse_gated_mlps(model: torch.nn.Module, group: int | None = None
                    ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Replace, in place, every gated MLP of ``model`` (:func:`gated_mlp_projections`) whose
    projections are already ``NVFP4Linear`` layers that :func:`unfusable_reason` accepts by
    an :class:`NVFP4GatedMLP` on the same bits. ``group``: the gate/up group, None for the
    GPU the weights are on (weights on the CPU are then left unfused, with that reason).
    Returns ``(fused names, (name, reason) of the gated MLPs left unfused)``."""
    fused, unfused = [], []
    # names, not modules: a list of the modules would keep every replaced projection alive
    # until the end (the whole model's gate and up weights twice at the peak); this way one
    # MLP's old and new weights coexist at a time
    for name in [n for n, _ in model.named_modules()]:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # inside an MLP fused above
            continue
        projs = gated_mlp_projections(module)
        if projs is None or not name:  # the model itself: NVFP4GatedMLP.from_layers
            continue
        why = unfusable_reason(*projs, act=module.act_fn)
        gate = projs[0]
        if why is None and group is None and gate.weight_packed.device.type != "cuda":
            why = ("its weights are on the CPU: the gate/up row order depends on the GPU's "
                   "kernels (convert on the GPU, or give gate_up_group)")
        if why is None:
            try:
                new = NVFP4GatedMLP.from_layers(*projs, group=group)
            except (FormatError, InputError) as e:
                why = str(e)
        if why is not None:
            unfused.append((name, why))
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
        fused.append(name)
        module = projs = gate = new = None  # the replaced layers go now, not next round
    return tuple(fused), tuple(unfused)
