"""The prepared-layer API (``cute_fp4.layers``) on the CPU, through the exact-reference
execution (``CUTE_FP4_REFERENCE=1`` / ``reference_execution``): ModelOpt tensors of any
shard in, results equal to an independent float64 computation; errors name the layer and
the numbers; the switch is off by default."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import moe, reference
from cute_fp4.errors import DeviceError, FormatError, InputError
from cute_fp4.layers import (
    REFERENCE_ENV,
    Experts,
    Linear,
    reference_execution,
    reference_mode,
)
from cute_fp4.moe import moe_reference


def _modelopt(n: int, k: int, seed: int = 0, scale: float = 1.0):
    """(weight uint8 [N, K/2], weight_scale e4m3 [N, K/16] row-major, weight_scale_2)."""
    g = torch.Generator().manual_seed(seed)
    w = cf.quantize(torch.randn(n, k, generator=g) * scale)
    return w.data, w.scale_linear(), w.global_scale


def _dense64(x: torch.Tensor, weight, scale, gs) -> torch.Tensor:
    """x @ W^T in float64 from the ModelOpt tensors (independent of the layer)."""
    w = cf.NVFP4Tensor.from_modelopt(weight, scale, gs).dequantize(torch.float64)
    return x.double().reshape(-1, w.shape[1]) @ w.T


def test_reference_mode_is_off_by_default_and_a_cpu_call_says_so(monkeypatch):
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    assert not reference_mode()
    lin = Linear.from_modelopt(*_modelopt(64, 128), name="q_proj")
    with pytest.raises(DeviceError):
        lin(torch.randn(2, 128, dtype=torch.bfloat16))
    with reference_execution():
        assert reference_mode()
        with reference_execution():
            assert reference_mode()
        assert reference_mode()
    assert not reference_mode()
    monkeypatch.setenv(REFERENCE_ENV, "1")
    assert reference_mode()
    assert lin(torch.randn(2, 128, dtype=torch.bfloat16)).shape == (2, 64)


@pytest.mark.parametrize("shape", [(1, 128), (7, 128), (2, 3, 128), (129, 128)])
@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_linear_equals_the_float64_product(shape, layout, dtype):
    t = _modelopt(72, 128, seed=1)
    bias = torch.randn(72)
    x = torch.randn(*shape, dtype=dtype)
    with reference_execution():
        lin = Linear.from_modelopt(*t, bias=bias, layout=layout, name="up")
        y = lin(x)
    assert lin.layout == layout and lin.mode == "w4a16" and y.dtype == dtype
    assert y.shape == (*shape[:-1], 72)
    want = _dense64(x, *t).to(dtype).double() + bias.double()
    torch.testing.assert_close(y.double().reshape(-1, 72), want, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("static", [True, False])
def test_w4a4_linear_quantizes_the_activation_as_the_kernels_do(static):
    t = _modelopt(64, 256, seed=2)
    x = torch.randn(5, 256, dtype=torch.bfloat16) * 3
    inp = x.abs().max().float() / 2688 if static else None
    with reference_execution():
        lin = Linear.from_modelopt(*t, input_scale=inp, mode="w4a4")
        y = lin(x)
    xq = cf.quantize(x.float(), inp)  # bit for bit the fused quantizer (tests/gpu)
    want = reference.gemm(xq, cf.NVFP4Tensor.from_modelopt(*t), out_dtype=torch.bfloat16)
    assert torch.equal(y, want)


def test_mode_auto_is_w4a16_off_sm12x_and_checkpoint_round_trips():
    t = _modelopt(64, 128, seed=3)
    inp = torch.tensor(0.01)
    with reference_execution():
        lin = Linear.from_modelopt(*t, input_scale=inp, bias=torch.ones(64), layout="packed")
    assert lin.mode == "w4a16"  # "auto": W4A4 on SM12x with input scales only
    ck = lin.checkpoint()
    assert torch.equal(ck["weight"], t[0]) and torch.equal(
        ck["weight_scale"].view(torch.uint8), t[1].view(torch.uint8))
    assert torch.equal(ck["weight_scale_2"], t[2]) and torch.equal(ck["input_scale"], inp)


def test_shards_with_their_own_global_scales_run_exactly():
    """A fused q/k/v weight whose shards keep their own global scales: one GEMM each, the
    outputs side by side, each shard's own product."""
    parts = [_modelopt(n, 128, seed=10 + i, scale=s)
             for i, (n, s) in enumerate([(64, 1.0), (32, 4.0), (32, 0.25)])]
    weight = torch.cat([p[0] for p in parts])
    scale = torch.cat([p[1] for p in parts])
    gs = torch.stack([p[2] for p in parts])
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with reference_execution(), pytest.warns(RuntimeWarning, match="different global scales"):
        lin = Linear.from_modelopt(weight, scale, gs, output_sizes=[64, 32, 32], name="qkv")
    with reference_execution():
        y = lin(x)
    assert lin.out_features == 128 and y.shape == (3, 128)
    want = torch.cat([_dense64(x, *p) for p in parts], dim=1)
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=1e-4)
    ck = lin.checkpoint()
    assert torch.equal(ck["weight"], weight) and torch.equal(ck["weight_scale_2"], gs)
    same = Linear.from_modelopt(weight, scale, torch.stack([gs[0]] * 3),
                                output_sizes=[64, 32, 32])
    assert same._parts is None  # equal scales: one GEMM


