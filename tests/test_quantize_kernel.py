"""The fused activation-quantization kernel without a GPU.

* The NumPy model of the kernel (``tests/quantize_model.py``: its PTX op by op, its
  addressing and padding) is bit-identical to ``cute_fp4.quantize`` on awkward inputs, for
  both arithmetic paths and both E2M1 encoders; the one-correction division is checked at
  every E2M1 decision point for every BF16 and FP16 significand.
* The kernel compiles for sm_90a, sm_120a and sm_121a (every dtype and scale variant)
  without spills, with 16-byte loads, 8-byte packed stores, the hardware E2M1 conversion
  on SM12x and the software one on SM90.
* ``quantize_activation`` refuses bad input with typed errors before anything is written.
"""

from __future__ import annotations

import re
from fractions import Fraction

import cutlass
import cutlass.cute as cute
import numpy as np
import pytest
import torch
from quantize_model import (
    awkward_input,
    e2m1_rne,
    fma32,
    hard_divisors,
    one_correction_codes,
    quantize_model,
    tie_case,
)

from cute_fp4 import quant
from cute_fp4.errors import DeviceError, InputError, InputTypeError
from cute_fp4.kernels.quantize import SCALES, QuantSpec
from cute_fp4.nvfp4 import NVFP4Tensor, quantize

SHAPES = [(1, 16), (1, 4096), (3, 48), (7, 96), (16, 8192), (127, 64), (129, 1040),
          (130, 32), (256, 208)]


def _same(x, gs, **kw):
    """Model vs CPU quantize: data, scale (padding included)."""
    ref = quantize(x, gs)
    data, scale, _ = quantize_model(x, gs, **kw)
    return (np.array_equal(data, ref.data.numpy())
            and np.array_equal(scale, ref.scale.view(torch.uint8).reshape(-1).numpy()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k", SHAPES)
def test_model_matches_quantize(dtype, m, k):
    x = awkward_input(m, k, dtype, seed=m * 7 + k)
    for gs in (None, 1.0, 2.0**-7, 3e-3):  # dynamic, exact ties, a power of two, arbitrary
        for hw in (False, True):
            assert _same(x, gs, hw=hw), (gs, hw)
    # the general path (forced) and global scales outside the fast range
    assert _same(x, 3e-3, general=True)
    assert _same(x, 1e-30, hw=True)
    assert _same(x, 300.0)
    assert _same(x, 3e-3, order="atoms")  # the other item order writes the same bytes


def test_model_detects_wrong_codes():
    """The comparison can fail: flipping one code or one padding byte is noticed."""
    x = awkward_input(3, 48, torch.bfloat16, seed=1)
    ref = quantize(x)
    data, scale, _ = quantize_model(x, None)
    data[1, 3] ^= 0x01
    assert not np.array_equal(data, ref.data.numpy())
    scale[-1] ^= 0x01  # a padding byte of row 127
    assert not np.array_equal(scale, ref.scale.view(torch.uint8).reshape(-1).numpy())


def test_cpu_quantize_follows_the_one_rule_where_division_differs():
    """On this block ``bamax / 6`` and ``bamax * float32(1/6)`` give different scales: CPU
    quantize takes the one rule's (the kernel's, CUDA's) and the comparison can tell."""
    x, gs = tie_case()
    divided = quantize_model(x, gs, div6="true")[1]
    rule = quantize_model(x, gs, div6="recip")[1]
    assert divided[0] != rule[0]
    assert np.array_equal(quantize(x, gs).scale.view(torch.uint8).reshape(-1).numpy(), rule)


@pytest.mark.parametrize("sig_bits", [8, 11])
def test_one_correction_is_exact_at_every_decision_point(sig_bits):
    """For every BF16 (8-bit) / FP16 (11-bit) significand and every E2M1 decision point,
    the divisors nearest to making x / d hit it: one Markstein correction gives the code of
    the correctly rounded quotient (no correction does not)."""
    x, d = hard_divisors(sig_bits)
    ours, exact = one_correction_codes(x, d)
    assert np.array_equal(ours, exact)
    r = (np.float32(1) / d).astype(np.float32)
    no_correction = e2m1_rne((x * r).astype(np.float32))
    assert (no_correction != exact).sum() > 0


def _encoder_codes(q: np.ndarray) -> np.ndarray:
    from quantize_model import _encode_sw

    return _encode_sw(q.astype(np.float32), np.zeros(q.shape, bool)) & 0x7FFFFF


def _encoder_samples() -> np.ndarray:
    """float32 q in [0, 6.5 + 1 ulp]: every one within 2^16 ulps of each decision point
    and power of two, and a stride over the rest."""
    from quantize_model import from_bits

    top = int(np.float32(6.5).view(np.uint32)) + 1
    marks = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5]
    near = np.concatenate([np.arange(-(1 << 16), 1 << 16) + int(np.float32(v).view(np.uint32))
                           for v in marks])
    b = np.unique(np.concatenate([near, np.arange(0, top + 1, 997)]))
    return from_bits(b[(b >= 0) & (b <= top)].astype(np.uint32))


def test_one_add_encoder_is_exact_on_its_range():
    """The software E2M1 encoder (one float add of M2(em)) against E2M1 RNE: every float32
    within 2^16 ulps of each decision point and power of two in [0, 6.5], and a stride over
    the whole range (every float32 in it was checked once, 2026-12-02); q up to 6.5 + 1 ulp
    (the most a block without a clamp can reach). Beyond the range it fails (q = 7 gives
    code 8): the comparison can fail."""
    from quantize_model import e2m1_rne

    q = _encoder_samples()
    assert np.array_equal(_encoder_codes(q), e2m1_rne(q))
    assert _encoder_codes(np.array([7.0]))[0] == 8


def test_fma32_is_correctly_rounded():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(2000) * 1e-7)).astype(np.float32)
    got = fma32(a, b, c)
    for ai, bi, ci, gi in zip(a[:300], b[:300], c[:300], got[:300]):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        err = abs(Fraction(float(gi)) - exact)
        for nb in (np.nextafter(gi, np.float32(np.inf)), np.nextafter(gi, np.float32(-np.inf))):
            assert err <= abs(Fraction(float(nb)) - exact), (ai, bi, ci)


