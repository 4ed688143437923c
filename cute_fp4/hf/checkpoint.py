"""ModelOpt NVFP4 checkpoints on disk: the format, its typed errors, reading the tensor
index from the safetensors headers (no tensor is read), and writing shards.

The format, per quantized linear layer ``<m>`` (``<m>.bias`` stays as it was):

* ``<m>.weight``: uint8 ``[N, K/2]``, two E2M1 codes per byte, element ``2j`` in the low
  nibble;
* ``<m>.weight_scale``: float8_e4m3fn ``[N, K/16]``, row-major (the kernels' 128x4
  swizzled layout is made on loading);
* ``<m>.weight_scale_2``: float32 scalar, the global scale (decode form, ``amax / 2688``);
* ``<m>.input_scale``: float32 scalar, optional: the calibrated activation global scale
  (W4A4).

MoE experts are stored expert by expert with the same four tensors each, under the names
the model's transformers conversion mapping merges into its fused expert tensors (e.g.
``model.layers.3.mlp.experts.7.gate_proj.weight_scale``; Mixtral:
``model.layers.3.block_sparse_moe.experts.7.w1.weight_scale``). Modules left in BF16 are
named in ``exclude_modules`` (fnmatch patterns or names; a name also excludes what is below
it) and stored as usual.

The quantization config: ``config.json``'s ``quantization_config`` ``{"quant_method":
"modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}``, or the
older ``hf_quant_config.json`` ``{"quantization": {"quant_algo": "NVFP4", ...}}``.

Errors: :class:`CheckpointError` (a ``FormatError``) names the file, the key and what was
expected. They are raised before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import struct
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from cute_fp4.errors import FormatError, InputError

__all__ = ["CONFIG_FILE", "INDEX_FILE", "LEGACY_QUANT_FILE", "CheckpointError", "QuantFormat",
           "TensorInfo", "describe", "excluded", "expect", "parse_quant_config",
           "read_quant_format", "read_tensor_index", "write_safetensors"]

CONFIG_FILE = "config.json"
LEGACY_QUANT_FILE = "hf_quant_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
QUANT_METHOD = "modelopt"
QUANT_ALGO = "NVFP4"
GROUP_SIZE = 16
KNOWN_ALGOS = ("NVFP4", "FP8", "FP8_PB_WO", "MXFP4", "MXFP8", "INT4_AWQ", "W4A8_AWQ",
               "W4A8_NVFP4_FP8", "INT8_SQ", "MIXED_PRECISION")

# safetensors dtype codes
DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
          "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(FormatError):
    """A checkpoint does not hold what its quantization config promises: ``file`` the file
    (relative to the checkpoint directory), ``key`` the tensor or config field, ``expected``
    what was expected there."""

    def __init__(self, file: str, key: str, expected: str, found: str | None = None,
                 hint: str = ""):
        self.file, self.key, self.expected, self.found = file, key, expected, found
        msg = f"{file}: {key}: expected {expected}"
        if found is not None:
            msg += f", found {found}"
        super().__init__(msg + (f" ({hint})" if hint else ""))


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """The quantization config of a ModelOpt NVFP4 checkpoint (``source``: the file it was
    read from; ``input_scales``: whether its quantized layers have activation scales, None
    when the config does not say)."""

    exclude_modules: tuple[str, ...] = ()
    group_size: int = GROUP_SIZE
    quant_algo: str = QUANT_ALGO
    kv_cache_quant_algo: str | None = None
    source: str = CONFIG_FILE
    input_scales: bool | None = None

    def to_dict(self) -> dict:
        """The ``quantization_config`` of config.json, with the keys every reader looks
        for: ``exclude_modules`` (this package's and the older key) and ``ignore`` (the
        key ModelOpt writes in config.json and vLLM reads there), and, when
        ``input_scales`` is known, ModelOpt's ``config_groups``, whose
        ``input_activations`` is null for weights-only checkpoints (vLLM then runs them
        W4A16 instead of reading input scales that are not there)."""
        d = {"quant_method": QUANT_METHOD, "quant_algo": self.quant_algo,
             "group_size": self.group_size, "kv_cache_quant_algo": self.kv_cache_quant_algo,
             "exclude_modules": list(self.exclude_modules),
             "ignore": list(self.exclude_modules),
             "producer": {"name": "cute_fp4", "version": _version()}}
        if self.input_scales is not None:
            fp4 = {"dynamic": False, "num_bits": 4, "type": "float",
                   "group_size": self.group_size}
            d["config_groups"] = {"group_0": {
                "weights": fp4, "input_activations": dict(fp4) if self.input_scales else None,
                "targets": ["Linear"]}}
        return d

    def legacy_dict(self) -> dict:
        """The older hf_quant_config.json, as ModelOpt writes it beside config.json."""
        return {"producer": {"name": "cute_fp4", "version": _version()},
                "quantization": {"quant_algo": self.quant_algo,
                                 "kv_cache_quant_algo": self.kv_cache_quant_algo,
                                 "group_size": self.group_size,
                                 "exclude_modules": list(self.exclude_modules)}}


def _version() -> str:
    """The installed package's version (its metadata: the front module is a layer above)."""
    from importlib import metadata

    try:
        return metadata.version("cute-fp4")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def parse_quant_config(d: Mapping, source: str = CONFIG_FILE,
                       field: str = "quantization_config") -> QuantFormat:
    """A :class:`QuantFormat` from a config dict; :class:`CheckpointError` names ``source``
    and the field for anything else than ModelOpt NVFP4 with blocks of 16."""
    if not isinstance(d, Mapping):
        raise CheckpointError(source, field, "a JSON object", type(d).__name__)
    method = d.get("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise CheckpointError(source, f"{field}.quant_method", f"{QUANT_METHOD!r}",
                              repr(method), "not a ModelOpt checkpoint")
    algo = d.get("quant_algo")
    if algo != QUANT_ALGO:
        what = ("an algorithm this package does not run" if algo in KNOWN_ALGOS
                else "an unknown algorithm")
        raise CheckpointError(source, f"{field}.quant_algo", f"{QUANT_ALGO!r}", repr(algo),
                              f"{what}; cute_fp4 runs NVFP4 only")
    group = d.get("group_size", GROUP_SIZE)
    if group != GROUP_SIZE:
        raise CheckpointError(source, f"{field}.group_size", str(GROUP_SIZE), repr(group),
                              "NVFP4 scales blocks of 16 elements")
    exclude: list[str] = []
    for key in ("exclude_modules", "ignore"):  # the older key, ModelOpt's config.json key
        names = d.get(key) or []
        if isinstance(names, str) or not all(isinstance(p, str) for p in names):
            raise CheckpointError(source, f"{field}.{key}", "a list of module names",
                                  repr(names))
        exclude += [n for n in names if n not in exclude]
    return QuantFormat(tuple(exclude), group, algo, d.get("kv_cache_quant_algo"), source,
                       _input_scales(d.get("config_groups")))


