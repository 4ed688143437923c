"""The layer API (``cute_fp4.layers``) at the tensor-parallel shard shapes of Llama-8B-,
Qwen3-30B-A3B- and DeepSeek-V3-like layers (TP 1/2/4/8; ``perf/shards.py`` times them):
every shard prepared from ModelOpt tensors runs, against the exact reference (the dense
layers by the error rule on their outputs, poisoned first; the experts stage by stage,
``moe.check_stages``, on a subset of experts), and a CUDA graph of the call replays on new
inputs to the eager result. The experts run with fewer experts than the models (the
shapes per expert are the models'). W4A16 where the GPU has it, W4A4 with a calibrated
scale otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from cute_fp4 import moe, reference
from cute_fp4.errors import FormatError
from cute_fp4.layers import Experts, Linear
from cute_fp4.packed import UNIT_K
from gpu import selection

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from shards import SHARDS, Dense, modelopt_experts, modelopt_linear, routing  # noqa: E402

pytestmark = pytest.mark.gpu("sm90", "sm120")
MS = (1, 16, 100)
EXPERTS = 16  # per stack here (the models have 128 and 256): the per-expert shapes are theirs


def _mode() -> str:
    return selection.modes()[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _captured(fn, x: torch.Tensor, fresh: torch.Tensor):
    """(eager result on ``fresh``, graph replay's result after ``x`` took its values)."""
    fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn(x)
    want = fn(fresh).clone()
    x.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    return want, y


@pytest.mark.parametrize("model, tp, layer", [s for s in SHARDS if isinstance(s[2], Dense)],
                         ids=[f"{m}-tp{t}-{la.name}" for m, t, la in SHARDS
                              if isinstance(la, Dense)])
def test_dense_shard(model, tp, layer):
    mode = _mode()
    w, sc, gs = modelopt_linear(layer.n, layer.k, seed=tp)
    inp = torch.tensor(3.0 / 2688, device="cuda") if mode == "w4a4" else None
    lin = Linear.from_modelopt(w, sc, gs, inp, mode=mode, name=f"{model}.{layer.name}")
    for m in MS:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, layer.k, generator=g, device="cuda").to(torch.bfloat16)
        y = lin(x)
        a = x if mode == "w4a16" else reference_quantized(x, inp)
        res = reference.check(y, a, lin.weight)
        assert res.passed, (model, tp, layer.name, m, str(res))
        want, got = _captured(lin, x.clone(), torch.randn_like(x))
        assert torch.equal(_bits(got), _bits(want)), (model, tp, layer.name, m)


def reference_quantized(x: torch.Tensor, scale: torch.Tensor):
    import cute_fp4 as cf

    return cf.quantize(x.float(), scale)


@pytest.mark.parametrize("model, tp, layer", [s for s in SHARDS if not isinstance(s[2], Dense)],
                         ids=[f"{m}-tp{t}-{la.name}" for m, t, la in SHARDS
                              if not isinstance(la, Dense)])
def test_expert_shard(model, tp, layer):
    mode = _mode()
    w13, w2 = modelopt_experts(EXPERTS, layer.hidden, layer.inter, seed=tp)
    scales = ((torch.tensor(3.0 / 2688, device="cuda"),) * 2 if mode == "w4a4"
              else (None, None))
    name = f"{model}.{layer.name}"
    if selection.family() == "sm90" and layer.inter % UNIT_K:
        # sm_90a's grouped kernels read the packed layout only (Qwen3-30B-A3B at TP 8: 96)
        with pytest.raises(FormatError, match=f"{name}: sm_90a's grouped kernels read the "
                           f"packed layout only.*intermediate \\({layer.inter}\\)"):
            Experts.from_modelopt(w13, w2, input_scales=scales, mode=mode, name=name)
        return
    ex = Experts.from_modelopt(w13, w2, input_scales=scales, mode=mode, name=name)
    layer_module = moe.NVFP4MoE(None, None, experts=ex)
    for t in (1, 16):
        ids, wts = routing(t, EXPERTS, layer.top_k, seed=t)
        x = torch.randn(t, layer.hidden, device="cuda").to(torch.bfloat16)
        checks = moe.check_stages(layer_module, ex.stages(x, ids, wts), x, ids, wts,
                                  max_rows=8)
        assert all(c.passed for c in checks), (model, tp, t, [str(c) for c in checks])
        y = ex(x, ids, wts)
        assert torch.isfinite(y).all()

        def call(x_, ids=ids, wts=wts):
            return ex(x_, ids, wts)

        want, got = _captured(call, x.clone(), torch.randn_like(x))
        assert torch.equal(_bits(got), _bits(want)), (model, tp, t)
