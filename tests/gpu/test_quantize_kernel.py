"""The fused activation-quantization kernel on a GPU: bit-identical to ``cute_fp4.quantize``.

Every run writes into outputs poisoned beforehand (packed codes 0xA5, scales 0x5A, global
scale NaN), and every byte is compared, scale padding included. Shapes: M = 1, odd M, M
around 128, K = 16 x odd (scale columns padded), 32 x odd, 64 x odd, long K; inputs from
``tests/quantize_model.awkward_input`` (rows spanning 2^-20..2^20, exact E2M1 ties, zero
blocks, subnormal and saturated block scales, negative zeros). Static scales cover the
fast path (a power of two, an arbitrary value, the tensor's own amax / 2688) and the
general one (1e-30, 300); dynamic scales both variants. Skipped without SM90 / SM12x.
"""

from __future__ import annotations

import pytest
import torch
from quantize_model import awkward_input, tie_case

from cute_fp4 import quant
from cute_fp4.errors import InputError
from cute_fp4.kernels.quantize import QuantSpec
from cute_fp4.nvfp4 import NVFP4Tensor, quantize, scale_shape

pytestmark = pytest.mark.gpu("sm90", "sm120")

SHAPES = [(1, 16), (1, 4096), (1, 8192), (2, 48), (3, 4160), (7, 96), (16, 4096), (16, 8192),
          (31, 1040), (127, 64), (128, 112), (129, 2080), (255, 32), (1000, 4096),
          (4096, 1024)]
DTYPES = [torch.bfloat16, torch.float16]


