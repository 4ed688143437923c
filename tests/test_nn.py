"""cute_fp4.nn on the CPU: convert (replacement, skip rules, reasons, shared layers), the
NVFP4Linear forward (shapes, bias, alpha, modes) with the kernel replaced by the exact
reference, ModelOpt tensors and state dicts, dtype conversions, and torch.compile traces
(one graph, the custom ops in it, no graph break). The kernels themselves run in
tests/gpu/test_nn.py."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from exact import fake_launch_path
from torch import nn

import cute_fp4 as cf
from cute_fp4 import api, reference
from cute_fp4 import bindings as cbind
from cute_fp4 import nn as cnn
from cute_fp4 import run as crun
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.layers import linear as clin
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape
from cute_fp4.packed import PackedNVFP4Weight


def _linear(k: int, n: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = _linear(64, 64)
        self.odd = _linear(48, 64)  # K not a multiple of 32
        self.narrow = _linear(64, 12)  # N not a multiple of 8
        self.mlp = nn.Sequential(_linear(64, 128, seed=1), nn.GELU(), _linear(128, 64, seed=2))
        self.head = _linear(64, 32, bias=False, seed=3)


# ----------------------------------------------------------------------------- convert

def test_convert_replaces_eligible_layers_and_reports_the_rest():
    m = Toy()
    w_before = m.mlp[0].weight.detach().clone()
    rep = cf.convert(m, skip="head")
    assert rep.model is m and rep.mode == "w4a16"
    assert rep.converted == ("q", "mlp.0", "mlp.2")
    reasons = dict(rep.skipped)
    assert set(reasons) == {"odd", "narrow", "head"}
    assert "in_features = 48 is not a multiple of 32" in reasons["odd"]
    assert "out_features = 12 is not a multiple of 8" in reasons["narrow"]
    assert reasons["head"] == "matches skip pattern 'head'"
    assert isinstance(m.q, cnn.NVFP4Linear) and isinstance(m.mlp[2], cnn.NVFP4Linear)
    assert type(m.odd) is nn.Linear and type(m.head) is nn.Linear
    assert torch.equal(m.mlp[0].weight.dequantize(), quantize(w_before).dequantize())
    assert torch.equal(m.mlp[0].bias, Toy().mlp[0].bias)
    assert "converted 3 of 6 nn.Linear layers" in str(rep) and "skipped odd: in_features" \
        in str(rep)


def test_skip_patterns_and_callables():
    rep = cf.convert(Toy(), "w4a4", skip=["mlp.*", lambda name, lin: lin.out_features == 32])
    assert rep.converted == ("q",)
    reasons = dict(rep.skipped)
    assert reasons["mlp.0"] == reasons["mlp.2"] == "matches skip pattern 'mlp.*'"
    assert reasons["head"].startswith("skip callable") and "returned True" in reasons["head"]
    assert rep.model.q.mode == "w4a4" and rep.model.q.input_scale is None

    def only_q(name, lin):
        return name != "q"

    rep = cf.convert(Toy(), skip=only_q)
    assert rep.converted == ("q",) and dict(rep.skipped)["mlp.0"] == \
        "skip callable only_q returned True"
    assert cf.convert(Toy(), skip=None).converted == ("q", "mlp.0", "mlp.2", "head")


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"mode": "w8a8"}, InputError, "mode must be one of 'w4a16', 'w4a4', got 'w8a8'"),
    ({"layout": "pakced"}, InputError, "layout must be one of 'auto', 'plain', 'packed' "
     r"\(or Layout.<NAME>\), got 'pakced'; did you mean 'packed'"),
    ({"skip": 3}, InputTypeError, "skip must be a name pattern"),
    ({"skip": ["q", 3]}, InputTypeError, "skip entries must be name patterns"),
])
def test_convert_argument_errors(kwargs, exc, match):
    m = Toy()
    with pytest.raises(exc, match=match):
        cf.convert(m, **kwargs)
    assert type(m.q) is nn.Linear  # nothing replaced before the error


def test_convert_rejects_a_non_module():
    with pytest.raises(InputTypeError, match="model must be a torch.nn.Module, got dict"):
        cf.convert({"q": _linear(64, 64)})


def test_subclasses_of_linear_are_left_alone():
    mha = nn.MultiheadAttention(64, 4, batch_first=True)  # reads out_proj.weight directly
    seq = nn.Sequential(mha)
    rep = cf.convert(seq)
    assert rep.converted == () and rep.skipped[0][0] == "0.out_proj"
    assert "NonDynamicallyQuantizableLinear is a subclass of nn.Linear" in rep.skipped[0][1]
    x = torch.randn(2, 3, 64)
    mha(x, x, x)  # still runs


def test_shared_layer_is_converted_once_and_stays_shared():
    shared = _linear(64, 64)
    m = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    rep = cf.convert(m)
    assert rep.converted == ("a.0",)
    assert m["a"][0] is m["b"][0] and isinstance(m["a"][0], cnn.NVFP4Linear)


def test_a_linear_model_is_returned_converted():
    lin = _linear(64, 32)
    rep = cf.convert(lin, "w4a4")
    assert isinstance(rep.model, cnn.NVFP4Linear) and rep.converted == ("",)
    rep = cf.convert(_linear(40, 32))
    assert type(rep.model) is nn.Linear and "in_features = 40" in rep.skipped[0][1]


# ----------------------------------------------------------------------------- forward

@pytest.fixture
def fake_kernels(monkeypatch):
    """The kernel path replaced by the exact reference (float64, rounded once), and the
    fused quantization by cute_fp4.quantize (bit-identical, tests/gpu). Records calls."""
    calls = []

    def kernel_for(schedule, m, n, k, a_format, out_dtype, device_index, packed=False,
                   b_format="nvfp4"):
        assert device_index == -1  # the CPU
        calls.append(("kernel", schedule, m, n, k, a_format, out_dtype))
        return types.SimpleNamespace(out_dtype=out_dtype)

    def run(kern, a, w, alpha, dims, out=None, early=False):
        """As the kernel: reads A's memory as [M, K], writes C's as [M, N] (``out``, of any
        contiguous shape, when given)."""
        calls.append(("run", dims, alpha))
        if isinstance(w, PackedNVFP4Weight):
            w = w.unpack()
        assert isinstance(w, NVFP4Tensor)
        m, n, k, _ = dims
        if not isinstance(a, NVFP4Tensor):
            assert a.is_contiguous() and a.numel() == m * k
            a = a.view(m, k)
        y = reference.gemm(a, w, alpha, out_dtype=kern.out_dtype)
        if out is None:
            return y
        assert out.is_contiguous() and out.numel() == m * n and out.dtype == y.dtype
        out.view(m, n).copy_(y)
        return out

    def quant(x, global_scale=None):
        calls.append(("quantize", tuple(x.shape), global_scale))
        return quantize(x, global_scale)

    fake_launch_path(monkeypatch, kernel_for, run)
    def dequant(a):
        calls.append(("dequantize", tuple(a.shape)))
        return a.block_values(torch.bfloat16)

    def dequant_alpha(a, other):
        return dequant(a), a.global_scale * other

    def values(x, global_scale):
        calls.append(("quantize_values", tuple(x.shape), global_scale))
        return quantize(x, global_scale).block_values(torch.bfloat16)

    monkeypatch.setattr(crun, "quantize_activation", quant)
    monkeypatch.setattr(crun, "quantize_values", values)
    monkeypatch.setattr(cbind.quant, "dequantize_activation", dequant)
    monkeypatch.setattr(cbind.quant, "dequantize_with_alpha", dequant_alpha)
    return calls


def _expected(layer: cnn.NVFP4Linear, x: torch.Tensor, xq=None) -> torch.Tensor:
    """Independent of the layer's plumbing: dequantized weight, float64."""
    a = (xq.dequantize(torch.float64) if xq is not None else x.double()).reshape(
        -1, layer.in_features)
    y = a @ layer.weight.dequantize(torch.float64).T
    if layer.bias is not None:
        y = y.to(x.dtype).double() + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("shape", [(64,), (5, 64), (2, 3, 64), (2, 2, 3, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_w4a16_forward_shapes_bias_and_alpha(fake_kernels, shape, bias):
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32, bias))
    x = torch.randn(*shape, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (*shape[:-1], 32) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _expected(layer, x), rtol=2**-7, atol=1e-6)
    m = x.numel() // 64
    assert fake_kernels[0] == ("kernel", "auto", m, 32, 64, "bf16", torch.bfloat16)
    assert fake_kernels[1][1] == (m, 32, 64, "bf16")
    assert fake_kernels[1][2] is layer.weight_scale_2  # alpha: the weight's global scale


def test_fp16_and_non_contiguous_inputs(fake_kernels):
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32), schedule="sm90_decode")
    x = torch.randn(64, 6, dtype=torch.float16).T  # [6, 64], not contiguous
    y = layer(x)
    assert y.dtype == torch.float16 and y.shape == (6, 32)
    torch.testing.assert_close(y, layer(x.contiguous()), rtol=0, atol=0)
    assert fake_kernels[0] == ("kernel", "sm90_decode", 6, 32, 64, "fp16", torch.float16)