# ----------------------------------------------------------------------------- compile

COMPILE_CASES = [(t, dt, sc) for t in ("sm_90a", "sm_120a", "sm_121a")
                 for dt in ("bf16", "fp16") for sc in SCALES]


@pytest.mark.compile
@pytest.mark.parametrize("target, dtype, scale", COMPILE_CASES,
                         ids=[f"{t}-{d}-{s}" for t, d, s in COMPILE_CASES])
def test_kernel_compiles(target, dtype, scale):
    """The kernels ``quantize_activation`` runs: compiled for every target, no spills, the
    input by 16-byte loads into registers, hardware conversions where the target has them."""
    spec = quant.default_spec(target, dtype, scale)
    rep = quant.quantize_compile_report(spec)
    ops = rep["opcodes"]
    assert rep["spills"] == 0, rep
    assert rep["kernels"] == (2 if scale == "dynamic" else 1), rep
    assert rep["registers"] <= 128, rep
    # per block: 2 x 16 B loads into registers, 8 B of codes and one scale byte out
    assert ops["LDGSTS.E.BYPASS.LTC128B.128"] == 0 and ops["LDS.128"] == 0, ops
    assert ops["LDG.E.128"] >= 2 * spec.items, ops
    assert ops["STG.E.64"] >= spec.items and ops["STG.E.U8"] >= spec.items, ops
    # the 16-byte zero stores of pad-row CTAs: the row order only
    assert (ops["STG.E.128"] > 0) == (spec.order == "rows"), ops
    assert ops["F2FP.SATFINITE.E4M3"] >= 2, ops  # UE4M3 scales by hardware conversion
    if target.startswith("sm_12"):
        assert ops["F2FP.SATFINITE.E2M1"] >= 16, ops  # hardware E2M1: 8 per block
    else:
        assert ops["F2FP.SATFINITE.E2M1"] == 0, ops
        assert ops["HMNMX2"] >= 16, ops  # packed block amax and clamp
    assert (ops["REDUX"] > 0) == (scale != "static"), ops


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)([^;]*);")


