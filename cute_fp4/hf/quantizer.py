"""The transformers quantizer plugin for ModelOpt NVFP4 checkpoints.

:func:`register` adds, under the quant method ``"modelopt"`` (or ``"cute_fp4_modelopt"``
when another package holds that name), a quantization config class
(:class:`ModelOptNVFP4Config`) and an ``HfQuantizer`` (:class:`ModelOptNVFP4Quantizer`)
to transformers' registries, and the ``"cute_fp4"`` experts implementation to its experts
interface. ``from_pretrained`` then runs its usual load (model built on the meta device,
safetensors shards streamed to the device, weight conversions) with three hooks:

* before loading: the checkpoint's headers are checked against the model (every tensor of
  every quantized layer present, with its dtype and shape; typed errors naming file, key
  and expectation, raised before any tensor is read), and the quantized ``nn.Linear`` layers
  and experts get placeholders holding the checkpoint's tensors as stored (no BF16 copy
  of a quantized weight ever exists);
* the weight conversions: the model's own expert converters (per-expert keys merged into
  the fused expert tensors), repeated for the NVFP4 tensors (``experts.nvfp4_converters``);
* after loading: each placeholder becomes an :class:`~cute_fp4.nn.NVFP4Linear` (or the
  experts' ``NVFP4MoE``) one layer at a time (scales swizzled, SM90 bytes repacked), and
  a tensor that did not load is an error.
"""

from __future__ import annotations

import os

import torch
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from cute_fp4.errors import FormatError, InputError
from cute_fp4.formats import NVFP4
from cute_fp4.hf import experts as ex
from cute_fp4.hf import tp
from cute_fp4.hf.checkpoint import (
    CheckpointError,
    QuantFormat,
    TensorInfo,
    describe,
    excluded,
    expect,
    parse_quant_config,
    read_tensor_index,
)
from cute_fp4.layers import Linear
from cute_fp4.layers.common import MODES, check_modelopt, resolve_mode
from cute_fp4.layers.linear import K_MULTIPLE, N_MULTIPLE
from cute_fp4.nn import NVFP4Linear

__all__ = ["MODES", "ModelOptNVFP4Config", "ModelOptNVFP4Quantizer", "QuantizedLinear",
           "register", "resolve_mode"]

_SCALAR = [(), (1,)]  # accepted shapes of a stored scalar


class ModelOptNVFP4Config(QuantizationConfigMixin):
    """``quantization_config`` of a ModelOpt NVFP4 checkpoint (checked by
    ``checkpoint.parse_quant_config``). Loading options ride along under ``cute_fp4``
    (``mode``, ``layout``; never saved)."""

    def __init__(self, quant_algo=None, group_size=16, exclude_modules=None,
                 kv_cache_quant_algo=None, quant_method="modelopt", cute_fp4=None,
                 source="config.json", ignore=None, config_groups=None, **kwargs):
        self.format = parse_quant_config(
            {"quant_algo": quant_algo, "group_size": group_size,
             "exclude_modules": exclude_modules, "ignore": ignore,
             "kv_cache_quant_algo": kv_cache_quant_algo, "config_groups": config_groups},
            source)
        self.quant_method = quant_method
        self.quant_algo, self.group_size = quant_algo, group_size
        self.exclude_modules = list(self.format.exclude_modules)
        self.kv_cache_quant_algo = kv_cache_quant_algo
        opts = dict(cute_fp4 or {})
        self.mode, self.layout = opts.get("mode", "auto"), opts.get("layout", "auto")
        self.fuse_mlp = opts.get("fuse_mlp", True)
        self.gate_up_group = opts.get("gate_up_group")

    def to_dict(self) -> dict:
        return self.format.to_dict()


