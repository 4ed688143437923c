"""cute_fp4.mlp on the CPU: NVFP4GatedMLP (state dict in ModelOpt's per-projection form, bit
exact; the forward, its fused GEMM replaced by the exact reference, bit-equal to the three
NVFP4Linear layers on the same bits; W4A4; dtype moves; torch.compile trace; typed errors)
and convert() fusing gated SiLU MLPs (skip lists, reasons, checkpoints whose gate and up
global scales differ staying unfused). The kernels run in tests/gpu/test_nn.py."""

from __future__ import annotations

import pytest
import torch
from exact import fake_launch_path
from torch import nn

import cute_fp4 as cf
from cute_fp4 import mlp as cmlp
from cute_fp4 import nn as cnn
from cute_fp4 import reference
from cute_fp4 import run as crun
from cute_fp4.errors import DeviceError, FormatError, InputError, InputTypeError
from cute_fp4.fused import silu_mul_unfused
from cute_fp4.layers import linear as clin
from cute_fp4.nvfp4 import NVFP4Tensor, quantize
from cute_fp4.packed import PackedNVFP4Weight

H, INTER = 64, 128


class MLP(nn.Module):
    """transformers' LlamaMLP, in short."""

    def __init__(self, h=H, i=INTER, act=None, seed=0, down_bias=False):
        super().__init__()
        torch.manual_seed(seed)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=down_bias)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = nn.Linear(H, H)
        self.mlp = MLP(seed=seed + 1)

    def forward(self, x):
        return self.mlp(self.attn(x))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)


@pytest.fixture
def exact(monkeypatch):
    """The GEMMs replaced by the exact reference (float64, one rounding), the fused one
    followed by the unfused activation (the fused epilogue's bits, tests/gpu); the
    activation quantizer by cute_fp4.quantize. Records the fused calls."""
    calls = []

    def fused(call):  # api.run_call of the gated layer's call
        a = quantize(call.a, call.input_scale) if call.quantize_a else call.a
        calls.append((tuple(a.shape), call.alpha, call.group))
        w = call.b.unpack() if isinstance(call.b, PackedNVFP4Weight) else call.b
        return silu_mul_unfused(reference.gemm(a, w, call.alpha, out_dtype=call.out_dtype),
                                call.group)

    fake_launch_path(monkeypatch, lambda s, m, n, k, f, dt, d, packed=False, b_format=None:
                     type("K", (), {"out_dtype": dt})())
    monkeypatch.setattr(crun, "quantize_activation", lambda x, gs=None: quantize(x, gs))
    monkeypatch.setattr(clin, "run_call", fused)
    return calls


def _unfused_twin(mlp: cmlp.NVFP4GatedMLP) -> MLP:
    """Three NVFP4Linear layers on the fused module's bits (gate and up from its natural
    order, its global scale)."""
    data, scale = mlp.natural_gate_up()
    gu = mlp.gate_up_proj
    inp = gu.input_scale
    twin = MLP()
    for j, name in enumerate(("gate_proj", "up_proj")):
        rows = slice(j * mlp.intermediate, (j + 1) * mlp.intermediate)
        setattr(twin, name, cnn.NVFP4Linear.from_modelopt(
            data[rows], scale[rows], gu.weight_scale_2, inp, None, mlp.mode, layout="plain"))
    twin.down_proj = mlp.down_proj
    return twin


# ----------------------------------------------------------------------------- the module