def _input_scales(groups) -> bool | None:
    """Whether ModelOpt's ``config_groups`` quantize activations (None: not said)."""
    if not isinstance(groups, Mapping) or not groups:
        return None
    return any(isinstance(g, Mapping) and g.get("input_activations") is not None
               for g in groups.values())


def read_quant_format(path: str | os.PathLike) -> QuantFormat:
    """The checkpoint's quantization config: config.json's ``quantization_config``, else
    hf_quant_config.json's ``quantization``; :class:`CheckpointError` when neither is a
    ModelOpt NVFP4 config."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InputError(f"{path!r} is not a checkpoint directory (config.json and "
                         "safetensors shards); download one first, e.g. with "
                         "huggingface_hub.snapshot_download")
    config = _read_json(path, CONFIG_FILE)
    if config.get("quantization_config") is not None:
        return parse_quant_config(config["quantization_config"], CONFIG_FILE)
    if os.path.exists(os.path.join(path, LEGACY_QUANT_FILE)):
        legacy = _read_json(path, LEGACY_QUANT_FILE)
        if not isinstance(legacy.get("quantization"), Mapping):
            raise CheckpointError(LEGACY_QUANT_FILE, "quantization", "a JSON object",
                                  repr(legacy.get("quantization")))
        return parse_quant_config(legacy["quantization"], LEGACY_QUANT_FILE, "quantization")
    raise CheckpointError(CONFIG_FILE, "quantization_config",
                          "a ModelOpt NVFP4 quantization config", "none",
                          f"and no {LEGACY_QUANT_FILE}: not a quantized checkpoint")


def _read_json(path: str, name: str) -> dict:
    try:
        with open(os.path.join(path, name)) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(name, "(file)", "the file to exist", "none") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(name, "(file)", "valid JSON", str(e)) from None
    if not isinstance(d, dict):
        raise CheckpointError(name, "(file)", "a JSON object", type(d).__name__)
    return d


def excluded(name: str, patterns: Iterable[str]) -> str | None:
    """The pattern of ``patterns`` that excludes module ``name`` (fnmatch, or a name that
    is ``name`` or one of its parents), None if none does."""
    for p in patterns:
        if fnmatch.fnmatchcase(name, p) or name == p or name.startswith(p + "."):
            return p
    return None


# ----------------------------------------------------------------------------- tensors

class TensorInfo(NamedTuple):
    """Where a tensor is and what it is, from its file's header."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def describe(dtype: torch.dtype, shape) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"{name} {list(shape)}"