class QuantizedLinear(torch.nn.Module):
    """A quantized ``nn.Linear``'s checkpoint tensors while loading, named as in the
    checkpoint (``weight`` and ``weight_scale`` parameters, which a tensor-parallel plan
    shards; the scalars buffers); :meth:`finalize` makes the ``NVFP4Linear``. Under
    tensor parallelism the module stays (transformers wrapped its forward):
    :meth:`prepare` makes its layer from the local shard, and its forward runs it."""

    _hf_quantized_needs_local_tp = True  # tensor parallel: run on the local shards

    def __init__(self, linear: torch.nn.Linear, input_scale: bool):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        self.in_features, self.out_features = k, n
        self.weight = tp.parameter((n, NVFP4.data_row_bytes(k)), torch.uint8)
        self.weight_scale = tp.parameter((n, NVFP4.scale_cols(k)), NVFP4.scale.torch_dtype)
        for name, shape in (("weight_scale_2", ()), ("input_scale", () if input_scale else None)):
            t = None if shape is None else torch.empty(shape, dtype=torch.float32, device="meta")
            self.register_buffer(name, t)
        self.bias = linear.bias
        self.layer: Linear | None = None

    def forward(self, x):
        if self.layer is None:
            raise FormatError("a QuantizedLinear is a loading placeholder; it is replaced by an "
                              "NVFP4Linear once its tensors are loaded")
        y = self.layer(x)
        # column-parallel: this rank's bias shard; row-parallel: hidden here, transformers
        # adds it once after the all-reduce
        return y if self.bias is None else y + tp.local(self.bias)

    def loaded_tensors(self) -> list[str]:
        return ["weight", "weight_scale"] + [n for n, b in self._buffers.items()
                                             if b is not None]

    def finalize(self, mode: str, layout: str = "auto", name: str = "") -> NVFP4Linear:
        check_modelopt(name, self.out_features, self.in_features, self.weight,
                       self.weight_scale, self.weight_scale_2, self.input_scale)
        ws2 = self.weight_scale_2.reshape(())
        inp = None if self.input_scale is None else self.input_scale.reshape(())
        bias = None if self.bias is None else self.bias.detach()
        return NVFP4Linear.from_modelopt(tp.local(self.weight), tp.local(self.weight_scale),
                                         ws2, inp, bias, mode, "auto", layout)

    def prepare(self, mode: str, layout: str, name: str) -> None:
        """Tensor parallel: the layer from this rank's shard (``cute_fp4.layers.Linear``),
        in place; the loaded shards are the layer's from now on."""
        w, scale = tp.local(self.weight), tp.local(self.weight_scale)
        check_modelopt(name, w.shape[0], 2 * w.shape[1], w, scale, self.weight_scale_2,
                       self.input_scale)
        inp = None if self.input_scale is None else self.input_scale.reshape(())
        self.layer = Linear.from_modelopt(w, scale, self.weight_scale_2.reshape(()), inp,
                                          mode=mode, layout=layout, name=name)
        del self._parameters["weight"], self._parameters["weight_scale"]


# ----------------------------------------------------------------------------- the plan

class _Plan:
    """Which modules of a model are quantized in a checkpoint, found and checked from the
    tensor index before anything is loaded."""

    def __init__(self):
        self.dense: dict[str, bool] = {}  # name -> has input_scale
        self.experts: dict[str, bool] = {}

    @property
    def has_input_scales(self) -> bool:
        return any(self.dense.values()) or any(self.experts.values())


