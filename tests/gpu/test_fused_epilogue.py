"""Fused epilogue operations (``Epilogue.ops``: bias, silu_mul) on a GPU, bit for bit
against the unfused pipeline they replace, for every kernel flavour that takes them.

The unfused pipeline: the same schedule without ops and with FP32 output (the same
accumulation, split-K order and scale), the bias added in FP32, rounded to the output
dtype, then ``F.silu(gate) * up`` in that dtype on the kernel's interleaved columns
(``cute_fp4.fused.silu_mul_unfused``); its GEMM is itself held to the exact reference. The
fused output goes into a NaN-filled buffer, so a tile the kernel leaves unwritten fails.
SiLU's bits are checked over every finite BF16 and FP16 input (torch's CUDA SiLU is the
other side). SM120 schedules run through the emulated MMA on SM90, natively on SM12x; the
weight-streaming kernel (one kernel for both families, no emulated build) runs as the GPU's
own family's schedule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cute_fp4 as cf
from cute_fp4 import catalogue, packed, reference
from cute_fp4.api import make_operands, run_compiled
from cute_fp4.compile import Signature, compile, compile_emulated  # noqa: A004
from cute_fp4.errors import InputError, ScheduleError
from cute_fp4.fused import interleave_gate_up, silu_mul_unfused
from cute_fp4.nvfp4 import NVFP4Tensor, swizzle_scales
from cute_fp4.plan import plan
from cute_fp4.planning.common import silu_group
from cute_fp4.run import run_grouped
from cute_fp4.schedule import Mainloop, Problem
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

WATCHDOG_S = 300
OPS = [("bias",), ("silu_mul",), ("bias", "silu_mul")]
# (schedule, A format): every kernel flavour of each family that takes ops
DENSE = {"sm90": [("sm90_rs_packed_decode", "bf16"), ("sm90_rs_packed", "bf16"),
                  ("sm90_default", "bf16"), ("sm90_default", "nvfp4"),
                  ("sm90_decode", "nvfp4"), ("sm90_decode_swapab", "bf16"),
                  ("sm90_decode_64x128_splitk2", "bf16"), ("sm90_stream_decode", "bf16")],
         "sm120": [("sm120_default", "nvfp4"), ("sm120_decode_splitk4", "nvfp4"),
                   ("sm120_pingpong", "nvfp4"), ("sm120_128x64", "nvfp4"),
                   ("sm120_stream_decode", "bf16")]}
GROUPED = {"sm90": [("sm90_grouped_decode", "bf16"), ("sm90_grouped_large", "bf16"),
                    ("sm90_grouped", "bf16"), ("sm90_stream_grouped_decode", "bf16")],
           "sm120": [("sm120_grouped", "nvfp4"), ("sm120_grouped_decode", "nvfp4"),
                     ("sm120_stream_grouped_decode", "bf16")]}
# M, N, K: M = 1 and tails in M, N (multiples of 64 = 2 x the SM120 group, not of 128 or
# 256) and K
SHAPES = [(1, 320, 256), (7, 576, 320), (16, 1088, 1024), (129, 320, 832), (300, 576, 512)]


def _cases(table):
    return [pytest.param(name, fmt, ops, id=f"{name}-{fmt}-{'+'.join(ops)}")
            for fam in ("sm90", "sm120") for name, fmt in table[fam] for ops in OPS]


def _runnable(s, fmt, groups=0):
    if s.arch.family == "sm90" and selection.family() != "sm90":
        pytest.skip(f"{s.name} is an sm_90a schedule; this GPU is {selection.target().name}")
    if s.mainloop is Mainloop.STREAM and s.arch.family != selection.family():
        pytest.skip(f"{s.name}: the stream kernel has no emulated build; it is one kernel "
                    "for both families, tested here as this GPU's own schedule")
    p = plan(s, Problem(a_format=fmt, groups=groups))
    if not p.ok:
        pytest.skip(f"plan() refuses {s.name} for {fmt}: {'; '.join(p.reasons)}")


def _compile(s, fmt):
    emulated = s.arch.family == "sm120" and selection.family() == "sm90"
    return compile_emulated(s, Signature(fmt)) if emulated else compile(s, Signature(fmt))


def _fused_and_plain(name: str, fmt: str, ops: tuple, groups: int = 0):
    """The catalogue schedule ``name`` with ``ops`` (skipped where it cannot run here), its
    kernel, and the kernel of the unfused pipeline's GEMM (the schedule, FP32 output)."""
    base = catalogue.get(name)
    s = base.replace(ops=ops)
    _runnable(s, fmt, groups)
    return s, _compile(s, fmt), _compile(base.replace(out_dtype="fp32"), fmt)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _unfused(raw, bias, ops, dtype, group):
    want = (raw if bias is None else raw + bias).to(dtype)
    return silu_mul_unfused(want, group) if "silu_mul" in ops else want


