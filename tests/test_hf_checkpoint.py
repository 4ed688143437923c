"""cute_fp4.hf checkpoints: the format read from config.json / hf_quant_config.json and the
safetensors headers, and the typed errors for bad checkpoints (file, key, expectation),
raised before any tensor is loaded."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import modeling_utils  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4.errors import FormatError, InputError  # noqa: E402
from cute_fp4.hf import checkpoint as ck  # noqa: E402
from cute_fp4.hf import experts as ex  # noqa: E402

Q_SCALE = "model.layers.1.self_attn.k_proj.weight_scale"
UP = "model.layers.0.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A saved tiny Qwen3-MoE checkpoint (dense and expert layers), built once."""
    model = hf_tiny.build("qwen3_moe")
    hf.quantize_model(model)
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(model, path)
    return path


@pytest.fixture
def ckpt(source, tmp_path):
    """A fresh copy of the checkpoint to damage."""
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture
def no_load(monkeypatch):
    """Reading any tensor fails the test: errors must come before loading."""
    def boom(*args, **kwargs):
        raise AssertionError("a tensor was loaded before the checkpoint was checked")

    monkeypatch.setattr(modeling_utils.PreTrainedModel, "_load_pretrained_model",
                        staticmethod(boom))


def _edit_tensors(path, fn) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(path, fn, name="config.json") -> None:
    with open(os.path.join(path, name)) as f:
        config = json.load(f)
    fn(config)
    with open(os.path.join(path, name), "w") as f:
        json.dump(config, f)


def _edit_exclusions(path, fn) -> None:
    """``fn`` applied to config.json's lists of excluded modules (a save writes ModelOpt's
    key ``ignore`` and the older ``exclude_modules``, the same list)."""
    def edit(config):
        for key in ("exclude_modules", "ignore"):
            fn(config["quantization_config"][key])

    _edit_config(path, edit)


def _raises(path, file, key, expected) -> ck.CheckpointError:
    with pytest.raises(ck.CheckpointError) as info:
        hf.from_pretrained(path, device="cpu")
    e = info.value
    assert (e.file, e.key) == (file, key), str(e)
    assert expected in e.expected, str(e)
    assert file in str(e) and key in str(e)
    return e


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("algo", ["FP8", "MXFP4", "INT4_AWQ", "W4A8_AWQ"])
def test_unknown_quant_algo(ckpt, algo, no_load):
    _edit_config(ckpt, lambda c: c["quantization_config"].update(quant_algo=algo))
    e = _raises(ckpt, "config.json", "quantization_config.quant_algo", "'NVFP4'")
    assert e.found == repr(algo)


