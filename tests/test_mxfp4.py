"""MXFP4 on the CPU: the format's descriptor, UE8M0 codes and the OCP quantization rule
against vectors written by hand, the tensor type (checkpoint form, expert stacks, the
packed weight), round trips bit for bit, and the exact reference on a small GEMM computed
by hand."""

from __future__ import annotations

import math

import pytest
import torch

from cute_fp4 import packed, reference
from cute_fp4.errors import FormatError, InputError, InputTypeError
from cute_fp4.formats import MXFP4, NVFP4, UE8M0, Operand
from cute_fp4.mxfp4 import MAX_KERNEL_CODE, MXFP4Tensor
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, unpack_e2m1
from cute_fp4.schedule import Problem


def test_mxfp4_fields():
    assert (MXFP4.name, MXFP4.block, MXFP4.global_scale, MXFP4.scale) == (
        "mxfp4", 32, False, UE8M0)
    assert (MXFP4.mma_kind, MXFP4.scale_vec, MXFP4.scales_per_mma) == ("mxf4", "2X", 2)
    assert MXFP4.sass_mma == "OMMA.SF.16864.F32.E2M1.E2M1.E8"  # as ptxas names it
    assert MXFP4.atom_k == 128 and MXFP4.element is NVFP4.element
    assert (UE8M0.torch_dtype, UE8M0.dsl_name) == (torch.float8_e8m0fnu, "Float8E8M0FNU")
    # scales: K / 32 columns padded to 4, rows to 128; data as NVFP4's
    assert MXFP4.scale_shape(130, 96) == (256, 4) and MXFP4.scale_shape(1, 256) == (128, 8)
    assert MXFP4.scale_bytes(130, 96) == 1024 and MXFP4.data_row_bytes(96) == 48
    assert MXFP4.atom_cols(48) == 1 and MXFP4.atom_cols(64) == 1 and MXFP4.atom_cols(65) == 2
    assert Operand.of("MXFP4") is Operand.MXFP4 and Operand.MXFP4.block_format is MXFP4


# UE8M0 codes written out by hand: 2^(code - 127)
UE8M0_VECTORS = [(0, 2.0**-127), (1, 2.0**-126), (120, 1 / 128), (126, 0.5), (127, 1.0),
                 (128, 2.0), (130, 8.0), (252, 2.0**125), (254, 2.0**127)]


@pytest.mark.parametrize("code, value", UE8M0_VECTORS)
def test_ue8m0_codes(code, value):
    assert UE8M0.decode(code) == value
    assert float(UE8M0.decode_tensor(torch.tensor([code], dtype=torch.uint8))) == value
    # the torch storage dtype agrees
    assert float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e8m0fnu).double()) \
        == value


def test_ue8m0_nan_and_encode():
    assert math.isnan(UE8M0.decode(255))
    assert math.isnan(float(UE8M0.decode_tensor(torch.tensor([255], dtype=torch.uint8))))
    vals = torch.tensor([1.0, 1.99, 2.0, 0.75, 0.0, 2.0**-140, 3.0 * 2.0**126])
    # down to a power of two (torch's own float -> e8m0 rounds up: 1.99 -> 2)
    assert UE8M0.encode(vals).view(torch.uint8).tolist() == [127, 127, 128, 126, 0, 0, 254]


def _codes(t) -> list[list[int]]:
    return unpack_e2m1(t.data).tolist()


def _block(*head, fill=0.0):
    return list(head) + [fill] * (32 - len(head))


