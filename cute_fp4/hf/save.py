"""``save_pretrained``: an NVFP4 transformers model (loaded by ``from_pretrained`` or quantized
by ``quantize_model``) written as a ModelOpt NVFP4 checkpoint, bit for bit what its layers
hold: ``NVFP4Linear``'s own state dict (ModelOpt's names), the experts split expert by
expert under the names of the model's transformers conversion mapping (reversed: the
names a BF16 checkpoint of the model has), everything else as transformers saves it (tied
weights once), config.json with the ``quantization_config``.
"""

from __future__ import annotations

import os

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from cute_fp4.errors import InputTypeError
from cute_fp4.hf import experts as ex
from cute_fp4.hf.checkpoint import QuantFormat, write_safetensors
from cute_fp4.nn import NVFP4Linear

__all__ = ["save_pretrained"]


def _renamer(model):
    """model key -> checkpoint key: the model's renamings reversed (e.g. Mixtral's
    ``.mlp.`` -> ``.block_sparse_moe.``)."""
    conversions = get_model_conversion_mapping(model, add_legacy=False)
    reverse = [c.reverse_transform() for c in conversions[::-1]
               if type(c) is WeightRenaming]

    def name(key: str) -> str:
        for r in reverse:
            key, _ = r.rename_source_key(key)
        return key

    return name, conversions


def _expert_tensors(model, conversions) -> dict[str, torch.Tensor]:
    """Model-naming per-expert keys of every NVFP4 experts module."""
    out = {}
    for name, module in model.named_modules():
        if not ex.holds_nvfp4(module):
            continue
        templates = ex.expert_names(conversions, name)
        tensors = ex.checkpoint_tensors(module)
        for proj, parts in tensors.items():
            if proj not in templates or len(templates[proj]) != len(parts):
                raise InputTypeError(f"{name}: no per-expert naming for {proj} in the "
                                     "model's transformers conversion mapping")
            for (template, _), part in zip(templates[proj], parts):
                for tensor, values in part.items():
                    for e, t in enumerate(values):
                        key = template.format(e=e)
                        out[key[: -len("weight")] + tensor] = t
    return out


def _exclusions(model, rename) -> list[str]:
    """Checkpoint names of the linears and experts left in BF16."""
    names = []
    for name, m in model.named_modules():
        if not name:
            continue
        if type(m) is torch.nn.Linear or ex.is_experts(m):  # NVFP4 experts have no BF16 tensors
            names.append(rename(name))
    return names


def save_pretrained(model: torch.nn.Module, path: str | os.PathLike, *,
                    max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write ``model`` as a ModelOpt NVFP4 checkpoint in directory ``path`` (created):
    safetensors shards of at most ``max_shard_size`` bytes (plus their index), config.json
    with ``quantization_config`` {quant_method: "modelopt", quant_algo: "NVFP4",
    group_size: 16, exclude_modules: [...]}, generation_config.json. Returns the shard
    names. ``cute_fp4.hf.from_pretrained(path)`` loads it back bit for bit."""
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise InputTypeError(f"model must be a transformers model, got {type(model).__name__}")
    if not any(isinstance(m, NVFP4Linear) or ex.holds_nvfp4(m) for m in model.modules()):
        raise InputTypeError("model has no NVFP4 layers: quantize it first "
                             "(cute_fp4.hf.quantize_model) or save it with transformers")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rename, conversions = _renamer(model)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    tensors = {}
    for key, t in model.state_dict().items():
        if key not in tied:
            tensors[rename(key)] = t.detach().cpu().contiguous()
    for key, t in _expert_tensors(model, conversions).items():
        tensors[rename(key)] = t.contiguous()
    files = write_safetensors(tensors, path, max_shard_size)
    _write_config(model, path, QuantFormat(tuple(_exclusions(model, rename))))
    return files


def _write_config(model, path: str, fmt: QuantFormat) -> None:
    config = model.config
    saved = getattr(config, "quantization_config", None)
    config.quantization_config = fmt.to_dict()
    try:
        config.save_pretrained(path)
    finally:
        if saved is None:
            del config.quantization_config
        else:
            config.quantization_config = saved
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(path)
