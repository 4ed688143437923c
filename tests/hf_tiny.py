"""Tiny random transformers models for the cute_fp4.hf tests (CPU and GPU), their
fake-quantized BF16 twins and the kernels replaced by the exact reference on the CPU."""

from __future__ import annotations

import copy
import types

import torch
import transformers as tf
from exact import exact_run, fake_launch_path

from cute_fp4 import mlp as cmlp
from cute_fp4 import moe, reference
from cute_fp4 import nn as cnn
from cute_fp4 import run as crun
from cute_fp4.fused import silu_mul_unfused
from cute_fp4.hf import experts as ex
from cute_fp4.hf.quantize import fake_quantize
from cute_fp4.layers import experts as cex
from cute_fp4.layers import linear as clin
from cute_fp4.nvfp4 import quantize
from cute_fp4.operands import check_grouped_operands
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
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,  # MLA, shared experts
                    dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64,
                         qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
                         topk_group=1, num_key_value_heads=4)),
}
MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")


def build(kind: str, seed: int = 0, device="cpu", **sizes) -> torch.nn.Module:
    """A random BF16 model of ``kind``; the weights N(0, 0.1) so that the tiny model's
    logits are not flat."""
    config_cls, model_cls, base = KINDS[kind]
    config = config_cls(**{**ATTN, **base, **sizes})
    torch.manual_seed(seed)
    with torch.device(device):  # BF16, except what the model keeps in FP32
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert type(model) is model_cls
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    for name, b in model.named_buffers():  # as from_pretrained leaves them
        if any(k in name for k in keep):
            mod, _, attr = name.rpartition(".")
            model.get_submodule(mod)._buffers[attr] = b.float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1 if "embed" not in name else 1.0)
    return model.eval()


def fake_quant(bf16: torch.nn.Module, nvfp4: torch.nn.Module) -> torch.nn.Module:
    """A copy of the BF16 model ``bf16`` whose quantized weights are the exact values of
    the NVFP4 model ``nvfp4``'s layers, rounded to BF16 (``cute_fp4.hf.fake_quantize``);
    where a layer runs W4A4, the copy's layer quantizes its input the same way first
    (static scale, or the call's amax; experts: the gate_up input and the activation)."""
    twin = fake_quantize(copy.deepcopy(bf16), nvfp4)
    for name, m in nvfp4.named_modules():
        if isinstance(m, cmlp.NVFP4GatedMLP) and m.mode == "w4a4":
            for proj in ("gate_proj", "up_proj"):
                twin.get_submodule(f"{name}.{proj}").register_forward_pre_hook(
                    lambda mod, args, s=m.gate_up_proj.input_scale: (_qdq(args[0], s),))
        elif isinstance(m, cmlp.GateUpLinear):
            continue
        elif isinstance(m, cnn.NVFP4Linear) and m.mode == "w4a4":
            twin.get_submodule(name).register_forward_pre_hook(
                lambda mod, args, s=m.input_scale: (_qdq(args[0], s),))
        elif ex.holds_nvfp4(m) and m.nvfp4.mode == "w4a4":
            scales = (m.nvfp4.w13_input_scale, m.nvfp4.w2_input_scale)
            twin.get_submodule(name).register_forward_hook(
                lambda mod, args, out, s=scales: _experts_w4a4(mod, *args, *s))
    return twin


