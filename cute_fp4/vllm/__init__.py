"""The vLLM plugin: ModelOpt NVFP4 checkpoints served with cute_fp4's kernels
(``pip install -e ".[vllm]"`` beside vLLM 0.32-0.34; ``docs/serving.md``).

vLLM loads it in every process through the entry point group ``vllm.general_plugins``
(``cute_fp4 = cute_fp4.vllm:register``). :func:`register` adds the quantization method
``"cute_fp4"`` (:class:`cute_fp4.vllm.config.CuteFp4Config`): chosen by
``--quantization cute_fp4``, and taking ModelOpt NVFP4 checkpoints by itself on SM90 and
SM12x GPUs (``CUTE_FP4_CLAIM_MODELOPT=0`` turns that off; on a CPU only under the exact
reference, ``CUTE_FP4_REFERENCE=1``). Its linear method (``cute_fp4.vllm.linear``) and fused
MoE method (``cute_fp4.vllm.moe``) prepare the layers through ``cute_fp4.layers`` once the
weights are loaded and apply them per call.

Importing this package imports nothing of vLLM: :func:`register` does.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the quantization method ``"cute_fp4"`` with vLLM (idempotent)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from cute_fp4.vllm.config import NAME, CuteFp4Config

    register_quantization_config(NAME)(CuteFp4Config)
