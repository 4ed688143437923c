"""What every serving-engine adapter shares (``cute_fp4.vllm``; an SGLang one would be one
more folder beside it), with no engine imported: which checkpoints cute_fp4 takes, on which
devices, the ModelOpt config as an engine hands it over, which modules it leaves
unquantized, and the per-rank shape checks with errors naming the layer and the
tensor-parallel split.

* :func:`modelopt_nvfp4`: whether a quantization config (config.json's
  ``quantization_config``, or hf_quant_config.json's whole object) is ModelOpt NVFP4;
* :func:`claims` / :func:`check_device`: whether cute_fp4 takes such checkpoints here
  (SM90 and SM12x GPUs; a CPU only under the exact reference, ``CUTE_FP4_REFERENCE=1``;
  ``CUTE_FP4_CLAIM_MODELOPT=0`` leaves them to the engine unless asked for by name);
* :func:`read_format`, :func:`has_input_scales`, :func:`is_excluded`: the config;
* :func:`check_linear_shard`, :func:`check_experts_shard`: a rank's shapes against the
  kernels' limits (``cute_fp4.layers.linear.check_sizes``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from cute_fp4.errors import DeviceError, FormatError, InputError
from cute_fp4.hf.checkpoint import (
    LEGACY_QUANT_FILE,
    QUANT_ALGO,
    QUANT_METHOD,
    QuantFormat,
    excluded,
    parse_quant_config,
    read_tensor_index,
)
from cute_fp4.layers.linear import check_sizes
from cute_fp4.targets import reference_mode

__all__ = ["CLAIM_ENV", "MODE_ENV", "check_device", "check_experts_shard",
           "check_linear_shard", "claims", "has_input_scales", "is_excluded", "mode",
           "modelopt_nvfp4", "read_format"]

CLAIM_ENV = "CUTE_FP4_CLAIM_MODELOPT"  # "0": ModelOpt NVFP4 checkpoints stay the engine's
MODE_ENV = "CUTE_FP4_MODE"  # "auto" (default), "w4a16" or "w4a4": the layers' mode
SUPPORTED_MAJORS = (9, 12)  # sm_90a, sm_120a / sm_121a


def _section(cfg: Mapping) -> tuple[Mapping, str, str]:
    """(the dict holding quant_algo, its file, its field): hf_quant_config.json's
    ``quantization`` object or config.json's flat ``quantization_config``."""
    if isinstance(cfg.get("quantization"), Mapping):
        return cfg["quantization"], LEGACY_QUANT_FILE, "quantization"
    return cfg, "config.json", "quantization_config"


def modelopt_nvfp4(cfg) -> bool:
    """Whether ``cfg`` is a ModelOpt NVFP4 quantization config, in either form."""
    if not isinstance(cfg, Mapping):
        return False
    inner, _, _ = _section(cfg)
    method = str(cfg.get("quant_method", inner.get("quant_method", QUANT_METHOD)))
    return (method.lower().startswith(QUANT_METHOD)
            and str(inner.get("quant_algo", "")).upper() == QUANT_ALGO)


def read_format(cfg: Mapping) -> QuantFormat:
    """The ModelOpt NVFP4 config ``cfg`` (either form) read and checked
    (``cute_fp4.hf.checkpoint.parse_quant_config``: a CheckpointError names the field)."""
    inner, source, field = _section(cfg)
    return parse_quant_config(inner, source, field)


def _unsupported(capability, cpu: bool) -> str | None:
    """Why cute_fp4 cannot run here, None when it can. ``capability``: (major, minor) of the
    engine's GPU, None without one."""
    if cpu or capability is None:
        return None if reference_mode() else (
            "no CUDA GPU: on a CPU cute_fp4 runs only the exact reference, with "
            "CUTE_FP4_REFERENCE=1 (for tests)")
    major, minor = capability[0], capability[1]
    if major not in SUPPORTED_MAJORS:
        return (f"the GPU is sm_{major}{minor}; cute_fp4's kernels are for sm_90a (H100, "
                "H200) and sm_120a/sm_121a (RTX 5090, RTX PRO 6000, GB10)")
    return None