def _weight_keys(model, conversions, index) -> dict[str, list[tuple[str, str | None]]]:
    """model key -> [(checkpoint key, converter source pattern)] for the checkpoint's
    ``.weight`` tensors, through transformers' own renaming."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    out: dict[str, list] = {}
    for key in index:
        if key.endswith(".weight"):
            new, pattern = rename_source_key(key, renamings, converters,
                                             model.base_model_prefix, meta)
            out.setdefault(new, []).append((key, pattern))
    return out


def _sibling(key: str, tensor: str) -> str:
    return key[: -len("weight")] + tensor


def _check_dense(name: str, lin: torch.nn.Linear, keys, index) -> bool:
    """The four tensors of quantized linear ``name``; returns whether it has an input
    scale."""
    n, k = lin.out_features, lin.in_features
    found = keys.get(f"{name}.weight")
    if not found:
        raise CheckpointError("the checkpoint", f"{name}.weight",
                              f"uint8 [{n}, {k // 2}] (an NVFP4 weight: {name} is not in "
                              "exclude_modules)", "no such tensor")
    key = found[0][0]
    expect(index, key, torch.uint8, (n, k // 2),
           what=f"NVFP4, {name} is not in exclude_modules")
    if k % K_MULTIPLE or n % N_MULTIPLE:
        raise FormatError(f"{name}: [{n}, {k}] cannot run on cute_fp4's kernels (in_features "
                          f"a multiple of {K_MULTIPLE}, out_features of {N_MULTIPLE}); "
                          "exclude it when quantizing")
    expect(index, _sibling(key, "weight_scale"), NVFP4.scale.torch_dtype, (n, NVFP4.scale_cols(k)),
           near=key, what="row-major block scales")
    expect(index, _sibling(key, "weight_scale_2"), torch.float32, _SCALAR, near=key,
           what="the global scale")
    inp = _sibling(key, "input_scale")
    if inp in index:
        expect(index, inp, torch.float32, _SCALAR, what="the activation global scale")
    return inp in index


def _check_excluded(name: str, keys, index) -> None:
    for key, _ in keys.get(f"{name}.weight", []):
        info: TensorInfo = index[key]
        if info.dtype == torch.uint8 or _sibling(key, "weight_scale") in index:
            raise CheckpointError(info.file, key, f"{name} in BF16 (exclude_modules names it)",
                                  f"NVFP4 tensors ({describe(info.dtype, info.shape)})")


def _check_expert_source(name: str, e: int, nk: tuple[int, int], template: str, source: str,
                         found: list[str], index) -> set[bool]:
    """The four tensors of every expert ``0 .. e-1`` of one source (gate, up or down) of
    experts module ``name``; returns {whether they have input scales}."""
    n, k = nk
    by_e = {}
    for key in found:
        hit = ex.expert_of(source, key)
        if hit is not None:
            by_e[hit[0]] = (key, hit[1])
    some = next(iter(by_e.values()), None)
    with_input = set()
    for x in range(e):
        if x in by_e:
            key = by_e[x][0]
        elif some is not None:  # name the missing key after one found
            key, start = some
            key = key[:start] + str(x) + key[start + len(str(_index_at(key, start))):]
        else:
            key = template.format(e=x)
        what = f"expert {x} of {e}, {name}"
        near = some[0] if some else None
        expect(index, key, torch.uint8, (n, k // 2), near=near, what=what)
        expect(index, _sibling(key, "weight_scale"), NVFP4.scale.torch_dtype,
               (n, NVFP4.scale_cols(k)), near=key, what=what)
        expect(index, _sibling(key, "weight_scale_2"), torch.float32, _SCALAR, near=key,
               what=what)
        inp = _sibling(key, "input_scale")
        if inp in index:
            expect(index, inp, torch.float32, _SCALAR, what=what)
        with_input.add(inp in index)
    return with_input


def _index_at(key: str, start: int) -> int:
    end = start
    while end < len(key) and key[end].isdigit():
        end += 1
    return int(key[start:end])


def _check_experts(name: str, module, keys, index, conversions) -> bool:
    """Every expert's four tensors for experts module ``name``; returns whether they have
    input scales (all experts or none)."""
    why = ex.unsupported(module)
    if why:
        raise FormatError(f"{name}: these experts cannot run on the NVFP4 grouped kernels: "
                          f"{why}; exclude them when quantizing")
    ex.check_shapes(module, name)
    e, n13, h = module.gate_up_proj.shape
    i = n13 // 2
    names = ex.expert_names(conversions, name)
    shapes = {"gate_up_proj": (i, h), "down_proj": (h, i)}
    with_input = set()
    for proj, (n, k) in shapes.items():
        sources = names.get(proj)
        found = [key for key, _ in keys.get(f"{name}.{proj}", [])]
        if not sources or not found:
            raise CheckpointError("the checkpoint", f"{name}.{proj}",
                                  f"per-expert NVFP4 tensors of {e} experts"
                                  + (f" named like {sources[0][0].format(e=0)}"
                                     if sources else ""), "none")
        for template, source in sources:
            with_input |= _check_expert_source(name, e, (n, k), template, source, found,
                                               index)
    if len(with_input) > 1:
        raise CheckpointError("the checkpoint", f"{name}.*.input_scale",
                              "an input_scale for every expert or for none", "some")
    return with_input == {True}


def plan_model(model, fmt: QuantFormat, index, conversions) -> _Plan:
    """Check the checkpoint (``index``) against the model and find what is quantized."""
    from transformers.core_model_loading import WeightRenaming

    keys = _weight_keys(model, conversions, index)
    patterns = list(fmt.exclude_modules)
    for rename in (c for c in conversions if isinstance(c, WeightRenaming)):
        patterns += [rename.rename_source_key(p)[0] for p in fmt.exclude_modules]
    plan = _Plan()
    for name, module in model.named_modules():
        if not name:
            continue
        is_linear, is_exp = isinstance(module, torch.nn.Linear), ex.is_experts(module)
        if not (is_linear or is_exp):
            continue
        if excluded(name, patterns):
            _check_excluded(name, keys, index)
        elif is_linear:
            plan.dense[name] = _check_dense(name, module, keys, index)
        else:
            plan.experts[name] = _check_experts(name, module, keys, index, conversions)
    return plan


# ----------------------------------------------------------------------------- quantizer

class PreQuantized(HfQuantizer):
    """What cute_fp4's quantizer plugins share (ModelOpt NVFP4 here, gpt-oss MXFP4 in
    ``cute_fp4.hf.mxfp4``): pre-quantized checkpoints only, loaded onto one device
    (``self.device``), saved by :func:`cute_fp4.hf.save_pretrained` (``SAVED_AS``), not
    trainable, compileable."""

    requires_calibration = True  # pre-quantized checkpoints only
    FORMAT = "NVFP4"
    SAVED_AS = "ModelOpt's per-expert NVFP4 tensors"

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.device = torch.device("cpu")

    def validate_environment(self, device_map=None, **kwargs):
        devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
        devices.discard(None)
        if len(devices) > 1 or devices & {"disk", "auto"}:
            raise InputError(f"{self.FORMAT} checkpoints load onto one device; device_map "
                             f"gives {sorted(map(str, devices))}")
        if devices:
            dev = devices.pop()
            self.device = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(
                dev)

    def is_serializable(self, safe_serialization=None):
        """transformers' ``model.save_pretrained`` asks this first: the answer is
        :func:`cute_fp4.hf.save_pretrained`, which writes the checkpoint's form."""
        raise InputError(f"save an {self.FORMAT} model with cute_fp4.hf.save_pretrained(model, "
                         f"path) ({self.SAVED_AS}, bit-exact), not model.save_pretrained")

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


