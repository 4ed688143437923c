"""gpt-oss MXFP4 on the CPU (the exact reference in place of the kernels): the host path's
format checks, the MXFP4 layers (``Linear.from_mxfp4``, ``Experts.from_gpt_oss``), and
``cute_fp4.hf`` on tiny random gpt-oss checkpoints written as transformers' ``mxfp4``
quantization stores them (tests/gpt_oss_tiny.py): every tensor loaded as stored, the
excluded modules in BF16, a forward against transformers' model on the decoded weights,
``save_pretrained`` byte for byte, bad checkpoints with typed errors naming file and key.
"""

from __future__ import annotations

import json
import os

import gpt_oss_tiny as tiny
import pytest
import torch
from safetensors.torch import load_file

import cute_fp4 as cf
from cute_fp4 import reference, tuning
from cute_fp4.errors import FormatError, InputError
from cute_fp4.formats import MXFP4
from cute_fp4.fused import swiglu_oai_unfused
from cute_fp4.grouped import grouped_gemm
from cute_fp4.hf.checkpoint import CheckpointError
from cute_fp4.layers import Experts, Linear, reference_execution, softmax_topk
from cute_fp4.packed import repack
from cute_fp4.plan import plan
from cute_fp4.schedule import Problem

EXPERTS = "model.layers.{}.mlp.experts"


