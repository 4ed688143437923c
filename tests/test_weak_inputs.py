"""Mistakes a new user made (issue 42), each a typed error naming the argument, what was
expected and what came: checkpoint tensors that do not fit the layer they fill (convert,
load_modelopt, the transformers loader's placeholders), scales of the wrong size, 2-D
expert weights, calibration ids past the vocabulary, and the CLI's arguments checked
before it looks for a GPU. On the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cute_fp4 as cf
from cute_fp4 import cli, reference
from cute_fp4 import nn as cnn
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.moe import NVFP4MoE


def _modelopt(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    w = cf.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return {"weight": w.data, "weight_scale": w.scale_linear(),
            "weight_scale_2": w.global_scale}


def _state_dict(prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{key}": t for key, t in _modelopt(n, k).items()}


# ----------------------------------------------------------------------------- convert

def test_convert_refuses_a_weight_of_another_k():
    """The issue's case: a [64, 32]-byte weight (K = 64) for nn.Linear(128, 64) made the
    layer in_features=64 ("converted 1 of 1"); now the weight is named, not its scale."""
    model = nn.Sequential(nn.Linear(128, 64))
    sd = _state_dict("0", 64, 64)
    with pytest.raises(FormatError, match=r"layer 0 \(out_features=64, in_features=128\): "
                       r"weight must be uint8 \[N, K/2\] = \[64, 64\], got uint8 \[64, 32\]"):
        cf.convert(model, state_dict=sd)
    sd["0.weight_scale"] = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)  # the layer's K/16
    with pytest.raises(FormatError, match=r"weight must be uint8 .* got uint8 \[64, 32\]"):
        cf.convert(model, state_dict=sd)
    assert type(model[0]) is nn.Linear and model[0].in_features == 128


@pytest.mark.parametrize("key, value, match", [
    ("weight", torch.zeros(32, 64, dtype=torch.uint8), r"weight must be uint8 \[N, K/2\] = "
     r"\[64, 64\], got uint8 \[32, 64\]"),
    ("weight", torch.zeros(64, 64, dtype=torch.int8), "got int8"),
    ("weight_scale", torch.zeros(64, 8, dtype=torch.float16), r"weight_scale must be "
     r"float8_e4m3fn \[N, K/16\] = \[64, 8\], got float16"),
    ("weight_scale_2", torch.ones(2), r"weight_scale_2 must be one float32 value, got "
     r"torch.float32 \[2\]"),
    ("weight_scale_2", torch.ones((), dtype=torch.int32), "weight_scale_2 must be one"),
    ("weight", "bytes", r"state_dict\['0.weight'\] must be a torch.Tensor, got str"),
])
def test_convert_checks_each_tensor_against_the_layer(key, value, match):
    model = nn.Sequential(nn.Linear(128, 64))
    sd = _state_dict("0", 64, 128)
    sd[f"0.{key}"] = value
    err = InputTypeError if isinstance(value, str) else FormatError
    with pytest.raises(err, match=match):
        cf.convert(model, state_dict=sd)
    del sd[f"0.{key}"]
    if key == "weight":
        with pytest.raises(FormatError, match=r"has 0.weight_scale but no 0.weight$"):
            cf.convert(model, state_dict=sd)


def test_convert_of_a_right_state_dict_keeps_the_declared_size():
    model = nn.Sequential(nn.Linear(128, 64))
    rep = cf.convert(model, state_dict=_state_dict("0", 64, 128))
    assert rep.converted == ("0",)
    assert (model[0].out_features, model[0].in_features) == (64, 128)


class _MLP(nn.Module):
    def __init__(self, h: int = 64, i: int = 128):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()


def test_convert_checks_the_projections_of_a_fused_mlp():
    model = nn.Sequential(_MLP())
    sd = {**_state_dict("0.gate_proj", 128, 64), **_state_dict("0.up_proj", 128, 64),
          **_state_dict("0.down_proj", 64, 64)}  # down_proj's K is 128
    with pytest.raises(FormatError, match=r"layer 0.down_proj \(out_features=64, "
                       r"in_features=128\): weight must be uint8 \[N, K/2\] = \[64, 64\]"):
        cf.convert(model, state_dict=sd, gate_up_group=8)


def test_load_modelopt_blames_the_weight_not_the_scale():
    layer = cnn.NVFP4Linear.from_linear(nn.Linear(128, 64))
    t = _modelopt(64, 64)
    t["weight_scale"] = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(FormatError, match=r"the layer \(out_features=64, in_features=128\): "
                       r"weight must be"):
        layer.load_modelopt(**t)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):  # torch's message
        layer.load_state_dict(_modelopt(64, 64))
    assert layer.in_features == 128


def test_loader_placeholder_checks_what_was_loaded():
    """A placeholder of the transformers loader holding tensors of another shape than its
    layer's (the header check comes first; this is the last line of defence)."""
    pytest.importorskip("transformers")
    from cute_fp4.hf.quantizer import QuantizedLinear

    def fill(holder, tensors):  # where the loader puts them: weight and scale parameters
        for key, t in tensors.items():
            if key in holder._parameters:
                holder._parameters[key] = nn.Parameter(t, requires_grad=False)
            else:
                holder._buffers[key] = t

    holder = QuantizedLinear(nn.Linear(128, 64), input_scale=False)
    fill(holder, _modelopt(64, 64))
    with pytest.raises(FormatError, match=r"layer model.q \(out_features=64, in_features="
                       r"128\): weight must be uint8 \[N, K/2\] = \[64, 64\]"):
        holder.finalize("w4a16", "plain", "model.q")
    fill(holder, _modelopt(64, 128))
    layer = holder.finalize("w4a16", "plain", "model.q")
    assert (layer.out_features, layer.in_features) == (64, 128)


