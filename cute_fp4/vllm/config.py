"""vLLM's side of the ModelOpt NVFP4 config: the quantization method ``"cute_fp4"``.

:class:`CuteFp4Config` reads the checkpoint's ModelOpt NVFP4 config (config.json's
``quantization_config`` or hf_quant_config.json: ``cute_fp4.serving.read_format``), takes
ModelOpt NVFP4 checkpoints in :meth:`~CuteFp4Config.override_quantization_method`
(``serving.claims``), and gives each layer its method: the linear method for linear layers,
the fused-MoE method for routed experts, vLLM's unquantized ones for the modules the config
excludes, nothing for attention (the KV cache stays 16-bit: an FP8 one is not taken from
the checkpoint).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from cute_fp4 import serving
from cute_fp4.errors import FormatError
from cute_fp4.hf.checkpoint import LEGACY_QUANT_FILE

__all__ = ["NAME", "CuteFp4Config"]

NAME = "cute_fp4"  # the quantization method's name in vLLM

log = logging.getLogger("cute_fp4.vllm")


def _platform() -> tuple[Any, bool]:
    """(the GPU's (major, minor) or None, whether vLLM runs on the CPU)."""
    from vllm.platforms import current_platform

    return current_platform.get_device_capability(), current_platform.is_cpu()


class CuteFp4Config(QuantizationConfig):
    """A ModelOpt NVFP4 checkpoint on cute_fp4's layers (module docstring)."""

    def __init__(self, fmt, input_scales: bool | None = None):
        super().__init__()
        self.format = fmt
        self.exclude_modules = list(fmt.exclude_modules)
        # None until maybe_update_config reads the checkpoint (the config's word until then)
        self.input_scales = fmt.input_scales if input_scales is None else input_scales
        self.mode = serving.mode()
        if fmt.kv_cache_quant_algo:
            log.warning("cute_fp4: the checkpoint's KV cache algorithm %s is not applied; "
                        "the KV cache is in the model's dtype", fmt.kv_cache_quant_algo)

    # ------------------------------------------------------------------ vLLM's interface

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [LEGACY_QUANT_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CuteFp4Config:
        serving.check_device(*_platform())
        return cls(serving.read_format(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None
                                     ) -> str | None:
        """``--quantization cute_fp4`` on a ModelOpt NVFP4 checkpoint: this method; no
        ``--quantization``: this method where ``serving.claims`` says so (else vLLM's
        own ModelOpt method takes it); another method named: that one."""
        if not serving.modelopt_nvfp4(hf_quant_cfg):
            return None
        if user_quant == NAME:
            return NAME
        if user_quant is None and serving.claims(hf_quant_cfg, *_platform()):
            return NAME
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Whether the checkpoint has input scales, from its safetensors headers when it is
        a local directory (vLLM then expects exactly the tensors the layers register)."""
        self.input_scales = serving.has_input_scales(self.format, model_name)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """The excluded names in vLLM's module names (a model's checkpoint renaming). A
        ModelOpt pattern ``path*`` becomes ``path`` and ``path.*`` first, as vLLM's own
        ModelOpt config does, so that the renaming maps it."""
        names = []
        for p in self.exclude_modules:
            names += [p[:-1], p[:-1] + ".*"] if p.endswith("*") and p[-2:-1] != "." else [p]
        self.exclude_modules = hf_to_vllm_mapper.apply_list(names)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from cute_fp4.vllm.linear import CuteFp4LinearMethod
        from cute_fp4.vllm.moe import CuteFp4ModelOptMoEMethod

        if isinstance(layer, (LinearBase, ParallelLMHead)):
            if self.excluded(prefix):
                return UnquantizedLinearMethod()
            if isinstance(layer, ParallelLMHead):
                raise FormatError(f"{prefix}: an NVFP4 lm_head is not supported by cute_fp4's "
                                  "vLLM plugin (the checkpoint's exclude_modules does not name "
                                  "it); ModelOpt and cute_fp4.hf.quantize_model keep it in BF16")
            return CuteFp4LinearMethod(self, prefix)
        if isinstance(layer, RoutedExperts):
            if self.excluded(prefix):
                return None  # vLLM's unquantized experts
            return CuteFp4ModelOptMoEMethod(self, layer.moe_config, prefix)
        return None

    # ------------------------------------------------------------------ helpers

    def excluded(self, prefix: str) -> bool:
        return serving.is_excluded(prefix, self.exclude_modules, self.packed_modules_mapping)

    def layer_input_scales(self) -> bool:
        """Whether quantized layers register (and load) input scales."""
        return bool(self.input_scales) if self.input_scales is not None else True
