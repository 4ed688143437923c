"""The vLLM plugin's layer methods in one process, without an engine (seconds, in the vLLM
venv of ``.ci/run``): vLLM's own QKV and row-parallel layers loaded through vLLM's weight
loaders from ModelOpt tensors (per-shard global scales that differ, a bias, input scales),
prepared and applied in W4A16 and W4A4, bit for bit the layer API's result on the same
tensors; the shape checks' errors; the fused-MoE method's W4A4 experts and its refusals.
The layers compute with the exact reference (``reference_execution``)."""

from __future__ import annotations

import socket
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run runs these tests in "
                    ".cache/venv-vllm: scripts/ci_venv.sh vllm)")

import torch  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear  # noqa: E402

import cute_fp4  # noqa: E402
from cute_fp4.errors import FormatError  # noqa: E402
from cute_fp4.hf.checkpoint import QuantFormat  # noqa: E402
from cute_fp4.layers import Experts, Linear, reference_execution  # noqa: E402
from cute_fp4.vllm.config import CuteFp4Config  # noqa: E402
from cute_fp4.vllm.moe import CuteFp4ModelOptMoEMethod  # noqa: E402

H, HEAD, HEADS, KV_HEADS = 128, 32, 4, 2
GEN = torch.Generator().manual_seed(3)


@pytest.fixture(scope="module", autouse=True)
def vllm_tp1():
    """vLLM's parallel state for one rank (gloo), and its config, for the whole module."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        with reference_execution():
            yield


def _modelopt(rows: int, cols: int, scale: float) -> dict[str, torch.Tensor]:
    """One layer's ModelOpt tensors (random weights of magnitude ``scale``)."""
    w = cute_fp4.quantize(torch.randn(rows, cols, generator=GEN) * scale)
    return {"weight": w.data, "weight_scale": w.scale_linear(),
            "weight_scale_2": w.global_scale.reshape(())}


def _config(mode: str, input_scales: bool) -> CuteFp4Config:
    cfg = CuteFp4Config(QuantFormat(input_scales=input_scales))
    cfg.mode = mode
    return cfg


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_qkv_layer_loaded_by_vllm_equals_the_layer_api(mode):
    x = torch.randn(5, H, generator=GEN).to(torch.bfloat16)
    inp = (x.float().abs().amax() / 2688).reshape(())
    sizes = {"q": HEADS * HEAD, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD}
    # q, k and v quantized on their own: three different global scales
    shards = {s: {**_modelopt(n, H, 0.05 * (i + 1)), "input_scale": inp}
              for i, (s, n) in enumerate(sizes.items())}
    bias = {s: torch.randn(n, generator=GEN).to(torch.bfloat16) for s, n in sizes.items()}
    layer = QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=True,
                              quant_config=_config(mode, True),
                              prefix="model.layers.0.self_attn.qkv_proj",
                              params_dtype=torch.bfloat16)
    for s, tensors in shards.items():
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t, s)
        layer.bias.weight_loader(layer.bias, bias[s], s)
    with pytest.warns(RuntimeWarning, match="different global scales"):
        layer.quant_method.process_weights_after_loading(layer)
    assert layer.cute_fp4.mode == mode
    got = layer.quant_method.apply(layer, x, layer.bias)
    want = torch.cat([Linear.from_modelopt(t["weight"], t["weight_scale"],
                                           t["weight_scale_2"], t["input_scale"], mode=mode)(x)
                      + bias[s] for s, t in shards.items()], dim=-1)
    assert torch.equal(got, want)
    dense = torch.cat([cute_fp4.nvfp4.NVFP4Tensor.from_modelopt(
        t["weight"], t["weight_scale"], t["weight_scale_2"]).dequantize(torch.float64)
        for t in shards.values()])
    exact = x.double() @ dense.T + torch.cat(list(bias.values())).double()
    assert (got.double() - exact).norm() / exact.norm() < (0.15 if mode == "w4a4" else 1e-2)


def test_row_layer_without_input_scales_runs_w4a16():
    x = torch.randn(3, 256, generator=GEN).to(torch.bfloat16)
    t = _modelopt(H, 256, 0.05)
    layer = RowParallelLinear(256, H, bias=False, quant_config=_config("auto", False),
                              prefix="model.layers.0.mlp.down_proj",
                              params_dtype=torch.bfloat16)
    assert not hasattr(layer, "input_scale")  # vLLM would want it loaded
    for name, tensor in t.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.cute_fp4.mode == "w4a16"
    want = Linear.from_modelopt(t["weight"], t["weight_scale"], t["weight_scale_2"])(x)
    assert torch.equal(layer.quant_method.apply(layer, x), want)
    assert layer.weight.data_ptr() == layer.cute_fp4.stored.data.data_ptr()  # one copy


