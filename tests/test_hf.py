"""cute_fp4.hf on the CPU: tiny random transformers models (Llama, Qwen3, Qwen3-MoE, Mixtral,
Qwen2-MoE and DeepSeek-V3, both with shared experts) quantized, saved as ModelOpt NVFP4
checkpoints and loaded back: every tensor equal to the checkpoint's, the layers cute_fp4's,
the excluded modules BF16, the forward (kernels replaced by the exact reference) equal to
the fake-quantized BF16 model's."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import cute_fp4  # noqa: E402
from cute_fp4 import nn as cnn  # noqa: E402
from cute_fp4.errors import DeviceError, InputError  # noqa: E402
from cute_fp4.hf import experts as ex  # noqa: E402
from cute_fp4.mlp import NVFP4GatedMLP  # noqa: E402
from cute_fp4.moe import NVFP4MoE  # noqa: E402
from cute_fp4.nvfp4 import quantize  # noqa: E402

hf = cute_fp4.hf
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_files(a: str, b: str) -> list[str]:
    """Keys whose tensors differ (dtype, shape or any bit) between two checkpoints."""
    x, y = load_file(os.path.join(a, "model.safetensors")), load_file(
        os.path.join(b, "model.safetensors"))
    assert x.keys() == y.keys(), (sorted(x.keys() - y.keys()), sorted(y.keys() - x.keys()))
    return [k for k in x if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape
            or not torch.equal(_bytes(x[k]), _bytes(y[k]))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (BF16 model, quantized model, checkpoint dir): built once per module."""
    out = {}
    for kind in hf_tiny.KINDS:
        bf16 = hf_tiny.build(kind)
        model = hf_tiny.build(kind)
        hf.quantize_model(model, calibration=[TOKENS])
        path = str(tmp_path_factory.mktemp(kind))
        hf.save_pretrained(model, path)
        out[kind] = (bf16, model, path)
    return out


@pytest.mark.parametrize("kind", list(hf_tiny.KINDS))
def test_round_trip_is_bit_exact(saved, kind, tmp_path):
    _, _, path = saved[kind]
    loaded = hf.from_pretrained(path, device="cpu")
    hf.save_pretrained(loaded, tmp_path)
    assert _same_files(path, str(tmp_path)) == []
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    assert "lm_head" in qc["exclude_modules"]


