"""Tiny random transformers models for the cute_fp4.hf tests (CPU and GPU), their
fake-quantized BF16 twins and the kernels replaced by the exact reference on the CPU."""

from __future__ import annotations

import copy
import types

import torch
import transformers as tf

from cute_fp4 import moe, reference
from cute_fp4 import nn as cnn
from cute_fp4.grouped import check_grouped_operands
from cute_fp4.hf.quantize import fake_quantize
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import PackedNVFP4Weight

ATTN = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            num_hidden_layers=2, max_position_embeddings=128)
# kind -> (config class, model class, sizes): hidden 128, heads of 32, experts of 64
KINDS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
              dict(hidden_size=128, intermediate_size=256, head_dim=32)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
              dict(hidden_size=128, intermediate_size=256, head_dim=32)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                       head_dim=32, num_experts=4, num_experts_per_tok=2)),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                dict(hidden_size=128, intermediate_size=64, head_dim=32,
                     num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128, num_experts=4,
                       num_experts_per_tok=2)),
}
MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")


def build(kind: str, seed: int = 0, device="cpu", **sizes) -> torch.nn.Module:
    """A random BF16 model of ``kind``; the weights N(0, 0.1) so that the tiny model's
    logits are not flat."""
    config_cls, model_cls, base = KINDS[kind]
    config = config_cls(**{**ATTN, **base, **sizes})
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1 if "embed" not in name else 1.0)
    return model.to(torch.bfloat16).eval()


def fake_quant(bf16: torch.nn.Module, nvfp4: torch.nn.Module) -> torch.nn.Module:
    """A copy of the BF16 model ``bf16`` whose quantized weights are the exact values of
    the NVFP4 model ``nvfp4``'s layers, rounded to BF16 (``cute_fp4.hf.quantize``)."""
    return fake_quantize(copy.deepcopy(bf16), nvfp4)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def exact_kernels(monkeypatch) -> list:
    """NVFP4Linear's and NVFP4MoE's GEMMs replaced by the exact reference (float64, one
    rounding) and the fused activation quantizer by cute_fp4.quantize, on the CPU.
    Returns the list the calls are recorded in."""
    calls = []

    def kernel_for(schedule, m, n, k, a_format, out_dtype, device_index, packed=False):
        return types.SimpleNamespace(out_dtype=out_dtype)

    def run(kern, a, w, alpha, dims, out=None):
        calls.append(("gemm", dims))
        w = w.unpack() if isinstance(w, PackedNVFP4Weight) else w
        m, n, k, _ = dims
        a = a if isinstance(a, NVFP4Tensor) else a.reshape(m, k)
        y = reference.gemm(a, w, alpha, out_dtype=kern.out_dtype)
        if out is None:
            return y
        out.view(m, n).copy_(y)
        return out

    def grouped(a, b, offsets, schedule, out_dtype, alpha):
        calls.append(("grouped", tuple(b.shape)))
        check_grouped_operands(a, b, offsets, None, alpha, out_dtype, require_cuda=False)
        return reference.grouped_gemm(a, b, offsets, alpha, out_dtype)

    def values(x, global_scale):
        return quantize(x, global_scale).block_values(torch.bfloat16)

    monkeypatch.setattr(cnn, "_kernel_for", kernel_for)
    monkeypatch.setattr(cnn, "_run", run)
    monkeypatch.setattr(cnn, "quantize_activation", lambda x, gs=None: quantize(x, gs))
    monkeypatch.setattr(cnn.quant, "quantize_values", values)
    monkeypatch.setattr(moe, "_grouped_gemm", grouped)
    monkeypatch.setattr(moe, "_quantize", lambda x, gs: quantize(x, gs))
    return calls