@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("group", [8, 32])
def test_state_dict_is_modelopt_per_projection_and_round_trips(layout, group):
    ref = MLP(down_bias=True)
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj,
                                          layout=layout, group=group)
    assert mlp.layout == layout and mlp.group == group
    assert isinstance(mlp.gate_up, PackedNVFP4Weight if layout == "packed" else NVFP4Tensor)
    sd = mlp.state_dict()
    keys = {f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj")
            for k in ("weight", "weight_scale", "weight_scale_2")} | {"down_proj.bias"}
    assert set(sd) == keys
    w13 = quantize(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]).detach())
    assert torch.equal(sd["gate_proj.weight"], w13.data[:INTER])
    assert torch.equal(sd["up_proj.weight"], w13.data[INTER:])
    assert torch.equal(_bytes(sd["up_proj.weight_scale"]), _bytes(w13.scale_linear()[INTER:]))
    assert sd["gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(sd["gate_proj.weight_scale_2"], sd["up_proj.weight_scale_2"])
    # the interleaved weight really is interleaved: its first rows are gate, then up
    first = mlp.gate_up_proj.weight
    assert torch.equal(first.data[group:2 * group], w13.data[INTER:INTER + group])
    # load into a module of other weights: the same tensors back, bit for bit
    other = MLP(seed=5, down_bias=True)
    back = cmlp.NVFP4GatedMLP.from_linears(other.gate_proj, other.up_proj, other.down_proj,
                                           layout=layout, group=group)
    assert not _same(back.state_dict(), sd)
    back.load_state_dict(sd)
    assert _same(back.state_dict(), sd)
    # and from the same tensors as a checkpoint
    split = {p: {k: sd[f"{p}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
             for p in ("gate_proj", "up_proj", "down_proj")}
    split["down_proj"]["bias"] = sd["down_proj.bias"]
    made = cmlp.NVFP4GatedMLP.from_modelopt(*split.values(), layout=layout, group=group)
    assert _same(made.state_dict(), sd)


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("group", [8, 32])
def test_from_layers_builds_the_stored_bytes_in_chunks_with_the_same_bits(layout, group,
                                                                         monkeypatch):
    """from_layers interleaves gate and up from the bytes as stored, a chunk of rows at a
    time (one 64-row unit per chunk here: three): the bits of the whole-weight path
    (concatenate, interleave, pack), and forward-ready buffers."""
    from cute_fp4 import packed

    inter = 192
    ref = MLP(i=inter, seed=3)
    whole = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj,
                                            layout=layout, group=group)
    sd = whole.state_dict()
    gs = sd["gate_proj.weight_scale_2"]
    gate, up = (cnn.NVFP4Linear.from_modelopt(sd[f"{p}.weight"], sd[f"{p}.weight_scale"], gs,
                                              layout=layout) for p in ("gate_proj", "up_proj"))
    monkeypatch.setattr(packed, "_CHUNK_BYTES", 1)
    built = cmlp.NVFP4GatedMLP.from_layers(gate, up, whole.down_proj, group=group)
    assert built.layout == layout and built.group == group
    for name in ("weight_packed", "weight_scale", "weight_scale_2"):
        a, b = (getattr(m.gate_up_proj, name) for m in (built, whole))
        assert a.shape == b.shape and torch.equal(_bytes(a), _bytes(b)), name
    assert _same(built.state_dict(), sd)
    with pytest.raises(FormatError, match="192 does not split into gate/up groups of 128"):
        cmlp.NVFP4GatedMLP.from_layers(gate, up, whole.down_proj, group=128)


def test_w4a4_state_dict_holds_the_input_scales():
    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj,
                                          mode="w4a4", input_scale=0.01, group=8)
    mlp.down_proj.set_input_scale(0.02)
    sd = mlp.state_dict()
    assert float(sd["gate_proj.input_scale"]) == float(sd["up_proj.input_scale"]) == \
        pytest.approx(0.01)
    assert float(sd["down_proj.input_scale"]) == pytest.approx(0.02)
    split = {p: {k: sd[f"{p}.{k}"] for k in cnn.CHECKPOINT_KEYS}
             for p in ("gate_proj", "up_proj", "down_proj")}
    made = cmlp.NVFP4GatedMLP.from_modelopt(*split.values(), group=8)  # mode from the scales
    assert made.mode == "w4a4" and _same(made.state_dict(), sd)
    assert made.gate_up_proj.alpha is not None


def test_load_reports_missing_keys_and_refuses_different_gate_up_scales():
    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj, group=8)
    sd = mlp.state_dict()
    partial = {k: v for k, v in sd.items() if k != "up_proj.weight_scale"}
    res = mlp.load_state_dict(partial, strict=False)
    assert res.missing_keys == ["up_proj.weight_scale"] and res.unexpected_keys == []
    sd["up_proj.weight_scale_2"] = sd["up_proj.weight_scale_2"] * 1.5
    before = mlp.state_dict()
    with pytest.raises(FormatError, match="up_proj.weight_scale_2 .* differ"):
        mlp.load_state_dict(sd)
    assert _same(mlp.state_dict(), before)  # nothing loaded
    split = {p: {k: sd[f"{p}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
             for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(FormatError, match="one GEMM applies one"):
        cmlp.NVFP4GatedMLP.from_modelopt(*split.values(), group=8)


@pytest.mark.parametrize("shape", [(H,), (5, H), (2, 3, H)])
@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_forward_equals_three_linears_on_the_same_bits(exact, shape, layout):
    ref = MLP(down_bias=True)
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj,
                                          layout=layout, group=8)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x)
        want = _unfused_twin(mlp)(x)
    assert y.shape == (*shape[:-1], H) and y.dtype == torch.bfloat16
    assert torch.equal(y, want)
    assert exact[0][2] == 8 and exact[0][1] is None  # alpha: the weight's global scale
    # and close to the float MLP (so the comparison can fail)
    with torch.no_grad():
        orig = ref.to(torch.float64)(x.double())
    err = float((y.double() - orig).norm() / orig.norm())
    assert 1e-3 < err < 0.2


@pytest.mark.parametrize("static", [True, False])
def test_w4a4_forward_quantizes_the_activation_then_the_fused_gemm(exact, static):
    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj,
                                          mode="w4a4", input_scale=0.002 if static else None,
                                          group=32)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mlp(x), _unfused_twin(mlp)(x))
    assert (exact[0][1] is not None) == static  # static: the layer's alpha, made once
    if static:
        assert exact[0][1] is mlp.gate_up_proj.alpha