def _fast_path_ops(spec: QuantSpec, tmp_path) -> tuple[list[str], int]:
    """(opcodes of the fast path of ``spec``'s kernel as a block that needs no clamp runs
    it, instructions of the clamps it branches around). The fast path: the longest stretch
    between two EXITs with at most one MUFU per block (the general path divides each element
    by MUFU); a clamp: a predicated forward branch over at most 12 instructions, 8 of them
    packed clamps (HMNMX2)."""
    from cute_fp4.inspect import cubin_sass

    quant.cross_compile_quantize(spec, dump_dir=str(tmp_path))
    sass = cubin_sass(sorted(tmp_path.glob("*.cubin"))[-1])
    ins = [(int(a, 16), pred, op, rest) for a, pred, op, rest in _SASS_LINE.findall(sass)]
    cuts = [i for i, (_, _, op, _) in enumerate(ins) if op == "EXIT"]
    segments = [ins[a + 1:b + 1] for a, b in zip([-1, *cuts], cuts, strict=False)]
    fast = max((seg for seg in segments if [i[2] for i in seg].count("MUFU") <= spec.items + 1),
               key=len)
    ops, skipped, i = [], 0, 0
    while i < len(fast):
        addr, pred, op, rest = fast[i]
        ops.append(op)
        target = re.match(r"\s*0x([0-9a-f]+)", rest) if op == "BRA" and pred else None
        if target:
            j = next((j for j in range(i + 1, len(fast)) if fast[j][0] == int(target[1], 16)),
                     None)
            body = [x[2] for x in fast[i + 1:j]] if j else []
            if j and len(body) <= 12 and body.count("HMNMX2") == 8:
                skipped += len(body)
                i = j
                continue
        i += 1
    return ops, skipped


@pytest.mark.compile
@pytest.mark.parametrize("target, budget", [("sm_90a", 15.2), ("sm_120a", 10.8)])
def test_default_large_kernel_stays_inside_its_budget(target, budget, tmp_path):
    """What the H200 measurements rest on (perf/results/2026-12-02-h200-encoder.md): at
    most 64 registers (8 CTAs of 128 threads per SM) and at most ``budget`` SASS
    instructions per element on the fast path of a block that needs no clamp (sm_90a
    measured 15.0 with the one-add E2M1 encoding, 16.3 with the multiply-add encoding
    before it; sm_120a converts in hardware), the clamps a block may branch to on the side
    (a branch over 8 packed clamps per block)."""
    spec = quant.default_spec(target, "bf16", "static")
    rep = quant.quantize_compile_report(spec)
    assert rep["registers"] <= 64 and rep["spills"] == 0, rep
    ops, clamps = _fast_path_ops(spec, tmp_path)
    per_element = len(ops) / (16 * spec.items)
    assert ops.count("LDG") == 2 * spec.items + 1, ops  # 2 per block, and the global scale
    # every block's loads go out before any block's arithmetic: one memory latency per CTA
    # (inside the global-scale branch, ptxas sank blocks 1..3's loads past block 0's work)
    last_load = max(i for i, op in enumerate(ops) if op == "LDG")
    assert last_load < ops.index("HMNMX2"), (last_load, ops.index("HMNMX2"))
    assert clamps >= 10 * spec.items, clamps  # each block's clamp is a branch on the side
    assert ops.count("HMNMX2") == 7 * spec.items, ops  # the block amax only
    assert per_element <= budget, (per_element, len(ops))
    assert per_element >= budget - 6, (per_element, len(ops))  # the segment is the kernel


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
def test_persistent_row_order_compiles(target):
    """The other grid and item order: a persistent loop over two register sets in turn."""
    spec = QuantSpec(target=target, ctas_per_sm=3, order="rows", items=2)
    rep = quant.quantize_compile_report(spec)
    ops = rep["opcodes"]
    assert rep["spills"] == 0 and rep["registers"] <= 128, rep
    assert ops["LDG.E.128"] >= 8, ops  # 2 per block, 2 blocks, both register sets
    assert ops["STG.E.128"] >= 1 and ops["STG.E.64"] >= 4, ops
    assert "p3" in spec.label() and "atoms" not in spec.label()