def test_shape_checks_name_the_layer_and_the_split():
    with pytest.raises(FormatError, match=r"model.layers.0.o_proj \(tensor-parallel size 1: "
                                          r"\[12, 128\] -> \[12, 128\] per rank\): "
                                          "out_features 12 is not a multiple of 8"):
        RowParallelLinear(H, 12, bias=False, quant_config=_config("auto", False),
                          prefix="model.layers.0.o_proj", params_dtype=torch.bfloat16)


def test_a_scale_missing_from_the_checkpoint_is_an_error():
    layer = RowParallelLinear(256, H, bias=False, quant_config=_config("auto", False),
                              prefix="model.layers.0.mlp.down_proj",
                              params_dtype=torch.bfloat16)
    t = _modelopt(H, 256, 0.05)
    layer.weight.weight_loader(layer.weight, t["weight"])  # no weight_scale loaded
    layer.weight_scale_2.weight_loader(layer.weight_scale_2, t["weight_scale_2"])
    with pytest.raises(FormatError, match="down_proj.weight_scale: 2048 of 2048 values were "
                                          "not in the checkpoint"):
        layer.quant_method.process_weights_after_loading(layer)


# ----------------------------------------------------------------------------- experts

def _moe_config(**over):
    """The FusedMoEConfig fields the method reads."""
    act = types.SimpleNamespace(value="silu")
    return types.SimpleNamespace(**{"tp_size": 1, "tp_rank": 0, "intermediate_size": 64,
                                    "is_act_and_mul": True, "activation": act,
                                    "has_bias": False, "use_ep": False, **over})


def _experts(e: int, i: int) -> tuple[dict, dict]:
    gate = [_modelopt(i, H, 0.05) for _ in range(e)]
    up = [_modelopt(i, H, 0.08) for _ in range(e)]  # up's own global scales
    down = [_modelopt(H, i, 0.05) for _ in range(e)]
    w13 = {"w13_weight": torch.stack([torch.cat((g["weight"], u["weight"]))
                                      for g, u in zip(gate, up)]),
           "w13_weight_scale": torch.stack([torch.cat((g["weight_scale"], u["weight_scale"]))
                                            for g, u in zip(gate, up)]),
           "w13_weight_scale_2": torch.stack([torch.stack((g["weight_scale_2"],
                                                           u["weight_scale_2"]))
                                              for g, u in zip(gate, up)])}
    w2 = {"w2_weight": torch.stack([d["weight"] for d in down]),
          "w2_weight_scale": torch.stack([d["weight_scale"] for d in down]),
          "w2_weight_scale_2": torch.stack([d["weight_scale_2"] for d in down])}
    return w13, w2


def test_moe_method_w4a4_equals_the_layer_api():
    e, i, t = 4, 64, 6
    w13, w2 = _experts(e, i)
    inputs = {"w13_input_scale": torch.full((e, 2), 0.002),
              "w2_input_scale": torch.linspace(0.001, 0.003, e)}
    method = CuteFp4ModelOptMoEMethod(_config("w4a4", True), _moe_config(),
                                      "model.layers.0.mlp.experts")
    layer = torch.nn.Module()
    method.create_weights(layer, e, H, i, torch.bfloat16, weight_loader=None)
    for name, value in {**w13, **w2, **inputs}.items():  # as vLLM's experts loader fills them
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    assert layer.cute_fp4.mode == "w4a4"
    x = torch.randn(t, H, generator=GEN).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, 2), generator=GEN, dtype=torch.int32)
    weights = torch.rand(t, 2, generator=GEN)
    want = Experts.from_modelopt(
        tuple(w13.values()), tuple(w2.values()), mode="w4a4",
        input_scales=(inputs["w13_input_scale"], inputs["w2_input_scale"]))(x, ids, weights)
    assert torch.equal(method.apply(layer, x, weights, ids, None, None), want)


@pytest.mark.parametrize("over, why", [
    ({"activation": types.SimpleNamespace(value="gelu")}, "activation 'gelu'"),
    ({"use_ep": True}, "expert parallelism"),
    ({"has_bias": True}, "biased experts"),
])
def test_moe_method_refuses_what_the_experts_do_not_compute(over, why):
    e, i = 2, 64
    method = CuteFp4ModelOptMoEMethod(_config("auto", False), _moe_config(**over),
                                      "model.layers.0.mlp.experts")
    layer = torch.nn.Module()
    method.create_weights(layer, e, H, i, torch.bfloat16, weight_loader=None)
    with pytest.raises(FormatError, match=f"experts: cute_fp4's experts do not support {why}"):
        method.process_weights_after_loading(layer)


def test_moe_method_checks_the_shard():
    method = CuteFp4ModelOptMoEMethod(_config("auto", False),
                                      _moe_config(tp_size=2, intermediate_size=96),
                                      "model.layers.0.mlp.experts")
    with pytest.raises(FormatError, match=r"experts w2 \(tensor-parallel size 2: intermediate "
                                          r"96 -> 48 per rank, hidden 128\): in_features 48 "
                                          "is not a multiple of 32"):
        method.create_weights(torch.nn.Module(), 2, H, 48, torch.bfloat16, weight_loader=None)