@pytest.mark.parametrize("static", [True, False])
def test_w4a4_quantizes_with_the_input_scale(fake_kernels, static):
    lin = _linear(64, 32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    gs = float(x.float().abs().max()) / 2688 * 2 if static else None
    layer = cnn.NVFP4Linear.from_linear(lin, "w4a4", input_scale=gs)
    y = layer(x)
    xq = quantize(x, gs)
    torch.testing.assert_close(y.double(), _expected(layer, x, xq), rtol=2**-7, atol=1e-6)
    q_call, k_call, r_call = fake_kernels
    assert q_call[0] == "quantize" and q_call[1] == (3, 64)
    assert (q_call[2] is layer.input_scale) if static else q_call[2] is None
    assert k_call[5] == "nvfp4"
    if static:  # alpha computed once, at construction
        assert r_call[2] is layer.alpha
        assert float(layer.alpha) == pytest.approx(gs * float(layer.weight_scale_2), rel=1e-6)
    else:  # per call, the product gemm would compute, as a tensor the binding can take
        assert layer.alpha is None
        assert torch.equal(r_call[2], layer.weight_scale_2 * xq.global_scale)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("schedule", ["auto", "sm90_rs_packed"])
def test_packed_w4a4_runs_the_w4a16_kernel_on_the_decoded_activation(fake_kernels, static,
                                                                      schedule):
    """A packed W4A4 layer with schedule="auto" takes the activation's BF16 block values
    (static scale: quantized to them in one pass; dynamic: quantized, then decoded) and
    runs a W4A16 kernel with the scales' product as alpha (the same products as W4A4); a
    named schedule keeps the W4A4 kernel."""
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    gs = float(x.float().abs().max()) / 2688 * 2 if static else None
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32), "w4a4", input_scale=gs,
                                        layout="packed", schedule=schedule)
    y = layer(x)
    assert y.shape == (2, 3, 32)
    xq = quantize(x.reshape(6, 64), gs)
    torch.testing.assert_close(y.double(), _expected(layer, x, xq), rtol=2**-7, atol=1e-6)
    steps = [c[0] for c in fake_kernels]
    k_call, r_call = fake_kernels[-2:]
    if schedule != "auto":
        assert steps == ["quantize", "kernel", "run"] and k_call[5] == "nvfp4"
        return
    assert steps == (["quantize_values", "kernel", "run"] if static else
                     ["quantize", "dequantize", "kernel", "run"])
    assert k_call[5] == "bf16" and r_call[1] == (6, 32, 64, "bf16")
    if static:
        assert r_call[2] is layer.alpha
    else:  # the dynamic scale's product with the weight's, on the device
        assert float(r_call[2]) == pytest.approx(float(xq.global_scale)
                                                 * float(layer.weight_scale_2), rel=1e-6)


