"""vLLM's routed experts (``RoutedExperts``) on ``cute_fp4.layers.Experts``.

``create_weights`` registers the ModelOpt NVFP4 expert tensors of this rank as vLLM's
experts weight loader fills them: ``w13_weight`` uint8 ``[E, 2I_p, H/2]`` (gate rows, then
up), ``w2_weight`` ``[E, H, I_p/2]``, their block scales (NaN until loaded),
``w13_weight_scale_2`` ``[E, 2]`` (gate, up), ``w2_weight_scale_2`` ``[E]`` and, when the
checkpoint has them, the input scales ``[E, 2]`` and ``[E]``. vLLM's loader reads a
ModelOpt NVFP4 layout (per-expert scalars in their slots) only for methods whose class
name contains "ModelOpt", hence this class's name. The shard's sizes are checked there
(errors name the layer, the tensor-parallel size and the numbers).

``process_weights_after_loading`` prepares the experts once (``Experts.from_modelopt``:
grouped kernels, SiLU-and-mul fused into the gate_up GEMM where the GPU's kernels take
it, gate and up global scales kept exact). ``apply`` takes vLLM's router output
(``topk_weights``, ``topk_ids``: the router already ran) and returns the experts' weighted
sum for this rank; vLLM's MoE runner does the tensor-parallel all-reduce and the shared
experts. No host sync: CUDA-graph capturable, traced by torch.compile.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from cute_fp4 import serving
from cute_fp4.errors import FormatError
from cute_fp4.hf.checkpoint import GROUP_SIZE
from cute_fp4.layers import Experts
from cute_fp4.vllm.weights import check_loaded, keep_as_parameters

__all__ = ["CuteFp4ModelOptMoEMethod"]

_SCALES = ("w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2", "w2_weight_scale_2")
_INPUTS = ("w13_input_scale", "w2_input_scale")


class CuteFp4ModelOptMoEMethod(FusedMoEMethodBase):
    """The routed experts of a ModelOpt NVFP4 checkpoint (module docstring)."""

    def __init__(self, quant_config, moe_config, prefix: str):
        super().__init__(moe_config)
        self.quant_config, self.prefix = quant_config, prefix
        self.name = prefix

    def uses_weight_scale_2_pattern(self) -> bool:
        return True  # the per-expert global scales are "weight_scale_2", as ModelOpt's

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        moe = self.moe
        tp = int(moe.tp_size)
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        serving.check_experts_shard(self.prefix, tp, h, moe.intermediate_size, i)
        if tp > 1:
            self.name = f"{self.prefix} (tensor-parallel rank {moe.tp_rank} of {tp})"
        nan = float("nan")
        shapes = {
            "w13_weight": ((e, 2 * i, h // 2), torch.uint8, 0),
            "w2_weight": ((e, h, i // 2), torch.uint8, 0),
            "w13_weight_scale": ((e, 2 * i, h // GROUP_SIZE), torch.float8_e4m3fn, nan),
            "w2_weight_scale": ((e, h, i // GROUP_SIZE), torch.float8_e4m3fn, nan),
            "w13_weight_scale_2": ((e, 2), torch.float32, nan),
            "w2_weight_scale_2": ((e,), torch.float32, nan),
        }
        if self.quant_config.layer_input_scales():
            shapes["w13_input_scale"] = ((e, 2), torch.float32, nan)
            shapes["w2_input_scale"] = ((e,), torch.float32, nan)
        loader = {"weight_loader": extra_weight_attrs["weight_loader"]}
        for name, (shape, dtype, fill) in shapes.items():
            param = torch.nn.Parameter(torch.full(shape, fill, dtype=dtype),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, loader)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_layer(layer)
        inputs = [n for n in _INPUTS if hasattr(layer, n)]
        check_loaded(layer, [*_SCALES, *inputs], self.prefix)
        scales = tuple(getattr(layer, n).data if n in inputs else None for n in _INPUTS)
        ex = Experts.from_modelopt(
            (layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data),
            (layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data),
            input_scales=scales, mode=self.quant_config.mode, name=self.name)
        layer.cute_fp4 = ex
        keep_as_parameters(layer, {  # the prepared tensors stay the layer's, the only copy
            "w13_weight": ex.w13.data, "w13_weight_scale": ex.w13.scale,
            "w2_weight": ex.w2.data, "w2_weight_scale": ex.w2.scale,
            "w13_input_scale": ex.input_scales[0], "w2_input_scale": ex.input_scales[1]})

    def _check_layer(self, layer) -> None:
        """What the experts compute, against what this vLLM layer asks for."""
        moe, why = self.moe, None
        act = getattr(getattr(moe, "activation", None), "value", moe.activation)
        if not moe.is_act_and_mul or str(act) != "silu":
            why = f"activation {act!r} (the NVFP4 experts compute silu(gate) * up)"
        elif getattr(moe, "has_bias", False):
            why = "biased experts"
        elif getattr(layer, "apply_router_weight_on_input", False):
            why = "router weights applied to the input"
        elif getattr(moe, "use_ep", False):
            why = "expert parallelism (use tensor parallelism)"
        if why:
            raise FormatError(f"{self.prefix}: cute_fp4's experts do not support {why}")

    def get_fused_moe_quant_config(self, layer):
        return None  # no modular kernel: apply() runs the experts

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts=None, shared_experts_input=None
              ) -> torch.Tensor:
        return layer.cute_fp4(x, topk_ids, topk_weights)