def claims(cfg, capability, cpu: bool = False) -> bool:
    """Whether cute_fp4 takes the checkpoint of quantization config ``cfg`` when the user
    named no method: a ModelOpt NVFP4 config, a device it runs on, and
    ``CUTE_FP4_CLAIM_MODELOPT`` not "0"."""
    if os.environ.get(CLAIM_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return modelopt_nvfp4(cfg) and _unsupported(capability, cpu) is None


def check_device(capability, cpu: bool = False) -> None:
    """DeviceError when cute_fp4 cannot run on the engine's device (asked for by name)."""
    why = _unsupported(capability, cpu)
    if why:
        raise DeviceError(f"quantization 'cute_fp4': {why}")


def mode() -> str:
    """The layers' mode from ``CUTE_FP4_MODE`` ("auto": W4A4 on SM12x when the checkpoint
    has input scales, else W4A16)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "w4a16", "w4a4"):
        raise InputError(f"{MODE_ENV} must be auto, w4a16 or w4a4, got {value!r}")
    return value


def has_input_scales(fmt: QuantFormat, path: str | None) -> bool:
    """Whether the checkpoint's quantized layers have activation scales (``input_scale``):
    from its safetensors headers when ``path`` is a local checkpoint directory, else from
    the config's ``config_groups``, else True (ModelOpt's NVFP4 exports have them)."""
    if path and os.path.isdir(path):
        try:
            return any(k.endswith(".input_scale") for k in read_tensor_index(path))
        except FormatError:  # no readable shards there (weights elsewhere): the config
            pass
    return True if fmt.input_scales is None else fmt.input_scales


def is_excluded(prefix: str, patterns: Sequence[str],
                fused: Mapping[str, Sequence[str]] | None = None) -> bool:
    """Whether module ``prefix`` is left unquantized by ``patterns`` (names, parents or
    fnmatch patterns: ``cute_fp4.hf.checkpoint.excluded``). An engine's fused module
    (``fused``: e.g. ``qkv_proj -> [q_proj, k_proj, v_proj]``) is excluded when all its
    checkpoint modules are; some of them only is an InputError (one layer cannot be both)."""
    if excluded(prefix, patterns):
        return True
    parent, _, leaf = prefix.rpartition(".")
    parts = (fused or {}).get(leaf)
    if not parts:
        return False
    names = [f"{parent}.{p}" if parent else p for p in parts]
    hits = [bool(excluded(n, patterns)) for n in names]
    if any(hits) and not all(hits):
        named = [n for n, h in zip(names, hits) if h]
        raise InputError(f"{prefix}: exclude_modules names {named} but not "
                         f"{[n for n in names if n not in named]}; the engine runs them as "
                         "one fused layer, quantized or not")
    return all(hits)


def _split(prefix: str, tp: int, what: str) -> str:
    return f"{prefix} (tensor-parallel size {tp}: {what})"


def check_linear_shard(prefix: str, tp: int, in_total: int, in_rank: int,
                       out_sizes: Sequence[int], out_total: int) -> None:
    """A linear layer's shard on one rank (``in_rank`` of ``in_total`` input features,
    ``out_sizes`` rows per logical output shard of ``out_total``) against the kernels'
    limits: a FormatError naming the layer, the tensor-parallel size and the numbers."""
    what = (f"[{out_total}, {in_total}] -> [{sum(out_sizes)}, {in_rank}] per rank"
            + (f", output shards {list(out_sizes)}" if len(out_sizes) > 1 else ""))
    check_sizes(sum(out_sizes), in_rank, _split(prefix, tp, what))
    for n in out_sizes:  # each output shard may run as a GEMM of its own
        check_sizes(n, in_rank, _split(prefix, tp, what))


def check_experts_shard(prefix: str, tp: int, hidden: int, inter_total: int,
                        inter_rank: int) -> None:
    """The experts' shard on one rank (intermediate ``inter_rank`` of ``inter_total``):
    both GEMMs against the kernels' limits, errors naming the layer and the split."""
    what = f"intermediate {inter_total} -> {inter_rank} per rank, hidden {hidden}"
    check_sizes(2 * inter_rank, hidden, _split(f"{prefix} w13", tp, what))
    check_sizes(hidden, inter_rank, _split(f"{prefix} w2", tp, what))