def test_empty_batch_gives_an_empty_output(fake_kernels):
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32))
    y = layer(torch.empty(0, 4, 64, dtype=torch.bfloat16))
    assert y.shape == (0, 4, 32) and fake_kernels == []


def test_forward_never_revalidates_the_weight(fake_kernels, monkeypatch):
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32))
    view = layer.weight
    assert layer.weight is view  # built once

    def boom(*args, **kwargs):
        raise AssertionError("NVFP4Tensor.__init__ (it syncs with the GPU) was called")

    monkeypatch.setattr(NVFP4Tensor, "__init__", boom)
    layer(torch.randn(2, 64, dtype=torch.bfloat16))
    layer.weight_packed = layer.weight_packed.clone()  # replaced buffers: a new view
    assert layer.weight is not view and layer.weight.data is layer.weight_packed


@pytest.mark.parametrize("x, exc, match", [
    (torch.zeros(2, 32, dtype=torch.bfloat16), InputError, "input has 32 features"),
    (torch.zeros(2, 64), InputError, "input must be bfloat16 or float16, got torch.float32"),
    (torch.zeros((), dtype=torch.bfloat16), InputError, "input has 0 features"),
    ([1.0] * 64, InputTypeError, "input must be a torch.Tensor, got list"),
])
def test_forward_errors(x, exc, match):
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32))
    with pytest.raises(exc, match=match):
        layer(x)


def test_cpu_forward_without_fakes_is_a_device_error():
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32))
    with pytest.raises(DeviceError):
        layer(torch.zeros(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("make, exc, match", [
    (lambda w: cnn.NVFP4Linear(w, mode="w8a8"), InputError, "mode must be"),
    (lambda w: cnn.NVFP4Linear(w, bias=torch.zeros(3)), InputError,
     r"bias must have shape \(32,\), got \(3,\)"),
    (lambda w: cnn.NVFP4Linear(w.data), InputTypeError, "weight must be an NVFP4Tensor"),
    (lambda w: cnn.NVFP4Linear(w, mode="w4a4", input_scale=0.0), FormatError,
     "input_scale must be finite and > 0, got 0"),
    (lambda w: cnn.NVFP4Linear(w, mode="w4a4", input_scale=torch.ones(2)), FormatError,
     "input_scale must be a scalar, got 2 elements"),
])
def test_construction_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make(quantize(torch.randn(32, 64)))


def test_module_dtype_conversion_keeps_the_nvfp4_buffers():
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32), "w4a4", input_scale=0.01)
    before = {n: b.clone() for n, b in layer.named_buffers()}
    for convert_dtype in (lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                          lambda m: m.float()):
        convert_dtype(layer)
        for n, b in layer.named_buffers():
            assert b.dtype == before[n].dtype and torch.equal(b, before[n]), n
    assert layer.bias.dtype == torch.float32  # the bias follows the module (last: float())
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert "mode=w4a4, input_scale=static" in repr(layer)


