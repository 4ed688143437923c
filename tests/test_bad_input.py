"""Bad input: every case raises a typed error naming the problem and the numbers, and
the output tensor is left untouched. Runs on the CPU (device checks relaxed where noted)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import api, catalogue
from cute_fp4.compile import retarget
from cute_fp4.errors import CuteFp4Error, DeviceError, ScheduleError
from cute_fp4.nvfp4 import NVFP4Tensor
from cute_fp4.schedule import OutDtype

U8, E4 = torch.uint8, torch.float8_e4m3fn


def fp4(rows, k):
    return cf.quantize(torch.randn(rows, k))


def raises(exc, match, fn):
    with pytest.raises(exc, match=match) as e:
        fn()
    assert isinstance(e.value, CuteFp4Error), type(e.value)


QUANTIZE = [
    ("not a tensor", TypeError, "torch.Tensor, got list", lambda: cf.quantize([[1.0] * 16])),
    ("int dtype", ValueError, "got torch.int32", lambda: cf.quantize(torch.ones(2, 16,
                                                                                dtype=torch.int32))),
    ("fp8 dtype", ValueError, "float8_e4m3fn", lambda: cf.quantize(torch.ones(2, 16).to(E4))),
    ("1-D", ValueError, r"2-D tensor \[R, K\], got shape \(16,\)",
     lambda: cf.quantize(torch.ones(16))),
    ("4-D", ValueError, r"got shape \(2, 2, 2, 16\)",
     lambda: cf.quantize(torch.ones(2, 2, 2, 16))),  # 3-D is an expert stack
    ("K=24", ValueError, "K = 24 is not a multiple of 16", lambda: cf.quantize(torch.ones(2, 24))),
    ("empty", ValueError, r"empty tensor of shape \(0, 16\)",
     lambda: cf.quantize(torch.ones(0, 16))),
    ("NaN", ValueError, "1 NaN/Inf",
     lambda: cf.quantize(torch.tensor([[float("nan")] + [0.0] * 15]))),
    ("+Inf", ValueError, "NaN/Inf", lambda: cf.quantize(torch.full((1, 16), float("inf")))),
    ("-Inf", ValueError, "NaN/Inf", lambda: cf.quantize(torch.full((1, 16), -float("inf")))),
    ("gs zero", ValueError, "global_scale must be finite and > 0, got 0",
     lambda: cf.quantize(torch.ones(1, 16), 0.0)),
    ("gs negative", ValueError, "got -1", lambda: cf.quantize(torch.ones(1, 16), -1.0)),
    ("gs nan", ValueError, "got nan", lambda: cf.quantize(torch.ones(1, 16), float("nan"))),
    ("string global scale", TypeError, "global_scale must be None, a float",
     lambda: cf.quantize(torch.randn(16, 64), global_scale="a")),
    ("float64 overflowing float32", ValueError, "1024 finite float64 values beyond float32",
     lambda: cf.quantize(torch.full((16, 64), 1e300, dtype=torch.float64))),
]

CONTAINER = [
    ("data float", ValueError, r"uint8 \[R, K/2\], got torch.float32",
     lambda: NVFP4Tensor(torch.zeros(4, 8), torch.zeros(128, 4, dtype=E4), 1.0)),
    ("data 1-D", ValueError, r"shape \(8,\)",
     lambda: NVFP4Tensor(torch.zeros(8, dtype=U8), torch.zeros(128, 4, dtype=E4), 1.0)),
    ("shape mismatch", ValueError, r"shape \(4, 32\) does not match data \(4, 8\)",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(128, 4, dtype=E4), 1.0,
                         (4, 32))),
    ("K=8", ValueError, "K = 8 is not a multiple of the block size 16",
     lambda: NVFP4Tensor(torch.zeros(4, 4, dtype=U8), torch.zeros(128, 4, dtype=E4), 1.0)),
    ("scale fp32", ValueError, "got torch.float32",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(128, 4), 1.0)),
    ("scale size", ValueError, "need 128 x 4 = 512 bytes, got 4",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(4, 1, dtype=E4), 1.0)),
    ("scale strided", ValueError, "scale must be contiguous",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(4, 128, dtype=E4).T, 1.0)),
    ("gs vector", ValueError, "global_scale must be a scalar, got 2 elements",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(128, 4, dtype=E4), [1., 2.])),
    ("gs zero", ValueError, "finite and > 0, got 0",
     lambda: NVFP4Tensor(torch.zeros(4, 8, dtype=U8), torch.zeros(128, 4, dtype=E4), 0.0)),
    ("data list", TypeError, "takes torch tensors, got list",
     lambda: NVFP4Tensor([0], torch.zeros(128, 4, dtype=E4), 1.0)),
    ("modelopt scale", ValueError, r"\[N, K/16\] = \[4, 2\]",
     lambda: NVFP4Tensor.from_modelopt(torch.zeros(4, 16, dtype=U8),
                                       torch.zeros(4, 4, dtype=E4), 1.0)),
    ("modelopt 1-D", ValueError, "must be 2-D",
     lambda: NVFP4Tensor.from_modelopt(torch.zeros(16, dtype=U8), torch.zeros(2, dtype=E4), 1.)),
    ("modelopt NaN scale", ValueError, "4 NaN bytes",
     lambda: NVFP4Tensor.from_modelopt(torch.zeros(4, 16, dtype=U8),
                                       torch.tensor([[0x7F, 1]] * 4, dtype=U8).view(E4), 1.0)),
    ("modelopt negative scale", ValueError, "4 negative bytes",
     lambda: NVFP4Tensor.from_modelopt(torch.zeros(4, 16, dtype=U8),
                                       torch.tensor([[0x81, 1], [0x82, 1]] * 2,
                                                    dtype=U8)[:4].view(E4), 1.0)),
    ("swizzle 1-D", ValueError, r"2-D \[rows, K/16\]", lambda: cf.swizzle_scales(torch.zeros(4))),
    ("swizzle fp32", ValueError, "1-byte dtype", lambda: cf.swizzle_scales(torch.zeros(4, 4))),
    ("unswizzle size", ValueError, "need 128 x 4 = 512 bytes, got 100",
     lambda: cf.unswizzle_scales(torch.zeros(100, dtype=U8), 4, 64)),
]

SCHEDULES = [
    ("impossible", ScheduleError, "121,856 B",
     lambda: cf.plan(catalogue.get("sm100_style_256x128x256")).raise_if_invalid()),
    ("wrong target", ValueError, "is for sm_120a; it cannot be compiled for sm_90a",
     lambda: retarget(catalogue.get("sm120_default"), "sm_90a")),
    ("unknown target", ValueError, "unknown target 'sm_89'", lambda: cf.Schedule(target="sm_89")),
    ("out dtype", ValueError, "unsupported output dtype 'int8'", lambda: OutDtype.of("int8")),
    ("catalogue name", ValueError, "no schedule named 'x'", lambda: catalogue.get("x")),
    ("catalogue name not a str", TypeError, r"schedule name \(str\), got NoneType",
     lambda: catalogue.get(None)),
    ("replace across families", ValueError,
     r"sm120_default is for sm_120a \(family sm120\); replace\(target='sm_90a'\) would move "
     r"it to family sm90", lambda: catalogue.get("sm120_default").replace(target="sm_90a")),
    ("plan M = 0", ValueError, r"problem \(0, 256, 256\): M = 0; a problem's sizes must be > 0",
     lambda: cf.plan("sm120_default", (0, 256, 256))),
    ("plan N = K = 0", ValueError, "N = 0, K = 0",
     lambda: cf.plan("sm120_default", (16, 0, 0, "nvfp4"))),
    ("stages 0", ValueError, "Schedule.stages must be a positive int, got 0",
     lambda: cf.Schedule(stages=0)),
    ("tile tuple", ValueError, "Schedule.tile must be a Tile, got tuple",
     lambda: cf.Schedule(tile=(128, 128, 128))),
]


@pytest.mark.parametrize("case", QUANTIZE + CONTAINER + SCHEDULES, ids=lambda c: c[0])
def test_construction_errors(case):
    _, exc, match, fn = case
    raises(exc, match, fn)


def _ops(**over):
    """Operands for check_operands: W4A4 M=4, N=64, K=64 unless overridden."""
    d = {"a": fp4(4, 64), "b": fp4(64, 64), "out": None, "alpha": None,
         "out_dtype": torch.bfloat16}
    d.update(over)
    return d


def check(**over):
    d = _ops(**over)
    return api.check_operands(d["a"], d["b"], d["out"], d["alpha"], d["out_dtype"],
                              require_cuda=False)


OUT = torch.full((4, 64), 7.0, dtype=torch.bfloat16)

OPERANDS = [
    ("b dense", TypeError, "b \\(the weight\\) must be an NVFP4Tensor",
     lambda: check(b=torch.zeros(64, 64))),
    ("a int", ValueError, "got torch.int8", lambda: check(a=torch.zeros(4, 64, dtype=torch.int8))),
    ("a 3-D", ValueError, r"a must be 2-D \[M, K\]", lambda: check(a=torch.zeros(1, 4, 64))),
    ("a list", TypeError, "got list", lambda: check(a=[1])),
    ("K mismatch", ValueError, r"a is \[4, 128\] and b is \[64, 64\]",
     lambda: check(a=fp4(4, 128))),
    ("K=48", ValueError, "K = 48 is not a multiple of 32",
     lambda: check(a=fp4(4, 48), b=fp4(64, 48))),
    ("W4A16 empty M", ValueError, "M = 0", lambda: check(a=torch.zeros(0, 64,
                                                                         dtype=torch.bfloat16))),
    ("out shape", ValueError, r"out must have shape \(4, 64\), got \(4, 32\)",
     lambda: check(out=torch.zeros(4, 32, dtype=torch.bfloat16))),
    ("out dtype", ValueError, "out must be torch.bfloat16, got torch.float16",
     lambda: check(out=torch.zeros(4, 64, dtype=torch.float16))),
    ("out strided", ValueError, "must be contiguous",
     lambda: check(out=torch.zeros(64, 4, dtype=torch.bfloat16).T)),
    ("a misaligned", ValueError, "not 16-byte aligned \\(offset 2\\)",
     lambda: check(a=torch.zeros(4 * 64 + 1, dtype=torch.bfloat16)[1:].view(4, 64))),
    ("a strided", ValueError, "a must be contiguous",
     lambda: check(a=torch.zeros(64, 4, dtype=torch.bfloat16).T)),
    ("N=60 bf16", ValueError, "N = 60 gives output rows of 120 bytes",
     lambda: check(b=fp4(60, 64))),
    ("alpha vector", ValueError, "alpha must be a scalar, got 3",
     lambda: check(alpha=torch.ones(3))),
    ("b.data strided", ValueError, "b.data must be contiguous",
     lambda: check(b=NVFP4Tensor(torch.zeros(64, 64, dtype=U8)[:, ::2],
                                 torch.zeros(128, 4, dtype=E4), 1.0))),
]


@pytest.mark.parametrize("case", OPERANDS, ids=lambda c: c[0])
def test_operand_errors_leave_output_untouched(case):
    _, exc, match, fn = case
    before = OUT.clone()
    raises(exc, match, fn)
    assert torch.equal(OUT, before)


def test_cpu_operands_are_a_device_error():
    d = _ops(out=OUT)
    with pytest.raises(DeviceError, match="CUDA device, b is on cpu"):
        api.check_operands(d["a"], d["b"], d["out"], None, torch.bfloat16)
    with pytest.raises(DeviceError):
        cf.gemm(d["a"], d["b"], out=OUT)
    assert torch.equal(OUT, torch.full((4, 64), 7.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("make, match", [
    (lambda: cf.NVFP4Linear(fp4(64, 64), mode="w8a8"),
     "mode must be one of 'w4a16', 'w4a4', got 'w8a8'"),
    (lambda: cf.NVFP4Linear(fp4(64, 64), mode="w4a61"), "got 'w4a61'; did you mean 'w4a16'"),
    (lambda: cf.NVFP4Linear(fp4(64, 64), bias=torch.zeros(3)), r"bias must have shape \(64,\)"),
    (lambda: cf.NVFP4Linear(fp4(64, 64), bias=torch.zeros(64, dtype=torch.int64)),
     "bias must be a floating-point tensor .*got torch.int64"),
    (lambda: cf.NVFP4Linear(torch.zeros(64, 64)), "weight must be an NVFP4Tensor"),
    (lambda: cf.NVFP4Linear(cf.quantize(torch.randn(4, 128, 256))),
     r"got an expert stack \[4, 128, 256\]: one layer per expert"),
    (lambda: cf.NVFP4Linear(fp4(64, 64), schedule="nope"), "no schedule named 'nope'"),
    (lambda: cf.NVFP4Linear(fp4(64, 64), schedule=3), "schedule must be 'auto', a catalogue"),
    (lambda: cf.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), schedule="nope"),
     "no schedule named 'nope'"),
    (lambda: cf.NVFP4Linear(fp4(64, 64))(torch.zeros(2, 32)), "input has 32 features"),
])
def test_linear_errors(make, match):
    with pytest.raises(CuteFp4Error, match=match):
        make()


def test_linear_checkpoint_of_the_wrong_shape_raises_even_when_not_strict():
    """As torch does for a parameter: a size mismatch is an error with strict=False too."""
    layer = cf.NVFP4Linear(fp4(64, 64))
    before = layer.weight_packed.clone()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*\[3, 3\].*\[64, 32\]"):
        layer.load_state_dict({"weight": torch.randn(3, 3)}, strict=False)
    with pytest.raises(RuntimeError, match="weight_scale_2 is one FP32 value"):
        layer.load_state_dict({"weight_scale_2": torch.ones(2)}, strict=False)
    assert torch.equal(layer.weight_packed, before)


def test_convert_warns_when_a_skip_pattern_or_the_checkpoint_matches_nothing():
    from cute_fp4.errors import CuteFp4Warning

    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))

    with pytest.warns(CuteFp4Warning, match=r"skip pattern 'no_such_layer' matched no nn.Linear"):
        cf.convert(model(), skip=["no_such_layer", "1"])
    with pytest.warns(CuteFp4Warning, match=r"state_dict's 1 keys \(e.g. 'x'\) hold no "
                      r"'<layer>.weight_scale'"):
        cf.convert(model(), state_dict={"x": torch.ones(1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", CuteFp4Warning)  # a pattern that matches: silent
        report = cf.convert(model(), skip="1")
    assert report.converted == ("0",)


def test_catalogue_folder_mistakes_warn(tmp_path, monkeypatch):
    """CUTE_FP4_SCHEDULES naming a missing folder or a file, and a user's file replacing a
    catalogue schedule: one warning each, naming the paths."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "sm120_default.py").write_text(
        '"""Mine."""\nfrom cute_fp4.schedule import Schedule\nSCHEDULE = Schedule(stages=2)\n')
    py = tmp_path / "one.py"
    py.write_text("")
    missing = tmp_path / "nonexistent"
    monkeypatch.setenv("CUTE_FP4_SCHEDULES", os.pathsep.join(map(str, (missing, py, user))))
    catalogue._warn_not_a_directory.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s = catalogue.get("sm120_default")
        catalogue.names()
    msgs = [str(w.message) for w in seen if issubclass(w.category, catalogue.CatalogueWarning)]
    assert s.stages == 2  # the user's file still wins, as documented
    assert len(msgs) == 3, msgs
    assert any(f"{str(missing)!r} does not exist" in m for m in msgs)
    assert any(f"{str(py)!r} is a file; name the folder" in m for m in msgs)
    assert any("'sm120_default' from " + str(user / "sm120_default.py") + " replaces" in m
               for m in msgs)