def test_legacy_hf_quant_config(ckpt, tmp_path_factory):
    """The older layout: no quantization_config in config.json, hf_quant_config.json
    instead; it loads the same, and its own errors name it."""
    with open(os.path.join(ckpt, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    _edit_config(ckpt, lambda c: c.pop("quantization_config"))
    legacy = {"producer": {"name": "modelopt"}, "quantization": {
        k: qc[k] for k in ("quant_algo", "group_size", "exclude_modules")}}
    with open(os.path.join(ckpt, ck.LEGACY_QUANT_FILE), "w") as f:
        json.dump(legacy, f)
    model = hf.from_pretrained(ckpt, device="cpu")
    assert ex.holds_nvfp4(model.model.layers[1].mlp.experts)
    out = tmp_path_factory.mktemp("again")
    hf.save_pretrained(model, out)
    assert load_file(os.path.join(out, "model.safetensors")).keys() == load_file(
        os.path.join(ckpt, "model.safetensors")).keys()
    _edit_config(ckpt, lambda c: c["quantization"].update(quant_algo="MXFP4"),
                 ck.LEGACY_QUANT_FILE)
    _raises(ckpt, ck.LEGACY_QUANT_FILE, "quantization.quant_algo", "'NVFP4'")


def test_not_quantized_or_wrong_group(ckpt, no_load):
    _edit_config(ckpt, lambda c: c["quantization_config"].update(group_size=32))
    _raises(ckpt, "config.json", "quantization_config.group_size", "16")
    _edit_config(ckpt, lambda c: c.pop("quantization_config"))
    os.remove(os.path.join(ckpt, ck.LEGACY_QUANT_FILE))  # a save writes both files
    _raises(ckpt, "config.json", "quantization_config", "ModelOpt NVFP4")
    with pytest.raises(InputError, match="not a checkpoint directory"):
        hf.from_pretrained(os.path.join(ckpt, "nowhere"), device="cpu")


# ----------------------------------------------------------------------------- tensors

def test_missing_dense_key(ckpt, no_load):
    _edit_tensors(ckpt, lambda t: t.pop(Q_SCALE))
    _raises(ckpt, "model.safetensors", Q_SCALE, "float8_e4m3fn [64, 8]")


def test_missing_expert_key(ckpt, no_load):
    _edit_tensors(ckpt, lambda t: t.pop(UP))
    e = _raises(ckpt, "model.safetensors", UP, "uint8 [64, 64]")
    assert "expert 3 of 4" in e.expected


def test_wrong_dtype_and_shape(ckpt, no_load):
    _edit_tensors(ckpt, lambda t: t.update({Q_SCALE: t[Q_SCALE].to(torch.bfloat16)}))
    e = _raises(ckpt, "model.safetensors", Q_SCALE, "float8_e4m3fn [64, 8]")
    assert e.found == "bfloat16 [64, 8]"
    key = "model.layers.0.mlp.experts.2.down_proj.weight_scale_2"
    _edit_tensors(ckpt, lambda t: t.update({Q_SCALE: t[Q_SCALE].to(torch.float8_e4m3fn),
                                            key: torch.ones(2)}))
    e = _raises(ckpt, "model.safetensors", key, "float32 []")
    assert e.found == "float32 [2]"


def test_exclusions_must_match_the_tensors(ckpt, no_load):
    """A module exclude_modules names must be BF16; one it does not name must be NVFP4."""
    _edit_exclusions(ckpt, lambda names: names.append("model.layers.0.self_attn.q_proj"))
    e = _raises(ckpt, "model.safetensors", "model.layers.0.self_attn.q_proj.weight", "BF16")
    assert "uint8" in e.found
    _edit_exclusions(ckpt, list.clear)
    e = _raises(ckpt, "model.safetensors", "lm_head.weight", "uint8 [256, 64]")
    assert e.found == "bfloat16 [256, 128]"


def test_sharded_checkpoint_names_the_shard(tmp_path, no_load):
    model = hf_tiny.build("qwen3_moe")
    hf.quantize_model(model)
    files = hf.save_pretrained(model, tmp_path, max_shard_size=100_000)
    assert len(files) > 2 and os.path.exists(tmp_path / ck.INDEX_FILE)
    index = ck.read_tensor_index(tmp_path)
    file = index[UP].file
    assert file != files[0]
    with safe_open(os.path.join(tmp_path, file), "pt") as f:  # the header reader agrees
        assert tuple(f.get_slice(UP).get_shape()) == index[UP].shape == (64, 64)
    with open(tmp_path / ck.INDEX_FILE) as f:
        index = json.load(f)
    index["weight_map"].pop(UP)
    with open(tmp_path / ck.INDEX_FILE, "w") as f:
        json.dump(index, f)
    tensors = load_file(tmp_path / file)
    tensors.pop(UP)
    save_file(tensors, tmp_path / file, metadata={"format": "pt"})
    _raises(tmp_path, file, UP, "uint8 [64, 64]")


def test_failed_conversion_is_not_left_half_loaded(ckpt, monkeypatch):
    """A weight conversion that raises: transformers reports it and raises. A tensor no
    conversion picked up (transformers only warns: 'missing', initialised at random): the
    quantizer refuses the model."""
    def fail(self, *args, **kwargs):
        raise RuntimeError("conversion failed")

    with monkeypatch.context() as m:
        m.setattr(ex.StackPair, "convert", fail)
        with pytest.raises(RuntimeError, match="conversion"):
            hf.from_pretrained(ckpt, device="cpu")
    real = ex.nvfp4_converters
    monkeypatch.setattr(ex, "nvfp4_converters", lambda conv: [
        c for c in real(conv) if not c.target_patterns[0].endswith("_weight_scale_2")])
    with pytest.raises(ck.CheckpointError, match="weight_scale_2: expected a loaded tensor"):
        hf.from_pretrained(ckpt, device="cpu")


def test_no_load_guard_works(ckpt, no_load):
    """The guard the error tests use does stop a load that gets that far."""
    with pytest.raises(AssertionError, match="was loaded before"):
        hf.from_pretrained(ckpt, device="cpu")


def test_layers_the_kernels_cannot_run(tmp_path, no_load):
    """A checkpoint that quantized a layer the kernels cannot run (out_features 1) is
    refused with the module's name."""
    model = hf_tiny.build("qwen2_moe")
    hf.quantize_model(model)
    hf.save_pretrained(model, tmp_path)
    gate = "model.layers.0.mlp.shared_expert_gate"
    w = torch.zeros(1, 64, dtype=torch.uint8)
    _edit_tensors(tmp_path, lambda t: t.update({
        f"{gate}.weight": w, f"{gate}.weight_scale": torch.ones(1, 8).to(torch.float8_e4m3fn),
        f"{gate}.weight_scale_2": torch.tensor(1.0)}))
    _edit_exclusions(tmp_path, lambda names: names.remove(gate))
    with pytest.raises(FormatError, match=f"{gate}: \\[1, 128\\] cannot run"):
        hf.from_pretrained(tmp_path, device="cpu")


def test_excluded_patterns():
    assert ck.excluded("model.layers.3.mlp.gate", ["*.mlp.gate"]) == "*.mlp.gate"
    assert ck.excluded("lm_head", ["lm_head"]) == "lm_head"
    assert ck.excluded("model.layers.3.mlp.experts", ["model.layers.3"]) == "model.layers.3"
    assert ck.excluded("model.layers.30.mlp", ["model.layers.3"]) is None
    assert ck.excluded("model.layers.1.self_attn.q_proj", ["*lm_head*"]) is None
