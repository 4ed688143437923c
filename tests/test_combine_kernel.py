"""The MoE combine (``cute_fp4.layers.routing.combine``, its kernel ``cute_fp4.kernels.
combine`` and host side ``cute_fp4.combining``) without a GPU: the torch path against the
exact weighted sum and its rounding rule, signed zeros, the cross-compiles for sm_90a and
sm_120a (no product contracted into an FMA: the kernel's bits are the torch path's), the
launch arguments, and when ``combine`` takes the kernel. On a GPU:
tests/gpu/test_combine.py."""

from __future__ import annotations

import pytest
import torch
from cubins import one_kernel

from cute_fp4 import combining, quant
from cute_fp4.errors import InputError
from cute_fp4.layers import routing
from cute_fp4.targets import reference_execution


def _case(t: int, k: int, h: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    down = (torch.randn(t * k, h, generator=g) * 4).to(dtype)
    inverse = torch.randperm(t * k, generator=g)
    weights = torch.rand(t, k, generator=g).softmax(-1)
    return down, inverse, weights


def _exact(down, inverse, weights):
    """The weighted sum in float64 (weights rounded to down's dtype, as combine takes them)."""
    t, k = weights.shape
    rows = down.index_select(0, inverse).view(t, k, -1).double()
    return (rows * weights.to(down.dtype).double().unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, k, h", [(1, 1, 8), (1, 4, 2880), (3, 8, 64), (17, 2, 24)])
def test_torch_path_is_the_slot_order_float32_sum(dtype, t, k, h):
    down, inverse, weights = _case(t, k, h, dtype, seed=t * 31 + k)
    got = routing.combine(down, routing.Routing(None, inverse, None, None), weights)
    assert got.dtype == dtype and got.shape == (t, h)
    # the definition written out: float32 products (exact), added in slot order, rounded
    rows = down.index_select(0, inverse).view(t, k, h).float()
    w = weights.to(dtype).float()
    acc = rows[:, 0] * w[:, :1]
    for j in range(1, k):
        acc = acc + rows[:, j] * w[:, j:j + 1]
    assert torch.equal(got.view(torch.int16), acc.to(dtype).view(torch.int16))
    # and within float32 accumulation plus one rounding of the exact sum
    exact = _exact(down, inverse, weights)
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    terms = (down.index_select(0, inverse).view(t, k, h).double().abs()
             * weights.to(dtype).double().unsqueeze(-1)).sum(1)
    bound = exact.abs() * u + terms * (k + 1) * 2.0**-23 + 2.0**-133
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_a_single_slot_keeps_the_sign_of_zero():
    down = torch.tensor([[-1.0] * 8, [2.0] * 8], dtype=torch.bfloat16)
    weights = torch.tensor([[0.0], [-0.0]])
    got = routing.combine_torch(down, torch.tensor([0, 1]), weights)
    assert torch.equal(torch.signbit(got), torch.ones_like(got, dtype=torch.bool))


def test_the_products_are_exact_in_float32():
    """Why the kernel's product rounding cannot differ from torch's: a product of two
    16-bit values (8 or 11 significand bits) fits float32's 24 bits."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        a = (torch.randn(4096, generator=g) * 100).to(dtype)
        b = torch.rand(4096, generator=g).to(dtype)
        assert torch.equal((a.float() * b.float()).double(), a.double() * b.double())


def test_the_kernel_is_not_taken_on_the_cpu_or_in_reference_mode():
    down, inverse, weights = _case(2, 4, 64)
    assert not combining.kernel_applies(down, inverse, weights)  # a CPU tensor
    with reference_execution():
        assert not combining.kernel_applies(down, inverse, weights)


class _OnCuda0:
    """What ``kernel_applies`` reads of ``down``, as if it were on cuda:0."""

    def __init__(self, t: torch.Tensor, ptr: int = 0):
        self._t, self._ptr = t, ptr
        self.device, self.dtype, self.shape = torch.device("cuda", 0), t.dtype, t.shape

    def dim(self):
        return self._t.dim()

    def is_contiguous(self):
        return self._t.is_contiguous()

    def data_ptr(self):
        return self._ptr


def test_kernel_applies_to_16_bit_rows_of_whole_vectors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(quant._TARGETS, 0, "sm_90a")
    down, inverse, weights = _case(2, 4, 64)
    assert combining.kernel_applies(_OnCuda0(down), inverse, weights)
    assert combining.kernel_applies(_OnCuda0(down.half()), inverse, weights.half())
    for bad, why in ((_OnCuda0(down[:, :60]), "H not a multiple of 8"),
                     (_OnCuda0(down.float()), "float32 rows"),
                     (_OnCuda0(down.t()), "not contiguous"),
                     (_OnCuda0(down, ptr=8), "not 16-byte aligned"),
                     (_OnCuda0(down[:0]), "no rows")):
        assert not combining.kernel_applies(bad, inverse, weights), why
    assert not combining.kernel_applies(_OnCuda0(down), inverse.int(), weights)
    assert not combining.kernel_applies(_OnCuda0(down), inverse, weights[:1])
    monkeypatch.setitem(quant._TARGETS, 0, None)  # a GPU without kernels here
    assert not combining.kernel_applies(_OnCuda0(down), inverse, weights)
    monkeypatch.setitem(quant._TARGETS, 0, "sm_90a")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not combining.kernel_applies(_OnCuda0(down), inverse, weights)


def test_combine_rows_refuses_bad_shapes_before_launching():
    down, inverse, weights = _case(2, 4, 64)
    with pytest.raises(InputError, match=r"H a multiple of 8.*down \(8, 60\)"):
        combining.combine_rows(down[:, :60], inverse, weights)
    with pytest.raises(InputError, match=r"weights \(3, 4\)"):
        combining.combine_rows(down, inverse, torch.rand(3, 4))
    with pytest.raises(InputError, match=r"out must be a contiguous, 16-byte aligned"):
        combining.combine_rows(down, inverse, weights, out=torch.empty(2, 63))


def test_launch_arguments():
    from cute_fp4.kernels.combine import CombineKernel, CombineSpec

    down, inverse, weights = _case(3, 2, 64)
    out = torch.empty(3, 64, dtype=down.dtype)
    raw = CombineKernel(CombineSpec()).raw_args(down, inverse, weights, out, 2, 7)
    assert raw == (down.data_ptr(), inverse.data_ptr(), weights.data_ptr(), out.data_ptr(),
                   3, 2, 64, 7)
    with pytest.raises(ValueError, match="dtype"):
        CombineSpec(dtype="float32")
    with pytest.raises(ValueError, match="threads"):
        CombineSpec(threads=48)
    assert CombineSpec("sm_120a", "float16").label() == "combine-float16-t128@sm_120a"


COMPILE_CASES = [("sm_90a", "bfloat16"), ("sm_120a", "bfloat16"), ("sm_90a", "float16")]


@pytest.mark.compile
@pytest.mark.parametrize("target, dtype", COMPILE_CASES,
                         ids=[f"{t}-{d}" for t, d in COMPILE_CASES])
def test_kernel_compiles(target, dtype, tmp_path):
    """One kernel, no spills, 16-byte loads of the down rows and stores of the output, and
    no fused multiply-add: each product is rounded on its own (``mul.rn.f32``), so the sum
    is the torch path's bit for bit."""
    combining.cross_compile_combine(combining.default_spec(target, dtype),
                                    dump_dir=str(tmp_path))
    rep, ops = one_kernel(tmp_path)
    assert rep.spills == 0 and rep.registers <= 64, rep
    assert sum(op.startswith("LDG.E.128") for op in ops) == 1, ops
    assert sum(op.startswith("STG.E.128") for op in ops) == 1, ops
    fused = [op for op in ops if op.startswith(("FFMA", "FHFMA"))]  # (HFMA2.MMA: moves)
    assert not fused, fused
    assert sum(op.startswith("FMUL") for op in ops) >= 8, ops  # the products of a slot


def test_each_device_and_dtype_builds_its_kernel_once(monkeypatch):
    """``quant.memo_spec_kernel`` (what the combine and the routing sort build through):
    the device's target, one build per key, a typed error for a GPU without kernels."""
    import types

    from cute_fp4 import targets
    from cute_fp4.errors import DeviceError

    builds = []
    monkeypatch.setattr(quant, "cached_spec_build",
                        lambda kernel, name: builds.append((kernel.spec, name)) or
                        (object(), 0.5, "built"))
    gpu = types.SimpleNamespace(target=types.SimpleNamespace(name="sm_120a"))
    monkeypatch.setattr(targets, "detect_device", lambda index: gpu)
    monkeypatch.setattr(quant, "_TARGETS", {})  # each device's target detected afresh
    memo = {}
    monkeypatch.setattr(combining, "_KERNELS", memo)
    a = combining._kernel_for(0, torch.bfloat16)
    assert combining._kernel_for(0, torch.bfloat16) is a and len(builds) == 1
    assert builds[0] == (combining.default_spec("sm_120a", "bfloat16"), "CombineKernel")
    assert isinstance(a, combining.CompiledCombine) and a.spec.target == "sm_120a"
    combining._kernel_for(0, torch.float16)
    assert len(builds) == 2 and len(memo) == 2
    monkeypatch.setattr(targets, "detect_device", lambda index: None)
    with pytest.raises(DeviceError, match="cuda:3 has no kernels here"):
        combining._kernel_for(3, torch.bfloat16)