def test_linear_round_trip_of_weights():
    lin = torch.nn.Linear(64, 32)
    q = cf.NVFP4Linear.from_linear(lin)
    assert q.weight.shape == (32, 64)
    assert torch.equal(q.weight.dequantize(), cf.quantize(lin.weight.detach()).dequantize())


def test_custom_op_is_registered_with_a_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cute_fp4.ops

    cute_fp4.ops.register()  # importing registers nothing; the first gemm call or this does

    with FakeTensorMode():
        a = torch.empty(16, 32, dtype=torch.uint8)
        b = torch.empty(64, 32, dtype=torch.uint8)
        sf = torch.empty(128, 4, dtype=E4)
        y = torch.ops.cute_fp4.mm(a, sf, b, sf, torch.ones(1), 64, torch.bfloat16, "auto")
    assert y.shape == (16, 64) and y.dtype == torch.bfloat16


def test_gemm_traces_into_one_op_under_torch_compile():
    from cute_fp4 import gemm

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    a, b = fp4(16, 64), fp4(64, 64)

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, w):
        return gemm(x, w) * 2

    with pytest.raises(DeviceError, match="CUDA device"):  # traced fine; runs only on a GPU
        f(a, b)
    assert len(graphs) == 1
    assert "cute_fp4.mm" in graphs[0].code