# ----------------------------------------------------------------------------- scalars

def test_quantize_names_a_global_scale_of_several_values():
    with pytest.raises(InputError, match=r"global_scale of a 2-D tensor \[16, 64\] must be one "
                       r"value, got 2"):
        cf.quantize(torch.randn(16, 64), global_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(InputError, match="got 3"):
        cf.quantize(torch.randn(16, 64), global_scale=[1.0, 2.0, 3.0])
    assert cf.quantize(torch.randn(16, 64), global_scale=torch.tensor([0.5])).shape == (16, 64)


def test_reference_names_an_alpha_of_several_values():
    x, w = torch.randn(16, 64).bfloat16(), cf.quantize(torch.randn(32, 64))
    with pytest.raises(InputError, match=r"alpha must be one value, got 2"):
        reference.gemm(x, w, alpha=torch.tensor([1.0, 2.0]))
    with pytest.raises(InputTypeError, match="alpha must be a float, a list of floats or a "
                       "real tensor, got str"):
        reference.check(torch.zeros(16, 32), x, w, alpha="1")
    ref = reference.gemm(x, w, alpha=torch.tensor([2.0]))
    assert torch.equal(ref, reference.gemm(x, w, alpha=2.0))
    stack = cf.quantize(torch.randn(2, 32, 64))
    with pytest.raises(InputError, match=r"hold one value per expert \(2\), got 3"):
        reference.grouped_gemm(x, stack, [0, 8, 16], alpha=torch.ones(3))


def test_moe_from_float_of_matrices_asks_for_expert_stacks():
    with pytest.raises(InputError, match=r"w13 must be an expert stack \[E, N, K\] of float "
                       r"weights, got shape \(128, 128\)"):
        NVFP4MoE.from_float(torch.randn(128, 128), torch.randn(128, 64))
    with pytest.raises(InputError, match=r"w2 must be an expert stack"):
        NVFP4MoE.from_float(torch.randn(2, 128, 64), torch.randn(64, 64))


def test_calibration_ids_past_the_vocabulary():
    pytest.importorskip("transformers")
    import hf_tiny

    model = hf_tiny.build("llama")  # vocabulary of 256
    ok = torch.randint(0, 256, (1, 8))
    with pytest.raises(InputError, match=r"calibration batch 1: token id 300 is outside the "
                       r"model's vocabulary of 256 \(ids 0 .. 255\)"):
        cf.hf.quantize_model(model, calibration=[ok, torch.tensor([[1, 300, 2]])])
    with pytest.raises(InputError, match="calibration batch 0: token id -1"):
        cf.hf.quantize_model(model, calibration=[{"input_ids": torch.tensor([[-1, 2]])}])
    with pytest.raises(InputTypeError, match="input_ids must be an integer tensor of token "
                       "ids, got torch.float32"):
        cf.hf.quantize_model(model, calibration=[ok.float()])
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # nothing quantized


# ----------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, needle", [
    (["bench", "--shapes", "16x8192x8192"], "--shapes '16x8192x8192': expected M,N,K, three "
     "integers separated by commas (did you mean 16,8192,8192?)"),
    (["tune", "--shapes", "16,0,64"], "--shapes '16,0,64': M, N and K must be > 0"),
    (["validate", "sm90_nosuch"], "no schedule named 'sm90_nosuch'"),
    (["validate", "sm90_default", "--all"], "not both"),
    (["validate"], "name the schedules to validate or pass --all"),
    (["bench", "sm90_default", "--shapes", "1,2"], "expected M,N,K"),
])
def test_cli_checks_its_arguments_before_the_gpu(capsys, monkeypatch, argv, needle):
    def no_gpu_lookup():
        raise AssertionError("looked for a GPU before checking the arguments")

    monkeypatch.setattr(cli, "_device_family", no_gpu_lookup)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "InputError" in err, err