class ModelOptNVFP4Quantizer(PreQuantized):
    """Loads pre-quantized ModelOpt NVFP4 checkpoints onto cute_fp4's layers (module
    docstring). Quantizing a BF16 model is ``cute_fp4.hf.quantize_model``."""

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.plan: _Plan | None = None
        self.mode = "w4a16"

    def update_weight_conversions(self, weight_conversions):
        out = []
        for conv in weight_conversions:
            out += ex.nvfp4_converters(conv) if ex.moe_converter(conv) else [conv]
        return out

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from transformers.conversion_mapping import get_model_conversion_mapping

        if not checkpoint_files or not str(checkpoint_files[0]).endswith(".safetensors"):
            raise FormatError("NVFP4 checkpoints load from safetensors shards, got "
                              f"{checkpoint_files!r}")
        root = os.path.dirname(checkpoint_files[0])
        index = read_tensor_index(root, checkpoint_files)
        conversions = get_model_conversion_mapping(model, None, self)
        fmt = self.quantization_config.format
        self.plan = plan_model(model, fmt, index, conversions)
        self.mode = resolve_mode(self.quantization_config.mode, self.device,
                                 self.plan.has_input_scales)
        for name, inp in self.plan.dense.items():
            parent, _, attr = name.rpartition(".")
            lin = model.get_submodule(name)
            setattr(model.get_submodule(parent), attr, QuantizedLinear(lin, inp))
        for name, inp in self.plan.experts.items():
            ex.install_placeholders(model.get_submodule(name), inp)

    def _process_model_after_weight_loading(self, model, **kwargs):
        layout = self.quantization_config.layout
        mesh = tp.tp_mesh(model)
        for name in self.plan.dense:
            holder = model.get_submodule(name)
            _check_loaded(name, holder, holder.loaded_tensors())
            if mesh is not None:  # in place: transformers wrapped the module's forward
                tp.check_linear_style(name, tp.tp_style(model, name))
                holder.prepare(self.mode, layout, _rank_name(name, mesh))
                continue
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, holder.finalize(self.mode, layout, name))
        for name in self.plan.experts:
            module = model.get_submodule(name)
            _check_loaded(name, module, ex.placeholder_names(module))
            if mesh is not None:
                tp.check_experts_styles(name, tp.tp_style(model, name), {
                    p: tp.tp_style(model, f"{name}.{p}") for p in ex.PROJECTIONS})
            ex.finalize(module, self.mode, layout,
                        name=name if mesh is None else _rank_name(name, mesh))
        if self.plan.experts:
            model.set_experts_implementation(ex.IMPLEMENTATION)
        model.cute_fp4_mode = self.mode
        fuse = self.quantization_config.fuse_mlp and mesh is None  # modules stay in place
        model.cute_fp4_mlps = fuse_mlps(model, fuse, self.quantization_config.gate_up_group)
        return model

    def update_tp_plan(self, config):
        """The experts' block scales are sharded as their weights (transformers shards the
        parameters its plan names)."""
        plan = getattr(config, "base_model_tp_plan", None)
        if plan:
            config.base_model_tp_plan = tp.expert_scale_plan(plan)
        return config

