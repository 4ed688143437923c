"""The host layer of the grouped (MoE) GEMM, on the CPU: NVFP4 expert stacks (3-D quantize
bit-identical to the 2-D one per expert, expert views, dequantize, stacking, the packed
layout), the exact grouped reference against per-expert dense references, its checker
catching a wrong element, a wrong expert and an unwritten row, every typed error of
``grouped_gemm`` (output untouched), the launch path through a stand-in kernel (arguments,
total_M = 0, ``check=True``, offsets never read), and the ``cute_fp4::grouped_mm`` op (fake
shapes, one node under torch.compile, registered lazily)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import catalogue, grouped, packed, reference, run, tuning
from cute_fp4 import operands as cops
from cute_fp4.compile import Signature
from cute_fp4.errors import (
    CuteFp4Error,
    DeviceError,
    FormatError,
    InputError,
    InputTypeError,
    ValidationError,
)
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.schedule import OutDtype, Problem, Schedule, Scheduler, Tile, Warps

U8, E4 = torch.uint8, torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[1]


def _has_grouped_fields() -> bool:
    return ("grouped" in {f.name for f in dataclasses.fields(Scheduler)}
            and "groups" in {f.name for f in dataclasses.fields(Problem)})


needs_grouped = pytest.mark.skipif(not _has_grouped_fields(),
                                   reason="Scheduler.grouped / Problem.groups not there yet")


def awkward(*shape, seed=0):
    """Values whose rows span 2^-8..2^8, with zero blocks (scale handling shows up)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x *= torch.exp2(torch.randint(-8, 9, (*shape[:-1], 1), generator=g).float())
    x.view(*shape[:-1], shape[-1] // 16, 16)[
        torch.rand(*shape[:-1], shape[-1] // 16, generator=g) < 0.05] = 0.0
    return x


def same(t: NVFP4Tensor, u: NVFP4Tensor) -> bool:
    return (t.shape == u.shape and torch.equal(t.data, u.data)
            and torch.equal(t.scale.view(U8), u.scale.view(U8))
            and torch.equal(t.global_scale, u.global_scale))


def offsets_of(sizes) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)


# ----------------------------------------------------------------------------- 3-D NVFP4

@pytest.mark.parametrize("gs", [None, "scalar", "per-expert", "list"])
def test_quantize_stack_is_bit_identical_per_expert(gs):
    x = awkward(5, 130, 96)
    x[2] = 0.0  # an all-zero expert: global scale 1.0
    x[3] *= 1e-30  # a tiny expert
    given = {None: None, "scalar": 0.01, "per-expert": torch.rand(5, dtype=torch.float64) + 0.1,
             "list": [0.5, 1e-3, 2.0, 1e-5, 0.25]}[gs]
    t = cf.quantize(x, given)
    assert t.shape == (5, 130, 96) and t.experts == 5
    assert t.data.shape == (5, 130, 48) and t.scale.shape == (5, 256, 8)
    assert t.global_scale.shape == (5,) and t.global_scale.dtype == torch.float32
    for e in range(5):
        ge = None if given is None else (given if gs == "scalar" else given[e])
        assert same(t.expert(e), cf.quantize(x[e], ge)), e
    if gs is None:
        assert float(t.global_scale[2]) == 1.0
        assert len(set(t.global_scale.tolist())) == 5  # each expert's own amax


def test_quantize_stack_of_16_bit_and_strided_inputs():
    x = awkward(3, 64, 64, seed=1)
    for xx in (x.bfloat16(), x.half(), x.transpose(1, 2).contiguous().transpose(1, 2)):
        t = cf.quantize(xx)
        for e in range(3):
            assert same(t.expert(e), cf.quantize(xx[e].contiguous())), (xx.dtype, e)


@pytest.mark.parametrize("x, gs, match", [
    (torch.ones(2, 4, 24), None, "K = 24 is not a multiple of 16"),
    (torch.ones(0, 4, 16), None, r"empty tensor of shape \(0, 4, 16\)"),
    (torch.ones(2, 0, 16), None, r"empty tensor of shape \(2, 0, 16\)"),
    (torch.ones(3, 2, 16).index_put_((torch.tensor([1, 2]), torch.tensor([0, 1]),
                                      torch.tensor([3, 4])), torch.tensor([float("nan"),
                                                                           float("inf")])),
     None, "x has 2 NaN/Inf values"),
    (torch.ones(3, 2, 16), [1.0, 0.0, 1.0], "got 0 for expert 1"),
    (torch.ones(3, 2, 16), torch.tensor([1.0, 1.0, float("nan")]), "got nan for expert 2"),
    (torch.ones(3, 2, 16), [1.0, 2.0], "3 experts must be a scalar or hold 3 values, got 2"),
])
def test_quantize_stack_errors(x, gs, match):
    with pytest.raises(InputError, match=match):
        cf.quantize(x, gs)


def test_expert_views_share_storage():
    t = cf.quantize(awkward(4, 72, 64))
    for e in (0, 3, -1):
        v = t.expert(e)
        i = e % 4
        assert v.shape == (72, 64) and v.experts is None
        assert v.data.data_ptr() == t.data[i].data_ptr()
        assert v.scale.data_ptr() == t.scale[i].data_ptr() and v.scale.shape == (128, 4)
        assert v.global_scale.dim() == 0 and v.global_scale.data_ptr() == \
            t.global_scale[i].data_ptr()
    with pytest.raises(InputError, match="expert 4 is out of range for 4 experts"):
        t.expert(4)
    with pytest.raises(FormatError, match="leading expert mode"):
        t.expert(0).expert(0)
    with pytest.raises(TypeError):
        t.expert(1.5)


def test_dequantize_block_values_and_scales_of_a_stack():
    t = cf.quantize(awkward(3, 40, 80, seed=2))
    deq, vals, lin = t.dequantize(torch.float64), t.block_values(), t.scale_linear()
    assert deq.shape == vals.shape == (3, 40, 80) and lin.shape == (3, 40, 5)
    for e in range(3):
        ex = t.expert(e)
        assert torch.equal(deq[e], ex.dequantize(torch.float64))
        assert torch.equal(vals[e], ex.block_values())
        assert torch.equal(lin[e].view(U8), ex.scale_linear().view(U8))
    assert not torch.equal(deq[0], deq[1])  # each expert its own values and global scale


def test_constructor_of_a_stack():
    t = cf.quantize(awkward(3, 8, 32))
    again = NVFP4Tensor(t.data, t.scale.view(U8).flatten(), t.global_scale)
    assert same(again, t) and again.scale.shape == (3, 128, 4)
    one = NVFP4Tensor(t.data, t.scale, 0.5)  # one value for every expert
    assert one.global_scale.tolist() == [0.5] * 3
    assert "experts=3" in repr(t)
    with pytest.raises(FormatError, match=r"3 experts of \[8, 32\] need 3 x 128 x 4 = 1536 "
                                          r"bytes, got 512"):
        NVFP4Tensor(t.data, t.scale[0], t.global_scale)
    with pytest.raises(FormatError, match="3 experts must be a scalar or hold 3 values, got 2"):
        NVFP4Tensor(t.data, t.scale, [1.0, 2.0])
    with pytest.raises(FormatError, match="got -1 for expert 1"):
        NVFP4Tensor(t.data, t.scale, [1.0, -1.0, 2.0])
    with pytest.raises(FormatError, match=r"expected \[E, R, K/2\]"):
        NVFP4Tensor(t.data, t.scale, t.global_scale, (3, 8, 64))
    with pytest.raises(FormatError, match=r"uint8 \[R, K/2\], got torch.uint8 with shape "
                                          r"\(1, 3, 8, 16\)"):
        NVFP4Tensor(t.data[None], t.scale, t.global_scale)


def test_stack_of_experts():
    parts = [cf.quantize(awkward(16, 64, seed=s)) for s in range(3)]
    t = NVFP4Tensor.stack(parts)
    assert t.shape == (3, 16, 64)
    assert all(same(t.expert(e), parts[e]) for e in range(3))
    with pytest.raises(FormatError, match=r"expert 1 is \(16, 32\)"):
        NVFP4Tensor.stack([parts[0], cf.quantize(torch.ones(16, 32))])
    with pytest.raises(InputTypeError):
        NVFP4Tensor.stack([])


def test_repack_of_a_stack_round_trips():
    w = cf.quantize(awkward(4, 72, 128, seed=3))  # 72 rows: padded to 128 per expert
    pw = packed.repack(w)
    assert pw.shape == (4, 72, 128) and pw.experts == 4 and pw.data.shape == (4, 128, 64)
    for e in range(4):
        assert torch.equal(pw.data[e], packed.pack(w.data[e]))
        pe = pw.expert(e)
        assert pe.shape == (72, 128) and pe.data.data_ptr() == pw.data[e].data_ptr()
        assert same(pe.unpack(), w.expert(e))
    assert same(pw.unpack(), w)
    assert torch.equal(packed.unpack(pw.data, 72), w.data)
    assert not torch.equal(pw.data[:, :72], w.data)  # really a different byte order
    with pytest.raises(FormatError, match="multiple of 64"):
        packed.repack(cf.quantize(torch.ones(2, 8, 96)))
    with pytest.raises(FormatError, match=r"packed data for \[4, 72, 128\] must be uint8 "
                                          r"\[4, 128, 64\]"):
        packed.PackedNVFP4Weight(pw.data[:, :64], pw.scale, pw.global_scale, (4, 72, 128))
    with pytest.raises(FormatError, match="must have 128 rows, got 64"):
        packed.unpack(pw.data[:, :64], 72)


# ----------------------------------------------------------------------------- reference

def routing(kind: str, n_exp: int, total: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if kind == "ragged":
        cuts = sorted(torch.randint(0, total + 1, (n_exp - 1,), generator=g).tolist())
        return [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    if kind == "empty-ends":
        inner = routing("ragged", n_exp - 2, total, seed)
        return [0, *inner, 0]
    if kind == "ones":
        return [1] * total + [0] * (n_exp - total)
    if kind == "one-expert":
        return [0] * (n_exp // 2) + [total] + [0] * (n_exp - n_exp // 2 - 1)
    raise ValueError(kind)


def operands(fmt, n_exp, total, n, k, seed=0):
    x = awkward(total, k, seed=seed) if total else torch.zeros(0, k)
    if fmt == "nvfp4":
        a = cf.quantize(x) if total else NVFP4Tensor(torch.zeros(0, k // 2, dtype=U8),
                                                     torch.zeros(0, k // 16, dtype=E4), 1.0)
    else:
        dt = torch.bfloat16 if fmt == "bf16" else torch.float16
        a = (x / x.abs().max().clamp(min=1e-30)).to(dt)
    return x, a, cf.quantize(awkward(n_exp, n, k, seed=seed + 1))


@pytest.mark.parametrize("kind, n_exp, total", [("ragged", 8, 300), ("empty-ends", 6, 90),
                                                ("ones", 9, 7), ("one-expert", 5, 64)])
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "fp16"])
def test_reference_matches_a_per_expert_loop(kind, n_exp, total, fmt):
    sizes = routing(kind, n_exp, total)
    offs = offsets_of(sizes)
    x, a, b = operands(fmt, n_exp, total, 24, 96)
    got = reference.grouped_gemm(a, b, offs, out_dtype=torch.float64)
    assert got.shape == (total, 24)
    for e in range(n_exp):
        lo, hi = int(offs[e]), int(offs[e + 1])
        if hi == lo:
            continue
        # the rows of one expert quantized alone (NVFP4 blocks are per row): the dense
        # reference of that expert's GEMM
        a_e = cf.quantize(x[lo:hi], a.global_scale) if fmt == "nvfp4" else a[lo:hi]
        want = reference.gemm(a_e, b.expert(e), out_dtype=torch.float64)
        torch.testing.assert_close(got[lo:hi], want, rtol=1e-12, atol=1e-300)
    assert reference.check_grouped(got.float(), a, b, offs).passed


def test_reference_alpha_packed_and_offsets_forms():
    x, a, b = operands("bf16", 4, 50, 16, 128)
    offs = offsets_of([10, 0, 25, 15])
    base = reference.grouped_gemm(a, b, offs, out_dtype=torch.float64)
    alpha = torch.tensor([1.0, 2.0, 3.0, 0.5])
    scaled = reference.grouped_gemm(a, b, offs.tolist(), alpha, torch.float64)
    gs = b.global_scale.double()
    for e, (lo, hi) in enumerate([(0, 10), (10, 10), (10, 35), (35, 50)]):
        torch.testing.assert_close(scaled[lo:hi], base[lo:hi] / gs[e] * alpha[e].double(),
                                   rtol=1e-12, atol=0)
    same_alpha = reference.grouped_gemm(a, b, offs, 2.0, torch.float64)
    torch.testing.assert_close(same_alpha, reference.grouped_gemm(a, b, offs, [2.0] * 4,
                                                                  torch.float64))
    assert torch.equal(reference.grouped_gemm(a, packed.repack(b), offs, None, torch.float64),
                       base)


@pytest.mark.parametrize("offs, match", [
    ([0, 10, 20], "E \\+ 1 = 5 elements for 4 experts, got 3"),
    ([1, 10, 20, 30, 50], "start at 0 and end at total_M = 50, got 1 .. 50"),
    ([0, 10, 20, 30, 49], "got 0 .. 49"),
    ([0, 30, 20, 40, 50], r"offsets\[1\] = 30 > offsets\[2\] = 20"),
    (torch.tensor([0.0, 10, 20, 30, 50]), "integer tensor, got torch.float32"),
])
def test_reference_offsets_errors(offs, match):
    _, a, b = operands("bf16", 4, 50, 16, 64)
    with pytest.raises(InputError, match=match):
        reference.grouped_gemm(a, b, offs)


def test_reference_operand_errors():
    _, a, b = operands("bf16", 4, 50, 16, 64)
    offs = offsets_of([10, 10, 10, 20])
    with pytest.raises(InputError, match="leading expert mode"):
        reference.grouped_gemm(a, b.expert(0), offs)
    with pytest.raises(InputError, match="K mismatch"):
        reference.grouped_gemm(a[:, :32], b, offs)
    with pytest.raises(InputError, match=r"one value per expert \(4\), got 3"):
        reference.grouped_gemm(a, b, offs, torch.ones(3))


def _checked_case(fmt="nvfp4", out_dtype=torch.bfloat16):
    sizes = [0, 5, 1, 0, 40, 3, 0]  # empty first and last experts, a 1-token group
    offs = offsets_of(sizes)
    _, a, b = operands(fmt, len(sizes), sum(sizes), 32, 160)
    out = reference.grouped_gemm(a, b, offs, out_dtype=out_dtype)
    return a, b, offs, out


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_grouped_passes_the_reference_and_catches_one_wrong_element(out_dtype):
    a, b, offs, out = _checked_case(out_dtype=out_dtype)
    res = reference.check_grouped(out, a, b, offs)
    assert res.passed and res.shape == (49, 32, 160) and res.experts == 7, res
    assert reference.assert_close_grouped(out, a, b, offs).passed
    ref = reference.grouped_gemm(a, b, offs, out_dtype=torch.float64)
    row = 44  # expert 4's rows are 6..45
    col = int(ref[row].abs().argmax())
    bad = out.clone()
    bad[row, col] = (ref[row, col] * 1.03).to(out_dtype)
    res = reference.check_grouped(bad, a, b, offs)
    assert not res.passed and res.nonfinite == 0 and res.worst_expert == 4, res
    with pytest.raises(ValidationError, match="expert 4"):
        reference.assert_close_grouped(bad, a, b, offs)


def test_check_grouped_catches_an_unwritten_row_and_a_wrong_expert():
    a, b, offs, out = _checked_case("bf16")
    poisoned = out.clone()
    poisoned[5] = float("nan")  # the one token of expert 2
    res = reference.check_grouped(poisoned, a, b, offs)
    assert not res.passed and res.nonfinite == 32 and res.worst_expert == 2, res
    # expert 1's rows computed with expert 4's weights (a wrong group mapping)
    swapped = out.clone()
    swapped[0:5] = reference.gemm(a[0:5], b.expert(4), out_dtype=torch.bfloat16)
    res = reference.check_grouped(swapped, a, b, offs)
    assert not res.passed and res.worst_expert == 1, res
    with pytest.raises(InputError, match=r"output shape \(48, 32\) != reference \(49, 32\)"):
        reference.check_grouped(out[:48], a, b, offs)


def test_check_grouped_is_the_dense_rule_per_expert():
    """check_grouped's verdict is check()'s on each expert's rows (W4A16: rows slice
    exactly), the worst ratio over the experts."""
    a, b, offs, out = _checked_case("fp16")
    noisy = out.clone()
    g = torch.Generator().manual_seed(5)
    noisy += (torch.randn(noisy.shape, generator=g) * 1e-2 * out.abs()).to(out.dtype)
    grouped_res = reference.check_grouped(noisy, a, b, offs)
    per = [reference.check(noisy[lo:hi], a[lo:hi], b.expert(e))
           for e, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())) if hi > lo]
    worst = max(r.max_err_over_bound for r in per)
    assert worst > 1.0 and not grouped_res.passed  # the noise is beyond the rule
    assert grouped_res.max_err_over_bound == pytest.approx(worst, rel=1e-12)
    assert grouped_res.max_abs_err == pytest.approx(max(r.max_abs_err for r in per), rel=1e-12)


def test_check_grouped_of_no_tokens():
    _, a, b = operands("nvfp4", 3, 0, 16, 64)
    offs = torch.zeros(4, dtype=torch.int32)
    out = torch.empty(0, 16, dtype=torch.bfloat16)
    res = reference.check_grouped(out, a, b, offs)
    assert res.passed and res.worst_expert is None and res.shape == (0, 16, 64)


# ----------------------------------------------------------------------------- typed errors

def raises(exc, match, fn):
    with pytest.raises(exc, match=match) as e:
        fn()
    assert isinstance(e.value, CuteFp4Error), type(e.value)


def _case(**over):
    """W4A4 operands: total_M = 12 over E = 4 experts, N = 64, K = 64 (CPU)."""
    d = {"a": cf.quantize(awkward(12, 64)), "b": cf.quantize(awkward(4, 64, 64, seed=1)),
         "offsets": offsets_of([3, 0, 8, 1]), "out": None, "alpha": None,
         "out_dtype": torch.bfloat16, "schedule": "auto"}
    d.update(over)
    return d


OUT = torch.full((12, 64), 7.0, dtype=torch.bfloat16)


def call(**over):
    d = _case(**over)
    out = d["out"] if "out" in over else OUT
    return cf.grouped_gemm(d["a"], d["b"], d["offsets"], schedule=d["schedule"], out=out,
                           out_dtype=d["out_dtype"], alpha=d["alpha"])


def check(**over):
    d = _case(**over)
    return cops.check_grouped_operands(d["a"], d["b"], d["offsets"], d["out"], d["alpha"],
                                          d["out_dtype"], require_cuda=False)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _sm90_grouped() -> Schedule:
    return Schedule(target="sm_90a", tile=Tile(128, 128, 64), warps=Warps(mma=(2, 1)),
                    mainloop="rs_packed", scheduler=Scheduler(grouped=True))


def _sm120_grouped() -> Schedule:
    return Schedule(target="sm_120a", scheduler=Scheduler(grouped=True))


ERRORS = [
    ("b dense", InputTypeError, "b \\(the experts' weights\\) must be an NVFP4Tensor",
     lambda: call(b=torch.zeros(4, 64, 64))),
    ("b 2-D", InputError, r"leading expert mode \[E, N, K\], got shape \(64, 64\)",
     lambda: call(b=cf.quantize(awkward(64, 64)))),
    ("a stack", InputError, r"a must be 2-D \[total_M, K\] .* expert stack",
     lambda: call(a=cf.quantize(awkward(2, 6, 64)))),
    ("a int", InputError, "got torch.int8", lambda: call(a=torch.zeros(12, 64, dtype=torch.int8))),
    ("a list", InputTypeError, "got list", lambda: call(a=[1.0])),
    ("a 3-D", InputError, r"a must be 2-D \[total_M, K\], got shape \(1, 12, 64\)",
     lambda: call(a=_bf16(1, 12, 64))),
    ("K mismatch", InputError, r"a is \[12, 128\] and b is \[4, 64, 64\]",
     lambda: call(a=cf.quantize(awkward(12, 128)))),
    ("K=48", InputError, "K = 48 is not a multiple of 32",
     lambda: call(a=_bf16(12, 48), b=cf.quantize(awkward(4, 64, 48)))),
    ("N=60", InputError, "N = 60 is not a multiple of 8",
     lambda: call(b=cf.quantize(awkward(4, 60, 64)), out=None)),
    ("out shape", InputError, r"out must have shape \(12, 64\), got \(12, 32\)",
     lambda: call(out=_bf16(12, 32))),
    ("out dtype", InputError, "out must be torch.bfloat16, got torch.float16",
     lambda: call(out=torch.zeros(12, 64, dtype=torch.float16))),
    ("out strided", InputError, "out must be contiguous", lambda: call(out=_bf16(64, 12).T)),
    ("out_dtype int8", InputError, "unsupported output dtype", lambda: call(out_dtype="int8")),
    ("offsets E", InputError, r"offsets must be \[E \+ 1\] = \[5\] for the 4 experts of b, got "
     r"shape \(4,\)", lambda: call(offsets=offsets_of([3, 0, 9]))),
    ("offsets int64", InputError, "offsets must be torch.int32, got torch.int64",
     lambda: call(offsets=offsets_of([3, 0, 8, 1]).long())),
    ("offsets list", InputTypeError, "offsets must be an int32 tensor",
     lambda: call(offsets=[0, 3, 3, 11, 12])),
    ("offsets 2-D", InputError, r"got shape \(1, 5\)",
     lambda: call(offsets=offsets_of([3, 0, 8, 1])[None])),
    ("offsets device", InputError, "offsets is on meta but the operands are on cpu; group "
     "offsets are read on the GPU",
     lambda: call(offsets=torch.empty(5, dtype=torch.int32, device="meta"))),
    ("alpha E", InputError, r"one value per expert: E = 4 \(b has 4 experts\), got 3",
     lambda: call(alpha=torch.ones(3))),
    ("alpha float64", InputError, "alpha must be torch.float32, got torch.float64",
     lambda: call(alpha=torch.ones(4, dtype=torch.float64))),
    ("alpha str", InputTypeError, "alpha must be a float32 tensor of E = 4 values",
     lambda: call(alpha="1")),
    ("a misaligned", InputError, "not 16-byte aligned \\(offset 2\\)",
     lambda: call(a=torch.zeros(12 * 64 + 1, dtype=torch.bfloat16)[1:].view(12, 64))),
    ("a strided", InputError, "a must be contiguous", lambda: call(a=_bf16(64, 12).T)),
    ("b.data strided", InputError, "b.data must be contiguous",
     lambda: call(b=NVFP4Tensor(torch.zeros(4, 64, 64, dtype=U8)[:, :, ::2],
                                torch.zeros(4, 128, 4, dtype=E4), 1.0))),
    ("a.scale size", InputError, r"a.scale must have shape \(128, 4\), got \(256, 4\)",
     lambda: call(a=NVFP4Tensor._unchecked(torch.zeros(12, 32, dtype=U8),
                                           torch.zeros(256, 4, dtype=E4),
                                           torch.tensor(1.0), (12, 64)))),
    ("b global scale", InputError, "b.global_scale must hold 4 value",
     lambda: call(b=NVFP4Tensor._unchecked(torch.zeros(4, 64, 32, dtype=U8),
                                           torch.zeros(4, 128, 4, dtype=E4),
                                           torch.tensor(1.0), (4, 64, 64)))),
    ("schedule type", InputTypeError, "schedule must be a Schedule, a catalogue name or 'auto', "
     "got int", lambda: call(schedule=3)),
    ("not grouped", InputError, "sm120_default is not a grouped schedule",
     lambda: call(schedule="sm120_default")),
    ("not grouped Schedule", InputError, "is not a grouped schedule",
     lambda: call(schedule=catalogue.get("sm90_default"))),
]

GROUPED_ERRORS = [
    ("plain B on rs_packed", InputError, "plain NVFP4Tensor: repack it once with "
     "cute_fp4.packed.repack", lambda: call(a=_bf16(12, 64), schedule=_sm90_grouped())),
    ("packed B on sm120", InputError, "reads the plain weight layout but b is a "
     "PackedNVFP4Weight", lambda: call(b=packed.repack(cf.quantize(awkward(4, 64, 64))),
                                       schedule=_sm120_grouped())),
    ("W4A16 on sm120", InputError, r"takes NVFP4 activations \(W4A4\), a is bf16",
     lambda: call(a=_bf16(12, 64), schedule=_sm120_grouped())),
    ("packed K=96", FormatError, "not a multiple of 64",
     lambda: call(b=packed.repack(cf.quantize(awkward(4, 64, 96))))),
    ("valid but on the CPU", DeviceError, "CUDA device, b is on cpu",
     lambda: call(schedule=_sm120_grouped())),
    ("valid W4A16 on the CPU", DeviceError, "CUDA device, b is on cpu",
     lambda: call(a=_bf16(12, 64), b=packed.repack(cf.quantize(awkward(4, 64, 64))),
                  schedule=_sm90_grouped())),
]


@pytest.mark.parametrize("case", ERRORS, ids=lambda c: c[0])
def test_grouped_gemm_errors_leave_output_untouched(case):
    _, exc, match, fn = case
    before = OUT.clone()
    raises(exc, match, fn)
    assert torch.equal(OUT, before)


@needs_grouped
@pytest.mark.parametrize("case", GROUPED_ERRORS, ids=lambda c: c[0])
def test_grouped_schedule_errors_leave_output_untouched(case):
    _, exc, match, fn = case
    before = OUT.clone()
    raises(exc, match, fn)
    assert torch.equal(OUT, before)


def test_checks_pass_valid_operands_and_report_dims():
    assert check() == cops.GroupedDims(12, 64, 64, 4, "nvfp4", False)
    pw = packed.repack(cf.quantize(awkward(4, 72, 128)))
    assert check(a=_bf16(12, 128), b=pw, out=_bf16(12, 72)) == \
        cops.GroupedDims(12, 72, 128, 4, "bf16", True)
    assert check(a=torch.zeros(0, 64, dtype=torch.float16)).total_m == 0  # no tokens: fine
    with pytest.raises(DeviceError, match="CUDA device, b is on cpu"):
        d = _case()
        cops.check_grouped_operands(d["a"], d["b"], d["offsets"], None, None)


@needs_grouped
def test_schedule_resolution():
    s = _sm120_grouped()
    assert tuning.resolve_grouped(s) is s  # bf16 epilogue already
    fp32 = tuning.resolve_grouped(s, torch.float32)
    assert fp32.epilogue.out_dtype is OutDtype.FP32 and fp32.scheduler.grouped
    for name in (r.grouped.default for r in tuning.AUTO.values()):
        if name in catalogue.names():
            got = tuning.resolve_grouped(name, "fp16")
            assert got.scheduler.grouped and got.epilogue.out_dtype is OutDtype.FP16


def test_auto_names_the_catalogue_entries():
    defaults = {fam: r.grouped.default for fam, r in tuning.AUTO.items()}
    assert defaults == {"sm90": "sm90_grouped", "sm120": "sm120_grouped",
                        "sm90/mxfp4": "sm90_mxfp4_grouped",
                        "sm120/mxfp4": "sm120_mxfp4_grouped"}
    missing = [n for n in defaults.values() if n not in catalogue.names()]
    if missing:
        pytest.skip(f"catalogue has no {missing} yet (the lead's schedules)")
    for key, name in defaults.items():
        s = catalogue.get(name)
        assert s.scheduler.grouped and s.arch.family == key.split("/")[0]
    assert catalogue.get("sm90_grouped").mainloop.value == "rs_packed"


# ----------------------------------------------------------------------------- launch path

class StandIn:
    """A CompiledGemm stand-in: records what it is launched with and writes ``fill(...)``
    (the exact reference by default) into the output, as a correct kernel would."""

    def __init__(self, schedule, a_format="nvfp4", out_dtype=torch.bfloat16, fill=None):
        self.schedule, self.out_dtype, self.validated = schedule, out_dtype, False
        self.signature = Signature(a_format)
        self.fill = fill
        self.launches, self.planned = [], []
        self.a = self.b = None

    def check_plan(self, dims):
        self.planned.append(dims)

    def launch(self, ops):
        self.launches.append((ops.a, ops.a_scale, ops.b, ops.b_scale, ops.out, ops.alpha,
                              ops.offsets))
        self.bias = ops.bias
        val = (self.fill or reference.grouped_gemm)(self.a, self.b, ops.offsets, ops.alpha,
                                                    ops.out.dtype)
        ops.out.copy_(val)


@needs_grouped
def test_launch_arguments_w4a4():
    d = _case()
    kern = StandIn(_sm120_grouped())
    kern.a, kern.b = d["a"], d["b"]
    dims = check()
    out = run._launch_grouped(kern, d["a"], d["b"], d["offsets"], None, None, dims)
    (a_data, a_scale, b_data, b_scale, o, alpha, offs), = kern.launches
    assert a_data is d["a"].data and a_scale is d["a"].scale
    assert b_data is d["b"].data and b_scale is d["b"].scale and offs is d["offsets"]
    assert o is out and out.shape == (12, 64) and out.dtype == torch.bfloat16
    assert alpha.shape == (4,) and alpha.dtype == torch.float32
    assert torch.equal(alpha, d["b"].global_scale * d["a"].global_scale)
    assert kern.planned == [(12, 64, 64, "nvfp4", 4)]
    assert reference.check_grouped(out, d["a"], d["b"], d["offsets"]).passed


@needs_grouped
def test_launch_arguments_w4a16_alpha_and_no_tokens():
    pw = packed.repack(cf.quantize(awkward(4, 64, 64, seed=1)))
    a = (awkward(12, 64) / 300).bfloat16()
    kern = StandIn(_sm90_grouped(), "bf16")
    kern.a, kern.b = a, pw
    dims = check(a=a, b=pw)
    out = run._launch_grouped(kern, a, pw, _case()["offsets"], None, None, dims)
    (a_data, a_scale, _, _, _, alpha, _), = kern.launches
    assert a_data is a and a_scale is None
    assert alpha.data_ptr() == pw.global_scale.data_ptr()  # W4A16: b's global scales
    assert reference.check_grouped(out, a, pw, _case()["offsets"]).passed
    given = torch.arange(1, 5, dtype=torch.float32)
    run._launch_grouped(kern, a, pw, _case()["offsets"], out, given, dims)
    assert kern.launches[-1][5] is given or kern.launches[-1][5].data_ptr() == given.data_ptr()
    run._launch_grouped(kern, a, pw, _case()["offsets"], out, 0.5, dims)
    assert kern.launches[-1][5].tolist() == [0.5] * 4
    assert cops.grouped_alpha(a, pw, 0.5, 4) is cops.grouped_alpha(a, pw, 0.5, 4)
    # no tokens: an empty output, nothing launched, nothing planned
    a0 = torch.zeros(0, 64, dtype=torch.bfloat16)
    zeros = torch.zeros(5, dtype=torch.int32)
    n_launch = len(kern.launches)
    empty = run._launch_grouped(kern, a0, pw, zeros, None, None,
                                check(a=a0, b=pw, offsets=zeros))
    assert empty.shape == (0, 64) and len(kern.launches) == n_launch
    assert len(kern.planned) == 3


@needs_grouped
def test_run_checks_the_kernel_against_the_operands():
    kern = StandIn(_sm120_grouped(), "nvfp4")
    d = _case()
    with pytest.raises(InputError, match="kernel was compiled for A in nvfp4, got bf16"):
        run.check_grouped_kernel(kern, check(a=_bf16(12, 64)))
    kern.schedule = catalogue.get("sm120_default")
    with pytest.raises(InputError, match="not a grouped kernel"):
        run.check_grouped_kernel(kern, check())
    with pytest.raises(DeviceError):  # run_grouped checks the device too
        run.run_grouped(StandIn(_sm120_grouped()), d["a"], d["b"], d["offsets"])


@needs_grouped
def test_check_true_validates_once_and_the_fast_path_never_reads_offsets(monkeypatch):
    d = _case()
    kern = StandIn(_sm120_grouped())
    kern.a, kern.b = d["a"], d["b"]
    monkeypatch.setattr(run, "grouped_kernel", lambda *args: kern)
    out = cf.grouped_gemm(d["a"], d["b"], d["offsets"], check=True)
    assert kern.validated and reference.check_grouped(out, d["a"], d["b"], d["offsets"]).passed
    # offsets whose values are invalid pass the fast path: their values are never read
    # (the stand-in reads them itself, so give it valid ones to compute with)
    bad = torch.tensor([0, 9, 3, 11, 12], dtype=torch.int32)
    good = d["offsets"]
    kern.fill = lambda a, b, offs, alpha, dt: reference.grouped_gemm(a, b, good, alpha, dt)
    cf.grouped_gemm(d["a"], d["b"], bad)
    kern.validated = False
    with pytest.raises(InputError, match="non-decreasing"):  # check=True does read them
        cf.grouped_gemm(d["a"], d["b"], bad, check=True)
    # a kernel that writes a wrong element fails check=True with ValidationError
    wrong = StandIn(_sm120_grouped())
    wrong.a, wrong.b = d["a"], d["b"]

    def off_by_one(a, b, offs, alpha, dt):
        v = reference.grouped_gemm(a, b, offs, alpha, dt)
        v[3, 5] = v[3, 5] * 2 + 1
        return v

    wrong.fill = off_by_one
    monkeypatch.setattr(run, "grouped_kernel", lambda *args: wrong)
    with pytest.raises(ValidationError, match="E=4"):
        cf.grouped_gemm(d["a"], d["b"], d["offsets"], check=True)
    assert not wrong.validated


# ----------------------------------------------------------------------------- the op

def test_fake_op_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = grouped.register_op()
    assert grouped.register_op() is ops  # idempotent
    with FakeTensorMode():
        a = torch.empty(10, 32, dtype=U8)
        sfa = torch.empty(128, 4, dtype=E4)
        b = torch.empty(4, 72, 32, dtype=U8)
        sfb = torch.empty(4, 128, 4, dtype=E4)
        offs = torch.empty(5, dtype=torch.int32)
        alpha = torch.empty(4)
        y = ops.grouped_mm(a, sfa, b, sfb, offs, alpha, 64, torch.bfloat16, "auto")
        assert y.shape == (10, 72) and y.dtype == torch.bfloat16
        a16 = torch.empty(10, 64, dtype=torch.float16)
        bp = torch.empty(4, 128, 32, dtype=U8)  # packed rows: 72 padded to 128
        y = ops.grouped_mm(a16, None, bp, sfb, offs, alpha, 64, torch.float32, "auto", 72)
        assert y.shape == (10, 72) and y.dtype == torch.float32
    schema = str(ops.grouped_mm.default._schema)
    assert schema.startswith("cute_fp4::grouped_mm(Tensor a, Tensor? a_scale, Tensor b, "
                             "Tensor b_scale, Tensor offsets, Tensor alpha, SymInt k, "
                             "ScalarType out_dtype, str schedule, SymInt n=0, "
                             "bool packed=False)"), schema


def test_grouped_gemm_traces_into_one_op_under_torch_compile():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    d = _case()

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, w, offs):
        return cf.grouped_gemm(x, w, offs) * 2

    with pytest.raises(DeviceError):  # traced fine; the op runs only on a GPU
        f(d["a"], d["b"], d["offsets"])
    assert len(graphs) == 1
    assert "cute_fp4.grouped_mm" in graphs[0].code


def test_op_body_checks_its_tensors():
    alpha, offs = torch.ones(4), offsets_of([3, 0, 8, 1])
    with pytest.raises(InputError, match=r"\[E, rows, K/2\], got shape \(64, 32\)"):
        grouped.grouped_mm(torch.zeros(12, 32, dtype=U8), torch.zeros(128, 4, dtype=E4),
                           torch.zeros(64, 32, dtype=U8), torch.zeros(128, 4, dtype=E4),
                           offs, alpha, 64)
    with pytest.raises(InputTypeError, match="b_scale must be a torch.Tensor"):
        grouped.grouped_mm(torch.zeros(12, 32, dtype=U8), None,
                           torch.zeros(4, 64, 32, dtype=U8), None, offs, alpha, 64)


_FRESH = r"""
import sys
import cute_fp4, cute_fp4.grouped
from cute_fp4.api import _op_exists
print("registered", _op_exists())
print("dsl", any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules))
print("export", cute_fp4.grouped_gemm is cute_fp4.grouped.grouped_gemm)
"""


def test_import_registers_nothing_and_exports_lazily():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["registered False", "dsl False", "export True"]
    assert "grouped_gemm" in cf.__all__


@pytest.mark.parametrize("family, rows, fmt, want", [
    ("sm90", 8, "bf16", "sm90_stream_grouped_decode"),  # one token x top-8: 192 CTAs
    ("sm90", 32, "fp16", "sm90_stream_grouped_decode"),  # 4 tokens: 768 CTAs
    ("sm90", 34, "bf16", "sm90_grouped_decode"),  # 34 x 24 CTAs: past two waves
    ("sm90", 128 * 1, "bf16", "sm90_grouped_decode"),  # 16 tokens
    ("sm90", 128 * 16, "bf16", "sm90_grouped_decode"),
    ("sm90", 128 * 1, "nvfp4", "sm90_grouped_large"),  # W4A4 needs 128-row tiles there
    ("sm90", 128 * 64, "nvfp4", "sm90_grouped_large"),
    ("sm90", 128 * 17, "bf16", "sm90_grouped"),
    ("sm90", 128 * 191, "fp16", "sm90_grouped"),
    ("sm90", 128 * 192, "bf16", "sm90_grouped_large"),
    ("sm90", 128 * 1024, "nvfp4", "sm90_grouped_large"),
    ("sm120", 128 * 32, "nvfp4", "sm120_grouped_decode"),
    ("sm120", 128 * 33, "nvfp4", "sm120_grouped"),
    ("sm120", 128 * 4096, "nvfp4", "sm120_grouped"),
    ("sm120", 8, "bf16", "sm120_stream_grouped_decode"),  # SM12x W4A16: a packed stack
    ("sm120", 128 * 4096, "bf16", "sm120_stream_grouped_decode"),
])
def test_auto_picks_by_rows_per_expert(family, rows, fmt, want):
    packed_stack = family == "sm90" or fmt != "nvfp4"
    dims = cops.GroupedDims(rows, 1536, 2048, 128, fmt, packed_stack)
    assert tuning.grouped_auto_name(family, dims) == want
    assert want in catalogue.names()
    assert tuning.grouped_auto_name(family) == tuning.AUTO[family].grouped.default


@pytest.mark.parametrize("rows, experts, n, k, want", [
    (8, 256, 4096, 7168, False),  # DeepSeek-V3 gate_up, 1 token: long K, 512 CTAs
    (32, 256, 4096, 7168, True),  # ... 4 tokens: long K, 2048 CTAs
    (8, 256, 7168, 2048, False),  # ... down: 8 x 112 CTAs
    (8, 128, 2048, 768, True),  # Qwen3-30B-A3B down, 1 token: 256 CTAs
    (600, 8, 64, 1024, False),  # few CTAs, but 75 rows per expert
])
def test_auto_takes_the_stream_kernel_for_few_ctas(rows, experts, n, k, want):
    dims = cops.GroupedDims(rows, n, k, experts, "bf16", True)
    stream = "sm90_stream_grouped_decode" + ("_long_k" if k > 4096 else "")
    name = tuning.grouped_auto_name("sm90", dims)
    assert (name == stream) == want, name
    if want:  # one K unit per batch of the ring, two for a long K
        assert catalogue.get(name).stages == (2 if k > 4096 else 1)
    assert tuning.grouped_auto_name("sm120", dims) == "sm120_stream_grouped_decode"
    assert "stream" not in tuning.grouped_auto_name("sm90", dims._replace(packed=False))


def test_a_long_k_stream_is_its_own_auto_regime():
    """The regime (the memo key of "auto") tells a long-K stream from a short one."""
    long_k = cops.GroupedDims(32, 4096, 7168, 256, "bf16", True)  # DeepSeek-V3 gate_up
    short = cops.GroupedDims(32, 1536, 2048, 128, "bf16", True)  # Qwen3-30B-A3B gate_up
    assert tuning.grouped_auto_name("sm90", long_k) == "sm90_stream_grouped_decode_long_k"
    assert tuning.grouped_auto_name("sm90", short) == "sm90_stream_grouped_decode"
    assert tuning.grouped_regime("auto", long_k) != tuning.grouped_regime("auto", short)
    # MXFP4 experts past K 4096 keep their one stream schedule
    assert tuning.grouped_auto_name("sm90", long_k._replace(b_format="mxfp4")) == \
        "sm90_mxfp4_stream_grouped_decode"


@pytest.mark.parametrize("tokens, experts, n, stream", [
    (1, 32, 5760, True),  # gpt-oss gate_up, 1 token x top-4: 360 CTAs
    (1, 128, 2880, "_w8"),  # down: 180 CTAs, at most 200: eight warps per CTA
    (2, 128, 2880, True),  # down, 2 tokens: 8 x 45 = 360 CTAs
    (4, 32, 5760, True),  # 16 x 90 = 1,440 CTAs
    (16, 128, 5760, True),  # bound 64 x 90 = 5,760 CTAs: still the stream kernel
    (64, 32, 2880, False),  # 8 rows per expert: past the stream kernel's 4
])
def test_auto_for_gpt_oss_experts_on_sm90(tokens, experts, n, stream):
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem

    dims = cops.GroupedDims(4 * tokens, n, 2880, experts, "bf16", True, "mxfp4")
    name = tuning.grouped_auto_name("sm90", dims)
    s = catalogue.get(name)
    assert plan(s, Problem(a_format="bf16", b_format="mxfp4", groups=experts)).ok, name
    if not stream:
        assert s.mainloop.value == "rs_packed", name
        return
    assert name == "sm90_mxfp4_stream_grouped_decode" + (stream if isinstance(stream, str) else "")
    assert s.stages == 1  # one K unit per batch of the ring (the schedule's docstring)


def test_a_few_cta_stream_is_its_own_auto_regime():
    """The regime (the memo key of "auto") tells the few-CTA stream (eight warps) from the
    four-warp one, and only where it differs: NVFP4 names no few-CTA schedule."""
    down = cops.GroupedDims(4, 2880, 2880, 128, "bf16", True, "mxfp4")  # 180 CTAs
    down2 = down._replace(total_m=8)  # 360 CTAs
    assert tuning.grouped_auto_name("sm90", down) == "sm90_mxfp4_stream_grouped_decode_w8"
    assert tuning.grouped_auto_name("sm90", down2) == "sm90_mxfp4_stream_grouped_decode"
    assert tuning.grouped_regime("auto", down) != tuning.grouped_regime("auto", down2)
    nv = down._replace(b_format="nvfp4")
    assert tuning.grouped_auto_name("sm90", nv) == "sm90_stream_grouped_decode"
    assert tuning.grouped_auto_name("sm120", down) == "sm120_stream_grouped_decode"


def test_gemm_refuses_an_expert_stack_with_a_pointer_to_grouped_gemm():
    w = cf.quantize(torch.randn(3, 64, 64))
    with pytest.raises(cf.errors.InputError, match="grouped_gemm"):
        cf.gemm(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(cf.errors.InputError, match="grouped_gemm"):
        cf.gemm(torch.zeros(2, 64, dtype=torch.bfloat16), packed.repack(w))


def test_gemm_refuses_an_expert_stack_as_a():
    from cute_fp4.operands import check_all

    stack = cf.quantize(torch.randn(2, 4, 64))
    with pytest.raises(cf.errors.InputError, match=r"2-D \[M, K\], got an expert stack"):
        check_all(stack, cf.quantize(torch.randn(64, 64)), None, None, torch.bfloat16,
                  require_cuda=False)


def test_w4a4_on_a_packed_stack_takes_the_values_route():
    """run.via_values: NVFP4 activations on a packed weight with "auto" run the W4A16
    kernel on the activation's block values; a named schedule, 16-bit activations or a
    plain weight keep their kernels."""
    assert run.via_values("auto", "nvfp4", True)
    assert not run.via_values("sm90_grouped", "nvfp4", True)
    assert not run.via_values("auto", "bf16", True)
    assert not run.via_values("auto", "nvfp4", False)