# ----------------------------------------------------------------------------- checkpoints

def _modelopt_tensors(n: int, k: int, seed: int = 0):
    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return w, {"weight": w.data.clone(), "weight_scale": w.scale_linear().clone(),
               "weight_scale_2": w.global_scale.clone(), "input_scale": torch.tensor(0.02)}


def test_from_modelopt_matches_the_quantized_weight():
    w, t = _modelopt_tensors(32, 64)
    layer = cnn.NVFP4Linear.from_modelopt(**t)
    assert layer.mode == "w4a4" and float(layer.input_scale) == pytest.approx(0.02)
    assert torch.equal(layer.weight.dequantize(), w.dequantize())
    assert torch.equal(layer.weight_scale.view(torch.uint8), w.scale.view(torch.uint8))
    del t["input_scale"]
    assert cnn.NVFP4Linear.from_modelopt(**t).mode == "w4a16"


def test_state_dict_is_modelopt_form_and_loads_in_place():
    w, t = _modelopt_tensors(32, 64)
    src = cnn.NVFP4Linear(w, torch.arange(32.0), "w4a4", input_scale=0.02)
    sd = src.state_dict()
    assert list(sd) == ["weight", "weight_scale", "weight_scale_2", "input_scale", "bias"]
    assert sd["weight_scale"].shape == (32, 4) and sd["weight_scale"].dtype == \
        torch.float8_e4m3fn
    assert torch.equal(sd["weight_scale"].view(torch.uint8), t["weight_scale"].view(torch.uint8))
    dst = cnn.NVFP4Linear.from_linear(_linear(64, 32, seed=9), "w4a4")  # dynamic until loaded
    ptrs = {n: b.data_ptr() for n, b in dst.named_buffers() if b is not None}
    assert dst.load_state_dict(sd) is not None
    for n, b in dst.named_buffers():
        assert torch.equal(b, dict(src.named_buffers())[n]), n
        if n in ptrs:
            assert b.data_ptr() == ptrs[n], f"{n} was replaced, not overwritten"
    assert torch.equal(dst.bias, src.bias)
    assert dst.alpha is not None and torch.equal(dst.alpha, src.alpha)


def test_load_reports_missing_keys_and_w4a16_ignores_input_scale():
    _, t = _modelopt_tensors(32, 64)
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32, bias=False))
    res = layer.load_state_dict(dict(t))  # input_scale: not used by W4A16, not unexpected
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert layer.input_scale is not None and layer.alpha is None
    partial = {k: v for k, v in t.items() if k != "weight_scale_2"}
    with pytest.raises(RuntimeError, match="Missing key.*weight_scale_2"):
        layer.load_state_dict(partial)
    res = layer.load_state_dict(partial, strict=False)
    assert res.missing_keys == ["weight_scale_2"]


def test_a_converted_model_loads_a_modelopt_state_dict():
    model = nn.Sequential(_linear(64, 64), nn.ReLU(), _linear(64, 32, seed=4))
    ckpt = {}
    refs = {}
    for i, (n, k) in ((0, (64, 64)), (2, (32, 64))):
        w, t = _modelopt_tensors(n, k, seed=10 + i)
        refs[i] = w
        ckpt.update({f"{i}.{key}": v for key, v in t.items()})
        ckpt[f"{i}.bias"] = torch.full((n,), float(i))
    cf.convert(model, "w4a4")
    model.load_state_dict(ckpt)
    for i in (0, 2):
        assert torch.equal(model[i].weight.dequantize(), refs[i].dequantize())
        assert model[i].input_scale is not None and torch.equal(model[i].bias,
                                                                ckpt[f"{i}.bias"])


def test_convert_from_a_state_dict_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 64))
    w, t = _modelopt_tensors(32, 64)
    sd = {f"0.{key}": v for key, v in t.items()} | {"0.bias": torch.ones(32)}
    rep = cf.convert(model, "w4a4", state_dict=sd)
    assert rep.converted == ("0",)
    assert "meta device" in dict(rep.skipped)["1"]
    assert torch.equal(model[0].weight.dequantize(), w.dequantize())
    assert float(model[0].input_scale) == pytest.approx(0.02)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(weight_scale=t["weight_scale"][:, :2]), r"weight_scale must be \[N, "
     r"K/16\] = \[32, 4\]"),
    (lambda t: t["weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x7F),
     "weight_scale holds 1 NaN bytes"),
    (lambda t: t["weight_scale"].view(torch.uint8).__setitem__((1, 1), 0x81),
     "weight_scale holds 1 negative bytes"),
    (lambda t: t.update(weight_scale_2=torch.tensor(-1.0)), "global_scale must be finite"),
    (lambda t: t.update(input_scale=torch.tensor(float("inf"))), "input_scale must be finite"),
])
def test_modelopt_errors(edit, match):
    _, t = _modelopt_tensors(32, 64)
    edit(t)
    with pytest.raises(FormatError, match=match):
        cnn.NVFP4Linear.from_modelopt(**t)


