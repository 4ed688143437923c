"""cute_fp4.hf on the GPU: tiny random transformers models (Llama, Qwen3-MoE, Qwen2-MoE with
a shared expert) quantized, saved, loaded back onto the GPU, and run by transformers:
prefill logits against the fake-quantized BF16 model, and greedy and sampled ``generate``
at batch 1 and 16 whose per-step logits (the decode path: KV cache, M = batch GEMMs)
match the fake-quantized model's logits on the generated sequence. On an SM90 GPU every
test runs twice: natively (W4A16) and as on SM12x (``cute_fp4.emulation.emulate``: W4A4
through the SM120 kernels, their MMA emulated)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4 import nn as cnn  # noqa: E402
from cute_fp4.emulation import emulate  # noqa: E402
from cute_fp4.hf import experts as ex  # noqa: E402
from cute_fp4.mlp import NVFP4GatedMLP  # noqa: E402
from cute_fp4.targets import capability_major  # noqa: E402

WATCHDOG_S = 240
# GPU-sized tiny models: K multiples of 64 (SM90's packed layout), 8 experts
SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=512)
MOE_SIZES = {"qwen3_moe": dict(moe_intermediate_size=128, num_experts=8),
             "qwen2_moe": dict(moe_intermediate_size=128, num_experts=8,
                               shared_expert_intermediate_size=256)}
KINDS = ("llama", "qwen3_moe", "qwen2_moe")
# end-to-end logits against the fake-quantized model: W4A16 3e-2; W4A4 (SM12x) only
# loosely, its 4-bit activations amplify last-bit differences layer by layer, so there
# the modules are held to the tight bound one by one (test_modules_match)
TOL = {"w4a16": 3e-2, "w4a4": 0.5}


@pytest.fixture(scope="module", params=[(k, e) for e in (False, True) for k in KINDS],
                ids=[f"{k}{'-emulated_sm120' if e else ''}" for e in (False, True)
                     for k in KINDS])
def pair(request, tmp_path_factory):
    """(kind, fake-quantized BF16 model, NVFP4 model loaded from its saved checkpoint).
    ``-emulated_sm120`` (an SM90 GPU only): loaded and run inside ``emulation.emulate()``,
    the SM12x route (W4A4, plain layout, gate/up groups of 32, SM120 block-scaled GEMMs
    with the MMA emulated) on the same checkpoint; every test below then checks it as it
    would on an SM12x GPU."""
    kind, emulated = request.param
    if emulated and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM120 emulation runs on an SM90 GPU (SM12x runs the route natively)")
    sizes = {**SIZES, **MOE_SIZES.get(kind, {})}
    model = hf_tiny.build(kind, device="cuda", **sizes)
    bf16 = hf_tiny.build(kind, device="cuda", **sizes)
    prompts = torch.randint(0, 512, (4, 16), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
    hf.quantize_model(model, calibration=[prompts])
    path = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(model, path)
    del model
    with contextlib.ExitStack() as stack:
        if emulated:
            stack.enter_context(emulate())
        loaded = hf.from_pretrained(path, device="cuda")
        yield kind, hf_tiny.fake_quant(bf16, loaded), loaded


def _tol(model) -> float:
    return TOL[model.model.layers[0].self_attn.q_proj.mode]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Per position (``hf_tiny.token_errors``: a MoE token may route differently): the
    median within ``tol``, nine in ten within twice that."""
    median, p90 = hf_tiny.token_errors(got, want)
    assert median < tol and p90 < 2 * tol, (median, p90)


def _prompts(batch: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(0, 512, (batch, 16), device="cuda", generator=g)


@pytest.mark.gpu("sm90", "sm120")
def test_layers_are_cute_fp4s(pair):
    kind, _, model = pair
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, cnn.NVFP4Linear)
    sm90 = capability_major(torch.device("cuda")) == 9  # emulate(): the SM120 target's
    assert q.layout == ("packed" if sm90 else "plain")
    assert q.mode == ("w4a16" if sm90 else "w4a4")  # auto: W4A4 where FP4 MMA exists
    fused, unfused = model.cute_fp4_mlps  # dense gated MLPs: one gate/up global scale
    assert unfused == ()
    if kind == "llama":
        assert fused == ("model.layers.0.mlp", "model.layers.1.mlp")
        assert isinstance(model.model.layers[0].mlp, NVFP4GatedMLP)
        assert model.model.layers[0].mlp.group == (8 if sm90 else 32)  # the kernels' group
    if kind == "qwen2_moe":
        assert isinstance(model.model.layers[0].mlp.shared_expert, NVFP4GatedMLP)
    if kind != "llama":
        moe = model.model.layers[1].mlp.experts.nvfp4
        assert ex.holds_nvfp4(model.model.layers[1].mlp.experts)
        assert moe.layout == q.layout and moe.mode == q.mode


@pytest.mark.gpu("sm90", "sm120")
def test_modules_match(pair):
    """Every NVFP4 module on the inputs it saw against the fake-quantized module."""
    _, bf16, model = pair
    errors = hf_tiny.module_errors(model, bf16, _prompts(16))
    assert errors
    for name, err in errors.items():
        m = model.get_submodule(name)
        inner = m.nvfp4.mode if name.endswith("experts") else getattr(m, "mode", None) \
            if isinstance(m, NVFP4GatedMLP) else None
        # W4A4 experts and fused MLPs round their activation to 4 bits inside the module
        assert err < (0.1 if inner == "w4a4" else 1e-2), (name, err)


@pytest.mark.gpu("sm90", "sm120")
def test_prefill_logits_match_the_fake_quantized_model(pair):
    _, bf16, model = pair
    x = _prompts(16)
    with torch.no_grad():
        got, want = model(x).logits, bf16(x).logits
    assert torch.isfinite(got).all()
    _close(got, want, _tol(model))


@pytest.mark.gpu("sm90", "sm120")
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_decode_logits(pair, batch, sample):
    """generate's per-step logits (its decode path) against the fake-quantized model's
    logits on the same tokens (teacher forced): within the tolerance; greedy picks their
    argmax; the sequences are the prompt plus new tokens from the vocabulary."""
    _, bf16, model = pair
    seq, steps = hf_tiny.generate_steps(model, _prompts(batch, seed=3 + batch), sample, 512)
    with torch.no_grad():
        want = bf16(seq).logits[:, 15:23].float()
    _close(steps, want, _tol(model))
