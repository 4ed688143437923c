"""MXFP4 kernels on the GPU, launched like NVFP4 ones: a ``CompiledGemm`` of an MXFP4 problem
(the format is the problem's: ``Problem(b_format="mxfp4")``) takes ``Operands`` of an
MXFP4 weight's data and UE8M0 scales, alpha 1 (no global scale).

Against the exact reference (``cute_fp4.reference``, MXFP4's values) with NaN-poisoned
outputs: the stream decode kernel (dense over M = 1..33, N and K tails, split-K; grouped
over random routings with empty experts), the register-sourced packed mainloop (dense and
grouped) on SM90, and on SM12x the block-scaled ``kind::mxf4`` MMA, dense and grouped,
W4A4 with MXFP4 activations: natively there, on SM90 through the emulated MMA
(kernels/mma_emulation.py: the UE8M0 conversion). The fused ``swiglu_oai`` epilogue
(gpt-oss's clamped SwiGLU, with bias) against the unfused pipeline, bit for bit.

The compile goes through the DSL here (``compiled``): ``compile.compile``'s ``Signature``
names the A format only (the host's plumbing of the weight format is the launch path's).
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import catalogue, packed, reference
from cute_fp4.compile import CompiledGemm, Signature, kernel_class
from cute_fp4.fused import interleave_gate_up
from cute_fp4.nvfp4 import quantize
from cute_fp4.operands import Operands
from cute_fp4.plan import plan
from cute_fp4.planning.common import silu_group
from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem
from cute_fp4.targets import detect_device
from cute_fp4.workspaces import split_workspace
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

W4A16 = Problem(a_format="bf16", b_format="mxfp4")
W4A4 = Problem(a_format="mxfp4", b_format="mxfp4")
_BUILT: dict = {}


def compiled(s, problem, emulate: bool = False) -> CompiledGemm:
    """``s`` compiled for ``problem`` on this GPU (SM120 schedules on SM90: emulated)."""
    import cutlass.cute as cute

    key = (s, problem, emulate)
    if key not in _BUILT:
        plan(s, problem).raise_if_invalid()
        cls = kernel_class(s)
        kernel = cls(s, problem, emulate=True) if emulate else cls(s, problem)
        fn = cute.compile(kernel, *kernel.fake_args())
        _BUILT[key] = CompiledGemm(s, Signature(str(problem.a_format)), fn, kernel, 0.0,
                                   "built-uncached")
    return _BUILT[key]


def _family() -> str:
    return selection.family()


def _target() -> str:
    return detect_device().target.name


def _one() -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device="cuda")


def _weight(n: int, k: int, seed: int, experts: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (experts, n, k) if experts else (n, k)
    w = torch.randn(shape, generator=g, device="cuda") * 0.05
    w[..., :, :32] *= 64.0  # awkward scales: a wide range of UE8M0 codes per row
    return quantize(w, format="mxfp4")


def _act(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return torch.randn(m, k, generator=g, device="cuda").bfloat16()


def _dense(kern, a, w, out_dtype=torch.bfloat16, bias=None, ops_n=None):
    """One poisoned launch of a dense kernel: the output."""
    m, n = a.shape[0], w.shape[-2]
    out = torch.full((m, ops_n or n), float("nan"), dtype=out_dtype, device="cuda")
    ws = split_workspace(kern, m, n, out.device) if kern.schedule.split_k > 1 else None
    a_data, a_scale = (a.data, a.scale) if hasattr(a, "scale") else (a, None)
    b = packed.repack(w) if kern.schedule.mainloop.reads_packed else w
    kern.launch(Operands(a_data, a_scale, b.data, b.scale, out, _one(), ws, bias=bias))
    torch.cuda.synchronize()
    return out


def _grouped(kern, a, w, offsets, bias=None, ops_n=None):
    m, n = a.shape[0], w.shape[-2]
    out = torch.full((m, ops_n or n), float("nan"), dtype=torch.bfloat16, device="cuda")
    alpha = torch.ones(w.shape[0], dtype=torch.float32, device="cuda")
    a_data, a_scale = (a.data, a.scale) if hasattr(a, "scale") else (a, None)
    b = packed.repack(w) if kern.schedule.mainloop.reads_packed else w
    offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    kern.launch(Operands(a_data, a_scale, b.data, b.scale, out, alpha, None, offs,
                         bias=bias))
    torch.cuda.synchronize()
    return out


# ----------------------------------------------------------------------------- stream

STREAM_SHAPES = [(1, 8, 64), (1, 136, 192), (2, 72, 4160), (5, 1000, 832), (8, 2880, 2880),
                 (16, 520, 1024), (17, 136, 2048), (33, 1000, 320)]
STREAM_VARIANTS = [dict(tile_m=8), dict(tile_m=16, split_k=4), dict(tile_m=8, split_k=3,
                                                                   stages=3),
                   dict(tile_m=8, warps=8, split_k=2)]


@pytest.mark.parametrize("variant", STREAM_VARIANTS, ids=lambda v: "-".join(
    f"{k}{v[k]}" for k in v))
def test_stream_dense(variant):
    kern = compiled(stream_schedule(_target(), **variant), W4A16)
    for i, (m, n, k) in enumerate(STREAM_SHAPES):
        if not plan(kern.schedule, Problem(m, n, k, "bf16", b_format="mxfp4")).ok:
            continue  # split-K past the K units of a small K
        a, w = _act(m, k, i), _weight(n, k, i)
        res = reference.check(_dense(kern, a, w), a, w)
        assert res.passed, f"{kern.schedule.label()}: {res}"


ROUTINGS = [[0, 1, 1, 3, 3, 4], [0, 0, 0, 16, 16, 16], [0, 5, 5, 5, 9, 13], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("name", ["sm90_mxfp4_stream_grouped_decode",
                                  "sm90_mxfp4_stream_grouped_decode_deep",
                                  "sm90_mxfp4_stream_grouped_decode_w8", "sm90_mxfp4_grouped"])
def test_grouped_sm90_kernels(name):
    if _family() != "sm90" and "stream" not in name:
        pytest.skip("an sm_90a schedule")
    kern = compiled(selection.here(catalogue.get(name)), W4A16)
    for i, offs in enumerate(ROUTINGS):
        for n, k in [(264, 640), (2880, 2880)]:
            w = _weight(n, k, 10 + i, experts=5)
            a = _act(offs[-1], k, i)
            out = _grouped(kern, a, w, offs)
            res = reference.check_grouped(out, a, w, offs)
            assert res.passed, f"{name} {offs} {n}x{k}: {res}"


@pytest.mark.parametrize("name", ["sm90_mxfp4_rs_packed", "sm90_rs_packed_decode"])
def test_rs_packed_dense(name):
    if _family() != "sm90":
        pytest.skip("an sm_90a schedule")
    kern = compiled(catalogue.get(name), W4A16)
    for i, (m, n, k) in enumerate([(1, 264, 256), (17, 1000, 896), (130, 520, 4096),
                                   (300, 2880, 2880)]):
        a, w = _act(m, k, i), _weight(n, k, i)
        res = reference.check(_dense(kern, a, w), a, w)
        assert res.passed, f"{name}: {res}"


# ----------------------------------------------------------------------------- SM120

SM120 = ["sm120_mxfp4", "sm120_pingpong", "sm120_sf_cp_async", "sm120_decode_splitk4",
         "sm120_k256_epi64x32"]


def _sm120(name):
    emulate = _family() == "sm90"
    s = catalogue.get(name)
    return compiled(s if emulate else selection.here(s), W4A4, emulate=emulate)


@pytest.mark.parametrize("name", SM120)
def test_sm120_dense_w4a4(name):
    """kind::mxf4 (emulated on SM90): MXFP4 activations and weights, M = 1 and tails."""
    kern = _sm120(name)
    for i, (m, n, k) in enumerate([(1, 264, 384), (129, 264, 896), (5, 136, 128),
                                   (300, 520, 4096)]):
        if not plan(kern.schedule, Problem(m, n, k, "mxfp4", b_format="mxfp4")).ok:
            continue
        a = quantize(_act(m, k, i).float(), format="mxfp4")
        w = _weight(n, k, i)
        res = reference.check(_dense(kern, a, w), a, w)
        assert res.passed, f"{name}: {res}"


@pytest.mark.parametrize("name", ["sm120_mxfp4_grouped", "sm120_grouped_decode"])
def test_sm120_grouped_w4a4(name):
    kern = _sm120(name)
    for i, offs in enumerate(ROUTINGS + [[0, 100, 100, 229, 300, 300]]):
        w = _weight(264, 640, 20 + i, experts=5)
        a = quantize(_act(offs[-1], 640, i).float(), format="mxfp4")
        out = _grouped(kern, a, w, offs)
        res = reference.check_grouped(out, a, w, offs)
        assert res.passed, f"{name} {offs}: {res}"


# ----------------------------------------------------------------------------- swiglu_oai

def _fused_case(s, problem, grouped: bool, emulate=False):
    """(fused output, FP32 GEMM output without ops, bias, group) of one gate_up GEMM."""
    group = silu_group(s)
    n, k, experts = 512, 640, 3
    w = interleave_gate_up(_weight(n, k, 31, experts=experts if grouped else 0), group)
    a = _act(9 if grouped else 5, k, 3)
    if problem.a_format == "mxfp4":
        a = quantize(a.float(), format="mxfp4")
    g = torch.Generator(device="cuda").manual_seed(5)
    shape = (experts, n) if grouped else (n,)
    bias = (torch.randn(shape, generator=g, device="cuda") * 2).float()
    fused = compiled(s.replace(ops=("bias", "swiglu_oai")), problem, emulate)
    raw = compiled(s.replace(out_dtype="fp32"), problem, emulate)
    if grouped:
        offs = [0, 4, 4, 9]
        got = _grouped(fused, a, w, offs, bias, n // 2)
        want = _grouped_fp32(raw, a, w, offs)
        full_bias = torch.cat([bias[e].expand(offs[e + 1] - offs[e], n) for e in range(3)])
        return got, want, full_bias, group
    return _dense(fused, a, w, bias=bias, ops_n=n // 2), _dense(raw, a, w, torch.float32), \
        bias, group


def _grouped_fp32(kern, a, w, offs):
    m, n = a.shape[0], w.shape[-2]
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
    a_data, a_scale = (a.data, a.scale) if hasattr(a, "scale") else (a, None)
    b = packed.repack(w) if kern.schedule.mainloop.reads_packed else w
    kern.launch(Operands(a_data, a_scale, b.data, b.scale, out,
                         torch.ones(w.shape[0], dtype=torch.float32, device="cuda"), None,
                         torch.tensor(offs, dtype=torch.int32, device="cuda")))
    torch.cuda.synchronize()
    return out


SWIGLU = [("stream", False), ("stream", True), ("stream_w8", True), ("sm90_mxfp4_grouped", True),
          ("sm120_mxfp4", False), ("sm120_mxfp4_grouped", True)]


@pytest.mark.parametrize("name, grouped", SWIGLU, ids=[f"{n}-{g}" for n, g in SWIGLU])
def test_swiglu_oai_is_the_unfused_pipeline(name, grouped):
    """bias + gpt-oss's clamped SwiGLU fused: the bits of the unfused pipeline (the same
    GEMM to FP32, + bias, rounded to BF16, transformers' _apply_gate on BF16)."""
    if name.startswith("stream"):
        warps = 8 if name == "stream_w8" else 4
        s, problem = stream_schedule(_target(), tile_m=16, grouped=grouped, warps=warps), W4A16
    else:
        s = catalogue.get(name)
        if s.arch.family.value == "sm90" and _family() != "sm90":
            pytest.skip("an sm_90a schedule")
        problem = W4A4 if s.arch.family.value == "sm120" else W4A16
    emulate = s.arch.family.value == "sm120" and _family() == "sm90"
    if not emulate:
        s = selection.here(s)
    got, raw, bias, group = _fused_case(s, problem, grouped, emulate)
    assert not got.isnan().any()
    reference.assert_fused(got, raw, bias, ("bias", "swiglu_oai"), group, name)