def test_quantize_by_hand():
    rows = [
        # amax 7: floor(log2 7) - 2 = 0 -> code 127; 7 saturates to 6; 0.25 ties to 0 and
        # 0.75 to 1.0 (even codes), 2.5 to 2.0, 5 to 4.0
        _block(6.0, -3.0, 0.5, 0.25, 0.75, 7.0, 2.5, 5.0, -0.0),
        # amax 8: shared 1 (scale 2, code 128): 8 -> 4 (code 6), 1 -> 0.5 (code 1)
        _block(8.0, fill=1.0),
        # amax 0.1: floor(-3.32) - 2 = -6 (code 121); 0.1 * 64 = 6.4 -> 6 -> 0.09375
        _block(0.1),
        # all zeros: code 0 (2^-127), zero codes
        _block(),
        # tiny: shared clamps at -127; 2^-130 * 2^127 = 1/8 -> code 0
        _block(2.0**-130),
        # huge: amax 1.5 x 2^127 -> shared 127 - 2 = 125 (code 252): 6 (code 7) and 1/2 (1)
        _block(1.5 * 2.0**127, 2.0**124),
    ]
    t = quantize(torch.tensor(rows), format="mxfp4")
    assert isinstance(t, MXFP4Tensor) and t.global_scale is None
    assert t.scale_linear().view(torch.uint8).flatten().tolist() == [127, 128, 121, 0, 0, 252]
    c = _codes(t)
    assert c[0][:9] == [7, 8 + 5, 1, 0, 2, 7, 4, 6, 0]
    assert c[1][:3] == [6, 1, 1] and c[2][:2] == [7, 0]
    assert c[3] == [0] * 32 and c[4] == [0] * 32 and c[5][:2] == [7, 1]
    d = t.dequantize(torch.float64)
    assert d[0, :9].tolist() == [6.0, -3.0, 0.5, 0.0, 1.0, 6.0, 2.0, 4.0, 0.0]
    assert d[1, :2].tolist() == [8.0, 1.0] and d[2, 0] == 0.09375
    assert d[5, 0] == 1.5 * 2.0**127 and d[5, 1] == 2.0**124


def test_padding_and_layout_are_the_blocked_ones():
    x = torch.randn(130, 96)
    t = quantize(x, format="mxfp4")
    assert t.scale.shape == (256, 4) and t.scale.dtype == torch.float8_e8m0fnu
    raw = t.scale.view(torch.uint8).reshape(-1)
    lin = t.scale_linear().view(torch.uint8)
    for r, c in [(0, 0), (1, 2), (129, 1), (64, 0)]:
        assert int(raw[MXFP4.scale_offset(r, c, 96)]) == int(lin[r, c])
    mask = torch.zeros(256, 4, dtype=torch.bool)
    mask[:130, :3] = True
    pad = torch.tensor([[MXFP4.scale_offset(r, c, 96) for c in range(4)] for r in range(256)])
    assert int(raw[pad[~mask]].sum()) == 0  # padding is zero


def test_error_within_half_the_scale_or_the_clip():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    t = quantize(x, format="mxfp4")
    scale = t.scale_linear().double().repeat_interleave(32, dim=-1)
    err = (t.dequantize(torch.float64) - x.double()).abs()
    # rounding: at most half the E2M1 spacing (2 x scale near 6); the OCP clip of a block's
    # amax in [6, 8) x scale: at most 2 x scale
    assert bool((err <= 2 * scale).all())


def test_expert_stack_is_each_expert_alone():
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1))
    t = quantize(x, format="mxfp4")
    assert t.experts == 3 and t.shape == (3, 40, 64) and t.global_scale is None
    for e in range(3):
        one = quantize(x[e], format="mxfp4")
        assert torch.equal(t.expert(e).data, one.data)
        assert torch.equal(t.expert(e).scale.view(torch.uint8), one.scale.view(torch.uint8))
    s = MXFP4Tensor.stack([t.expert(e) for e in range(3)])
    assert torch.equal(s.data, t.data) and s.global_scale is None


def test_checkpoint_form_round_trips_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (4, 24, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (4, 24, 3), dtype=torch.uint8, generator=g)
    t = MXFP4Tensor.from_blocks(blocks, scales)
    assert t.shape == (4, 24, 96) and t.experts == 4
    b2, s2 = t.to_blocks()
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    # 2-D, and the values are transformers' (lut[code] * 2^(scale - 127), low nibble first)
    one = MXFP4Tensor.from_blocks(blocks[0], scales[0])
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=torch.float64)
    b = blocks[0].reshape(24, 48)
    vals = torch.stack([lut[(b & 15).long()], lut[(b >> 4).long()]], -1).reshape(24, 96)
    want = torch.ldexp(vals, scales[0].long().repeat_interleave(32, -1) - 127)
    assert torch.equal(one.dequantize(torch.float64), want)


def test_quantize_round_trips_on_representable_values():
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    t = quantize(x, format="mxfp4")
    d = t.dequantize()
    again = quantize(d, format="mxfp4")
    assert torch.equal(again.dequantize(), d)  # the values, bit for bit
    # a block whose largest code is 6 or 7 keeps its scale, so its bytes too
    top = unpack_e2m1(t.data).reshape(16, 4, 32).bitwise_and(7).amax(-1) >= 6
    same = (again.scale_linear().view(torch.uint8) == t.scale_linear().view(torch.uint8))
    assert bool(same[top].all())