@pytest.mark.parametrize("n, k, match", [
    (64, 80, r"o_proj: in_features 80 is not a multiple of 32"),
    (60, 128, r"o_proj: out_features 60 is not a multiple of 8"),
])
def test_sizes_the_kernels_cannot_run_name_the_layer(n, k, match):
    w = torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.full((n, k // 16), 1.0).to(torch.float8_e4m3fn)
    with pytest.raises(FormatError, match=match):
        Linear.from_modelopt(w, s, torch.tensor(1.0), name="o_proj")


def test_bad_shard_description_and_input_are_typed_errors():
    t = _modelopt(64, 128)
    with pytest.raises(FormatError, match=r"qkv: output_sizes \[32, 16\] \(sum 48\)"):
        Linear.from_modelopt(*t, output_sizes=[32, 16], name="qkv")
    with reference_execution():
        lin = Linear.from_modelopt(*t, name="down")
        with pytest.raises(InputError, match="down: input has 64 features"):
            lin(torch.randn(2, 64, dtype=torch.bfloat16))


def test_a_saved_or_copied_layer_drops_its_bindings():
    lin = Linear.from_modelopt(*_modelopt(64, 128))
    lin.launches.bound[(1, torch.bfloat16)] = object()
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    for back in (torch.load(buf, weights_only=False), copy.deepcopy(lin)):
        assert back.launches.bound == {} and torch.equal(back.stored.data, lin.stored.data)


def _experts_modelopt(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.5, 2.0, e).view(e, 1, 1)
    w13 = cf.quantize(torch.randn(e, 2 * i, h, generator=g) * spread)
    w2 = cf.quantize(torch.randn(e, h, i, generator=g))

    def linear(w):
        return torch.stack([w.expert(x).scale_linear() for x in range(e)])

    return (w13.data, linear(w13), w13.global_scale), (w2.data, linear(w2), w2.global_scale)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_experts_equal_the_float64_layer(mode):
    e, h, i, t, k = 4, 128, 64, 9, 2
    w13, w2 = _experts_modelopt(e, h, i, seed=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    tw = torch.rand(t, k, generator=g).softmax(-1)
    with reference_execution():
        ex = Experts.from_modelopt(w13, w2, mode=mode, name="mlp.experts")
        y = ex(x, ids, tw)
    assert ex.mode == mode and y.shape == (t, h) and y.dtype == torch.bfloat16

    layer = moe.NVFP4MoE(None, None, experts=ex)  # every stage to its exact definition
    with reference_execution():
        checks = moe.check_stages(layer, ex.stages(x, ids, tw), x, ids, tw)
    assert all(c.passed for c in checks), [str(c) for c in checks]
    if mode == "w4a16":  # and the whole layer close to float64 (W4A4 requantizes between)

        def of(stack):
            return lambda x_: cf.NVFP4Tensor.from_modelopt(
                stack[0][x_], stack[1][x_], stack[2][x_]).dequantize(torch.float64)

        want = moe_reference(x, ids, tw, of(w13), of(w2))
        assert (y.double() - want).abs().max() / want.abs().max() < 3e-2


def test_experts_with_their_own_up_scales():
    """weight_scale_2 [E, 2] (gate, up) that differ: the up rows scaled after the GEMM;
    against the layer computed with each projection's own scale in float64."""
    e, h, i, t = 3, 64, 32, 6
    w13, w2 = _experts_modelopt(e, h, i, seed=7)
    gs = torch.stack([w13[2], w13[2] * torch.tensor([1.0, 1.5, 0.5])], dim=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, 2), generator=g)
    tw = torch.rand(t, 2, generator=g)
    with reference_execution():
        ex = Experts.from_modelopt((w13[0], w13[1], gs), w2)
        y = ex(x, ids, tw)
    assert ex.up_ratio is not None and ex.gate_up_group is None

    def w13_of(x_):
        w = cf.NVFP4Tensor.from_modelopt(w13[0][x_], w13[1][x_], gs[x_, 0]).dequantize(
            torch.float64)
        w[i:] *= float(gs[x_, 1] / gs[x_, 0])
        return w

    def w2_of(x_):
        return cf.NVFP4Tensor.from_modelopt(w2[0][x_], w2[1][x_], w2[2][x_]).dequantize(
            torch.float64)

    want = moe_reference(x, ids, tw, w13_of, w2_of)
    assert (y.double() - want).abs().max() / want.abs().max() < 3e-2


def test_experts_errors_name_the_layer():
    w13, w2 = _experts_modelopt(2, 64, 32)
    with pytest.raises(FormatError, match=r"mlp\.experts.*w13 weight_scale must be"):
        Experts.from_modelopt((w13[0], w13[1][:, :, :2], w13[2]), w2, name="mlp.experts")
    with pytest.raises(InputError, match=r"experts: w13 must be an expert stack \[E, N, K\]"):
        Experts.from_float(torch.randn(64, 128), torch.randn(64, 32), name="experts")


def test_experts_an_sm90_gpu_cannot_run_are_refused_with_the_sizes(monkeypatch):
    """On sm_90a every grouped kernel reads the packed layout (intermediate a multiple of
    64): Qwen3-30B-A3B's experts at TP 8 (I = 96 per rank) are a FormatError naming the
    layer and the sizes there, before anything runs; the exact reference runs them."""
    from cute_fp4.layers import stacks

    w13, w2 = _experts_modelopt(2, 128, 96)
    monkeypatch.setattr(stacks, "capability_major", lambda dev: 9)
    with pytest.raises(FormatError, match=r"experts\.0: sm_90a's grouped kernels read the "
                       r"packed layout only, .*intermediate \(96\) multiples of 64"):
        Experts.from_modelopt(w13, w2, mode="w4a16", name="experts.0")
    with reference_execution():
        assert Experts.from_modelopt(w13, w2, mode="w4a16").layout == "plain"


def test_modes_and_layouts_are_enums_that_read_as_their_strings():
    """A layer's mode and layout are ``Mode`` / ``Layout`` members (str enums: equal to,
    hashed and printed as their strings); strings, names in any case and members are taken
    at the edge, a typo names the closest."""
    from cute_fp4.layers import Layout, Mode

    w = cf.quantize(torch.randn(64, 128))
    lin = Linear.from_modelopt(w.data, w.scale_linear(), w.global_scale, mode="W4A16",
                               layout=Layout.PLAIN)
    assert lin.mode is Mode.W4A16 and lin.mode == "w4a16" and f"{lin.mode}" == "w4a16"
    assert lin.layout is Layout.PLAIN and {lin.layout: 1}["plain"] == 1
    with pytest.raises(InputError, match="did you mean 'plain'"):
        Linear.from_modelopt(w.data, w.scale_linear(), w.global_scale, layout="plian")