@pytest.mark.parametrize("kind", list(hf_tiny.KINDS))
def test_loaded_layers_hold_the_checkpoint(saved, kind):
    """Every stored tensor is what the loaded model's layers give back; quantized linears
    are NVFP4Linear, experts run NVFP4MoE, excluded modules stay BF16 with the stored
    values."""
    bf16, _, path = saved[kind]
    stored = load_file(os.path.join(path, "model.safetensors"))
    model = hf.from_pretrained(path, device="cpu")
    names = dict(model.named_modules())
    linears = [n for n, m in names.items() if isinstance(m, cnn.NVFP4Linear)]
    experts = [n for n, m in names.items() if ex.holds_nvfp4(m)]
    assert linears and (experts or kind not in hf_tiny.MOE_KINDS)
    assert {names[n].mode for n in linears} == {"w4a16"}  # auto on the CPU
    for n in linears:
        layer = names[n]
        key = n.replace(".mlp.", ".block_sparse_moe.") if kind == "mixtral" else n
        for t, v in layer.state_dict().items():
            assert torch.equal(_bytes(v), _bytes(stored[f"{key}.{t}"])), (n, t)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert torch.equal(model.lm_head.weight, bf16.lm_head.weight)
    if kind == "qwen2_moe":  # out_features 1: cannot run on the kernels, kept in BF16
        assert type(model.model.layers[0].mlp.shared_expert_gate) is torch.nn.Linear
        assert isinstance(model.model.layers[0].mlp.shared_expert.up_proj, cnn.NVFP4Linear)
    for n in experts:
        assert model.config._experts_implementation == ex.IMPLEMENTATION
        assert names[n].nvfp4.num_experts == 4 and names[n].nvfp4.up_ratio is None


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("kind", list(hf_tiny.KINDS))
def test_forward_matches_the_fake_quantized_model(saved, kind, mode, monkeypatch):
    """The loaded model (GEMMs: the exact reference) against the BF16 model with the
    NVFP4 weight values (W4A4: and its activations quantized as the layers do): every
    NVFP4 module on the inputs it saw, within BF16 rounding; W4A16 logits too, and they
    are an order further from the unquantized model's (so the comparison can fail)."""
    bf16, _, path = saved[kind]
    model = hf.from_pretrained(path, device="cpu", mode=mode)
    calls = hf_tiny.exact_kernels(monkeypatch)
    twin = hf_tiny.fake_quant(bf16, model)
    errors = hf_tiny.module_errors(model, twin, TOKENS)
    assert len(errors) == sum(isinstance(m, cnn.NVFP4Linear) or ex.holds_nvfp4(m)
                              for m in model.modules())
    for name, err in errors.items():  # W4A4 experts: act = silu(gate) * up is rounded to
        # 4 bits inside the module, from a gate_up that differs in its last bits
        bound = 0.1 if mode == "w4a4" and name.endswith("experts") else 1e-2
        assert err < bound, (name, err)
    assert any(c[0] == "gemm" for c in calls)
    assert (kind in hf_tiny.MOE_KINDS) == any(c[0] == "grouped" for c in calls)
    with torch.no_grad():
        got, want, orig = model(TOKENS).logits, twin(TOKENS).logits, bf16(TOKENS).logits
    median, p90 = hf_tiny.token_errors(got, want)  # per position: a MoE token may route
    if mode == "w4a16":                              # to another expert on one side
        assert median < 3e-2 and p90 < 6e-2, (median, p90)
        assert hf_tiny.token_errors(got, orig)[0] > 3 * median
    else:  # 4-bit activations amplify last-bit differences (module_errors' docstring)
        assert hf_tiny.rel_err(got, want) < 0.5


def test_cpu_forward_raises_device_error(saved):
    model = hf.from_pretrained(saved["qwen3_moe"][2], device="cpu")
    with pytest.raises(DeviceError):
        model(TOKENS)


def test_transformers_save_pretrained_points_to_ours(saved, tmp_path):
    model = hf.from_pretrained(saved["llama"][2], device="cpu")
    with pytest.raises(InputError, match="cute_fp4.hf.save_pretrained"):
        model.save_pretrained(tmp_path)


# ----------------------------------------------------------------------------- experts