def _offsets(values, total_m: int = 300):
    from cute_fp4.operands import check_offsets

    return lambda: check_offsets(torch.tensor(values, dtype=torch.int32), total_m)


# grouped_gemm(validate_offsets=True) / check=True: the offsets' values (the GPU tests run
# them through grouped_gemm; the check itself is torch ops, the same on the CPU)
OFFSETS = [
    ("past the end", (3, 600), r"offsets\[3\] = 600 is past the end: a has total_M = 300",
     _offsets([0, 100, 200, 600])),
    ("negative", (2, -50), r"offsets\[2\] = -50 is negative", _offsets([0, 100, -50, 300])),
    ("decreasing", (2, 40), r"offsets\[2\] = 40 < offsets\[1\] = 250: offsets must be "
     "non-decreasing", _offsets([0, 250, 40, 300])),
    ("first not 0", (0, 37), r"offsets\[0\] = 37 must be 0", _offsets([37, 100, 200, 300])),
    ("last short", (3, 250), r"offsets\[3\] = 250 must equal total_M = 300",
     _offsets([0, 100, 200, 250])),
    ("int32 extremes", (0, -2**31), r"offsets\[0\] = -2147483648 is negative",
     _offsets([-2**31, 2**31 - 1, 0, 300])),
]


@pytest.mark.parametrize("case", OFFSETS, ids=lambda c: c[0])
def test_offsets_errors_name_the_entry(case):
    from cute_fp4.errors import OffsetsError

    _, (index, value), match, fn = case
    with pytest.raises(OffsetsError, match=match) as e:
        fn()
    assert (e.value.index, e.value.value) == (index, value)


def test_valid_offsets_pass():
    _offsets([0, 0, 100, 100, 300])()
    _offsets([0, 0], 0)()


def test_float64_nan_is_still_named_nan():
    x = torch.randn(16, 64, dtype=torch.float64)
    x[0, 0] = float("nan")
    raises(ValueError, "1 NaN/Inf values", lambda: cf.quantize(x))
