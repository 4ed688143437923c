"""gpt-oss MXFP4 checkpoints in transformers: the experts on cute_fp4's grouped kernels.

A checkpoint of transformers' ``mxfp4`` quantization method (config.json's
``quantization_config`` ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``,
gpt-oss-20b and -120b) stores each ``GptOssExperts`` module's weights as MXFP4:
``<experts>.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``..._scales`` uint8
``[E, 2I, H/32]``, ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales``
``[E, H, I/32]``; its biases ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias``
``[E, H]`` and every other module (attention with its sinks, the router, embeddings, norms,
lm_head: ``modules_to_not_convert``) are BF16. transformers' ``Mxfp4HfQuantizer`` runs them
on OpenAI's Triton kernels from the Hugging Face hub (the ``kernels`` package), else
dequantizes the experts to BF16 at load.

Here (:func:`from_pretrained`, through ``cute_fp4.hf.from_pretrained``) the quantizer plugin
:class:`MXFP4Quantizer` (quant method ``"cute_fp4_mxfp4"``) checks the checkpoint's headers
against the model before anything is read (typed :class:`~cute_fp4.hf.checkpoint.
CheckpointError` naming file, key and expectation), loads the blocks and scales into
placeholder buffers of each experts module as stored (no BF16 copy ever exists), then
prepares them as a :class:`~cute_fp4.moe.MXFP4MoE` held as the module's child ``mxfp4``
(``Experts.from_gpt_oss``: gate/up regrouped, bias and clamped SwiGLU fused). The module
keeps its class, its router and its BF16 biases (the checkpoint's, for saving); its forward
runs through transformers' experts interface (``"cute_fp4"``,
``cute_fp4.hf.experts.experts_forward``). :func:`checkpoint_tensors` gives the stored
tensors back bit for bit (``cute_fp4.hf.save_pretrained`` writes them).
"""

from __future__ import annotations

import os

import torch
from transformers.utils.quantization_config import QuantizationConfigMixin

from cute_fp4.errors import FormatError
from cute_fp4.formats import MXFP4
from cute_fp4.hf.checkpoint import CheckpointError, excluded, expect, read_tensor_index
from cute_fp4.hf.quantizer import PreQuantized
from cute_fp4.moe import MXFP4MoE

__all__ = ["ATTRIBUTE", "MXFP4Config", "MXFP4Quantizer", "QUANT_METHOD", "checkpoint_tensors",
           "holds_mxfp4", "is_gpt_oss_experts", "register"]

QUANT_METHOD = "mxfp4"  # transformers' name, in the checkpoints' config.json
PLUGIN_METHOD = "cute_fp4_mxfp4"  # ours, registered with transformers at load
ATTRIBUTE = "mxfp4"  # the experts module's child that runs them
PROJECTIONS = ("gate_up_proj", "down_proj")
_STORED = ("blocks", "scales")
STORED_KEYS = tuple(f"{p}_{t}" for p in PROJECTIONS for t in _STORED)


def is_gpt_oss_experts(module: torch.nn.Module) -> bool:
    """transformers' gpt-oss experts: fused ``[E, in, out]`` weights with biases, gate and
    up interleaved (``GptOssExperts``)."""
    return (type(module).__name__ == "GptOssExperts"
            and hasattr(module, "gate_up_proj_bias") and hasattr(module, "down_proj_bias"))


def holds_mxfp4(module: torch.nn.Module) -> bool:
    """An experts module running on an ``MXFP4MoE`` (its child ``mxfp4``)."""
    return isinstance(getattr(module, ATTRIBUTE, None), MXFP4MoE)


class MXFP4Config(QuantizationConfigMixin):
    """``quantization_config`` of a gpt-oss MXFP4 checkpoint while cute_fp4 loads it:
    ``modules_to_not_convert`` as stored; loading options under ``cute_fp4`` (``layout``,
    ``fused``; never saved). :meth:`to_dict` is the checkpoint's own form."""

    def __init__(self, modules_to_not_convert=None, quant_method=PLUGIN_METHOD, cute_fp4=None,
                 **kwargs):
        if modules_to_not_convert is not None and not (
                isinstance(modules_to_not_convert, list)
                and all(isinstance(m, str) for m in modules_to_not_convert)):
            raise CheckpointError("config.json", "quantization_config.modules_to_not_convert",
                                  "a list of module names", repr(modules_to_not_convert))
        self.quant_method = quant_method
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        opts = dict(cute_fp4 or {})
        self.layout, self.fused = opts.get("layout", "auto"), opts.get("fused", "auto")

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "modules_to_not_convert":
                list(self.modules_to_not_convert)}