def _copy_with_scaled(path, to, key: str, factor: float) -> None:
    """The checkpoint at ``path`` written to ``to`` with tensor ``key`` times ``factor``."""
    stored = load_file(os.path.join(path, "model.safetensors"))
    stored[key] = stored[key] * factor
    save_file(stored, os.path.join(to, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(path, name)) as f, open(os.path.join(to, name), "w") as g:
            g.write(f.read())


def test_up_projection_with_its_own_global_scale(saved, tmp_path, monkeypatch):
    """A checkpoint whose up_proj global scale differs from gate_proj's (expert 1) loads
    with the ratio applied after the GEMM, saves back unchanged, and computes what the
    checkpoint says; without the ratio the logits are off."""
    bf16, _, path = saved["qwen3_moe"]
    _copy_with_scaled(path, tmp_path, "model.layers.0.mlp.experts.1.up_proj.weight_scale_2", 1.5)
    model = hf.from_pretrained(tmp_path, device="cpu")
    experts = model.model.layers[0].mlp.experts
    assert experts.nvfp4.up_ratio.tolist() == [1.0, 1.5, 1.0, 1.0]
    hf.save_pretrained(model, tmp_path / "again")
    assert _same_files(str(tmp_path), str(tmp_path / "again")) == []
    hf_tiny.exact_kernels(monkeypatch)
    with torch.no_grad():
        want = hf_tiny.fake_quant(bf16, model)(TOKENS).logits
        err = hf_tiny.rel_err(model(TOKENS).logits, want)
        experts.nvfp4.up_ratio = None
        err_without = hf_tiny.rel_err(model(TOKENS).logits, want)
    assert err < 3e-2 < err_without


def test_moe_from_modelopt_equals_the_quantized_stacks():
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(3, 128, 64, generator=g), torch.randn(3, 64, 64, generator=g)
    q13, q2 = quantize(w13), quantize(w2)
    want = NVFP4MoE(q13, q2, layout="plain")
    for layout in ("plain", "packed"):
        got = NVFP4MoE.from_modelopt((q13.data, q13.scale_linear(), q13.global_scale),
                                     (q2.data, q2.scale_linear(), q2.global_scale),
                                     layout=layout)
        assert got.layout == layout
        for e in range(3):
            for a, b in ((ex.expert(got.w13, e), ex.expert(want.w13, e)),
                         (ex.expert(got.w2, e), ex.expert(want.w2, e))):
                assert torch.equal(a.data, b.data) and torch.equal(a.global_scale,
                                                                   b.global_scale)
                assert torch.equal(_bytes(a.scale), _bytes(b.scale))


# ----------------------------------------------------------------------------- quantize

def test_calibration_gives_input_scales():
    """input_scale = amax / 2688 of the layer's inputs over the batches; an experts
    module's largest gate_up scale is the amax over all tokens that reach it."""
    model = hf_tiny.build("qwen3_moe")
    seen = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0.0),
                                                  float(a[0].abs().amax()))))
        for n in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.experts")]
    with torch.no_grad():
        model(TOKENS)
        model(TOKENS[:, :5] + 1)
    for h in hooks:
        h.remove()
    rep = hf.quantize_model(model, calibration=[TOKENS, {"input_ids": TOKENS[:, :5] + 1}])
    assert rep.calibrated and rep.mode == "w4a16" and "lm_head" in dict(rep.skipped)
    o_proj = model.model.layers[1].self_attn.o_proj
    assert float(o_proj.input_scale) == pytest.approx(seen["model.layers.1.self_attn.o_proj"]
                                                      / 2688, rel=1e-6)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_input_scale.shape == (4, 2)
    assert float(experts.gate_up_proj_input_scale.max()) == pytest.approx(
        seen["model.layers.0.mlp.experts"] / 2688, rel=1e-6)
    assert (experts.down_proj_input_scale > 0).all()


def test_w4a4_loads_static_input_scales(saved):
    model = hf.from_pretrained(saved["qwen3_moe"][2], device="cpu", mode="w4a4")
    q = model.model.layers[0].self_attn.q_proj
    assert q.mode == "w4a4" and q.input_scale is not None and q.alpha is not None
    moe = model.model.layers[0].mlp.experts.nvfp4
    assert moe.mode == "w4a4" and moe.w13_input_scale is not None


def test_quantize_model_skips_with_reasons():
    model = hf_tiny.build("llama")
    rep = hf.quantize_model(model, exclude=["lm_head", "*.layers.1.mlp.*"])
    skipped = dict(rep.skipped)
    assert "model.layers.1.mlp.down_proj" in skipped and "lm_head" in skipped
    assert isinstance(model.model.layers[0].mlp.down_proj, cnn.NVFP4Linear)
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear
    with pytest.raises(InputError, match="mode"):
        hf.quantize_model(hf_tiny.build("llama"), mode="w8a8")


# ----------------------------------------------------------------------------- fused MLPs

def _gated(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, NVFP4GatedMLP)]