def _assert_same_bits(got, want, what):
    diff = (_bits(got) != _bits(want))
    assert not diff.any(), (f"{what}: {int(diff.sum())} of {got.numel()} values differ, "
                            f"first at {tuple(diff.nonzero()[0].tolist())}")


@pytest.mark.parametrize("name, fmt, ops", _cases(DENSE))
def test_fused_dense_is_the_unfused_pipeline_bit_for_bit(name, fmt, ops):
    s, fused, plain = _fused_and_plain(name, fmt, ops)
    dt, g = torch.bfloat16, silu_group(s)
    for i, (m, n, k) in enumerate(SHAPES):
        if not plan(plain.schedule, Problem(m, n, k, fmt)).ok:  # e.g. split-K past K's tiles
            continue
        a, b = make_operands(m, n, k, fmt, seed=i)
        bias = torch.randn(n, device="cuda") if "bias" in ops else None
        raw = run_compiled(plain, a, b)
        assert reference.check(raw, a, b).passed, (name, m, n, k)
        cols = n // 2 if "silu_mul" in ops else n
        out = torch.full((m, cols), float("nan"), dtype=dt, device="cuda")
        run_compiled(fused, a, b, out=out, bias=bias)
        _assert_same_bits(out, _unfused(raw, bias, ops, dt, g), f"{s.name} {(m, n, k)}")


def _grouped_case(counts, n, k, fmt, seed, reads_packed):
    g = torch.Generator().manual_seed(seed)
    b = cf.quantize(torch.randn(len(counts), n, k, generator=g).cuda())
    total = sum(counts)
    x = torch.randn(total, k, generator=g).cuda()
    a = cf.quantize(x) if fmt == "nvfp4" else x.to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                           device="cuda")
    return a, packed.repack(b) if reads_packed else b, offsets


ROUTINGS = [([0, 5, 17, 0, 3, 9, 2, 0], 576, 512), ([1] * 16, 320, 256),
            ([0, 0, 300, 0], 320, 320), ([129, 17, 255, 1], 1088, 512)]


@pytest.mark.parametrize("name, fmt, ops", _cases(GROUPED))
def test_fused_grouped_is_the_unfused_pipeline_bit_for_bit(name, fmt, ops):
    s, fused, plain = _fused_and_plain(name, fmt, ops, groups=8)
    dt, g = torch.bfloat16, silu_group(s)
    for i, (counts, n, k) in enumerate(ROUTINGS):
        a, b, offsets = _grouped_case(counts, n, k, fmt, i, s.mainloop.reads_packed)
        bias = torch.randn(len(counts), n, device="cuda") if "bias" in ops else None
        raw = run_grouped(plain, a, b, offsets)
        assert reference.check_grouped(raw, a, b, offsets).passed, (name, counts)
        total, cols = sum(counts), n // 2 if "silu_mul" in ops else n
        out = torch.full((total, cols), float("nan"), dtype=dt, device="cuda")
        run_grouped(fused, a, b, offsets, out=out, bias=bias)
        if bias is not None:
            expert = torch.repeat_interleave(torch.arange(len(counts), device="cuda"),
                                             torch.tensor(counts, device="cuda"))
            raw = raw + bias[expert]
        _assert_same_bits(out, _unfused(raw, None, ops, dt, g), f"{s.name} {counts}")