def test_load_modelopt_of_another_shape_is_refused():
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32))
    _, t = _modelopt_tensors(64, 64)
    del t["input_scale"]
    with pytest.raises(FormatError, match=r"\(out_features=32, in_features=64\): weight "
                       r"must be uint8 \[N, K/2\] = \[32, 32\], got uint8 \[64, 32\]"):
        layer.load_modelopt(**t)


# ----------------------------------------------------------------------------- ops, compile

def test_op_body_wraps_operands_without_the_checked_constructor(monkeypatch):
    """The body of cute_fp4::mm must not build checked NVFP4Tensors: the global-scale check
    reads the GPU, which invalidates a CUDA-graph capture (reduce-overhead)."""
    w = quantize(torch.randn(32, 64))

    def boom(*args, **kwargs):
        raise AssertionError("NVFP4Tensor.__init__ called in the op body")

    monkeypatch.setattr(NVFP4Tensor, "__init__", boom)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="CUDA device"):
        api.mm(x, None, w.data, w.scale, w.global_scale, 64, torch.bfloat16, "auto")
    with pytest.raises(InputTypeError, match="alpha must be a torch.Tensor, got NoneType"):
        api.mm(x, None, w.data, w.scale, None, 64)


def test_fake_implementations_have_the_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = api.register_op()
    with FakeTensorMode():
        x = torch.empty(3, 96, dtype=torch.bfloat16)
        data, scale = ops.quantize(x, torch.empty((), dtype=torch.float32))
        d2, s2, gs = ops.quantize_dynamic(x)
        b = torch.empty(40, 48, dtype=torch.uint8)
        y = ops.mm(data, scale, b, torch.empty(scale_shape(40, 96), dtype=torch.float8_e4m3fn),
                   gs, 96, torch.float16, "auto")
    assert data.shape == d2.shape == (3, 48) and data.dtype == torch.uint8
    assert scale.shape == s2.shape == (128, 8) and scale.dtype == torch.float8_e4m3fn
    assert gs.shape == () and gs.dtype == torch.float32
    assert y.shape == (3, 40) and y.dtype == torch.float16


def _trace(module: nn.Module, x: torch.Tensor) -> str:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(module, backend=backend, fullgraph=True)
    with pytest.raises(DeviceError):  # traced; the ops run only on a GPU
        f(x)
    assert len(graphs) == 1
    return graphs[0].code


@pytest.mark.parametrize("mode, scale, ops", [
    ("w4a16", None, ["cute_fp4.mm"]),
    ("w4a4", 0.01, ["cute_fp4.quantize(", "cute_fp4.mm"]),
    ("w4a4", None, ["cute_fp4.quantize_dynamic", "cute_fp4.mm"]),
])
def test_torch_compile_traces_one_graph(mode, scale, ops):
    model = nn.Sequential(_linear(64, 64), nn.SiLU(), _linear(64, 32, bias=False))
    cf.convert(model, mode)
    for layer in (model[0], model[2]):
        if scale is not None:
            layer.load_modelopt(layer.weight.data, layer.weight.scale_linear(),
                                layer.weight_scale_2, input_scale=scale)
    code = _trace(model, torch.randn(2, 3, 64, dtype=torch.bfloat16))
    for op in ops:
        assert code.count(op) == 2, (op, code)
    assert ".item()" not in code
    if mode == "w4a16":
        assert "cute_fp4.quantize" not in code


def test_torch_compile_of_a_schedule_object_is_refused():
    from cute_fp4 import catalogue

    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32),
                                        schedule=catalogue.get("sm90_decode"))
    torch._dynamo.reset()
    f = torch.compile(layer, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="catalogue name or 'auto'"):
        f(torch.randn(2, 64, dtype=torch.bfloat16))


def test_set_input_scale_switches_w4a4_to_static_in_place():
    layer = cnn.NVFP4Linear.from_linear(_linear(64, 32), "w4a4")
    assert layer.alpha is None
    layer.set_input_scale(torch.tensor(0.5))
    alpha = layer.alpha
    assert float(alpha) == pytest.approx(0.5 * float(layer.weight_scale_2), rel=1e-6)
    layer.set_input_scale(0.25)
    assert layer.alpha is alpha and float(alpha) == pytest.approx(
        0.25 * float(layer.weight_scale_2), rel=1e-6)  # in place: graphs see it
    with pytest.raises(FormatError, match="input_scale must be finite and > 0, got nan"):
        layer.set_input_scale(float("nan"))


# ----------------------------------------------------------------------------- the model