def test_from_blocks_refusals():
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    for bad, what in [(255, "NaN"), (253, r"2\^126")]:
        with pytest.raises(FormatError, match=what):
            MXFP4Tensor.from_blocks(blocks, torch.tensor([[127], [bad]], dtype=torch.uint8))
    MXFP4Tensor.from_blocks(blocks, torch.tensor([[0], [MAX_KERNEL_CODE]], dtype=torch.uint8))
    with pytest.raises(FormatError, match=r"\[\.\.\., N, K/32, 16\]"):
        MXFP4Tensor.from_blocks(torch.zeros(2, 1, 8, dtype=torch.uint8),
                                torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(FormatError, match="uint8"):
        MXFP4Tensor.from_blocks(blocks.float(), torch.zeros(2, 1, dtype=torch.uint8))


def test_quantize_refusals():
    with pytest.raises(InputError, match="no global scale"):
        quantize(torch.randn(4, 32), 0.5, format="mxfp4")
    with pytest.raises(InputError, match="multiple of 32"):
        quantize(torch.randn(4, 48), format="mxfp4")
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with pytest.raises(InputError, match="mxfp4 has no encoding"):
        quantize(x, format="mxfp4")
    with pytest.raises(InputError, match="did you mean 'mxfp4'"):
        quantize(torch.randn(4, 32), format="mxfp5")
    with pytest.raises(FormatError, match="no global scale"):
        MXFP4Tensor._checked(torch.zeros(4, 16, dtype=torch.uint8),
                             torch.zeros(128, 4, dtype=torch.uint8), 1.0, None)
    t = quantize(torch.randn(4, 32), format="mxfp4")
    with pytest.raises(FormatError, match="float8_e8m0fnu"):
        MXFP4Tensor(t.data, t.scale.view(torch.uint8).view(torch.float8_e4m3fn))


def test_sibling_types_never_pass_for_each_other():
    m = quantize(torch.randn(64, 64), format="mxfp4")
    n = quantize(torch.randn(64, 64))
    assert not isinstance(m, NVFP4Tensor) and not isinstance(n, MXFP4Tensor)
    pm = packed.repack(m)
    assert isinstance(pm, packed.PackedMXFP4Weight) and pm.fmt is MXFP4
    assert not isinstance(pm, packed.PackedNVFP4Weight) and pm.global_scale is None
    back = pm.unpack()
    assert isinstance(back, MXFP4Tensor) and torch.equal(back.data, m.data)
    assert torch.equal(back.scale.view(torch.uint8), m.scale.view(torch.uint8))
    stack = quantize(torch.randn(2, 64, 128), format="mxfp4")
    ps = packed.repack(stack)
    assert torch.equal(ps.expert(1).unpack().data, stack.expert(1).data)
    with pytest.raises(InputTypeError, match="PackedNVFP4Weight.from_tensor"):
        packed.PackedNVFP4Weight.from_tensor(m)
    with pytest.raises(InputError, match="one block format"):
        reference.gemm(n, m)
    with pytest.raises(InputError, match="one block format"):
        Problem(a_format="nvfp4", b_format="mxfp4")
    assert Problem(a_format="mxfp4", b_format="mxfp4").fmt is MXFP4
    assert repr(Problem(b_format="mxfp4", a_format="bf16")) == \
        "Problem(m=0, n=0, k=0, a_format='bf16', groups=0, b_format='mxfp4')"


def _tensor(codes_rows, scale_codes) -> MXFP4Tensor:
    """An MXFP4 tensor from E2M1 codes per row (K = 32 x blocks) and scale codes."""
    codes = torch.tensor(codes_rows, dtype=torch.uint8)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    n, k = codes.shape
    blocks = data.reshape(n, k // 32, 16)
    return MXFP4Tensor.from_blocks(blocks, torch.tensor(scale_codes, dtype=torch.uint8))


def test_small_gemm_by_hand():
    # A: one row of 1.0 (code 2) x scale 2 (128): every element 2
    a = _tensor([[2] * 32], [[128]])
    # B row 0: 0.5 (code 1) x scale 0.5 (126) = 0.25 each; row 1: 16 x -1.0 (code 10),
    # 16 x 6.0 (code 7), scale 1 (127)
    b = _tensor([[1] * 32, [10] * 16 + [7] * 16], [[126], [127]])
    d = reference.gemm(a, b, out_dtype=torch.float64)
    assert d.tolist() == [[32 * 2 * 0.25, 16 * 2 * -1.0 + 16 * 2 * 6.0]]  # [[16, 160]]
    # W4A16: a BF16 activation of 3.0 against B, and alpha
    x = torch.full((1, 32), 3.0, dtype=torch.bfloat16)
    assert reference.gemm(x, b, alpha=0.5, out_dtype=torch.float64).tolist() == \
        [[0.5 * 32 * 3 * 0.25, 0.5 * (16 * 3 * -1.0 + 16 * 3 * 6.0)]]
    # two K blocks with different scales: 32 x (1 x 2^-1) + 32 x (1 x 2^3)
    a2 = _tensor([[2] * 64], [[126, 130]])
    b2 = _tensor([[2] * 64], [[127, 127]])
    assert reference.gemm(a2, b2, out_dtype=torch.float64).tolist() == [[32 * 0.5 + 32 * 8.0]]


def test_error_rule_holds_for_exact_and_catches_a_dropped_block():
    g = torch.Generator().manual_seed(4)
    a = quantize(torch.randn(8, 320, generator=g), format="mxfp4")
    b = quantize(torch.randn(24, 320, generator=g), format="mxfp4")
    exact = reference.gemm(a, b, out_dtype=torch.float32)
    assert reference.check(exact.bfloat16(), a, b).passed
    # without one 32-element block of K (its contribution moved out): fails
    av, bv = a.block_values(), b.block_values()
    drop = (av[:, 32:64] @ bv[:, 32:64].T).float()
    res = reference.check((exact - drop).bfloat16(), a, b)
    assert not res.passed
    bound = reference.error_bound(a, b, out_dtype=torch.bfloat16)
    assert bound.shape == (8, 24) and bool((bound > 0).all())
    # grouped: experts of MXFP4 weights, no global scale (alpha 1)
    w = quantize(torch.randn(3, 24, 320, generator=g), format="mxfp4")
    x = torch.randn(10, 320, generator=g).bfloat16()
    offs = [0, 4, 4, 10]
    out = reference.grouped_gemm(x, w, offs, out_dtype=torch.float32)
    assert reference.check_grouped(out, x, w, offs).passed
    assert torch.equal(out[4:], reference.gemm(x[4:], w.expert(2), out_dtype=torch.float32))
    assert reference.check_grouped(out, x, packed.repack(w), offs).passed


def test_plan_says_where_mxfp4_runs():
    """SM120's MMA (W4A4, kind::mxf4) and the packed-weight decodes (rs_packed, stream;
    BF16 activations); every other place refused with its reason."""
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan

    w4a4, w4a16 = Problem(a_format="mxfp4", b_format="mxfp4"), Problem(a_format="bf16",
                                                                         b_format="mxfp4")
    for name, p in [("sm120_mxfp4", w4a4), ("sm120_mxfp4_grouped", w4a4),
                    ("sm90_mxfp4_rs_packed", w4a16), ("sm90_mxfp4_grouped", w4a16),
                    ("sm90_mxfp4_stream_decode", w4a16), ("sm120_mxfp4_stream_decode", w4a16)]:
        assert plan(catalogue.get(name), p).ok, name

    def reasons(name, p):
        return " ".join(plan(catalogue.get(name), p).reasons)

    assert "UE4M3 scales only" in reasons("sm90_default", w4a16)
    assert "swap-AB" in reasons("sm90_decode_swapab", w4a16)
    assert "tile K 64 is not a multiple of 128" in reasons("sm120_k64_deep", w4a4)
    assert "tile K 64 is not a multiple of 128" in reasons("sm90_rs_packed", w4a16)
    fp16 = Problem(a_format="fp16", b_format="mxfp4")
    assert "decode to BF16 only" in reasons("sm90_mxfp4_stream_decode", fp16)
    assert "runs SM120's block-scaled MMA" in reasons("sm90_mxfp4_rs_packed",
                                                      Problem(a_format="mxfp4",
                                                              b_format="mxfp4"))
    # the byte counts follow the format: a stage of MXFP4 scales is half NVFP4's
    nv = plan(catalogue.get("sm120_default")).stage_bytes
    mx = plan(catalogue.get("sm120_default"), w4a4).stage_bytes
    assert (mx["SFA"], mx["SFB"]) == (nv["SFA"] // 2, nv["SFB"] // 2) == (512, 512)
