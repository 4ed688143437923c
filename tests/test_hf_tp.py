"""Tensor parallelism in transformers (``cute_fp4.hf.from_pretrained(..., tp_plan="auto")``,
``cute_fp4.hf.tp``): the plan checks on the CPU, and, under torchrun with 2 processes on gloo
(``tests/hf_tp_run.py``, the layers on the exact reference), tiny Llama and Qwen3-MoE
checkpoints sharded as their plans say (q/k/v and gate/up by rows, o_proj and down_proj by
K, the experts by their intermediate size) give the single-process model's greedy tokens,
and a checkpoint whose row-parallel shard the kernels cannot run is refused.

The torchrun part takes ~20 s on 2 cores: it runs in ``.ci/run`` (``CUTE_FP4_TP_TESTS=1``)
and is skipped by the README's test command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4.errors import FormatError, InputError  # noqa: E402
from cute_fp4.hf import tp  # noqa: E402
from cute_fp4.layers import reference_execution  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUN = Path(__file__).with_name("hf_tp_run.py")
PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 7, 128, 64]]
NEW_TOKENS = 4
TP_ENV = "CUTE_FP4_TP_TESTS"


# ----------------------------------------------------------------------------- the plan

def test_linear_styles():
    for style in (None, "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"):
        tp.check_linear_style("model.layers.0.self_attn.q_proj", style)
    for style in ("packed_colwise", "mla_kv_a_proj", "sequence_parallel"):
        with pytest.raises(FormatError, match=f"q_proj: the tensor-parallel plan shards it as "
                                              f"'{style}'"):
            tp.check_linear_style("model.layers.0.self_attn.q_proj", style)


def test_expert_styles():
    good = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    tp.check_experts_styles("experts", "moe_tp_experts", good)
    tp.check_experts_styles("experts", None, {"gate_up_proj": None, "down_proj": None})
    for module, styles in (("grouped_gemm", good),  # expert parallelism
                           ("moe_tp_experts", {**good, "gate_up_proj": "colwise"}),
                           (None, good)):
        with pytest.raises(FormatError, match="experts: the tensor-parallel plan shards"):
            tp.check_experts_styles("experts", module, styles)


def test_a_tensor_parallel_model_is_not_saved(tmp_path):
    model = hf_tiny.build("llama")
    hf.quantize_model(model)
    model._tp_size, model._device_mesh = 2, object()  # what transformers sets under TP
    with pytest.raises(InputError, match="holds only its rank's shards"):
        hf.save_pretrained(model, tmp_path)


def test_expert_block_scales_get_their_weights_style():
    plan = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts",
            "layers.*.mlp.down_proj": "rowwise"}
    got = tp.expert_scale_plan(plan)
    assert got == {**plan, "layers.*.mlp.experts.gate_up_proj_weight_scale": "packed_colwise",
                   "layers.*.mlp.experts.down_proj_weight_scale": "rowwise"}


# ----------------------------------------------------------------------------- torchrun

def _save(kind: str, path: Path, **sizes) -> list[list[int]] | None:
    """Quantize and save a tiny ``kind`` model; the single-process model's greedy tokens
    (loaded back, on the exact reference), None for a model meant to be refused."""
    model = hf_tiny.build(kind, **sizes)
    hf.quantize_model(model)
    hf.save_pretrained(model, path)
    if sizes:
        return None
    loaded = hf.from_pretrained(path, device="cpu")
    loaded.generation_config.eos_token_id = None
    out = []
    with reference_execution(), torch.no_grad():
        for ids in PROMPTS:
            g = loaded.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                do_sample=False)
            out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """One torchrun (2 ranks) over three checkpoints: name -> (result, single-process
    tokens)."""
    if os.environ.get(TP_ENV) != "1":
        pytest.skip(f"torchrun tests: .ci/run runs them ({TP_ENV}=1)")
    cases = {"llama": ("llama", {}), "qwen3_moe": ("qwen3_moe", {}),
             # down_proj: 288 in_features, 144 per rank: not a multiple of 32
             "bad_shard": ("llama", {"intermediate_size": 288})}
    paths, want = {}, {}
    for name, (kind, sizes) in cases.items():
        paths[name] = tmp_path_factory.mktemp(name)
        want[name] = _save(kind, paths[name], **sizes)
    env = {**os.environ, "CUTE_FP4_REFERENCE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(RUN),
           json.dumps(PROMPTS), str(NEW_TOKENS), *map(str, paths.values())]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    results = json.loads(lines[-1][len("RESULT "):])
    return {name: (results[str(path)], want[name]) for name, path in paths.items()}


def test_dense_layers_sharded_as_the_plan_says(tp_run):
    got, want = tp_run["llama"]
    assert "error" not in got, got
    assert got["tokens"] == want
    shards = got["shards"]  # [out, in] per rank: hidden 128, 4 heads of 32 (2 kv), MLP 256
    for i in (0, 1):
        layer = f"model.layers.{i}"
        assert shards[f"{layer}.self_attn.q_proj"] == [64, 128]
        assert shards[f"{layer}.self_attn.k_proj"] == shards[f"{layer}.self_attn.v_proj"] == [
            32, 128]
        assert shards[f"{layer}.self_attn.o_proj"] == [128, 64]
        assert shards[f"{layer}.mlp.gate_proj"] == shards[f"{layer}.mlp.up_proj"] == [128, 128]
        assert shards[f"{layer}.mlp.down_proj"] == [128, 128]


def test_experts_sharded_by_their_intermediate_size(tp_run):
    got, want = tp_run["qwen3_moe"]
    assert "error" not in got, got
    assert got["tokens"] == want
    for i in (0, 1):  # 4 experts, moe_intermediate_size 64: 32 per rank
        assert got["shards"][f"model.layers.{i}.mlp.experts"] == [128, 32]
        assert got["shards"][f"model.layers.{i}.self_attn.o_proj"] == [128, 64]


def test_a_shard_the_kernels_cannot_run_is_refused(tp_run):
    got, _ = tp_run["bad_shard"]
    assert got.get("error", "").startswith(
        "FormatError: model.layers.0.mlp.down_proj (tensor-parallel rank 0 of 2): "
        "in_features 144 is not a multiple of 32"), got