def _qdq(x: torch.Tensor, scale) -> torch.Tensor:
    """``x`` through NVFP4 and back (what a W4A4 kernel multiplies), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    return quantize(flat, scale).dequantize(x.dtype).view(x.shape)


def _experts_w4a4(mod, x, ids, weights, s13, s2) -> torch.Tensor:
    r = moe.route(ids, mod.num_experts)
    gate_up = moe._bf16_grouped(_qdq(x, s13).index_select(0, r.token), mod.gate_up_proj,
                                r.offsets)
    act = _qdq(moe.silu_and_mul(gate_up), s2)
    return moe.combine(moe._bf16_grouped(act, mod.down_proj, r.offsets), r, weights)


def module_errors(model: torch.nn.Module, twin: torch.nn.Module, *args, **kwargs
                  ) -> dict[str, float]:
    """Run ``model(*args, **kwargs)``; then each NVFP4 module of ``model`` (linear or
    experts) against the same module of ``twin`` on the very inputs it saw: name ->
    relative error of the outputs. Module by module, so W4A4's activation rounding sees
    the same values on both sides (end to end, a last-bit difference upstream moves an
    activation to the next E2M1 code, and those steps add up layer by layer)."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, cmlp.GateUpLinear):
            continue  # runs inside its NVFP4GatedMLP's fused GEMM
        if isinstance(m, (cnn.NVFP4Linear, cmlp.NVFP4GatedMLP)) or ex.holds_nvfp4(m):
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, name=name: seen.__setitem__(name, (a, out))))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
            return {n: rel_err(o, twin.get_submodule(n)(*a)) for n, (a, o) in seen.items()}
    finally:
        for h in hooks:
            h.remove()


def token_errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(median, 90th percentile) over positions of the relative error of logits ``a``
    against ``b`` (last dimension the vocabulary). In a MoE model a token whose router
    sees two experts nearly tied may pick the other one on one side: that token's logits
    move by a lot while the rest stay close, so the tests bound these rather than the
    error of the whole tensor."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    e = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return float(e.median()), float(e.quantile(0.9))


def generate_steps(model, x: torch.Tensor, sample: bool, vocab: int, new: int = 8
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.generate`` of ``new`` tokens after the prompts ``x`` (greedy, or sampled with
    top-k 20) with its per-step logits: (sequences, logits ``[batch, new, vocab]`` float32),
    after checking the sequences are the prompts plus ``new`` tokens of the vocabulary and
    that greedy picked the argmax of its logits."""
    torch.manual_seed(0)
    kw = dict(do_sample=True, top_k=20, temperature=1.0) if sample else dict(do_sample=False)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                         min_new_tokens=new, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, **kw)
    seq, p = out.sequences, x.shape[1]
    assert seq.shape == (x.shape[0], p + new) and torch.equal(seq[:, :p], x)
    assert ((seq >= 0) & (seq < vocab)).all()
    steps = torch.stack(out.logits, dim=1).float()
    if not sample:
        assert torch.equal(steps.argmax(-1), seq[:, p:])
    return seq, steps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def exact_kernels(monkeypatch) -> list:
    """NVFP4Linear's and NVFP4MoE's GEMMs replaced by the exact reference (float64, one
    rounding) and the fused activation quantizer by cute_fp4.quantize, on the CPU.
    Returns the list the calls are recorded in."""
    calls = []

    def kernel_for(schedule, m, n, k, a_format, out_dtype, device_index, packed=False,
                   b_format="nvfp4"):
        return types.SimpleNamespace(out_dtype=out_dtype)

    def run(kern, a, w, alpha, dims, out=None, early=False):
        calls.append(("gemm", dims))
        return exact_run(kern, a, w, alpha, dims, out)

    def grouped(a, b, offsets, schedule, out_dtype, alpha):
        calls.append(("grouped", tuple(b.shape)))
        check_grouped_operands(a, b, offsets, None, alpha, out_dtype, require_cuda=False)
        return reference.grouped_gemm(a, b, offsets, alpha, out_dtype)

    def values(x, global_scale):
        return quantize(x, global_scale).block_values(torch.bfloat16)

    fake_launch_path(monkeypatch, kernel_for, run)
    monkeypatch.setattr(crun, "quantize_activation", lambda x, gs=None: quantize(x, gs))
    monkeypatch.setattr(crun, "quantize_values", values)
    def fused(call):  # api.run_call of a gated layer's call
        calls.append(("gemm", "silu_mul"))
        a = quantize(call.a, call.input_scale) if call.quantize_a else call.a
        w = call.b.unpack() if isinstance(call.b, PackedNVFP4Weight) else call.b
        return silu_mul_unfused(reference.gemm(a, w, call.alpha, out_dtype=call.out_dtype),
                                call.group)

    monkeypatch.setattr(clin, "run_call", fused)
    monkeypatch.setattr(cex, "_grouped_gemm", grouped)
    monkeypatch.setattr(cex, "_quantize", lambda x, gs: quantize(x, gs))
    return calls
