"""cute_fp4.nn on a GPU: NVFP4Linear against the exact reference, torch.compile
(fullgraph, and mode="reduce-overhead", i.e. CUDA graphs) against eager for a module and
for a plain function calling gemm, manual CUDA-graph capture of the eager forward, no host
sync and no allocation beyond the outputs per call, ModelOpt loading, convert() of a model
against its BF16 original. Modes: W4A16 (SM90 only), W4A4 with a static (calibrated) and
a dynamic activation scale."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cute_fp4 as cf
from cute_fp4 import nn as cnn
from cute_fp4 import reference, workspaces
from cute_fp4.api import make_operands
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

# (mode, static input scale)
MODES = [("w4a16", False), ("w4a4", True), ("w4a4", False)]
IDS = ["w4a16", "w4a4-static", "w4a4-dynamic"]


def _skip_unsupported(mode: str) -> None:
    if mode not in selection.modes():
        selection.skip_unless_w4a16()


def _layer(mode: str, static: bool, k: int = 640, n: int = 256, bias: bool = True,
           seed: int = 0) -> tuple[nn.Linear, cnn.NVFP4Linear]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    # inputs are ~N(0, 1): a calibrated amax of 4.5 saturates a few elements, as in use
    return lin, cnn.NVFP4Linear.from_linear(lin, mode, input_scale=4.5 / 2688 if static
                                            else None)


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)


def _captured(module, x: torch.Tensor):
    """Run ``module`` on ``x`` once outside a capture (kernels resolved and compiled), capture
    one call in a CUDA graph, put new values into ``x`` and replay: (graph, the captured
    output, the warm-up's output)."""
    want = module(x).clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = module(x)
    x.copy_(_x(*x.shape, seed=5))
    g.replay()
    return g, y, want


def _activation(layer: cnn.NVFP4Linear, x2: torch.Tensor):
    from cute_fp4.quant import quantize_activation

    return quantize_activation(x2, layer.input_scale) if layer.mode == "w4a4" else x2


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_forward_matches_the_reference(mode, static):
    _skip_unsupported(mode)
    _, layer = _layer(mode, static, bias=False)
    x = _x(2, 5, 640)
    y = layer(x)
    assert y.shape == (2, 5, 256) and y.dtype == torch.bfloat16
    a = _activation(layer, x.reshape(-1, 640))
    res = reference.check(y.reshape(-1, 256), a, layer.weight)
    assert res.passed, str(res)
    # the bias is added in the output's dtype, after the GEMM
    _, with_bias = _layer(mode, static, bias=True)
    yb = with_bias(x)
    torch.testing.assert_close(yb, (y.float() + with_bias.bias.float()).to(torch.bfloat16),
                               rtol=0, atol=0)


def _single(mode, static):
    return nn.Sequential(_layer(mode, static)[1])


def _two_layers(mode, static):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(640, 512), nn.SiLU(), nn.Linear(512, 256)).cuda()
    m = m.to(torch.bfloat16)
    cf.convert(m, mode)
    if static:
        for layer in (m[0], m[2]):
            w = layer.weight
            layer.load_modelopt(w.data, w.scale_linear(), w.global_scale,
                                input_scale=4.5 / 2688)
    return m


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_compiled_module_matches_eager(mode, static, compile_mode):
    _skip_unsupported(mode)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    three_d = [(4, 3, 640)] * 3  # record, then replays
    for build, exact, shapes in ((_single, True, [*three_d, (16, 640)]),
                                 (_two_layers, False, three_d)):
        model = build(mode, static)
        f = torch.compile(model, mode=compile_mode, fullgraph=True)
        for i, shape in enumerate(shapes):
            x = _x(*shape, seed=10 + i)  # new data each call: a replay must read it
            got = f(x).clone()
            want = model(x)
            if exact:  # the same kernels on the same operands
                assert torch.equal(got, want), f"call {i}: compiled != eager"
            else:  # SiLU compiled by inductor may round differently, so codes may flip
                torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    if compile_mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("shape", [(16, 256, 640), (16, 1024, 8192)], ids=["plain", "split-k"])
