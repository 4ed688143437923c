"""Every public entry point, fed random arguments (hypothesis), returns a result or raises a
typed error of ``cute_fp4.errors``, never another exception: ``quantize``, ``NVFP4Tensor``
and ``from_modelopt``, gemm's operand checks and the reference, ``convert``, the grouped
offsets and operand checks. Each argument starts valid and is then, or not, broken in
one or two ways: its shape (empty, tails, K off the block size, another rank), dtype
(float, int, bool, complex, float8), device (meta: no data), layout (transposed,
strided, broadcast, offset), values (NaN, inf, huge, zero) or type (a list, a string,
None); scalars include NaN, inf, negatives, lists and tensors of several values.

Deterministic for CI (``derandomize``, no example database) and small: a few seconds.
``CUTE_FP4_FUZZ=N`` explores instead: N random examples per test, a new draw each run."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cute_fp4 as cf
from cute_fp4 import operands, reference
from cute_fp4.errors import CuteFp4Error
from cute_fp4.nvfp4 import NVFP4Tensor, scale_shape
from cute_fp4.operands import check_operands

_EXPLORE = int(os.environ.get("CUTE_FP4_FUZZ", "0"))
FUZZ = settings(max_examples=_EXPLORE or 100, deadline=None, derandomize=not _EXPLORE,
                database=None, suppress_health_check=list(HealthCheck))

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
          torch.int64, torch.uint8, torch.int8, torch.bool, torch.complex64,
          torch.float8_e4m3fn)
LAYOUTS = ("transposed", "strided", "broadcast", "offset")
SPECIAL = ("nan", "inf", "huge", "zero", "tiny")
F32, BF16, U8, FP8 = torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn


def _fill(shape, dtype: torch.dtype, seed: int, special: str | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        hi = 16 if dtype == torch.uint8 else 100
        return torch.randint(-hi if dtype.is_signed else 0, hi, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if x.numel() and special is not None:
        x.view(-1)[0] = {"nan": math.nan, "inf": -math.inf, "huge": 1e300, "zero": 0.0,
                         "tiny": 1e-300}[special]
    if dtype == torch.float8_e4m3fn:  # scales: unsigned unless the values are broken
        return (x.abs() if special is None else x).clamp(-448, 448).float().to(dtype)
    return x.to(dtype)


def _make(shape, dtype, device, layout, special, seed) -> torch.Tensor:
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        t = _fill(shape[:-2] + shape[:-3:-1], dtype, seed, special).transpose(-1, -2)
    elif layout == "strided" and shape:
        t = _fill(shape[:-1] + (2 * shape[-1],), dtype, seed, special)[..., ::2]
    elif layout == "broadcast" and shape:
        t = _fill(shape[:-1] + (1,), dtype, seed, special).expand(shape)
    elif layout == "offset" and shape:
        t = _fill((math.prod(shape) + 1,), dtype, seed, special)[1:].view(shape)
    else:
        t = _fill(shape, dtype, seed, special)
    return t.to(device) if device == "meta" else t


@st.composite
def like(draw, shape, dtype):
    """A tensor of ``shape`` and ``dtype`` (contiguous, CPU, finite values), or that
    tensor broken in one or two ways (or not a tensor at all)."""
    shape = list(shape)
    device, layout, special = "cpu", None, None
    for kind in draw(st.lists(st.sampled_from(["shape", "rank", "dtype", "device", "layout",
                                               "values", "type"]), max_size=2)):
        if kind == "shape" and shape:
            i = draw(st.integers(0, len(shape) - 1))
            shape[i] = max(0, shape[i] + draw(st.sampled_from([-16, -1, 1, 2, 16])))
        elif kind == "shape":
            shape = [draw(st.integers(0, 3))]
        elif kind == "rank":
            shape = draw(st.sampled_from([[], shape[:1], [1, *shape], shape[1:]]))
        elif kind == "dtype":
            dtype = draw(st.sampled_from(DTYPES))
        elif kind == "device":
            device = "meta"
        elif kind == "layout":
            layout = draw(st.sampled_from(LAYOUTS))
        elif kind == "values":
            special = draw(st.sampled_from(SPECIAL))
        else:
            return draw(st.sampled_from([None, [[1.0, 2.0]], "tensor", 3]))
    return _make(shape, dtype, device, layout, special, draw(st.integers(0, 2**16)))


junk_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(),
    st.just("1.0"), st.lists(st.floats(0.001, 10), max_size=3), st.tuples(st.floats(0.1, 2)),
    st.builds(lambda v, d: torch.tensor(v).to(d), st.floats(-1, 100) | st.just(math.nan),
              st.sampled_from(DTYPES[:9])),
    like((2,), F32), like((), F32))
scales = st.one_of(st.floats(0.001, 100), st.just(torch.tensor(0.25)), junk_scalars)
ks = st.sampled_from([32, 64, 96, 128, 16, 48, 0, 1, 40])  # mostly multiples of 32
ns = st.sampled_from([8, 16, 24, 64, 128, 1, 4, 0])  # mostly multiples of 8
ms = st.sampled_from([1, 2, 7, 16, 33, 128, 0])


def typed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when it raised a typed error; any other exception
    fails the test (with the call that raised it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except CuteFp4Error:
        return None


@st.composite
def nvfp4(draw, rows, k, experts=None):
    """``quantize`` of a random tensor [rows, k] ([experts, rows, k]); sometimes a
    tensor of another size or rank, or not an NVFP4Tensor."""
    shape = (rows, k) if experts is None else (experts, rows, k)
    x = draw(like(shape, F32))
    t = typed(cf.quantize, x)
    return t if t is not None else x


# ----------------------------------------------------------------------------- quantize

@FUZZ
@given(st.data(), st.sampled_from([F32, BF16, torch.float16, torch.float64]))
def test_quantize(data, dtype):
    shape = data.draw(st.sampled_from([(16, 64), (1, 16), (3, 32, 48), (130, 96)]))
    x = data.draw(like(shape, dtype))
    gs = data.draw(st.one_of(st.none(), scales))
    t = typed(cf.quantize, x, global_scale=gs)
    if t is not None:
        assert isinstance(t, NVFP4Tensor) and t.shape == tuple(x.shape)
        assert t.data.dtype == U8 and t.global_scale.dtype == F32
        assert torch.isfinite(t.dequantize()).all()


@FUZZ
@given(st.data(), st.sampled_from([0, 1, 5, 130]), st.sampled_from([16, 32, 64, 0, 8]),
       st.sampled_from([None, None, 2, 0]))
def test_nvfp4_tensor(data, rows, k, e):
    """The constructor, with parts near a valid tensor, then what it offers."""
    lead = () if e is None else (e,)
    d = data.draw(like((*lead, rows, k // 2), U8))
    s = data.draw(like((*lead, *scale_shape(rows, k)), FP8))
    shape = data.draw(st.sampled_from([None, (*lead, rows, k), (*lead, rows, k + 16), rows]))
    gs = data.draw(st.one_of(scales, st.just([0.5] * (e or 1))))
    t = typed(NVFP4Tensor, d, s, gs, shape)
    if t is not None:
        assert t.shape == (*d.shape[:-1], 2 * d.shape[-1])
        for fn in (t.dequantize, t.scale_linear, lambda: t.expert(0), lambda: t.to("cpu"),
                   lambda: t.to("meta"), lambda: t.to("nowhere"), lambda: repr(t)):
            typed(fn)


@FUZZ
@given(st.data(), st.sampled_from([1, 8, 64]), st.sampled_from([16, 32, 64, 0, 8]))
def test_from_modelopt(data, n, k):
    w = data.draw(like((n, k // 2), U8))
    s = data.draw(like((n, k // 16), FP8))
    gs, inp = data.draw(scales), data.draw(st.one_of(st.none(), scales))
    t = typed(NVFP4Tensor.from_modelopt, w, s, gs)
    if t is not None:
        assert t.shape == (w.shape[0], 2 * w.shape[1])
    layer = typed(cf.NVFP4Linear.from_modelopt, w, s, gs, inp, layout="plain")
    if layer is not None:
        assert (layer.out_features, layer.in_features) == (w.shape[0], 2 * w.shape[1])


# ----------------------------------------------------------------------------- gemm

@st.composite
def gemm_args(draw):
    m, n, k = draw(ms), draw(ns), draw(ks)
    a = draw(st.one_of(nvfp4(m, k), like((m, k), BF16), like((m, k), torch.float16)))
    b = draw(st.one_of(nvfp4(n, k), nvfp4(n, k, experts=2)))
    out_dtype = draw(st.sampled_from([BF16, torch.float16, F32]))
    out = draw(st.one_of(like((m, n), out_dtype), st.none()))
    return a, b, out, draw(st.one_of(st.none(), scales)), out_dtype


@FUZZ
@given(gemm_args())
def test_gemm_operand_checks(args):
    a, b, out, alpha, out_dtype = args
    dims = typed(check_operands, a, b, out, alpha, out_dtype, require_cuda=False)
    if dims is not None:
        m, n, k, fmt = dims
        assert (n, k) == b.shape and fmt in ("nvfp4", "bf16", "fp16")
        assert typed(check_operands, a, b, out, alpha, out_dtype, False) == dims  # memo
    ref = typed(reference.gemm, a, b, alpha)
    if ref is not None:
        assert ref.shape == (a.shape[0], b.shape[0])
    if out is not None:  # reference.check's own checks, on any operands
        typed(reference.check, out, a, b, alpha)


# ----------------------------------------------------------------------------- convert

@FUZZ
@given(st.data(), st.sampled_from([8, 64, 24, 4]), st.sampled_from([32, 128, 48]))
def test_convert(data, n, k):
    device = data.draw(st.sampled_from(["cpu", "cpu", "meta"]))
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=data.draw(st.booleans())))
    sd = None
    if data.draw(st.booleans()):
        w = data.draw(nvfp4(n, k))
        sd = {"0.weight": w.data if isinstance(w, NVFP4Tensor) else w,
              "0.weight_scale": w.scale_linear() if isinstance(w, NVFP4Tensor) else w,
              "0.weight_scale_2": data.draw(st.one_of(st.just(torch.tensor(0.1)), scales)),
              "0.input_scale": data.draw(st.one_of(st.just(torch.tensor(0.1)), scales)),
              "0.bias": data.draw(like((n,), BF16))}
        for key in data.draw(st.lists(st.sampled_from(sorted(sd)), max_size=2, unique=True)):
            del sd[key]
    mode = data.draw(st.sampled_from(["w4a16", "w4a4", "w8a8"]))
    layout = data.draw(st.sampled_from(["auto", "plain", "packed", "fancy"]))
    group = data.draw(st.sampled_from([None, 8, 32, 7]))
    skip = data.draw(st.sampled_from([None, "0", "*", 3, ["0", None]]))
    rep = typed(cf.convert, model, mode, skip, state_dict=sd, layout=layout,
                gate_up_group=group)
    if rep is not None:
        for m in model.modules():  # nothing changed a layer's declared size
            if isinstance(m, torch.nn.Linear | cf.NVFP4Linear):
                assert (m.out_features, m.in_features) == (n, k)


# ----------------------------------------------------------------------------- grouped

@st.composite
def offsets(draw, e: int, total_m: int):
    """E + 1 offsets from 0 to total_m (an int32 tensor, or a list), or broken."""
    cuts = sorted(draw(st.lists(st.integers(0, total_m), min_size=max(e - 1, 0),
                                max_size=max(e - 1, 0))))
    good = [0, *cuts, total_m] if e else [0]
    kind = draw(st.sampled_from(["tensor", "tensor", "list", "swap", "tail", "broken"]))
    if kind == "list":
        return good
    if kind == "swap" and len(good) > 2:
        good[1], good[-1] = good[-1], good[1]
    elif kind == "tail":
        good[-1] += draw(st.sampled_from([-1, 1]))
    if kind == "broken":
        return draw(like((len(good),), torch.int32))
    return torch.tensor(good, dtype=torch.int32)


@st.composite
def grouped_args(draw):
    e, m, n, k = draw(st.sampled_from([1, 3])), draw(ms), draw(ns), draw(ks)
    a = draw(st.one_of(nvfp4(m, k), like((m, k), BF16)))
    b = draw(st.one_of(nvfp4(n, k, experts=e), nvfp4(n, k)))
    out_dtype = draw(st.sampled_from([BF16, torch.float16, F32, "bf16", "int8"]))
    out = draw(st.one_of(st.none(), like((m, n), BF16)))
    alpha = draw(st.one_of(st.none(), like((e,), F32), scales))
    return a, b, draw(offsets(e, m)), out, alpha, out_dtype


@FUZZ
@given(grouped_args())
def test_grouped_checks(args):
    a, b, offs, out, alpha, out_dtype = args
    dims = typed(operands.check_grouped_operands, a, b, offs, out, alpha, out_dtype,
                 require_cuda=False)
    if dims is not None:
        assert (dims.experts, dims.n, dims.k) == b.shape
        typed(operands.check_offsets, offs, dims.total_m)  # the values (after the checks)
    total_m = a.shape[0] if getattr(a, "shape", ()) else 0
    bounds = typed(reference.group_bounds, offs, getattr(b, "experts", None) or 1, total_m)
    if bounds is not None:
        assert bounds[0] == 0 and bounds[-1] == total_m and bounds == sorted(bounds)
    ref = typed(reference.grouped_gemm, a, b, offs, alpha)
    if ref is not None:
        assert ref.shape == (a.shape[0], b.shape[1])


def test_the_fuzzer_can_fail():
    """``typed`` lets only typed errors through: anything else fails the property."""
    with pytest.raises(ZeroDivisionError):
        typed(lambda: 1 / 0)
    assert typed(cf.quantize, torch.randn(4, 15)) is None
