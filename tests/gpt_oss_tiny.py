"""Tiny random gpt-oss models and their MXFP4 checkpoints, written here the way transformers'
``mxfp4`` quantization stores them (for the CPU tests and tests/gpu/test_gpt_oss.py):
each ``GptOssExperts`` module's ``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj``
``[E, I, H]`` (transformers keeps them ``[E, in, out]``) as ``*_blocks`` uint8
``[E, out, in/32, 16]`` and ``*_scales`` uint8 ``[E, out, in/32]`` of their transposes
(``cute_fp4.quantize(..., format="mxfp4")``, ``MXFP4Tensor.to_blocks``), the rest BF16;
config.json's ``quantization_config`` ``{"quant_method": "mxfp4",
"modules_to_not_convert": [...]}`` as gpt-oss-20b's.
"""

from __future__ import annotations

import json
import os

import torch
import transformers as tf

from cute_fp4.hf.checkpoint import write_safetensors
from cute_fp4.nvfp4 import quantize

# gpt-oss-20b's config.json lists these
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]
PROJECTIONS = ("gate_up_proj", "down_proj")


def config(layers: int = 2, hidden: int = 64, intermediate: int = 64, experts: int = 4,
           top_k: int = 2, **extra) -> tf.GptOssConfig:
    """A gpt-oss config of the given sizes (by default heads of 32 and a 256-token
    vocabulary; ``extra`` overrides any field; sliding and full attention alternating as
    gpt-oss's)."""
    params = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                  num_local_experts=experts, num_experts_per_tok=top_k, head_dim=32,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256, sliding_window=16)
    return tf.GptOssConfig(**{**params, **extra})


def build(cfg: tf.GptOssConfig, seed: int = 0, device="cpu") -> tf.GptOssForCausalLM:
    """A random BF16 gpt-oss model: weights N(0, 0.1), so the tiny model's logits are not
    flat (its biases too, the router's and the experts')."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.GptOssForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def experts_modules(model):
    """(name, module) of the model's ``GptOssExperts``."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "GptOssExperts"]


def mxfp4_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict as an MXFP4 checkpoint holds it (module docstring), on the
    CPU: each projection quantized on its own device, one at a time (a float32 copy of one
    projection at most)."""
    quantized = {}
    for name, module in experts_modules(model):
        for proj in PROJECTIONS:
            w = getattr(module, proj).detach().float().transpose(1, 2).contiguous()
            blocks, scales = quantize(w, format="mxfp4").to_blocks()
            del w
            quantized[f"{name}.{proj}"] = (blocks.cpu(), scales.cpu())
    tensors = {}
    for key, t in model.state_dict().items():
        if key in quantized:
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = quantized[key]
        else:
            tensors[key] = t.detach().cpu().contiguous()
    return tensors


def write(model, path, tensors: dict | None = None, not_converted=None,
          max_shard_bytes: int = 5 * 2**30) -> dict[str, torch.Tensor]:
    """Write ``model`` (or ``tensors``) as an MXFP4 checkpoint in ``path``; returns the
    tensors written."""
    os.makedirs(path, exist_ok=True)
    tensors = mxfp4_tensors(model) if tensors is None else tensors
    write_safetensors(tensors, path, max_shard_bytes)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert":
                                  list(NOT_CONVERTED if not_converted is None
                                       else not_converted)}
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg.pop("experts_implementation", None)
    cfg.pop("_experts_implementation", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return tensors


def dequantized(model, tensors: dict[str, torch.Tensor], dtype=torch.bfloat16):
    """A copy of ``model`` with its experts' weights replaced by the checkpoint's decoded
    values (transformers' ``GptOssExperts`` on them: the model transformers dequantizes it
    to without its hub kernels), in ``dtype``; decoded expert by expert on the model's
    device."""
    import copy

    from cute_fp4.mxfp4 import MXFP4Tensor

    twin = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        for name, module in experts_modules(twin):
            for proj in PROJECTIONS:
                param = getattr(module, proj)
                blocks = tensors[f"{name}.{proj}_blocks"]
                scales = tensors[f"{name}.{proj}_scales"]
                for e in range(param.shape[0]):
                    w = MXFP4Tensor.from_blocks(blocks[e].to(param.device),
                                                scales[e].to(param.device))
                    param[e].copy_(w.dequantize(torch.float32).T)
    if dtype == torch.float32:  # torch's grouped_mm takes 16-bit operands
        twin.set_experts_implementation("eager")
    return twin