def test_default_specs():
    """Decode-sized inputs take 1 block per thread in the row order, larger ones 4 in the
    atom order; the fused dynamic variant the row order; every default is one CTA per
    chunk."""
    small = quant.default_spec("sm_90a", "bf16", "static", small=True)
    large = quant.default_spec("sm_90a", "bf16", "static")
    fused = quant.default_spec("sm_120a", "fp16", "dynamic_fused", small=True)
    assert (small.items, large.items) == (1, 4)
    assert (small.order, large.order) == ("rows", "atoms")
    assert fused.order == "rows" and fused.target == "sm_120a"
    assert {s.ctas_per_sm for s in (small, large, fused)} == {0}
    assert quant.default_spec("sm_90a", threads=64).threads == 64  # changes override


@pytest.mark.compile
@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("small", [False, True])
def test_values_kernel_compiles(target, small):
    """``output="values"`` (``quant.quantize_values``): no spills, at most 64 registers,
    the same 16-byte loads, 16-byte stores of BF16 values (two per block), no code or
    scale stores, no E2M1 conversion (the value is computed, not encoded)."""
    spec = quant.default_spec(target, "bf16", "static", small=small, output="values")
    assert spec.order == "rows" and "-values" in spec.label()
    rep = quant.quantize_compile_report(spec)
    ops = rep["opcodes"]
    assert rep["spills"] == 0 and rep["registers"] <= 64 and rep["kernels"] == 1, rep
    assert ops["LDG.E.128"] >= 2 * spec.items, ops
    assert ops["STG.E.128"] >= 2 * spec.items, ops
    assert ops["STG.E.64"] == 0 and ops["STG.E.U8"] == 0, ops
    assert ops["F2FP.SATFINITE.E2M1"] == 0, ops


def test_value_arithmetic_gives_the_e2m1_value():
    """The values kernel's ``RN(q + M2) - M2`` is the E2M1 magnitude of q (the sum and the
    difference exact in float32) on the samples of the encoder test; the comparison can
    fail (q = 7 rounds to 8, no E2M1 value)."""
    from quantize_model import M2_BIAS, bits, e2m1_rne, from_bits

    from cute_fp4.nvfp4 import E2M1_VALUES

    def value(q):
        em = np.maximum(bits(q) >> 23, 127).astype(np.uint64)
        mg = from_bits(((em * (2**23 + 2) + M2_BIAS) & 0xFFFFFFFF).astype(np.uint32))
        return ((q + mg).astype(np.float32) - mg).astype(np.float32)

    q = _encoder_samples()
    table = np.asarray(E2M1_VALUES, dtype=np.float32)
    assert np.array_equal(value(q), table[e2m1_rne(q)])
    assert value(np.array([7.0], dtype=np.float32))[0] == 8.0


def test_spec_validation():
    with pytest.raises(ValueError, match="in_dtype"):
        QuantSpec(in_dtype="fp32")
    with pytest.raises(ValueError, match="scale must be one of"):
        QuantSpec(scale="per_row")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantSpec(threads=100)
    with pytest.raises(ValueError, match="order"):
        QuantSpec(order="cols")
    with pytest.raises(ValueError, match="output must be one of"):
        QuantSpec(output="floats")
    for bad in ({"scale": "dynamic"}, {"order": "atoms"}):
        with pytest.raises(ValueError, match="output='values' takes"):
            QuantSpec(output="values", **bad)


# ----------------------------------------------------------------------------- host checks

def test_bad_inputs_raise_typed_errors():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(InputTypeError, match="takes a torch.Tensor"):
        quant.quantize_activation([[1.0]])
    with pytest.raises(InputError, match="bfloat16 or float16.*float32"):
        quant.quantize_activation(x.float())
    with pytest.raises(InputError, match="2-D"):
        quant.quantize_activation(x.reshape(2, 2, 64))
    with pytest.raises(InputError, match="K = 40 is not a multiple of 16"):
        quant.quantize_activation(torch.zeros(4, 40, dtype=torch.float16))
    with pytest.raises(InputError, match="empty"):
        quant.quantize_activation(torch.zeros(0, 64, dtype=torch.float16))
    with pytest.raises(DeviceError, match="CUDA device, x is on cpu"):
        quant.quantize_activation(x)
    with pytest.raises(InputError, match="dynamic_mode"):
        quant._scale_variant(None, 64, "three_pass")