def test_gemm_function_under_reduce_overhead(fmt, shape):
    _skip_unsupported("w4a16" if fmt == "bf16" else "w4a4")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def f(x, w):
        return cf.gemm(x, w) * 2

    for seed in range(3):
        a, b = make_operands(*shape, fmt, seed=seed)
        got = f(a, b).clone()
        assert torch.equal(got / 2, cf.gemm(a, b)), f"replay {seed} differs from eager"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_manual_graph_capture_of_the_eager_forward(mode, static):
    _skip_unsupported(mode)
    _, layer = _layer(mode, static)
    x = _x(1, 640)
    g, y, want = _captured(layer, x)
    assert torch.equal(y, layer(x)) and not torch.equal(y, want)
    # the weights load in place: the captured graph reads the new ones
    _, other = _layer(mode, static, seed=7)
    layer.load_state_dict(other.state_dict())
    g.replay()
    assert torch.equal(y, other(x))


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_forward_has_no_host_sync(mode, static):
    _skip_unsupported(mode)
    _, layer = _layer(mode, static)
    x = _x(3, 640)
    layer(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16])
def test_decoder_shapes_have_no_host_sync(mode, static, n, k, m):
    """A Llama layer's projection shapes at decode batch sizes, where the heuristics pick
    split-K (the eager workspace memo and the capture reserve run) and, on SM90, the
    fragment-order weight: no synchronising call, output against the reference."""
    _skip_unsupported(mode)
    _, layer = _layer(mode, static, k=k, n=n, bias=False)
    x = _x(m, k, seed=n + m)
    layer(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x)
        y2 = layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, y2)
    res = reference.check(y, _activation(layer, x), layer.weight)
    assert res.passed, str(res)