def _shapes(module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors of a gpt-oss experts module: name -> (shape, dtype)."""
    e, h, n13 = module.gate_up_proj.shape  # [E, H, 2I] (transformers stores [E, in, out])
    i = n13 // 2
    half = MXFP4.block // MXFP4.element.per_byte
    return {"gate_up_proj_blocks": ((e, n13, h // MXFP4.block, half), torch.uint8),
            "gate_up_proj_scales": ((e, n13, h // MXFP4.block), torch.uint8),
            "down_proj_blocks": ((e, h, i // MXFP4.block, half), torch.uint8),
            "down_proj_scales": ((e, h, i // MXFP4.block), torch.uint8)}


def plan_model(model, patterns, index) -> list[str]:
    """The gpt-oss experts modules of ``model`` the checkpoint (``index``) holds in MXFP4,
    each tensor checked (dtype, shape) before anything is read; the excluded ones must be
    stored in BF16."""
    names = []
    for name, module in model.named_modules():
        if not is_gpt_oss_experts(module):
            continue
        specs = _shapes(module)
        if excluded(name, patterns):
            for key in specs:
                if f"{name}.{key}" in index:
                    info = index[f"{name}.{key}"]
                    raise CheckpointError(info.file, f"{name}.{key}",
                                          f"{name} in BF16 (modules_to_not_convert names it)",
                                          "MXFP4 tensors")
            continue
        e, h, n13 = module.gate_up_proj.shape
        if h % MXFP4.block or (n13 // 2) % MXFP4.block:
            raise FormatError(f"{name}: hidden {h} and intermediate {n13 // 2} must be "
                              f"multiples of {MXFP4.block} (MXFP4 blocks)")
        near = next((f"{name}.{k}" for k in specs if f"{name}.{k}" in index), None)
        for key, (shape, dtype) in specs.items():
            expect(index, f"{name}.{key}", dtype, shape, near=near,
                   what=f"MXFP4, {name} is not in modules_to_not_convert")
        for key in ("gate_up_proj_bias", "down_proj_bias"):
            shape = tuple(getattr(module, key).shape)
            info = index.get(f"{name}.{key}")
            if info is None or not info.dtype.is_floating_point or tuple(info.shape) != shape:
                found = "no such tensor" if info is None else f"{info.dtype} {list(info.shape)}"
                raise CheckpointError(info.file if info else (index[near].file if near
                                                              else "the checkpoint"),
                                      f"{name}.{key}", f"a float tensor {list(shape)}", found)
        names.append(name)
    return names


def install_placeholders(module: torch.nn.Module) -> None:
    """Replace the experts' BF16 weight parameters (meta) by buffers of the checkpoint's
    MXFP4 tensors, named as stored."""
    specs = _shapes(module)
    for proj in PROJECTIONS:
        delattr(module, proj)
        # an empty stand-in under the weight's name, marked loaded: transformers' weight
        # initialisation of the model's missing tensors reads it (and skips it)
        stand_in = torch.empty(0, dtype=torch.uint8)
        stand_in._is_hf_initialized = True
        module.register_buffer(proj, stand_in, persistent=False)
    for name, (shape, dtype) in specs.items():
        module.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"))


def finalize(module: torch.nn.Module, name: str, index, layout: str, fused) -> None:
    """The loaded placeholders of experts module ``name`` -> its ``MXFP4MoE`` (child
    ``mxfp4``); a bad scale code (NaN 255, or 253/254 the kernels' decodes overflow) is a
    CheckpointError naming the file and key."""
    b = {key: module._buffers.pop(key) for key in STORED_KEYS}
    for proj in PROJECTIONS:
        module._buffers.pop(proj, None)  # the stand-ins
    for key, t in b.items():
        if t.is_meta or not getattr(t, "_is_hf_initialized", False):
            raise CheckpointError(index[f"{name}.{key}"].file, f"{name}.{key}",
                                  "a loaded tensor", "not loaded (see transformers' report)")
    try:
        moe = MXFP4MoE.from_gpt_oss(
            b["gate_up_proj_blocks"], b["gate_up_proj_scales"], module.gate_up_proj_bias,
            b["down_proj_blocks"], b["down_proj_scales"], module.down_proj_bias,
            layout=layout, fused=fused, name=name)
    except FormatError as e:
        msg = str(e)
        proj = "down_proj" if f": {PROJECTIONS[1]}" in msg else PROJECTIONS[0]
        key = f"{proj}_{'scales' if 'scales hold' in msg else 'blocks'}"
        info = index.get(f"{name}.{key}")
        raise CheckpointError(info.file if info else "the checkpoint", f"{name}.{key}",
                              "valid MXFP4 tensors", str(e)) from None
    setattr(module, ATTRIBUTE, moe)


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An MXFP4 experts module's stored tensors on the CPU (``gate_up_proj_blocks``,
    ``..._scales``, ``down_proj_blocks``, ``..._scales``), bit for bit what was loaded; its
    biases are its own parameters (the module's state dict)."""
    out = getattr(module, ATTRIBUTE).gpt_oss_checkpoint()
    return {k: v for k, v in out.items() if k.endswith(_STORED)}


class MXFP4Quantizer(PreQuantized):
    """Loads gpt-oss MXFP4 checkpoints onto cute_fp4's grouped kernels (module
    docstring)."""

    FORMAT = "MXFP4"
    SAVED_AS = "the checkpoint's blocks and scales"

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.names: list[str] = []
        self.index = {}

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files or not str(checkpoint_files[0]).endswith(".safetensors"):
            raise FormatError("MXFP4 checkpoints load from safetensors shards, got "
                              f"{checkpoint_files!r}")
        root = os.path.dirname(checkpoint_files[0])
        self.index = read_tensor_index(root, checkpoint_files)
        self.names = plan_model(model, self.quantization_config.modules_to_not_convert,
                                self.index)
        for name in self.names:
            install_placeholders(model.get_submodule(name))

    def _process_model_after_weight_loading(self, model, **kwargs):
        from cute_fp4.hf.experts import IMPLEMENTATION

        qc = self.quantization_config
        for name in self.names:
            finalize(model.get_submodule(name), name, self.index, qc.layout, qc.fused)
        if self.names:
            model.set_experts_implementation(IMPLEMENTATION)
        model.cute_fp4_mode = "w4a16"
        model.cute_fp4_format = QUANT_METHOD
        return model


_registered = False


def register() -> str:
    """Register the config and the quantizer with transformers under
    :data:`PLUGIN_METHOD` (idempotent), and the experts implementation; returns the
    name."""
    global _registered
    if not _registered:
        from transformers.quantizers import auto

        from cute_fp4.hf.quantizer import register as register_nvfp4

        register_nvfp4()  # the "cute_fp4" experts implementation
        if auto.AUTO_QUANTIZER_MAPPING.get(PLUGIN_METHOD) is not MXFP4Quantizer:
            auto.register_quantization_config(PLUGIN_METHOD)(MXFP4Config)
            auto.register_quantizer(PLUGIN_METHOD)(MXFP4Quantizer)
        _registered = True
    return PLUGIN_METHOD


def read_config(path: str) -> dict | None:
    """config.json's ``quantization_config`` when it is transformers' ``mxfp4`` one, else
    None."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


def from_pretrained(path: str, qc: dict, device: torch.device, layout: str, fused,
                    **transformers_kwargs):
    """``cute_fp4.hf.from_pretrained`` of a gpt-oss MXFP4 checkpoint (module docstring)."""
    method = register()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = transformers_kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    config.quantization_config = {"quant_method": method,
                                  "modules_to_not_convert": qc.get("modules_to_not_convert"),
                                  "cute_fp4": {"layout": layout, "fused": fused}}
    transformers_kwargs.setdefault("dtype", torch.bfloat16)
    transformers_kwargs.setdefault("device_map", {"": device})
    transformers_kwargs.setdefault("experts_implementation", "cute_fp4")
    return AutoModelForCausalLM.from_pretrained(path, config=config, **transformers_kwargs)