def test_global_scale_and_out_checks():
    cpu = torch.device("cpu")
    with pytest.raises(InputError, match="finite and > 0, got -1"):
        quant._static_scale(-1.0, cpu)
    with pytest.raises(InputError, match="finite and > 0, got inf"):
        quant._static_scale(float("inf"), cpu)
    with pytest.raises(InputTypeError, match="got str"):
        quant._static_scale("0.1", cpu)
    with pytest.raises(InputError, match="must be float32, got torch.float16"):
        quant._static_scale(torch.ones(1, dtype=torch.float16), cpu)
    with pytest.raises(InputError, match="one element, got 2"):
        quant._static_scale(torch.ones(2), cpu)
    with pytest.raises(InputError, match="is on meta but x is on cpu"):
        quant._static_scale(torch.ones(1, device="meta"), cpu)
    assert float(quant._static_scale(0.5, cpu)) == 0.5
    ok = quantize(torch.ones(3, 64))
    quant._check_out(ok, 3, 64, cpu, dynamic=True)
    with pytest.raises(InputError, match=r"out has shape \(3, 64\) but x is \[3, 32\]"):
        quant._check_out(ok, 3, 32, cpu, dynamic=False)
    with pytest.raises(InputTypeError, match="NVFP4Tensor"):
        quant._check_out(ok.data, 3, 64, cpu, dynamic=False)
    bad = NVFP4Tensor._unchecked(ok.data, ok.scale, torch.ones(2), (3, 64))
    with pytest.raises(InputError, match="out.global_scale must have one element"):
        quant._check_out(bad, 3, 64, cpu, dynamic=True)
    with pytest.raises(InputError, match="out.global_scale must have one element"):
        quant._check_out(bad, 3, 64, cpu, dynamic=False)  # a static scale is written too
    strided = NVFP4Tensor._unchecked(torch.zeros(3, 64, dtype=torch.uint8)[:, ::2], ok.scale,
                                     ok.global_scale, (3, 64))
    with pytest.raises(InputError, match="out.data must be contiguous"):
        quant._check_out(strided, 3, 64, cpu, dynamic=False)


def test_scale_variant_policy():
    assert quant._scale_variant(0.1, 10**9, "auto") == "static"
    assert quant._scale_variant(None, quant.FUSED_MAX_ELEMENTS, "auto") == "dynamic_fused"
    assert quant._scale_variant(None, quant.FUSED_MAX_ELEMENTS + 16, "auto") == "dynamic"
    assert quant._scale_variant(None, 16, "two_pass") == "dynamic"


@cute.kernel
def _rcp_probe(m: cute.Tensor):
    m[1] = cute.arch.inline_ptx("rcp.rn.f32 {$w0}, {$r0};", write_only_types=[cutlass.Float32],
                                read_only_args=[m[0]])


@cute.jit
def _rcp_launch(p: cute.Pointer):
    _rcp_probe(cute.make_tensor(p, cute.make_layout((2,)))).launch(grid=[1, 1, 1],
                                                                   block=[32, 1, 1])


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
def test_rcp_rn_fast_path_is_what_the_kernel_inlines(target, tmp_path):
    """The kernel computes RN(1/d) as MUFU.RCP, FFMA(d r - 1), negate, FFMA(r e + r):
    ptxas's own ``rcp.rn.f32`` for normal inputs, without the range test. If a DSL/ptxas
    update changes that sequence, this fails and the kernel's copy must follow."""
    from cutlass.cute.runtime import make_ptr

    from cute_fp4.inspect import cubin_sass

    cute.compile(_rcp_launch, make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem,
                                       assumed_align=4),
                 options=f"--gpu-arch {target} --keep-cubin --dump-dir {tmp_path}")
    sass = cubin_sass(next(tmp_path.glob("*.cubin")))
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(MUFU\.RCP|FFMA|FADD\.FTZ)\s+([^;]*);", sass)
    text = " | ".join(f"{op} {args.strip()}" for op, args in ops)
    pattern = (r"MUFU\.RCP (R\d+), (R\d+) \| FFMA (R\d+), \2, \1, -1 \| "
               r"FADD\.FTZ \3, -\3, -RZ \| FFMA (R\d+), \1, \3, \1")
    assert re.search(pattern, text), text