def fuse_mlps(model, fuse: bool, group: int | None) -> tuple[tuple, tuple]:
    """The dense gated SiLU MLPs whose three projections are NVFP4 with one gate/up global
    scale become ``NVFP4GatedMLP`` (``cute_fp4.mlp.fuse_gated_mlps``: the same bits;
    ``group`` None: the GPU's, so a model on the CPU stays unfused). Returns
    ``(fused names, (name, reason) of the gated MLPs left as three layers)``, kept on the
    model as ``cute_fp4_mlps``; a reason other than being on the CPU is also logged."""
    if not fuse:
        return (), ()
    from transformers.utils import logging

    from cute_fp4.mlp import fuse_gated_mlps

    fused, unfused = fuse_gated_mlps(model, group)
    odd = [(n, r) for n, r in unfused if "on the CPU" not in r]
    if odd:
        logging.get_logger("cute_fp4.hf").warning(
            "%d gated MLPs stay unfused (three NVFP4Linear layers), e.g. %s: %s",
            len(odd), *odd[0])
    return fused, unfused


def _rank_name(name: str, mesh) -> str:
    """A layer's name in errors under tensor parallelism: with this rank and the size."""
    return f"{name} (tensor-parallel rank {mesh.get_local_rank()} of {mesh.size()})"


def _check_loaded(name: str, module, tensors) -> None:
    """A placeholder tensor that transformers did not fill (a missing or failed tensor it
    only logs) is an error: nothing half-loaded."""
    for b in tensors:
        t = getattr(module, b)
        if t.is_meta or not getattr(t, "_is_hf_initialized", False):
            raise CheckpointError("the checkpoint", f"{name}.{b}", "a loaded tensor",
                                  "not loaded (see transformers' loading report)")


# ----------------------------------------------------------------------------- registry

_registered: str | None = None


def register() -> str:
    """Register the config, the quantizer and the experts implementation with transformers
    (idempotent); returns the quant method name they are registered under."""
    global _registered
    if _registered is not None:
        return _registered
    from transformers.integrations.moe import ExpertsInterface
    from transformers.quantizers import auto

    for key in ("modelopt", "cute_fp4_modelopt"):
        q = auto.AUTO_QUANTIZER_MAPPING.get(key)
        c = auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(key)
        if q is ModelOptNVFP4Quantizer and c is ModelOptNVFP4Config:
            break
        if q is None and c is None:
            auto.register_quantization_config(key)(ModelOptNVFP4Config)
            auto.register_quantizer(key)(ModelOptNVFP4Quantizer)
            break
    else:
        raise InputError("transformers already has other quantizers registered as 'modelopt' "
                         "and 'cute_fp4_modelopt'")
    ExpertsInterface.register(ex.IMPLEMENTATION, ex.experts_forward)
    _registered = key
    return key