def _model_decode():
    import importlib.util
    from pathlib import Path

    if "model_decode" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "perf" / "model_decode.py"
        spec = importlib.util.spec_from_file_location("model_decode", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["model_decode"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["model_decode"]


def _tiny(md):
    return md.Config(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                     vocab=96, context=16)


def _full_forward(model, c, ids: torch.Tensor) -> torch.Tensor:
    """A causal forward over whole sequences ``ids`` [B, T] written without the decode
    loop's cache, mask or rotary tables: logits [B, T, vocab]."""
    def rms(x, norm):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps))

    def rope(x):  # [B, heads, T, D]
        t = torch.arange(x.shape[2], dtype=torch.float64)
        freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64)
                                / c.head_dim)
        ang = torch.outer(t, freq).repeat(1, 2).to(x.dtype)
        h = c.head_dim // 2
        return x * ang.cos() + torch.cat((-x[..., h:], x[..., :h]), -1) * ang.sin()

    b, t = ids.shape
    body = model.model
    h = body.embed_tokens(ids)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer in body.layers:
        a = layer.self_attn
        x = rms(h, layer.input_layernorm)
        q = rope(a.q_proj(x).view(b, t, c.heads, c.head_dim).transpose(1, 2))
        k = rope(a.k_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2))
        v = a.v_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) / c.head_dim ** 0.5
        o = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        h = h + a.o_proj(o.transpose(1, 2).reshape(b, t, c.heads * c.head_dim))
        h = h + layer.mlp(rms(h, layer.post_attention_layernorm))
    return model.lm_head(rms(h, body.norm))