def test_quantize_model_gives_gate_and_up_one_global_scale(saved):
    _, _, path = saved["llama"]
    stored = load_file(os.path.join(path, "model.safetensors"))
    for layer in range(2):
        key = f"model.layers.{layer}.mlp.%s_proj.weight_scale_2"
        assert torch.equal(stored[key % "gate"], stored[key % "up"])


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe", "deepseek_v3"])
def test_fused_mlps_load_save_bit_exact_and_compute_the_checkpoint(saved, kind, tmp_path,
                                                                   monkeypatch):
    """from_pretrained with a gate/up group (given: on the CPU there is no GPU to pick it)
    makes each dense gated MLP (Qwen2-MoE's shared expert, DeepSeek-V3's dense layer)
    an NVFP4GatedMLP; save_pretrained writes the same tensors; the forward (exact
    reference) matches the fake-quantized model as the unfused load does."""
    bf16, _, path = saved[kind]
    model = hf.from_pretrained(path, device="cpu", gate_up_group=8)
    fused, unfused = model.cute_fp4_mlps
    assert fused and fused == tuple(_gated(model)) and unfused == ()
    hf.save_pretrained(model, tmp_path)
    assert _same_files(path, str(tmp_path)) == []
    plain = hf.from_pretrained(path, device="cpu")
    assert _gated(plain) == [] and plain.cute_fp4_mlps[0] == ()
    assert all("on the CPU" in r for _, r in plain.cute_fp4_mlps[1])
    calls = hf_tiny.exact_kernels(monkeypatch)
    twin = hf_tiny.fake_quant(bf16, model)
    errors = hf_tiny.module_errors(model, twin, TOKENS)
    assert set(fused) <= set(errors)
    assert max(errors.values()) < 1e-2, errors
    assert ("gemm", "silu_mul") in calls
    with torch.no_grad():
        got, want = model(TOKENS).logits, plain(TOKENS).logits
    assert hf_tiny.token_errors(got, want)[0] < 1e-2  # one GEMM instead of two: same values


def test_w4a4_fused_mlp_quantizes_its_input_with_the_stored_scale(saved, monkeypatch):
    bf16, _, path = saved["llama"]
    model = hf.from_pretrained(path, device="cpu", mode="w4a4", gate_up_group=32)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, NVFP4GatedMLP) and mlp.mode == "w4a4" and mlp.group == 32
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(mlp.gate_up_proj.input_scale,
                       stored["model.layers.0.mlp.gate_proj.input_scale"].reshape(()))
    hf_tiny.exact_kernels(monkeypatch)
    twin = hf_tiny.fake_quant(bf16, model)
    errors = hf_tiny.module_errors(model, twin, TOKENS)
    assert errors["model.layers.0.mlp.down_proj"] < 1e-2  # on the inputs it saw
    # the whole MLP: its activation is rounded to 4 bits inside, from a gate_up that
    # differs in its last bits (as for W4A4 experts)
    assert errors["model.layers.0.mlp"] < 0.1


def test_an_mlp_with_different_gate_up_scales_stays_unfused(saved, tmp_path):
    """A checkpoint whose layer-1 up_proj has another global scale: that MLP loads as
    three NVFP4Linear (with the reason, never requantized), the other fuses, and the
    checkpoint saves back unchanged."""
    _, _, path = saved["llama"]
    _copy_with_scaled(path, tmp_path, "model.layers.1.mlp.up_proj.weight_scale_2", 1.5)
    model = hf.from_pretrained(tmp_path, device="cpu", gate_up_group=8)
    fused, unfused = model.cute_fp4_mlps
    assert fused == ("model.layers.0.mlp",)
    assert unfused[0][0] == "model.layers.1.mlp" and "differ" in unfused[0][1]
    assert isinstance(model.model.layers[1].mlp.up_proj, cnn.NVFP4Linear)
    hf.save_pretrained(model, tmp_path / "again")
    assert _same_files(str(tmp_path), str(tmp_path / "again")) == []
    with pytest.raises(InputError, match="gate_up_group"):
        hf.from_pretrained(path, device="cpu", gate_up_group=4)
