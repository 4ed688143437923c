"""What ``cute_fp4.hf.save_pretrained`` writes into a checkpoint's quantization config, per
model family: every module left unquantized (lm_head, the MoE routers, the shared-expert
gates, whatever quantize_model skipped) listed as ModelOpt lists them, under the keys every
reader looks for (config.json's ``exclude_modules`` and ``ignore``, hf_quant_config.json's
``quantization.exclude_modules``), and ``config_groups`` saying whether activations are
quantized. Engines decide per module from that list (tests/test_vllm.py loads these
exports in vLLM)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4.hf import checkpoint as ck  # noqa: E402

LAYERS = (0, 1)
# family -> the modules a save must list (checkpoint names), beyond lm_head
EXPECTED = {
    "llama": [],
    "qwen3_moe": [f"model.layers.{i}.mlp.gate" for i in LAYERS],
    "qwen2_moe": [n for i in LAYERS for n in (f"model.layers.{i}.mlp.gate",
                                              f"model.layers.{i}.mlp.shared_expert_gate")],
}


def _read(path) -> tuple[dict, dict]:
    with open(os.path.join(path, ck.CONFIG_FILE)) as f:
        config = json.load(f)["quantization_config"]
    with open(os.path.join(path, ck.LEGACY_QUANT_FILE)) as f:
        legacy = json.load(f)
    return config, legacy


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_unquantized_module_is_listed(kind, tmp_path):
    model = hf_tiny.build(kind)
    report = hf.quantize_model(model)
    hf.save_pretrained(model, tmp_path)
    config, legacy = _read(tmp_path)
    with open(os.path.join(tmp_path, ck.CONFIG_FILE)) as f:
        assert json.load(f)["architectures"] == [type(model).__name__]
    want = sorted(["lm_head", *EXPECTED[kind]])
    assert sorted(config["exclude_modules"]) == want
    assert sorted(config["ignore"]) == want  # ModelOpt's config.json key, vLLM reads it
    assert sorted(legacy["quantization"]["exclude_modules"]) == want
    assert {n for n, _ in report.skipped} <= set(want)  # what quantize_model kept
    q = legacy["quantization"]
    assert (q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"]) == ("NVFP4", 16, None)
    assert (config["quant_method"], config["quant_algo"]) == ("modelopt", "NVFP4")
    # no calibration: weights-only, which ModelOpt's config_groups say with null activations
    (group,) = config["config_groups"].values()
    assert group["input_activations"] is None and group["weights"]["num_bits"] == 4
    # read back: the same list, whichever file and key it comes from
    assert sorted(ck.read_quant_format(tmp_path).exclude_modules) == want
    os.remove(os.path.join(tmp_path, ck.CONFIG_FILE))
    fmt = ck.parse_quant_config(legacy["quantization"], ck.LEGACY_QUANT_FILE)
    assert sorted(fmt.exclude_modules) == want


def test_a_skipped_linear_is_listed_and_calibration_shows_in_the_groups(tmp_path):
    model = hf_tiny.build("llama")
    batches = [torch.randint(0, 256, (1, 8))]
    hf.quantize_model(model, exclude=("lm_head", "model.layers.1.self_attn.o_proj"),
                      calibration=batches)
    hf.save_pretrained(model, tmp_path)
    config, legacy = _read(tmp_path)
    want = ["lm_head", "model.layers.1.self_attn.o_proj"]
    assert sorted(config["ignore"]) == sorted(legacy["quantization"]["exclude_modules"]) == want
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["num_bits"] == 4  # input scales were calibrated
    assert ck.read_quant_format(tmp_path).input_scales is True


def test_modelopt_config_json_keys_are_read():
    """A ModelOpt export's config.json lists its exclusions under ``ignore`` only."""
    fmt = ck.parse_quant_config({"quant_method": "modelopt", "quant_algo": "NVFP4",
                                 "ignore": ["lm_head", "model.layers.0.mlp.gate"],
                                 "config_groups": {"group_0": {"input_activations": {}}}})
    assert fmt.exclude_modules == ("lm_head", "model.layers.0.mlp.gate")
    assert fmt.input_scales is True
    with pytest.raises(ck.CheckpointError, match="quantization_config.ignore"):
        ck.parse_quant_config({"quant_algo": "NVFP4", "ignore": "lm_head"})