def _ones_weight(n: int, k: int, group: int) -> NVFP4Tensor:
    """Gate rows read element 0 of K, up rows element 1, each as exactly 1.0 (E2M1 code 2,
    block scale 1.0, global scale 1.0): the GEMM's outputs are the activation's columns."""
    data = torch.zeros(n, k // 2, dtype=torch.uint8)
    rows = torch.arange(n)
    gate = (rows % (2 * group)) < group
    data[gate, 0] = 0x02  # element 0 (low nibble)
    data[~gate, 0] = 0x20  # element 1 (high nibble)
    scales = torch.full((n, k // 16), 0x38, dtype=torch.uint8)  # UE4M3 1.0
    return NVFP4Tensor(data.cuda(), swizzle_scales(scales).view(torch.float8_e4m3fn).cuda(),
                       1.0)


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_is_torchs_for_every_finite_input(dtype):
    """gate = x, up = 1 for every finite value x of the dtype: the fused output is
    ``F.silu(x)`` (torch's CUDA kernel) bit for bit."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    # finite, and not -0.0: the GEMM's sum (from +0) gives +0 for it, before any SiLU
    x = every[torch.isfinite(every.float()) & ~((every == 0) & every.float().signbit())]
    x = x.cuda()
    k, group = 64, 8
    a = torch.zeros(len(x), k, dtype=dtype, device="cuda")
    a[:, 0], a[:, 1] = x, 1.0
    w = _ones_weight(2 * group, k, group)
    out = cf.gemm(a, w, silu_mul=True, out_dtype=dtype, alpha=1.0)
    want = F.silu(x).unsqueeze(1).expand(-1, group)
    _assert_same_bits(out, want, f"silu over {len(x)} {dtype} values")


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gemm_with_fused_ops_checks_itself(m):
    """``gemm(..., bias=, silu_mul=, check=True)`` on "auto", packed and plain weights:
    check=True compares the fused call with the unfused pipeline's bits."""
    n, k = 1024, 512
    g = torch.Generator().manual_seed(m)
    w = cf.quantize(torch.randn(n, k, generator=g).cuda())
    x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
    bias = torch.randn(n, generator=g).cuda()
    for weight in (w, packed.repack(w)):
        out = cf.gemm(x, weight, bias=bias, silu_mul=True, check=True)
        assert out.shape == (m, n // 2) and torch.isfinite(out).all()
    gate, up = w.dequantize(torch.float64)[: n // 2], w.dequantize(torch.float64)[n // 2:]
    wi = interleave_gate_up(w, silu_group(catalogue.get("sm90_default")))
    bias_i = interleave_gate_up(bias.unsqueeze(1), 8).squeeze(1)
    out = cf.gemm(x, wi, bias=bias_i, silu_mul=True)
    xd = x.double()
    ref = F.silu(xd @ gate.T + bias[: n // 2].double()) * (xd @ up.T + bias[n // 2:].double())
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel  # the natural gate/up product, after interleaving at load


@pytest.mark.gpu("sm90")
def test_fused_ops_refuse_bad_operands_before_launching():
    w = cf.quantize(torch.randn(256, 128).cuda())
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full((4, 128), 7.0, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match="bias must have shape"):
        cf.gemm(x, w, bias=torch.zeros(255, device="cuda"), out=out)
    with pytest.raises(InputError, match="bias must be torch.float32"):
        cf.gemm(x, w, bias=torch.zeros(256, device="cuda", dtype=torch.bfloat16), out=out)
    with pytest.raises(InputError, match=r"out must have shape \(4, 128\)"):
        cf.gemm(x, w, silu_mul=True, out=torch.empty(4, 256, device="cuda",
                                                     dtype=torch.bfloat16))
    w_odd = cf.quantize(torch.randn(264, 128).cuda())  # 264 = 8 x 33: no gate/up groups
    with pytest.raises(InputError, match="132 columns .* must be a multiple of 16"):
        cf.gemm(x, w_odd, silu_mul=True)
    assert (out == 7.0).all()  # nothing written on any error


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("m", [1, 16, 100])
def test_gated_mlp_is_the_float_mlp_on_its_weights(m):
    """NVFP4GatedMLP (gate_up with SiLU-and-mul fused, then down) against the float64 MLP
    on the same dequantized weights, gate and up in their natural order."""
    from cute_fp4.fused import natural_gate_up
    from cute_fp4.mlp import NVFP4GatedMLP

    g = torch.Generator().manual_seed(m)
    h, i = 256, 512
    lin = [torch.nn.Linear(a, b, bias=False).cuda() for a, b in ((h, i), (h, i), (i, h))]
    for layer in lin:
        layer.weight.data = torch.randn(layer.weight.shape, generator=g).cuda() * 0.05
    mlp = NVFP4GatedMLP.from_linears(*lin)
    w13 = natural_gate_up(mlp.gate_up.unpack(), mlp.group).dequantize(torch.float64)
    w2 = mlp.down.weight.dequantize(torch.float64)
    x = torch.randn(m, h, generator=g).cuda().to(torch.bfloat16)
    gu = x.double() @ w13.T
    ref = (F.silu(gu[:, :i]) * gu[:, i:]) @ w2.T
    out = mlp(x)
    assert out.shape == (m, h) and torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 2e-2


# ----------------------------------------------------------------------------- nvfp4_out
# The unfused pipeline nvfp4_out replaces: the output above (bias, silu_mul), rounded to
# BF16, then quantize(y, global_scale). Codes and blocked scales, padding included, must be
# the same bytes; the output buffers are filled with 0xFF first.

NV_OPS = [("nvfp4_out",), ("bias", "silu_mul", "nvfp4_out")]
NV_DENSE = {"sm90": [("sm90_default", "bf16"), ("sm90_default", "nvfp4")],
            "sm120": [("sm120_default", "nvfp4"), ("sm120_pingpong", "nvfp4"),
                      ("sm120_128x64", "nvfp4")]}
# (sm120_grouped_decode: 4 MMA warps along N put a 16-column block in two warps: refused)
NV_GROUPED = {"sm90": [], "sm120": [("sm120_grouped", "nvfp4")]}
# global scales relative to amax / 2688: the usual one, scales saturated at 448, and
# scales rounded down to subnormals or 2^-9
NV_SCALES = (1.0, 1 / 64, 512.0)


def _nv_cases(table):
    return [pytest.param(name, fmt, ops, id=f"{name}-{fmt}-{'+'.join(ops)}")
            for fam in ("sm90", "sm120") for name, fmt in table[fam] for ops in NV_OPS]


def _poisoned_nvfp4(rows: int, cols: int, gs: torch.Tensor) -> NVFP4Tensor:
    from cute_fp4.nvfp4 import scale_shape

    rp, cp = scale_shape(rows, cols)
    return NVFP4Tensor._unchecked(
        torch.full((rows, cols // 2), 0xFF, dtype=torch.uint8, device="cuda"),
        torch.full((rp, cp), 0xFF, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
        gs, (rows, cols))


def _assert_same_nvfp4(got: NVFP4Tensor, y: torch.Tensor, what: str) -> None:
    want = cf.quantize(y, got.global_scale)
    bad = (got.data != want.data)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} code bytes differ, "
                           f"first at {tuple(bad.nonzero()[0].tolist())}")
    bad = got.scale.view(torch.uint8) != want.scale.view(torch.uint8)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} scale bytes differ "
                           f"(blocked layout, padding included), first at "
                           f"{tuple(bad.nonzero()[0].tolist())}")


def _nv_scales(y: torch.Tensor):
    amax = float(y.float().abs().max()) or 1.0
    return [torch.tensor(amax / 2688 * f, dtype=torch.float32, device="cuda")
            for f in NV_SCALES]


@pytest.mark.parametrize("name, fmt, ops", _nv_cases(NV_DENSE))
def test_nvfp4_out_dense_is_quantize_of_the_unfused_output(name, fmt, ops):
    s, fused, plain = _fused_and_plain(name, fmt, ops)
    g = silu_group(s)
    for i, (m, n, k) in enumerate(SHAPES):
        a, b = make_operands(m, n, k, fmt, seed=i)
        bias = torch.randn(n, device="cuda") if "bias" in ops else None
        raw = run_compiled(plain, a, b)
        assert reference.check(raw, a, b).passed, (name, m, n, k)
        y = _unfused(raw, bias, ops, torch.bfloat16, g)
        for gs in _nv_scales(y):
            out = _poisoned_nvfp4(m, y.shape[1], gs)
            got = run_compiled(fused, a, b, out=out, bias=bias)
            assert got is out
            _assert_same_nvfp4(got, y, f"{s.name} {(m, n, k)} gs {float(gs):g}")


@pytest.mark.parametrize("name, fmt, ops", _nv_cases(NV_GROUPED))
def test_nvfp4_out_grouped_is_quantize_of_the_unfused_output(name, fmt, ops):
    s, fused, plain = _fused_and_plain(name, fmt, ops, groups=8)
    g = silu_group(s)
    for i, (counts, n, k) in enumerate(ROUTINGS):
        a, b, offsets = _grouped_case(counts, n, k, fmt, i, s.mainloop.reads_packed)
        bias = torch.randn(len(counts), n, device="cuda") if "bias" in ops else None
        raw = run_grouped(plain, a, b, offsets)
        if bias is not None:
            expert = torch.repeat_interleave(torch.arange(len(counts), device="cuda"),
                                             torch.tensor(counts, device="cuda"))
            raw = raw + bias[expert]
        y = _unfused(raw, None, ops, torch.bfloat16, g)
        for gs in _nv_scales(y):
            out = _poisoned_nvfp4(sum(counts), y.shape[1], gs)
            got = run_grouped(fused, a, b, offsets, out=out, bias=bias)
            assert got is out
            _assert_same_nvfp4(got, y, f"{s.name} {counts} gs {float(gs):g}")


@pytest.mark.gpu("sm90")
@pytest.mark.parametrize("m", [1, 129])
def test_gemm_nvfp4_out_checks_itself_and_feeds_a_w4a4_gemm(m):
    """``gemm(..., nvfp4_out=gs, check=True)`` returns an NVFP4Tensor (checked against the
    unfused pipeline's bytes), which a following W4A4 GEMM takes as its activation."""
    n, k = 512, 256
    g = torch.Generator().manual_seed(m)
    w = cf.quantize(torch.randn(n, k, generator=g).cuda())
    w2 = cf.quantize(torch.randn(128, n, generator=g).cuda())
    x = torch.randn(m, k, generator=g).cuda().to(torch.bfloat16)
    bias = torch.randn(n, generator=g).cuda()
    gs = torch.tensor(0.01, device="cuda")
    h = cf.gemm(x, w, schedule="sm90_default", bias=bias, nvfp4_out=gs, check=True)
    assert isinstance(h, NVFP4Tensor) and h.shape == (m, n)
    y = cf.gemm(h, w2, check=True)
    assert y.shape == (m, 128) and torch.isfinite(y).all()
    with pytest.raises(ScheduleError, match="D\\^T tiles of swap-AB"):
        cf.gemm(x, w, schedule="sm90_decode_swapab", nvfp4_out=gs)
