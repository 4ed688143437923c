"""``save_pretrained``: an NVFP4 transformers model (loaded by ``from_pretrained`` or quantized
by ``quantize_model``) written as a ModelOpt NVFP4 checkpoint, bit for bit what its layers
hold: ``NVFP4Linear``'s own state dict (ModelOpt's names), the experts split expert by
expert under the names of the model's transformers conversion mapping (reversed: the
names a BF16 checkpoint of the model has), everything else as transformers saves it (tied
weights once), config.json with the ``quantization_config`` and, as ModelOpt writes it
beside, hf_quant_config.json; both list every module left unquantized. A gpt-oss MXFP4
model (``cute_fp4.hf.mxfp4``) is written back in its own form: each experts module's
``*_blocks`` and ``*_scales``, config.json's ``{"quant_method": "mxfp4", ...}``.

A save replaces, never mixes: every file is written into a staging folder inside the
directory and renamed into place at the end, so a save that fails or is interrupted while
writing (the long part) leaves the previous checkpoint as it was; then the weight files of
the earlier save that the new one does not write (its shards, index or single file) are
removed. Files that are not a checkpoint's weights (a README, the tokenizer) are left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.hf import experts as ex
from cute_fp4.hf import mxfp4, tp
from cute_fp4.hf.checkpoint import (
    INDEX_FILE,
    LEGACY_QUANT_FILE,
    SINGLE_FILE,
    QuantFormat,
    write_safetensors,
)
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
    """Checkpoint names of every module left unquantized that holds a weight matrix: the
    linears and experts kept in BF16 (lm_head, whatever was excluded or skipped) and the
    other modules with a 2-D weight of their own, the MoE routers (``mlp.gate``) and
    shared-expert gates. ModelOpt lists them all, and engines that decide per module from
    this list (vLLM) would otherwise give a router NVFP4 parameters. Embeddings are not
    listed (no engine quantizes them from this config), nor are the NVFP4 layers."""
    names = []
    for name, m in model.named_modules():
        if (not name or isinstance(m, (NVFP4Linear, torch.nn.Embedding))
                or ex.holds_nvfp4(m)):
            continue
        w = m._parameters.get("weight")
        matrix = w is not None and w.dim() >= 2 and w.is_floating_point()
        if type(m) is torch.nn.Linear or ex.is_experts(m) or matrix:
            names.append(rename(name))
    return names


def _quant_format(model, rename, tensors) -> QuantFormat:
    """The config of the checkpoint ``tensors`` (checkpoint names) of ``model``."""
    return QuantFormat(tuple(_exclusions(model, rename)),
                       input_scales=any(k.endswith(".input_scale") for k in tensors))


def save_pretrained(model: torch.nn.Module, path: str | os.PathLike, *,
                    max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write ``model`` as a ModelOpt NVFP4 checkpoint in directory ``path`` (created):
    safetensors shards of at most ``max_shard_size`` bytes (plus their index), config.json
    with ``quantization_config`` {quant_method: "modelopt", quant_algo: "NVFP4",
    group_size: 16, exclude_modules/ignore: [every module left unquantized: lm_head, the
    routers, ...], config_groups: {...}}, hf_quant_config.json (the same, ModelOpt's older
    file), generation_config.json. Returns the shard names.
    ``cute_fp4.hf.from_pretrained(path)`` loads it back bit for bit. A checkpoint already in
    ``path`` is replaced (module docstring); ``path`` an existing file: InputError."""
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise InputTypeError(f"model must be a transformers model, got {type(model).__name__}")
    if tp.tp_mesh(model) is not None:
        raise InputError("save_pretrained: this tensor-parallel model holds only its rank's "
                         "shards; save from a single-process load (cute_fp4.hf.from_pretrained "
                         "without tp_plan)")
    if not any(isinstance(m, NVFP4Linear) or ex.holds_nvfp4(m) or mxfp4.holds_mxfp4(m)
               for m in model.modules()):
        raise InputTypeError("model has no NVFP4 or MXFP4 layers: quantize it first "
                             "(cute_fp4.hf.quantize_model) or save it with transformers")
    path = _checkpoint_dir(path)
    rename, conversions = _renamer(model)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    tensors = {}
    for key, t in model.state_dict().items():
        if key not in tied:
            tensors[rename(key)] = t.detach().cpu().contiguous()
    for key, t in _expert_tensors(model, conversions).items():
        tensors[rename(key)] = t.contiguous()
    for name, module in model.named_modules():  # gpt-oss's MXFP4 experts, as stored
        if mxfp4.holds_mxfp4(module):
            for key, t in mxfp4.checkpoint_tensors(module).items():
                tensors[rename(f"{name}.{key}")] = t.contiguous()
    _remove_dead_stages(path)
    stage = tempfile.mkdtemp(prefix=f"{_STAGE}{os.getpid()}-", dir=path)
    try:
        files = write_safetensors(tensors, stage, max_shard_size)
        if getattr(model, "cute_fp4_format", None) == mxfp4.QUANT_METHOD:
            _write_config(model, stage, model.config.quantization_config.to_dict())
        else:
            _write_config(model, stage, _quant_format(model, rename, tensors))
        _replace(stage, path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return files


_STAGE = ".cute_fp4-save-"  # + pid-random: a save's staging folder inside the directory
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _checkpoint_dir(path) -> str:
    """``path`` as a directory, made (with its parents) when absent; InputError when it is
    a file or cannot be made."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"save_pretrained: path {path!r} is an existing file; a checkpoint "
                         "is a directory (config.json and safetensors shards)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InputError(f"save_pretrained: cannot make the checkpoint directory {path!r} "
                         f"({e.strerror or e})") from None
    return path


def _weight_files(path: str) -> set[str]:
    """The weight files of a checkpoint in ``path``: model.safetensors, the index, the
    shards the index names and the shards named as transformers and this module name
    them (``model-00001-of-00004.safetensors``). Nothing else is a save's to remove."""
    names = set(os.listdir(path))
    ours = {n for n in names if n in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(n)}
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            weight_map = json.load(f).get("weight_map", {})
        ours |= {n for n in weight_map.values() if isinstance(n, str) and n in names
                 and n.endswith(".safetensors") and os.path.basename(n) == n}
    except (OSError, ValueError, AttributeError):  # no index, or one that is not JSON
        pass
    return ours


def _replace(stage: str, path: str) -> None:
    """Move the new checkpoint from ``stage`` into ``path`` and remove the earlier one's
    weight files that it does not overwrite. The old entry points (index, single file) go
    first (a single file replacing a single file is one atomic rename) and the new one
    comes last, so that at every moment the directory holds the old checkpoint, the new
    one or none that loads (an error), never a mix of the two."""
    new = sorted(os.listdir(stage))
    entry = INDEX_FILE if INDEX_FILE in new else SINGLE_FILE
    stale = _weight_files(path) - set(new)
    for name in {INDEX_FILE, SINGLE_FILE} - ({entry} if entry == SINGLE_FILE else set()):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    for name in [n for n in new if n != entry] + [entry]:
        os.replace(os.path.join(stage, name), os.path.join(path, name))
    for name in stale - {INDEX_FILE, SINGLE_FILE}:
        os.remove(os.path.join(path, name))


def _remove_dead_stages(path: str) -> None:
    """Staging folders of saves whose process has ended (killed before it could clean
    up)."""
    for name in os.listdir(path):
        if not name.startswith(_STAGE):
            continue
        pid = name[len(_STAGE):].partition("-")[0]
        try:
            os.kill(int(pid), 0)
            continue  # that save is still running
        except ProcessLookupError:
            pass
        except (ValueError, OSError):  # not our name, or a process of another user
            continue
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def _write_config(model, path: str, fmt: QuantFormat | dict) -> None:
    """config.json with ``fmt``'s quantization config and ModelOpt's hf_quant_config.json
    (a dict: written as it is, without the ModelOpt file: an MXFP4 model's own), and
    generation_config.json."""
    config = model.config
    saved = getattr(config, "quantization_config", None)
    config.quantization_config = fmt if isinstance(fmt, dict) else fmt.to_dict()
    # as transformers' own save does: engines pick the model class from it (vLLM runs a
    # config without it as an embedding model)
    config.architectures = [type(model).__name__]
    try:
        config.save_pretrained(path)
    finally:
        if saved is None:
            del config.quantization_config
        else:
            config.quantization_config = saved
    if not isinstance(fmt, dict):
        with open(os.path.join(path, LEGACY_QUANT_FILE), "w") as f:
            json.dump(fmt.legacy_dict(), f, indent=2)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(path)