def shard_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint (relative names): the index's, else
    model.safetensors."""
    if os.path.exists(os.path.join(path, INDEX_FILE)):
        index = _read_json(path, INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise CheckpointError(INDEX_FILE, "weight_map", "a non-empty JSON object",
                                  repr(weight_map))
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise CheckpointError(SINGLE_FILE, "(file)", f"{SINGLE_FILE} or {INDEX_FILE}", "none")


def read_tensor_index(path: str | os.PathLike, files: Iterable[str] | None = None
                      ) -> dict[str, TensorInfo]:
    """key -> :class:`TensorInfo` over the checkpoint's shards, read from the safetensors
    headers only (8 bytes of length, then JSON)."""
    path = os.fspath(path)
    out: dict[str, TensorInfo] = {}
    for name in (shard_files(path) if files is None else
                 [os.path.relpath(f, path) for f in files]):
        for key, (dtype, shape) in _header(path, name).items():
            if key in out:
                raise CheckpointError(name, key, "each tensor in one file",
                                      f"also in {out[key].file}")
            out[key] = TensorInfo(name, dtype, shape)
    return out


def _header(path: str, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    full = os.path.join(path, name)
    try:
        with open(full, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(name, "(file)", "the shard the index names", "none") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError):
        raise CheckpointError(name, "(header)", "a safetensors header", "unreadable") from None
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        code = meta.get("dtype")
        if code not in DTYPES:
            raise CheckpointError(name, key, "a known safetensors dtype", repr(code))
        out[key] = (DTYPES[code], tuple(meta.get("shape", ())))
    return out


def expect(index: Mapping[str, TensorInfo], key: str, dtype: torch.dtype,
           shapes: tuple | list, *, near: str | None = None, what: str = "") -> TensorInfo:
    """The tensor ``key`` of ``index`` with ``dtype`` and one of ``shapes`` (a shape, or a
    list of accepted shapes); :class:`CheckpointError` otherwise. ``near``: a key whose file
    is named when ``key`` is missing."""
    accepted = shapes if isinstance(shapes, list) else [shapes]
    want = describe(dtype, accepted[0]) + (f" ({what})" if what else "")
    info = index.get(key)
    if info is None:
        where = index[near].file if near in index else "the checkpoint"
        raise CheckpointError(where, key, want, "no such tensor")
    if info.dtype != dtype or tuple(info.shape) not in [tuple(s) for s in accepted]:
        raise CheckpointError(info.file, key, want, describe(info.dtype, info.shape))
    return info


# ----------------------------------------------------------------------------- writing

def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                      max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``tensors`` (CPU, contiguous) as safetensors shards of at most
    ``max_shard_bytes`` each (a larger tensor gets a shard of its own), with the index when
    there are several. Returns the file names."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in tensors:  # the caller's order (model order)
        t = tensors[key]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(path, name),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    elif os.path.exists(os.path.join(path, INDEX_FILE)):
        os.remove(os.path.join(path, INDEX_FILE))
    return names