def _poisoned_out(m: int, k: int) -> NVFP4Tensor:
    data = torch.full((m, k // 2), 0xA5, dtype=torch.uint8, device="cuda")
    scale = torch.full(scale_shape(m, k), 0x5A, dtype=torch.uint8, device="cuda")
    gs = torch.full((), float("nan"), dtype=torch.float32, device="cuda")
    return NVFP4Tensor._unchecked(data, scale.view(torch.float8_e4m3fn), gs, (m, k))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_identical(got: NVFP4Tensor, ref: NVFP4Tensor, what: str) -> None:
    torch.cuda.synchronize()
    assert got.shape == ref.shape, what
    bad = (got.data != ref.data).sum().item()
    assert bad == 0, f"{what}: {bad} packed bytes differ"
    gs_, rs = _bits(got.scale), _bits(ref.scale)
    bad = (gs_ != rs).sum().item()
    if bad:
        idx = (gs_ != rs).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: {bad} scale bytes differ, e.g. at {idx}: "
                             f"{gs_[idx].tolist()} vs {rs[idx].tolist()}")
    got_gs = got.global_scale.reshape(1).view(torch.int32)
    ref_gs = ref.global_scale.reshape(1).to("cuda").view(torch.int32)
    assert torch.equal(got_gs, ref_gs), f"{what}: global scale {got.global_scale} vs " \
                                         f"{ref.global_scale}"


def _static_scales(x: torch.Tensor):
    amax = x.float().abs().max().item()
    own = amax / 2688 if amax > 0 else 1.0
    return [2.0**-7, 3e-3, own, 1e-30, 300.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, k", SHAPES)
def test_static_scale_bit_identical(dtype, m, k):
    x = awkward_input(m, k, dtype, seed=m + 3 * k).cuda()
    for gs in _static_scales(x):
        gs_t = torch.full((1,), gs, dtype=torch.float32, device="cuda")
        out = _poisoned_out(m, k)
        got = quant.quantize_activation(x, gs_t, out=out)
        assert got.data.data_ptr() == out.data.data_ptr()
        assert_identical(got, quantize(x, gs_t), f"[{m}, {k}] {dtype} gs={gs:g}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, k", SHAPES)
@pytest.mark.parametrize("mode", ["two_pass", "fused"])
def test_dynamic_scale_bit_identical(dtype, m, k, mode):
    x = awkward_input(m, k, dtype, seed=7 * m + k).cuda()
    out = _poisoned_out(m, k)
    got = quant.quantize_activation(x, out=out, dynamic_mode=mode)
    assert_identical(got, quantize(x), f"[{m}, {k}] {dtype} dynamic {mode}")
    fresh = quant.quantize_activation(x, dynamic_mode=mode)  # allocated outputs
    assert_identical(fresh, quantize(x), f"[{m}, {k}] {dtype} dynamic {mode}, allocated")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fast_and_general_paths_agree(dtype):
    """The same inputs through the fast path and the forced general (div.rn) path."""
    m, k = 129, 4160
    x = awkward_input(m, k, dtype, seed=11).cuda()
    gs = torch.full((1,), 3e-3, dtype=torch.float32, device="cuda")
    target = quant._spec_for(x, "static").target
    outs = []
    for general in (False, True):
        spec = quant.default_spec(target, "bf16" if dtype == torch.bfloat16 else "fp16",
                                  force_general=general)
        out = _poisoned_out(m, k)
        quant.compile_quantize(spec).launch(x, out.data, out.scale, gs, None)
        outs.append(NVFP4Tensor._unchecked(out.data, out.scale, gs.reshape(()), (m, k)))
    assert_identical(outs[0], quantize(x, gs), "fast path")
    assert_identical(outs[1], quantize(x, gs), "general path")


def test_saturated_blocks_next_to_unsaturated_ones():
    """Blocks whose scale saturates (their words are clamped to 6 d) interleaved with blocks
    that need no clamp, in every warp: both sides of the kernel's per-block branch, and
    blocks whose largest quotient is just under and over 6 (UE4M3 rounded down, up)."""
    m, k = 256, 4096
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g)
    gs = 2.0 / 2688  # blocks with bamax > 2 saturate (UE4M3 448)
    big = torch.rand(m, k // 16, generator=g) < 0.5
    x = x.reshape(m, k // 16, 16)
    x[big] *= 8.0
    # a block whose scale rounds down by up to a UE4M3 half step (8.5 -> 8): bamax / d up
    # to 6.375, the largest quotient of a normal, unsaturated scale (no clamp needed)
    x[:, 1, 0] = 6.0 * 8.5 * gs * torch.linspace(0.99, 1.01, m)
    x[:, 1, 1:] = 0.01
    x = x.reshape(m, k).to(torch.bfloat16).cuda()
    gs_t = torch.full((1,), gs, dtype=torch.float32, device="cuda")
    out = _poisoned_out(m, k)
    got = quant.quantize_activation(x, gs_t, out=out)
    assert_identical(got, quantize(x, gs_t), "mixed saturation")


SPLITS = [(128, 1, 1, "rows"), (256, 4, 2, "rows"), (512, 2, 1, "rows"), (256, 2, 0, "rows"),
          (64, 1, 1, "rows"), (256, 2, 3, "atoms"), (256, 1, 1, "atoms"), (128, 4, 0, "atoms"),
          (256, 2, 0, "atoms"), (64, 4, 1, "atoms")]


@pytest.mark.parametrize("threads, items, per_sm, order", SPLITS)
@pytest.mark.parametrize("m, k", [(131, 1072), (1, 4096), (300, 2080)])
def test_other_thread_splits(threads, items, per_sm, order, m, k):
    """Other splits and item orders, including one CTA in all (every CTA
    loops over many chunks, both register sets in turn) and no persistent loop (one chunk
    per CTA)."""
    x = awkward_input(m, k, torch.bfloat16, seed=5).cuda()
    gs = torch.full((1,), 2.0**-5, dtype=torch.float32, device="cuda")
    spec = QuantSpec(target=quant._spec_for(x, "static").target, threads=threads, items=items,
                     ctas_per_sm=per_sm, order=order)
    out = _poisoned_out(m, k)
    quant.compile_quantize(spec).launch(x, out.data, out.scale, gs, None)
    got = NVFP4Tensor._unchecked(out.data, out.scale, gs.reshape(()), (m, k))
    assert_identical(got, quantize(x, gs), spec.label())


@pytest.mark.parametrize("max_ctas", [1, 3])
@pytest.mark.parametrize("path", [{"ctas_per_sm": 4, "order": "atoms"},
                                  {"ctas_per_sm": 4, "order": "rows", "items": 2}])
def test_few_ctas_loop_over_every_chunk(max_ctas, path):
    """One (or three) CTAs of the persistent grid quantize all chunks: the two register
    sets in turn, each reused many times."""
    import copy
    import dataclasses

    m, k = 300, 2080
    x = awkward_input(m, k, torch.float16, seed=9).cuda()
    gs = torch.full((1,), 1e-2, dtype=torch.float32, device="cuda")
    spec = dataclasses.replace(quant._spec_for(x, "static"), **path)
    kern = copy.copy(quant.compile_quantize(spec))
    kern.max_ctas = max_ctas
    out = _poisoned_out(m, k)
    kern.launch(x, out.data, out.scale, gs, None)
    got = NVFP4Tensor._unchecked(out.data, out.scale, gs.reshape(()), (m, k))
    assert_identical(got, quantize(x, gs), f"max_ctas={max_ctas}")


def test_special_tensors():
    """All zeros (dynamic scale 1, every code 0), one element per block set, the largest
    finite values, and the block whose scale rounds differently under '/ 6' and
    '* float32(1/6)' (the rule multiplies on every device)."""
    z = torch.zeros(5, 64, dtype=torch.bfloat16, device="cuda")
    assert_identical(quant.quantize_activation(z), quantize(z), "zeros")
    one = torch.zeros(3, 256, dtype=torch.float16, device="cuda")
    one[:, ::16] = torch.tensor([1.0, -2.0, 65504.0], device="cuda", dtype=torch.float16)[:, None]
    assert_identical(quant.quantize_activation(one), quantize(one), "one per block")
    big = torch.full((2, 32), 3.3e38, dtype=torch.bfloat16, device="cuda")
    big[1] = -3.3e38
    assert_identical(quant.quantize_activation(big), quantize(big), "largest bf16")
    x, gs = tie_case()
    x = x.cuda()
    gs_t = torch.full((1,), gs, dtype=torch.float32, device="cuda")
    assert_identical(quant.quantize_activation(x, gs_t), quantize(x, gs_t),
                     "bamax / 6 vs * fl(1/6)")


def test_python_float_scale_and_repeatability():
    x = awkward_input(17, 512, torch.bfloat16, seed=2).cuda()
    a = quant.quantize_activation(x, 0.01)
    assert_identical(a, quantize(x, 0.01), "python float scale")
    for _ in range(3):
        assert_identical(quant.quantize_activation(x, 0.01), a, "repeat")


def test_no_host_sync_and_cuda_graph():
    """Static and dynamic calls never synchronise; both replay correctly from a CUDA graph
    with new input values."""
    m, k = 16, 4096
    x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    gs = torch.full((1,), 0.004, dtype=torch.float32, device="cuda")
    outs = [_poisoned_out(m, k) for _ in range(3)]
    x.copy_(awkward_input(m, k, torch.bfloat16, seed=1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quant.quantize_activation(x, gs, out=outs[0])
        quant.quantize_activation(x, out=outs[1], dynamic_mode="two_pass")
        quant.quantize_activation(x, out=outs[2], dynamic_mode="fused")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        quant.quantize_activation(x, gs, out=outs[0])
        quant.quantize_activation(x, out=outs[1], dynamic_mode="two_pass")
        quant.quantize_activation(x, out=outs[2], dynamic_mode="fused")
    for seed in (3, 4):
        x.copy_(awkward_input(m, k, torch.bfloat16, seed=seed))
        for o in outs:
            o.data.fill_(0xA5)
        g.replay()
        assert_identical(outs[0], quantize(x, gs), f"graph static seed {seed}")
        assert_identical(outs[1], quantize(x), f"graph two_pass seed {seed}")
        assert_identical(outs[2], quantize(x), f"graph fused seed {seed}")


def test_errors_leave_outputs_untouched():
    x = torch.randn(8, 64, device="cuda").to(torch.bfloat16)
    shifted = torch.zeros(8 * 64 + 4, dtype=torch.bfloat16, device="cuda")[4:].view(8, 64)
    out = _poisoned_out(8, 64)
    before = out.data.clone(), out.scale.view(torch.uint8).clone()
    cases = [
        (lambda: quant.quantize_activation(x, torch.ones(1), out=out), "is on cpu"),
        (lambda: quant.quantize_activation(x, torch.ones(1, device="cuda", dtype=torch.float64),
                                           out=out), "must be float32"),
        (lambda: quant.quantize_activation(x.t(), out=out), "K = 8 is not a multiple of 16"),
        (lambda: quant.quantize_activation(x[:, :48], out=out), r"out has shape|contiguous"),
        (lambda: quant.quantize_activation(x.float(), out=out), "bfloat16 or float16"),
        (lambda: quant.quantize_activation(x, -1.0, out=out), "finite and > 0"),
        (lambda: quant.quantize_activation(shifted, out=out), "not 16-byte aligned"),
    ]
    for fn, msg in cases:
        with pytest.raises(InputError, match=msg):
            fn()
    wrong_dev = NVFP4Tensor._unchecked(out.data.cpu(), out.scale, out.global_scale, (8, 64))
    with pytest.raises(InputError, match="out.data is on cpu"):
        quant.quantize_activation(x, out=wrong_dev)
    torch.cuda.synchronize()
    assert torch.equal(out.data, before[0]) and torch.equal(out.scale.view(torch.uint8),
                                                            before[1])
    assert torch.isnan(out.global_scale).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, k", SHAPES)
def test_values_are_the_decoded_codes_bit_for_bit(dtype, m, k):
    """``quantize_values`` (one pass) against ``dequantize_activation(quantize_activation)``
    and ``quantize(...).block_values``, every bit (signed zeros included) of outputs
    poisoned first, for the fast path's scales and the general path's (1e-30, 300)."""
    x = awkward_input(m, k, dtype, seed=m + 5 * k).cuda()
    for gs in _static_scales(x):
        gs_t = torch.full((1,), gs, dtype=torch.float32, device="cuda")
        out = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = quant.quantize_values(x, gs_t, out=out)
        assert got.data_ptr() == out.data_ptr()
        two_pass = quant.dequantize_activation(quant.quantize_activation(x, gs_t))
        ref = quantize(x, gs_t).block_values(torch.bfloat16)
        for want, name in ((two_pass, "two passes"), (ref, "quantize().block_values")):
            bad = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
            assert bad == 0, f"[{m}, {k}] {dtype} gs={gs:g}: {bad} values differ from {name}"


def test_values_errors_leave_the_output_untouched():
    x = torch.randn(8, 64, device="cuda").to(torch.bfloat16)
    out = torch.full((8, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    before = out.clone()
    for fn, msg in ((lambda: quant.quantize_values(x, None, out=out), "static global scale"),
                    (lambda: quant.quantize_values(x, -1.0, out=out), "finite and > 0"),
                    (lambda: quant.quantize_values(x, 0.1, out=out[:, :48]), "out must be"),
                    (lambda: quant.quantize_values(x[:, :48].contiguous(), 0.1, out=out),
                     "out must be"),
                    (lambda: quant.quantize_values(x, 0.1, out=out.half()), "out must be")):
        with pytest.raises(InputError, match=msg):
            fn()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