def test_dtype_moves_keep_the_nvfp4_buffers_and_repr():
    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj, group=8)
    sd = mlp.state_dict()
    mlp.to(torch.bfloat16).half()
    assert mlp.gate_up_proj.weight_scale.dtype == torch.float8_e4m3fn
    assert mlp.gate_up_proj.weight_scale_2.dtype == torch.float32
    assert _same(mlp.state_dict(), sd)
    text = repr(mlp)
    assert "gate_up_group=8" in text and "intermediate=128" in text and "down_proj" in text


def test_torch_compile_traces_the_unfused_activation():
    from test_nn import _trace

    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj, group=8)
    code = _trace(mlp, torch.randn(2, 3, H, dtype=torch.bfloat16))
    assert code.count("cute_fp4.mm") == 2 and ".item()" not in code


@pytest.mark.parametrize("make, exc, match", [
    (lambda r: cmlp.NVFP4GatedMLP.from_linears(r.gate_proj, r.up_proj, r.down_proj),
     DeviceError, "gate/up row order depends on the GPU"),
    (lambda r: cmlp.NVFP4GatedMLP.from_linears(r.gate_proj, r.up_proj, r.down_proj, group=16),
     InputError, "group must be 8 or 32"),
    (lambda r: cmlp.NVFP4GatedMLP(quantize(torch.randn(2 * 48, H)),
                                  cnn.NVFP4Linear(quantize(torch.randn(H, 48))), group=32),
     FormatError, "intermediate size 48 does not split into gate/up groups of 32"),
    (lambda r: cmlp.NVFP4GatedMLP(quantize(torch.randn(2 * INTER, H)), r.down_proj, group=8),
     InputTypeError, "down must be an NVFP4Linear"),
    (lambda r: cmlp.NVFP4GatedMLP(quantize(torch.randn(2 * INTER, H)),
                                  cnn.NVFP4Linear(quantize(torch.randn(H, 64))), group=8),
     InputError, "not an MLP"),
    (lambda r: cmlp.NVFP4GatedMLP.from_linears(nn.Linear(H, INTER), r.up_proj, r.down_proj,
                                               group=8),
     InputError, "with a bias"),
    (lambda r: cmlp.NVFP4GatedMLP.from_modelopt({"weight": 1}, {}, {}, group=8),
     InputTypeError, "gate must be a dict with"),
    (lambda r: cmlp.NVFP4GatedMLP.from_linears(r.gate_proj, r.up_proj, r.down_proj,
                                               schedule="sm90_decode", group=32),
     InputError, "not schedule sm90_decode's gate/up group"),
])
def test_construction_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make(MLP())