def test_model_decode_step_is_a_llama_forward():
    md = _model_decode()
    c = _tiny(md)
    model, impl = md.build_model(c, "local", device="cpu", dtype=torch.float32)
    assert impl == "local"
    st = md.DecodeState(c, 3, prefix=0, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, c.vocab, (6, 3, 1), generator=torch.Generator().manual_seed(0))
    logits = md.teacher_forced_logits(model, st, ids)  # [T, B, vocab]
    with torch.no_grad():
        ref = _full_forward(model, c, ids[:, :, 0].T)
    torch.testing.assert_close(logits, ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
    assert int(st.pos) == 6


def test_model_decode_hf_tree_and_conversion():
    pytest.importorskip("transformers")
    md = _model_decode()
    c = _tiny(md)
    model, impl = md.build_model(c, "hf", device="cpu", dtype=torch.float32)
    assert impl == "hf" and type(model).__name__ == "LlamaForCausalLM"
    st = md.DecodeState(c, 2, prefix=0, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, c.vocab, (5, 2, 1), generator=torch.Generator().manual_seed(1))
    logits = md.teacher_forced_logits(model, st, ids)
    with torch.no_grad():  # transformers' own forward over the whole sequence
        ref = model(ids[:, :, 0].T).logits
    torch.testing.assert_close(logits, ref.transpose(0, 1).float(), rtol=1e-4, atol=1e-5)
    amax = md.calibrate(model, st, ids)
    assert len(amax) == 7 * c.layers
    q, info = md.quantized_copy(model.to(torch.bfloat16), "w4a4", amax)
    assert info["converted"] == 7 * c.layers and info["skipped"][0].startswith("lm_head")
    layer = q.get_submodule("model.layers.1.mlp.down_proj")
    assert isinstance(layer, cnn.NVFP4Linear) and layer.input_scale is not None
    assert float(layer.input_scale) == pytest.approx(
        float(amax["model.layers.1.mlp.down_proj"]) / 2688, rel=1e-6)
    assert md.weight_bytes(q) < md.weight_bytes(model) / 3


def test_model_decode_bars_and_report():
    md = _model_decode()
    rows = [{"model": "bf16", "batch": 1, "step": "torch", "eager_ms": 3.0, "graph_ms": 1.0},
            {"model": "w4a16", "batch": 1, "step": "torch", "eager_ms": 3.5, "graph_ms": 0.5},
            {"model": "bf16", "batch": 1, "step": "compiled", "eager_ms": 2.0,
             "graph_ms": 0.6, "vs_eager_rel_err": 1e-3},
            {"model": "w4a16", "batch": 1, "step": "compiled", "eager_ms": 1.0,
             "graph_ms": 0.5, "vs_eager_rel_err": 2e-3},
            {"model": "w4a4", "batch": 1, "step": "torch", "error": "DeviceError: no kernel"}]
    res = {"config": dataclasses.asdict(md.Config()), "impl": "local", "prefix": 470,
           "environment": {"gpu": "H200", "date": "today", "torch": "2", "cuda": "13",
                           "cutlass_dsl": "4.8.1", "transformers": None},
           "steps": 32, "repeats": 3, "w4a4_scale": "static", "results": rows,
           "accuracy": {"w4a16": {"logits_rel_err_mean": 0.1, "logits_rel_err_max": 0.2,
                                  "top1_agreement": 0.9}, "w4a4": {"error": "x"}},
           "weight_bytes": {"bf16": 2**30, "w4a16": 2**28},
           "profiles": {"w4a16": {"span_us": 500.0, "kernels": 9, "gemm_busy_us": 300.0,
                                  "cute_fp4_busy_us": 260.0, "projections_floor_us": 200.0,
                                  "overlapping_neighbours": 2}},
           "convert": {"w4a16": {"converted": 56}}, "wall_s": 100.0, "build_s": 5.0}
    bars = res["bars"] = md.bars(res)  # issue 44's: >= 1.75x BF16, busy <= 1.3x floor
    assert [(b["value"], b["passed"]) for b in bars] == [(2.0, True), (1.2, False),
                                                         (1.3, True)]
    assert "compiled step" in bars[1]["bar"]
    text = md.markdown(res)
    assert "| w4a16 | torch | 1 | 3.500 | 0.500 | 2,000 | 2.00x | 0.86x | - | - |" in text
    assert "| w4a16 | compiled | 1 | 1.000 | 0.500 | 2,000 | 1.20x | 2.00x | - | - |" in text
    assert "| w4a16 | 500.0 | 9 | 300.0 | 260.0 | 200.0 | 1.30 | 2 |" in text
    assert "| w4a4 | torch | 1 | error: DeviceError: no kernel" in text
    assert "worst relative difference: 2.00e-03" in text
    assert "| w4a16 | 256 MiB | - | 0.1000 / 0.2000 | 0.900 |" in text
    assert "busy <= 1.3x" not in text and "1.3x their weights' read floor: 1.3x, PASS" in text


def test_model_decode_moe_tree_and_conversion():
    """The Qwen3-MoE decoder (q/k norms, routed experts): its decode step, quantized by
    hf.quantize_model, and the weight bytes a step reads (every expert, or the expected
    share for a batch)."""
    pytest.importorskip("transformers")
    md = _model_decode()
    c = dataclasses.replace(md.moe_config(2, 96, 16), hidden=64, heads=4, kv_heads=2,
                            head_dim=16, experts=8, experts_per_token=2, moe_intermediate=32)
    model, impl = md.build_model(c, "hf", device="cpu", dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    st = md.DecodeState(c, 2, prefix=0, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, c.vocab, (3, 2, 1), generator=torch.Generator().manual_seed(2))
    assert md.teacher_forced_logits(model, st, ids).shape == (3, 2, c.vocab)
    q, info = md.quantized_copy(model.to(torch.bfloat16), "w4a16", None)
    assert info["converted"] == 5 * c.layers  # q, k, v, o and the experts of each layer
    every, one = md.weight_bytes(model), md.weight_bytes(model, 1)
    experts = 2 * c.layers * c.experts * 3 * c.hidden * c.moe_intermediate  # BF16
    assert every - one == pytest.approx(experts * (1 - 2 / 8), rel=1e-6)
    assert md.weight_bytes(q) < every / 2  # NVFP4 (tiny rows: padded scale atoms)


def test_model_decode_step_traces_whole_for_compile():
    """The compiled step kind is one graph (``fullgraph``) computing the eager step."""
    md = _model_decode()
    c = _tiny(md)
    model, _ = md.build_model(c, "local", device="cpu", dtype=torch.float32)
    st = md.DecodeState(c, 2, prefix=3, device="cpu", dtype=torch.float32)
    torch._dynamo.reset()
    step = md.step_function(model, st, compiled=True, backend="eager")
    with torch.no_grad():
        st.reset()
        ref = md.decode_step(model, st)
        st.reset()
        got = step()
    torch.testing.assert_close(got, ref)
    assert int(st.pos) == 4  # the compiled step advanced the position too


# ----------------------------------------------------------------------------- layout

def test_layout_auto_is_plain_off_sm90_and_packed_round_trips_the_state_dict():
    from cute_fp4.packed import PackedNVFP4Weight, pack

    w, _ = _modelopt_tensors(72, 128)
    assert cnn.NVFP4Linear(w).layout == "plain"  # a CPU tensor: no SM90 here
    packed = cnn.NVFP4Linear(w, layout="packed")
    stored = packed.stored_weight
    assert isinstance(stored, PackedNVFP4Weight) and stored.shape == (72, 128)
    assert torch.equal(packed.weight_packed, pack(w.data))
    assert torch.equal(packed.weight.data, w.data)  # .weight stays the plain NVFP4Tensor
    assert "layout=packed" in repr(packed)
    sd = packed.state_dict()  # the plain ModelOpt form, bit for bit
    plain_sd = cnn.NVFP4Linear(w, layout="plain").state_dict()
    assert list(sd) == list(plain_sd)
    for key in sd:
        assert torch.equal(sd[key].reshape(-1).view(torch.uint8),
                           plain_sd[key].reshape(-1).view(torch.uint8)), key
    dst = cnn.NVFP4Linear.from_linear(_linear(128, 72, seed=4, bias=False), layout="packed")
    ptr = dst.weight_packed.data_ptr()
    dst.load_state_dict(plain_sd)
    assert dst.weight_packed.data_ptr() == ptr and torch.equal(dst.weight_packed, pack(w.data))
    assert torch.equal(dst.weight.data, w.data)


def test_layout_auto_follows_the_schedule_on_sm90(monkeypatch):
    """On SM90 "auto" packs the weight only for schedules that read the packed layout
    ("auto" and rs_packed ones, W4A16 and W4A4 alike); a plain-layout schedule keeps the
    plain weight, so a layer built with one still runs; an unknown name is refused at
    construction."""
    from cute_fp4 import catalogue
    from cute_fp4.layers import common

    monkeypatch.setattr(common, "capability_major", lambda dev: 9)
    w, _ = _modelopt_tensors(72, 128)
    for mode in ("w4a16", "w4a4"):
        assert cnn.NVFP4Linear(w, mode=mode).layout == "packed"
        assert cnn.NVFP4Linear(w, mode=mode, schedule="sm90_rs_packed_m64").layout == "packed"
        assert cnn.NVFP4Linear(w, mode=mode, schedule="sm90_default").layout == "plain"
        s = catalogue.get("sm90_rs_packed").replace(split_k=2)
        assert cnn.NVFP4Linear(w, mode=mode, schedule=s).layout == "packed"
        assert cnn.NVFP4Linear(w, mode=mode, schedule=catalogue.get("sm90_decode")
                               ).layout == "plain"
    with pytest.raises(InputError, match="did you mean 'sm90_rs_packed'"):
        cnn.NVFP4Linear(w, schedule="sm90_rs_packd")
    monkeypatch.setattr(common, "capability_major", lambda dev: 0)
    assert cnn.NVFP4Linear(w).layout == "plain"


def test_layout_errors_and_convert_layout():
    w, _ = _modelopt_tensors(32, 96)  # K = 96: not a multiple of 64
    with pytest.raises(FormatError, match="multiple of 64"):
        cnn.NVFP4Linear(w, layout="packed")
    assert cnn.NVFP4Linear(w).layout == "plain"
    with pytest.raises(InputError, match="layout must be one of"):
        cnn.NVFP4Linear(w, layout="fragment")
    model = nn.Sequential(_linear(64, 64), nn.SiLU(), _linear(64, 32))
    with pytest.raises(InputError, match="layout must be one of"):
        cf.convert(model, layout="bogus")
    cf.convert(model, layout="packed")
    assert model[0].layout == model[2].layout == "packed"


def test_packed_layer_traces_the_packed_op():
    model = nn.Sequential(_linear(64, 64), nn.SiLU(), _linear(64, 32, bias=False))
    cf.convert(model, "w4a16", layout="packed")
    code = _trace(model, torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert code.count("cute_fp4.mm_packed") == 2, code
    assert ".item()" not in code


def test_packed_fake_implementation_has_the_kernel_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = api.register_op()
    with FakeTensorMode():
        x = torch.empty(3, 128, dtype=torch.bfloat16)
        b = torch.empty(128, 64, dtype=torch.uint8)  # 72 rows padded to 128
        y = ops.mm_packed(x, None, b, torch.empty(scale_shape(72, 128),
                                                  dtype=torch.float8_e4m3fn),
                          torch.empty((), dtype=torch.float32), 72, 128, torch.bfloat16, "auto")
    assert y.shape == (3, 72) and y.dtype == torch.bfloat16


def test_emit_nvfp4_hands_the_next_layer_its_activation(monkeypatch):
    """emit_nvfp4(scale): forward is gemm(..., nvfp4_out=scale) (the epilogue quantizes;
    tests/gpu/test_fused_epilogue.py holds its bytes to quantize's); an NVFP4Tensor input
    goes into a W4A4 layer as it is; typed refusals."""
    calls = []

    def fake_run(call):  # api.run_call
        a = quantize(call.a, call.input_scale) if call.quantize_a else call.a
        calls.append((a, {"nvfp4_out": call.nvfp4_out, "bias": call.bias,
                          "out_dtype": call.out_dtype}))
        return "out"

    monkeypatch.setattr(clin, "run_call", fake_run)
    w = quantize(torch.randn(64, 128))
    first = cnn.NVFP4Linear(w, bias=torch.randn(64, dtype=torch.bfloat16), layout="plain")
    second = cnn.NVFP4Linear(quantize(torch.randn(32, 64)), mode="w4a4", input_scale=0.01,
                             layout="plain")
    first.emit_nvfp4(second.input_scale)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert first(x) == "out"
    a, kw = calls[-1]
    assert a.shape == (3, 128) and float(kw["nvfp4_out"]) == pytest.approx(0.01)
    assert kw["bias"].dtype == torch.float32 and kw["out_dtype"] == torch.bfloat16
    h = quantize(torch.randn(3, 64), 0.01)
    assert second(h) == "out" and calls[-1][0] is h and calls[-1][1]["nvfp4_out"] is None
    with pytest.raises(InputError, match="an NVFP4 input needs mode='w4a4'"):
        first(h)
    first.emit_nvfp4(None)
    assert first.out_scale is None