@pytest.mark.parametrize("scale", SCALES)
def test_runtime_args_match_the_compiled_signature(scale):
    """Launch arguments built from tensors have the pointer types and alignments of the
    fake arguments the kernel was compiled against (alignment is part of the signature)."""
    from cute_fp4.kernels.quantize import PARTIALS_MAX, QuantizeKernel

    kern = QuantizeKernel(QuantSpec(scale=scale))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 32, dtype=torch.uint8)
    sf = torch.zeros(128, 4, dtype=torch.uint8)
    gs = torch.ones((), dtype=torch.float32)
    part = torch.zeros(PARTIALS_MAX) if scale == "dynamic" else None
    fake = kern.fake_args()
    real = kern.runtime_args(x, q, sf, gs, part, 7, fake[-1])
    assert len(fake) == len(real) == 9
    for f, r in zip(fake[:5], real[:5]):
        assert (f.dtype, f._assumed_align) == (r.dtype, r._assumed_align)
    assert [int(v) for v in real[5:8]] == [3, 64, 7]
    assert real[0]._pointer == x.data_ptr() and real[2]._pointer == sf.data_ptr()


@pytest.mark.parametrize("scale", SCALES)
def test_raw_args_are_the_runtime_args_as_ints(scale):
    from cute_fp4.kernels.quantize import PARTIALS_MAX, QuantizeKernel

    kern = QuantizeKernel(QuantSpec(scale=scale))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    q, sf = torch.zeros(3, 32, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8)
    gs = torch.ones((), dtype=torch.float32)
    part = torch.zeros(PARTIALS_MAX) if scale == "dynamic" else None
    real = kern.runtime_args(x, q, sf, gs, part, 7, 0x5000)
    raw = kern.raw_args(x, q, sf, gs, part, 7, 0x5000)
    assert [r._pointer for r in real[:5]] == list(raw[:5])
    assert [int(v) for v in real[5:8]] == list(raw[5:8]) and raw[8] == 0x5000


@pytest.mark.compile
def test_the_tvm_ffi_entries_take_the_raw_args(tmp_path):
    """Quantize and dequantize compiled with the TVM-FFI entry (as ``quant`` builds them
    when apache-tvm-ffi is present), exported and loaded as the disk cache does: their
    entries decode ``raw_args`` (what fails is the first CUDA call, there is no driver)."""
    pytest.importorskip("tvm_ffi")
    from cute_fp4.compile import _exporter, ffi_function
    from cute_fp4.kernels.dequantize import DequantizeKernel, DequantSpec
    from cute_fp4.kernels.quantize import QuantizeKernel

    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    q, sf = torch.zeros(3, 32, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8)
    gs = torch.ones((), dtype=torch.float32)
    out = torch.zeros(3, 64, dtype=torch.bfloat16)
    for i, (kernel, args) in enumerate([
            (QuantizeKernel(QuantSpec()), lambda k: k.raw_args(x, q, sf, gs, None, 7, 0)),
            (DequantizeKernel(DequantSpec()), lambda k: k.raw_args(q, sf, out, None, 0))]):
        compiled = cute.compile(kernel, *kernel.fake_args(),
                                options="--gpu-arch sm_90a --enable-tvm-ffi")
        export, load = _exporter(f"cute_fp4_test_q{i}", ffi=True)
        export(compiled, tmp_path)
        fn = ffi_function(load(tmp_path / "kernel.o"))
        assert fn is not None
        with pytest.raises(RuntimeError, match="(?i)cuda"):
            fn(*args(kernel))
        with pytest.raises(TypeError):
            fn(*args(kernel)[:-1])