def _mx(*shape, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return cf.quantize(torch.randn(*shape, generator=g) * scale, format="mxfp4")


# ----------------------------------------------------------------------------- the host path

def test_public_path_computes_the_exact_reference():
    """W4A16 and W4A4 through gemm, grouped through grouped_gemm, plain and packed: the
    exact reference's values rounded once (what reference execution computes)."""
    w, x = _mx(72, 128), torch.randn(5, 128).bfloat16()
    stack = _mx(3, 72, 128, seed=1)
    offs = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    with reference_execution():
        assert torch.equal(cf.gemm(x, w), reference.gemm(x, w).bfloat16())
        assert torch.equal(cf.gemm(x, repack(w)), reference.gemm(x, w).bfloat16())
        a = cf.quantize(x.float(), format="mxfp4")
        assert torch.equal(cf.gemm(a, w), reference.gemm(a, w).bfloat16())
        want = reference.grouped_gemm(x, stack, offs).bfloat16()
        assert torch.equal(grouped_gemm(x, stack, offs), want)
        assert torch.equal(grouped_gemm(x, repack(stack), offs), want)


def test_fused_swiglu_oai_is_its_definition():
    stack, x = _mx(3, 64, 128, seed=2), torch.randn(6, 128).bfloat16()
    offs = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    bias = torch.randn(3, 64)
    with reference_execution():
        got = grouped_gemm(x, stack, offs, bias=bias, swiglu_oai=True)
    raw = reference.grouped_gemm(x, stack, offs)
    raw = reference.add_expert_bias(raw.float(), bias, offs)
    assert torch.equal(got, swiglu_oai_unfused(raw.bfloat16(), 32))  # the CPU's plain group


@pytest.mark.parametrize("case", ["nvfp4 activations", "fp16 activations", "grouped nvfp4",
                                  "mxfp4 act, nvfp4 weight"])
def test_mixed_formats_are_typed_errors_naming_both(case):
    w, x = _mx(64, 128), torch.randn(4, 128)
    stack = _mx(2, 64, 128)
    offs = torch.tensor([0, 1, 4], dtype=torch.int32)
    out = torch.full((4, 64), 7.0, dtype=torch.bfloat16)
    calls = {
        "nvfp4 activations": lambda: cf.gemm(cf.quantize(x), w, out=out),
        "fp16 activations": lambda: cf.gemm(x.half(), w, out=out.half()),
        "grouped nvfp4": lambda: grouped_gemm(cf.quantize(x), stack, offs, out=out),
        "mxfp4 act, nvfp4 weight": lambda: cf.gemm(cf.quantize(x, format="mxfp4"),
                                                   cf.quantize(w.dequantize()), out=out),
    }
    with reference_execution(), pytest.raises(FormatError) as e:
        calls[case]()
    assert "mxfp4" in str(e.value) and ("nvfp4" in str(e.value) or "fp16" in str(e.value))
    assert (out == 7).all()  # nothing written


def test_auto_rows_pick_schedules_that_plan_for_mxfp4():
    """'auto' on each family for MXFP4 weights: every pick plans for the MXFP4 problem
    (K tiles of whole MXFP4 scale atoms), dense and grouped."""
    for m in (1, 8, 16, 64, 200, 4096):
        for k in (2880, 8192):
            s = tuning.heuristic("sm90", m, 2880, k, packed=True, b_format="mxfp4")
            assert plan(s, Problem(m, 2880, k, "bf16", b_format="mxfp4")).ok, (m, k, s)
            s = tuning.heuristic("sm120", m, 2880, k, b_format="mxfp4")
            assert plan(s, Problem(m, 2880, k, "mxfp4", b_format="mxfp4")).ok, (m, k, s)
            s = tuning.heuristic("sm120", m, 2880, k, packed=True, target="sm_120a",
                                 b_format="mxfp4")
            assert plan(s, Problem(m, 2880, k, "bf16", b_format="mxfp4")).ok, (m, k, s)
    from cute_fp4 import catalogue
    from cute_fp4.operands import GroupedDims

    for fam in ("sm90", "sm120"):
        for rows in (1, 4, 16, 64, 4096):
            dims = GroupedDims(rows * 4, 5760, 2880, 32, "bf16", True, "mxfp4")
            name = tuning.grouped_auto_name(fam, dims)
            assert plan(catalogue.get(name), Problem(a_format="bf16", b_format="mxfp4",
                                                     groups=32)).ok, (fam, rows, name)
    with pytest.raises(InputError, match="packed layout only"):
        tuning.heuristic("sm90", 1, 64, 64, b_format="mxfp4")


# ----------------------------------------------------------------------------- layers

def test_linear_from_mxfp4_round_trip_and_errors():
    w = _mx(64, 128, seed=3)
    blocks, scales = w.to_blocks()
    bias = torch.randn(64)
    with reference_execution():
        lin = Linear.from_mxfp4(blocks, scales, bias, name="o_proj")
        x = torch.randn(2, 3, 128).bfloat16()
        want = (reference.gemm(x.reshape(6, 128), w).bfloat16() + bias).view(2, 3, 64)
        assert torch.equal(lin(x), want.to(torch.bfloat16))
    ck = lin.checkpoint()
    assert torch.equal(ck["blocks"], blocks) and torch.equal(ck["scales"], scales)
    bad = scales.clone()
    bad[3, 1] = 255
    with pytest.raises(FormatError, match="o_proj: .*255"):
        Linear.from_mxfp4(blocks, bad, name="o_proj")
    with pytest.raises(FormatError, match="o_proj: .*MXFP4 layers run W4A16|mxfp4 layers"):
        Linear.from_mxfp4(blocks, scales, mode="w4a4", name="o_proj")
    with pytest.raises(FormatError, match="o_proj: blocks must be uint8"):
        Linear.from_mxfp4(blocks.reshape(64, -1), scales, name="o_proj")


def _gpt_oss_experts_loop(x, ids, weights, w13, b13, w2, b2):
    """transformers' GptOssExperts.forward in float32 on [E, out, in] weights."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = x[t].float() @ w13[e].T + b13[e].float()
            g, u = gu[::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            h = (u + 1) * g * torch.sigmoid(1.702 * g)
            out[t] += float(weights[t, j]) * (h @ w2[e].T + b2[e].float())
    return out


@pytest.mark.parametrize("fused", ["auto", False])
def test_experts_from_gpt_oss(fused):
    """The layer against gpt-oss's experts in float32 on the same values; fused and
    unfused give the same bits; the checkpoint tensors come back bit for bit."""
    e, h, i = 4, 128, 64
    w13, w2 = _mx(e, 2 * i, h, seed=4), _mx(e, h, i, seed=5)
    (b13, s13), (bl2, s2) = w13.to_blocks(), w2.to_blocks()
    bias13, bias2 = torch.randn(e, 2 * i).bfloat16(), torch.randn(e, h).bfloat16()
    ex = Experts.from_gpt_oss(b13, s13, bias13, bl2, s2, bias2, fused=fused, name="moe")
    assert ex.gate_up_group == (32 if fused == "auto" else 1)
    x = torch.randn(9, h).bfloat16()
    ids, weights = softmax_topk(torch.randn(9, e).bfloat16(), 2)
    with reference_execution():
        got = ex(x, ids, weights)
        stages = ex.stages(x, ids, weights)
    assert torch.equal(got, stages.out)
    want = _gpt_oss_experts_loop(x, ids, weights, w13.dequantize(), bias13, w2.dequantize(),
                                 bias2)
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()
    ck = ex.gpt_oss_checkpoint()
    for key, t in dict(gate_up_proj_blocks=b13, gate_up_proj_scales=s13,
                       down_proj_blocks=bl2, down_proj_scales=s2, gate_up_proj_bias=bias13,
                       down_proj_bias=bias2).items():
        assert torch.equal(ck[key], t), key


def test_experts_from_gpt_oss_errors_name_the_tensor():
    w13, w2 = _mx(2, 128, 64), _mx(2, 64, 64)
    (b13, s13), (bl2, s2) = w13.to_blocks(), w2.to_blocks()
    bad = s2.clone()
    bad[1, 5, 0] = 255
    with pytest.raises(FormatError, match="moe: down_proj: .*255"):
        Experts.from_gpt_oss(b13, s13, None, bl2, bad, None, name="moe")
    with pytest.raises(FormatError, match="moe: gate_up_proj_bias must be"):
        Experts.from_gpt_oss(b13, s13, torch.zeros(2, 64), bl2, s2, None, name="moe")
    with pytest.raises(FormatError, match="moe: w13 is nvfp4 and w2 is mxfp4"):
        Experts(cf.quantize(torch.randn(2, 128, 64)), w2, name="moe")


def test_softmax_topk_is_gpt_oss_router():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(tiny.config(experts=8, top_k=4)).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(5, 64).bfloat16()
    logits, scores, ids = router(x)
    got_ids, got_w = softmax_topk(logits, 4)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, scores)


# ----------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(directory, tensors written, the BF16 model) of a tiny gpt-oss MXFP4 checkpoint."""
    model = tiny.build(tiny.config(layers=2, hidden=64, intermediate=64, experts=4, top_k=2))
    path = tmp_path_factory.mktemp("gpt_oss")
    return str(path), tiny.write(model, path), model


@pytest.fixture(scope="module")
def loaded(ckpt):
    return cf.hf.from_pretrained(ckpt[0], device="cpu")


def test_load_holds_every_tensor(ckpt, loaded):
    _, tensors, model = ckpt
    state = loaded.state_dict()
    for name, module in loaded.named_modules():
        if type(module).__name__ == "GptOssExperts":
            assert type(module.mxfp4).__name__ == "MXFP4MoE" and module.mxfp4.fmt is MXFP4
            for key, t in module.mxfp4.gpt_oss_checkpoint().items():
                assert torch.equal(t, tensors[f"{name}.{key}"]), f"{name}.{key}"
    for key, t in tensors.items():
        if key.endswith(("_blocks", "_scales")):
            continue
        assert state[key].dtype == torch.bfloat16 or key.endswith("norm.weight"), key
        assert torch.equal(state[key].to(t.dtype), t), key
    # the excluded modules are transformers' own BF16 modules
    layer = loaded.model.layers[0]
    assert type(layer.self_attn.q_proj) is torch.nn.Linear
    assert type(layer.mlp.router).__name__ == "GptOssTopKRouter"
    assert type(loaded.lm_head) is torch.nn.Linear
    assert loaded.config.quantization_config.to_dict() == {
        "quant_method": "mxfp4", "modules_to_not_convert": tiny.NOT_CONVERTED}


def test_forward_matches_transformers_on_decoded_weights(ckpt, loaded):
    """Logits under the exact reference against transformers' own model on the decoded
    weights (what it dequantizes the checkpoint to without its hub kernels): within its
    BF16 model's distance to the float32 one, and each MoE layer's output close."""
    _, tensors, model = ckpt
    bf16 = tiny.dequantized(model, tensors)
    fp32 = tiny.dequantized(model, tensors, torch.float32)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with reference_execution():
        got = loaded(ids).logits.float()
    want, exact = bf16(ids).logits.float(), fp32(ids).logits
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 1e-3
    assert (got - want).abs().max() <= 0.05 * exact.abs().max()
    x = torch.randn(7, 64).bfloat16()
    mine, theirs = loaded.model.layers[1].mlp, fp32.model.layers[1].mlp
    with reference_execution():
        out = mine(x[None])[0][0].float()
    ref = theirs(x[None].float())[0][0]
    assert (out - ref).abs().max() <= 0.03 * ref.abs().max() + 1e-3


def test_save_is_byte_exact(ckpt, loaded, tmp_path):
    path, tensors, _ = ckpt
    cf.hf.save_pretrained(loaded, tmp_path)
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(saved) == set(tensors)
    assert all(torch.equal(saved[k], tensors[k]) for k in tensors)
    with open(os.path.join(tmp_path, "model.safetensors"), "rb") as a, \
            open(os.path.join(path, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {
            "quant_method": "mxfp4", "modules_to_not_convert": tiny.NOT_CONVERTED}
    again = cf.hf.from_pretrained(tmp_path, device="cpu")
    name = EXPERTS.format(0)
    got = again.get_submodule(name).mxfp4.gpt_oss_checkpoint()
    assert torch.equal(got["down_proj_scales"], tensors[f"{name}.down_proj_scales"])


def _spoil(tensors, case):
    key = EXPERTS.format(1)
    t = dict(tensors)
    if case == "wrong shape":
        key += ".gate_up_proj_scales"
        t[key] = t[key][:, :, :1].contiguous()
    elif case == "missing key":
        key += ".down_proj_blocks"
        del t[key]
    elif case == "scale code 255":
        key += ".down_proj_scales"
        t[key] = t[key].clone()
        t[key][2, 7, 1] = 255
    elif case == "wrong dtype":
        key += ".gate_up_proj_blocks"
        t[key] = t[key].view(torch.int8)
    return t, key


@pytest.mark.parametrize("case", ["wrong shape", "missing key", "scale code 255",
                                  "wrong dtype"])
def test_bad_checkpoints_name_file_and_key(ckpt, tmp_path, case):
    _, tensors, model = ckpt
    spoiled, key = _spoil(tensors, case)
    tiny.write(model, tmp_path, spoiled)
    with pytest.raises(CheckpointError) as e:
        cf.hf.from_pretrained(tmp_path, device="cpu")
    assert e.value.key == key and e.value.file == "model.safetensors", str(e.value)
    if case == "scale code 255":
        assert "255" in str(e.value)


def test_an_excluded_experts_module_must_be_bf16(ckpt, tmp_path):
    _, tensors, model = ckpt
    tiny.write(model, tmp_path, tensors, not_converted=[*tiny.NOT_CONVERTED,
                                                        EXPERTS.format(0)])
    with pytest.raises(CheckpointError, match="in BF16"):
        cf.hf.from_pretrained(tmp_path, device="cpu")