def _on_a_side_stream(check, shape, seeds) -> None:
    """``check`` on new inputs of ``shape``, called on a second stream (ordered after the
    current one's work and before its next)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for seed in seeds:
            check(_x(*shape, seed=seed))
    torch.cuda.current_stream().wait_stream(side)


@selection.needs_bindings
def test_bound_launches_follow_each_input_the_workspace_and_the_stream():
    """From the second call at an M, a W4A16 forward launches through its binding
    (``bindings.bind``): a new input every call (a stale address would repeat the last output,
    which the allocator may hand back), the stream's split-K workspace replaced by another
    launch in between, and a second stream, each against the reference."""
    _skip_unsupported("w4a16")

    _, layer = _layer("w4a16", False, k=4096, n=1024, bias=False)  # split-K at M = 1

    def check(x):
        res = reference.check(layer(x), x, layer.weight)
        assert res.passed, str(res)

    for i in range(4):
        check(_x(1, 4096, seed=20 + i))
        if i == 1:  # record the stream's buffer as too small: the next full path replaces it
            key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
            workspaces._WORKSPACES[key] = (workspaces._WORKSPACES[key][0], 0, 0)
            generation = workspaces._GENERATION[0]
            check(_x(2, 4096, seed=30))  # a new M: the full path
            assert workspaces._GENERATION[0] != generation
    bound = layer.layer.launches.bound
    assert bound[(1, torch.bfloat16)].kernel.schedule.split_k > 1  # the premise
    _on_a_side_stream(check, (1, 4096), seeds=(40, 41))


@selection.needs_bindings
@pytest.mark.parametrize("layout", ["auto", "plain"])
def test_bound_w4a4_launches_follow_each_input_and_the_stream(layout):
    """From the second call at an M, a W4A4 forward with a static input scale launches its
    quantizer (on SM90's packed weight also its dequantizer) and GEMM through their
    bindings (``quant.BoundActivation``, ``bindings.BoundLaunch``) into one scratch allocation:
    new inputs every call, several M, an N-D input, a second stream, the input scale
    changed in place, each against the reference on the activation ``quantize_activation``
    gives."""
    from cute_fp4.quant import BoundActivation

    torch.manual_seed(0)
    lin = nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    w = cf.quantize(lin.weight.detach())
    layer = cnn.NVFP4Linear(w, mode="w4a4", input_scale=4.5 / 2688, layout=layout)

    def check(x):
        y = layer(x)
        x2 = x.reshape(-1, 1024)
        res = reference.check(y.reshape(-1, 512), _activation(layer, x2), layer.weight)
        assert res.passed, str(res)

    for i, shape in enumerate([(1, 1024)] * 3 + [(5, 1024)] * 3 + [(2, 3, 1024)] * 2):
        check(_x(*shape, seed=50 + i))
    assert {key[0] for key in layer.layer.launches.bound} == {1, 5, 6}
    layer.set_input_scale(3.0 / 2688)  # in place: the bindings read the new value
    check(_x(5, 1024, seed=60))
    _on_a_side_stream(check, (1, 1024), seeds=(70, 71))
    assert isinstance(layer.layer.launches.bound[(1, torch.bfloat16, "w4a4")][0], BoundActivation)


@selection.needs_bindings
@pytest.mark.parametrize("layout", ["auto", "plain"])
def test_bound_dynamic_w4a4_follows_each_input_and_the_stream(layout):
    """A W4A4 forward with a dynamic input scale binds too: the quantizer computing the
    scale (fused for small M, an amax kernel first for larger), then on SM90's packed
    weight the decoder writing values and alpha into the same scratch, else torch
    multiplying the scales into it; the GEMM reads alpha there. New inputs every call (a
    stale scale or alpha would be the last call's), several M, an N-D input, a second
    stream, each against the reference."""
    from cute_fp4.quant import FUSED_MAX_ELEMENTS, BoundActivation

    torch.manual_seed(0)
    lin = nn.Linear(1024, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = cnn.NVFP4Linear(cf.quantize(lin.weight.detach()), mode="w4a4", layout=layout)

    def check(x):
        y = layer(x)
        x2 = x.reshape(-1, 1024)
        res = reference.check(y.reshape(-1, 512), _activation(layer, x2), layer.weight)
        assert res.passed, str(res)

    big = FUSED_MAX_ELEMENTS // 1024 + 31  # two kernels: amax partials, then quantize
    shapes = [(1, 1024)] * 3 + [(5, 1024)] * 3 + [(2, 3, 1024)] * 2 + [(big, 1024)] * 3
    for i, shape in enumerate(shapes):
        x = _x(*shape, seed=80 + i)
        check(x * (1 + i))  # a scale that differs call by call
    _on_a_side_stream(check, (5, 1024), seeds=(90, 91))
    assert {key[0] for key in layer.layer.launches.bound} == {1, 5, 6, big}
    assert isinstance(layer.layer.launches.bound[(big, torch.bfloat16, "w4a4")][0], BoundActivation)


@pytest.mark.parametrize("mode, static, most", [("w4a16", False, 1), ("w4a4", True, 2),
                                                ("w4a4", False, 2)], ids=IDS)
def test_forward_allocates_only_its_outputs(mode, static, most):
    """W4A16: the output; W4A4: the output and one scratch buffer (the bound path: the
    packed activation and its scales, or its decoded BF16 values; a dynamic scale: also
    the scale, the amax partials and alpha). No split-K at this shape."""
    _skip_unsupported(mode)
    if mode == "w4a4" and not static and not selection.bindings_available():
        pytest.skip("unbound, a dynamic W4A4 forward allocates its scale, amax partials "
                    "and alpha on every call (no TVM-FFI entry: apache-tvm-ffi)")
    _, layer = _layer(mode, static, bias=True)
    x = _x(3, 640)
    layer(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    layer(x)
    n = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert 1 <= n <= most, f"{n} allocations per forward, expected at most {most}"


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_modelopt_tensors_load_into_a_converted_layer(mode, static):
    _skip_unsupported(mode)
    _, src = _layer(mode, static, seed=3)
    ckpt = {k: v.cpu() for k, v in src.state_dict().items()}  # ModelOpt form, on the host
    _, dst = _layer(mode, False, seed=4)
    dst.load_state_dict(ckpt)
    x = _x(2, 640)
    assert torch.equal(dst(x), src(x))
    fresh = cnn.NVFP4Linear.from_modelopt(**{k: v.cuda() for k, v in ckpt.items()
                                            if k != "bias"}, bias=ckpt["bias"].cuda(),
                                          mode=mode)
    assert torch.equal(fresh(x), src(x))


@pytest.mark.parametrize("mode, limit", [("w4a16", 0.2), ("w4a4", 0.27)])  # CPU: .145, .196
def test_converted_model_is_close_to_bf16(mode, limit):
    _skip_unsupported(mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 512, bias=False),
                          nn.Linear(1000, 16)).cuda().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    rep = cf.convert(model, mode, skip="2")
    assert rep.converted == ("0", "1") and dict(rep.skipped)["2"].startswith("matches")
    x = _x(16, 1024)
    y, y_ref = model[1](model[0](x)).float(), ref[1](ref[0](x)).float()
    err = float((y - y_ref).norm() / y_ref.norm())
    assert err < limit, f"relative error {err:.3f} vs BF16, expected < {limit}"


def test_w4a16_packed_and_plain_layouts():
    """On SM90 a W4A16 layer holds its weight in fragment order ("auto"); the plain layout
    still works; both match the exact reference at decode and prefill sizes (split-K
    included), and both give the same state_dict."""
    _skip_unsupported("w4a16")
    torch.manual_seed(3)
    lin = nn.Linear(4096, 264, bias=False, device="cuda", dtype=torch.bfloat16)
    packed = cnn.NVFP4Linear.from_linear(lin)
    plain = cnn.NVFP4Linear.from_linear(lin, layout="plain")
    assert packed.layout == "packed" and plain.layout == "plain"
    for m in (1, 16, 300):
        x = _x(m, 4096, seed=m)
        for layer in (packed, plain):
            out = torch.full((m, 264), float("nan"), dtype=torch.bfloat16, device="cuda")
            out.copy_(layer(x))
            res = reference.check(out, x, layer.weight)
            assert res.passed, f"{layer.layout} M={m}: {res}"
    a, b = packed.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k].reshape(-1).view(torch.uint8),
                           b[k].reshape(-1).view(torch.uint8)) for k in a)


# ----------------------------------------------------------------------------- gated MLP

def _gated(mode: str, static: bool, h: int = 4096, i: int = 512, seed: int = 0):
    """A float MLP's three projections (bf16, on the GPU) and its NVFP4GatedMLP."""
    from cute_fp4.mlp import NVFP4GatedMLP

    torch.manual_seed(seed)
    lin = [nn.Linear(a, b, bias=False, device="cuda", dtype=torch.bfloat16)
           for a, b in ((h, i), (h, i), (i, h))]
    for layer in lin:
        nn.init.normal_(layer.weight, std=0.02)
    mlp = NVFP4GatedMLP.from_linears(*lin, mode=mode, input_scale=4.5 / 2688 if static
                                     else None)
    if static:
        mlp.down_proj.set_input_scale(0.2 / 2688)
    return lin, mlp


def _gated_reference(mlp, x: torch.Tensor) -> torch.Tensor:
    """float64 on the dequantized weights (natural order), W4A4: the activations through
    NVFP4 as the layers quantize them."""
    import torch.nn.functional as F

    from cute_fp4.nvfp4 import NVFP4Tensor, quantize, swizzle_scales

    data, scale = mlp.natural_gate_up()
    gu = mlp.gate_up_proj
    w13 = NVFP4Tensor(data, swizzle_scales(scale.contiguous()), gu.weight_scale_2,
                      (2 * mlp.intermediate, mlp.hidden)).dequantize(torch.float64)
    w2 = mlp.down_proj.weight.dequantize(torch.float64)
    x2 = x.reshape(-1, mlp.hidden)
    a = x2 if mlp.mode == "w4a16" else quantize(x2, gu.input_scale).dequantize(x.dtype)
    h = a.double() @ w13.T
    act = (F.silu(h[:, :mlp.intermediate]) * h[:, mlp.intermediate:]).to(x.dtype)
    if mlp.mode == "w4a4":
        act = quantize(act, mlp.down_proj.input_scale).dequantize(x.dtype)
    return (act.double() @ w2.T).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
@pytest.mark.parametrize("shape", [(1, 4096), (1, 3, 4096), (16, 4096)])
def test_gated_mlp_forward_matches_the_float64_mlp(mode, static, shape):
    _skip_unsupported(mode)
    _, mlp = _gated(mode, static)
    x = _x(*shape)
    y = mlp(x)
    assert y.shape == shape and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    ref = _gated_reference(mlp, x)
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < (2e-2 if mode == "w4a16" else 6e-2), err
    # the same bits as three NVFP4Linear layers would need: the state dict round-trips
    sd = mlp.state_dict()
    _, other = _gated(mode, static, seed=9)
    other.load_state_dict(sd)
    assert torch.equal(other(x), y)


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_gated_mlp_graph_capture_of_the_eager_forward(mode, static):
    _skip_unsupported(mode)
    _, mlp = _gated(mode, static)
    x = _x(1, 4096)
    _, y, want = _captured(mlp, x)
    assert torch.equal(y, mlp(x)) and not torch.equal(y, want)


@pytest.mark.parametrize("mode, static", MODES, ids=IDS)
def test_gated_mlp_compiled_matches_eager(mode, static):
    """Under torch.compile the fused MLP runs the unfused activation on the interleaved
    gate_up (the custom ops take no epilogue operands). Inductor computes ``silu(g) * u``
    in FP32 without rounding ``silu(g)`` to BF16 first, so the bits differ from eager's
    by that rounding (measured on the H200: up to 2 BF16 ulps in the activation); the
    outputs agree to well within the NVFP4 error."""
    _skip_unsupported(mode)
    _, mlp = _gated(mode, static)
    x = _x(16, 4096)
    torch._dynamo.reset()
    f = torch.compile(mlp, fullgraph=True)
    got, want = f(x).double(), mlp(x).double()
    assert (got - want).norm() / want.norm() < 3e-2


def test_convert_fuses_a_transformers_llama():
    """convert() of a tiny transformers Llama on the GPU: every MLP an NVFP4GatedMLP, the
    logits close to the same model converted without fusing (gate and up then have their
    own global scales) and to the BF16 model."""
    transformers = pytest.importorskip("transformers")
    from cute_fp4.mlp import NVFP4GatedMLP

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, head_dim=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=512)
    torch.manual_seed(0)
    bf16 = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    fused, unfused = copy.deepcopy(bf16), copy.deepcopy(bf16)
    rep = cf.convert(fused, skip="lm_head")
    assert rep.fused == ("model.layers.0.mlp", "model.layers.1.mlp") and rep.unfused == ()
    assert all(isinstance(layer.mlp, NVFP4GatedMLP) for layer in fused.model.layers)
    cf.convert(unfused, skip="lm_head", fuse_mlp=False)
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    with torch.no_grad():
        a, b, c = (m(ids).logits.float() for m in (fused, unfused, bf16))
    assert float((a - b).norm() / b.norm()) < 0.1
    assert float((a - c).norm() / c.norm()) < 0.2


@pytest.mark.parametrize("m", [1, 16, 200])
def test_a_layer_emitting_nvfp4_feeds_a_w4a4_layer(m):
    """first.emit_nvfp4(second.input_scale): the first layer's epilogue writes the second's
    NVFP4 activation (no quantize kernel between them). Against the same chain with a
    BF16 hand-off (the second layer quantizing it): the codes are those of quantize on the
    first GEMM's BF16 output, whose tile may differ (auto's pick vs a tile that writes
    NVFP4), so the outputs agree within the NVFP4 error, not bit for bit."""
    _skip_unsupported("w4a4")
    g = torch.Generator().manual_seed(m)
    mode1 = "w4a16" if selection.family() == "sm90" else "w4a4"
    first = cnn.NVFP4Linear(cf.quantize(torch.randn(512, 256, generator=g).cuda() * 0.05),
                            mode=mode1, input_scale=None if mode1 == "w4a16" else 0.01,
                            layout="plain")
    second = cnn.NVFP4Linear(cf.quantize(torch.randn(128, 512, generator=g).cuda() * 0.05),
                             mode="w4a4", input_scale=0.004, layout="plain")
    x = _x(m, 256, seed=m)
    want = second(first(x)).double()
    first.emit_nvfp4(second.input_scale)
    h = first(x)
    assert isinstance(h, cf.NVFP4Tensor) and h.shape == (m, 512)
    got = second(h).double()
    assert (got - want).norm() / want.norm() < 5e-2