def test_forward_errors():
    ref = MLP()
    mlp = cmlp.NVFP4GatedMLP.from_linears(ref.gate_proj, ref.up_proj, ref.down_proj, group=8)
    with pytest.raises(InputError, match="input has 32 features"):
        mlp(torch.randn(2, 32, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="bfloat16 or float16"):
        mlp(torch.randn(2, H))
    with pytest.raises(DeviceError):  # the kernels run on a GPU only
        mlp(torch.randn(2, H, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- convert

def test_convert_fuses_gated_silu_mlps_for_a_given_group(exact):
    model = Block()
    x = torch.randn(3, H, dtype=torch.bfloat16)
    rep = cf.convert(model, gate_up_group=8)
    assert isinstance(model.mlp, cmlp.NVFP4GatedMLP) and model.mlp.group == 8
    assert isinstance(model.attn, cnn.NVFP4Linear)
    assert rep.fused == ("mlp",) and rep.unfused == ()
    assert rep.converted == ("attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert "fused 1 of 1 gated MLPs" in str(rep)
    # gate and up quantized together: one global scale from their joint amax
    ref = Block()
    w13 = quantize(torch.cat([ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight]).detach())
    assert torch.equal(model.mlp.gate_up_proj.weight_scale_2, w13.global_scale)
    unfused = Block()
    rep2 = cf.convert(unfused, fuse_mlp=False)
    assert rep2.fused == () and rep2.unfused == () and type(unfused.mlp) is MLP
    with torch.no_grad():
        got, other = model(x.to(torch.bfloat16)), unfused(x)
    assert float((got.double() - other.double()).norm() / other.double().norm()) < 0.1


def test_convert_on_the_cpu_keeps_mlps_unfused_with_the_reason():
    model = Block()
    rep = cf.convert(model)
    assert type(model.mlp) is MLP and isinstance(model.mlp.gate_proj, cnn.NVFP4Linear)
    assert rep.fused == () and rep.unfused[0][0] == "mlp"
    assert "gate/up row order depends on the GPU" in rep.unfused[0][1]
    assert "unfused mlp: its weights are on cpu" in str(rep)


@pytest.mark.parametrize("skip, reason", [
    ("mlp.up_proj", "up_proj is not converted (matches skip pattern 'mlp.up_proj')"),
    ("*.down_proj", "down_proj is not converted (matches skip pattern '*.down_proj')"),
])
def test_convert_does_not_fuse_an_mlp_with_a_skipped_projection(skip, reason):
    model = Block()
    rep = cf.convert(model, skip=skip, gate_up_group=8)
    assert type(model.mlp) is MLP and rep.unfused == (("mlp", reason),)
    assert dict(rep.skipped) == {skip.replace("*.", "mlp."): f"matches skip pattern {skip!r}"}
    assert len(rep.converted) == 3


def test_convert_leaves_other_activations_and_biased_gate_up():
    gelu = Block()
    gelu.mlp.act_fn = nn.GELU()
    rep = cf.convert(gelu, gate_up_group=8)
    assert rep.unfused == (("mlp", "its activation is GELU, not SiLU"),)
    biased = Block()
    biased.mlp.gate_proj = nn.Linear(H, INTER)
    rep = cf.convert(biased, gate_up_group=8)
    assert rep.unfused == (("mlp", "gate_proj/up_proj have a bias"),)
    assert isinstance(biased.mlp.gate_proj, cnn.NVFP4Linear)
    with pytest.raises(InputError, match="gate_up_group must be None, 8 or 32"):
        cf.convert(Block(), gate_up_group=16)


def _checkpoint(up_scale: float = 1.0, w4a4: bool = False) -> dict:
    """A ModelOpt state dict of Block: gate and up quantized together (one global scale),
    up's global scale multiplied by ``up_scale``."""
    src = Block(seed=3)
    cf.convert(src, gate_up_group=8)
    if w4a4:
        src.attn.set_input_scale(0.01)
        src.mlp.gate_up_proj.set_input_scale(0.02)
        src.mlp.down_proj.set_input_scale(0.03)
    sd = src.state_dict()
    sd["mlp.up_proj.weight_scale_2"] = sd["mlp.up_proj.weight_scale_2"] * up_scale
    return sd


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_convert_from_a_state_dict_fuses_and_saves_it_back_bit_exact(mode):
    sd = _checkpoint(w4a4=True)
    with torch.device("meta"):
        model = Block()
    rep = cf.convert(model, mode, state_dict=sd, gate_up_group=8)
    assert rep.fused == ("mlp",) and model.mlp.mode == mode
    want = sd if mode == "w4a4" else {k: v for k, v in sd.items() if "input_scale" not in k}
    assert _same(model.state_dict(), want)


def test_a_checkpoint_with_different_gate_up_scales_stays_unfused():
    sd = _checkpoint(up_scale=1.5)
    model = Block()
    rep = cf.convert(model, state_dict=sd, gate_up_group=8)
    assert type(model.mlp) is MLP and rep.fused == ()
    name, why = rep.unfused[0]
    assert name == "mlp" and "gate_proj.weight_scale_2" in why and "differ" in why
    assert "requantizing" in why and "unfused mlp:" in str(rep)
    assert _same(model.state_dict(), sd)  # three NVFP4Linear, every tensor as stored
    # W4A4 input scales that differ keep it unfused too
    sd = _checkpoint(w4a4=True)
    sd["mlp.up_proj.input_scale"] = sd["mlp.up_proj.input_scale"] * 2
    rep = cf.convert(Block(), "w4a4", state_dict=sd, gate_up_group=8)
    assert rep.fused == () and "input_scale" in rep.unfused[0][1]


def test_fuse_gated_mlps_of_converted_layers_keeps_their_bits(exact):
    sd = _checkpoint()
    model = Block()
    cf.convert(model, state_dict=sd, fuse_mlp=False)
    x = torch.randn(2, H, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    fused, unfused = cmlp.fuse_gated_mlps(model, group=32)
    assert fused == ("mlp",) and unfused == () and model.mlp.group == 32
    assert _same(model.state_dict(), sd)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    other = Block()
    cf.convert(other, state_dict=_checkpoint(up_scale=2.0), fuse_mlp=False)
    fused, unfused = cmlp.fuse_gated_mlps(other, group=8)
    assert fused == () and "differ" in unfused[0][1]
    separate = Block()  # gate and up quantized one by one: two global scales
    cf.convert(separate, fuse_mlp=False)
    assert "differ" in cmlp.fuse_gated_mlps(separate, group=8)[1][0][1]
    cpu = Block()
    cf.convert(cpu, state_dict=sd, fuse_mlp=False)
    assert "on the CPU" in cmlp.fuse_gated_mlps(cpu)[1][0][1]


def test_fusing_frees_each_mlps_old_layers_before_the_next_is_built(exact, monkeypatch):
    """Peak memory while fusing: when the next MLP's fused layer is built, the projections
    of the MLPs fused before are gone (a model holds its gate and up weights twice for one
    MLP at a time, not for all of them; from_pretrained's bound counts on it)."""
    import gc
    import weakref

    sd = _checkpoint()
    model = torch.nn.ModuleList([Block() for _ in range(3)])
    for b in model:
        cf.convert(b, state_dict=sd, fuse_mlp=False)
    olds = [weakref.ref(b.mlp.gate_proj) for b in model]
    alive, build = [], cmlp.NVFP4GatedMLP.from_layers

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(r() is not None for r in olds))
        return build(*args, **kwargs)

    monkeypatch.setattr(cmlp.NVFP4GatedMLP, "from_layers", counting)
    fused, _ = cmlp.fuse_gated_mlps(model, group=8)
    assert fused == ("0.mlp", "1.mlp", "2.mlp")
    assert alive == [3, 2, 1]  # only the MLPs not yet fused still hold their layers
