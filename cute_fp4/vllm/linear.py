"""vLLM's linear layers (column, row, QKV, merged column parallel, replicated) on
``cute_fp4.layers.Linear``.

``create_weights`` registers the ModelOpt NVFP4 tensors of this rank's shard as vLLM loads
them (vLLM's own parameter classes, so its weight loaders shard them): ``weight`` uint8
``[N_p, K_p/2]``, ``weight_scale`` float8_e4m3fn ``[N_p, K_p/16]`` (NaN until loaded, so an
unloaded scale shows), ``weight_scale_2`` float32 ``[S]`` and, when the checkpoint has them,
``input_scale`` ``[S]``: one value per logical shard (q/k/v, gate/up), in its slot. The
shard's sizes are checked there against the kernels' limits (an error names the layer, the
tensor-parallel size and the numbers). ``process_weights_after_loading`` prepares the
layer once (``Linear.from_modelopt``: per-shard global scales kept exact) and leaves the
prepared tensors as the layer's parameters, the only copy. ``apply`` is one call of the
prepared layer (no host sync: CUDA-graph capturable, traced by torch.compile), then the
bias vLLM passes (row-parallel layers pass it on one rank only).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter

from cute_fp4 import serving
from cute_fp4.hf.checkpoint import GROUP_SIZE
from cute_fp4.layers import Linear
from cute_fp4.vllm.weights import check_loaded, keep_as_parameters

__all__ = ["CuteFp4LinearMethod"]


@register_weight_loader_v2_supported_method
class CuteFp4LinearMethod(LinearMethodBase):
    """A quantized linear layer of a ModelOpt NVFP4 checkpoint (module docstring)."""

    def __init__(self, quant_config, prefix: str):
        super().__init__()
        self.quant_config, self.prefix = quant_config, prefix
        self.name = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        tp = int(getattr(layer, "tp_size", 1))
        k, sizes = input_size_per_partition, [int(s) for s in output_partition_sizes]
        serving.check_linear_shard(self.prefix, tp, input_size, k, sizes, output_size)
        n, s = sum(sizes), len(sizes)
        if tp > 1:
            self.name = f"{self.prefix} (tensor-parallel rank {layer.tp_rank} of {tp})"
        loader = extra_weight_attrs.get("weight_loader")
        layer.cute_fp4_output_sizes = sizes
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            weight_loader=loader))
        layer.register_parameter("weight_scale", ModelWeightParameter(
            data=torch.full((n, k // GROUP_SIZE), float("nan"), dtype=torch.float8_e4m3fn),
            input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale_2", PerTensorScaleParameter(
            data=torch.full((s,), float("nan"), dtype=torch.float32), weight_loader=loader))
        if self.quant_config.layer_input_scales():
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=torch.full((s,), float("nan"), dtype=torch.float32),
                weight_loader=loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        names = ["weight_scale", "weight_scale_2"] + (
            ["input_scale"] if hasattr(layer, "input_scale") else [])
        check_loaded(layer, names, self.prefix)
        inp = layer.input_scale.data if hasattr(layer, "input_scale") else None
        lin = Linear.from_modelopt(layer.weight.data, layer.weight_scale.data,
                                   layer.weight_scale_2.data, inp,
                                   output_sizes=layer.cute_fp4_output_sizes,
                                   mode=self.quant_config.mode, name=self.name)
        layer.cute_fp4 = lin
        w = lin.stored  # the prepared tensors stay the layer's parameters, the only copy
        keep_as_parameters(layer, {"weight": w.data, "weight_scale": w.scale,
                                   "weight_scale_2": w.global_scale,
                                   "input_scale": lin.input_scale})

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        y = layer.cute_fp4(x)
        if bias is not None:
            y.add_(bias)
        return y

