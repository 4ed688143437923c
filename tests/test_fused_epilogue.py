"""Fused epilogue operations (``Epilogue.ops``: bias, silu_mul, swiglu_oai) on the CPU: the
schedule component, plan()'s refusals, the gate/up weight order, the pairing of gate and up values
in every thread of every SM120 tiled MMA, and per family one compile of a grouped kernel
and one of the weight-streaming kernel (0 spills, the accurate exp and division the
bit-identity with torch's SiLU rests on).

The GPU half (tests/gpu/test_fused_epilogue.py) compares fused outputs with the unfused
pipeline bit for bit and with the exact reference.
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import catalogue, reference
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.fused import (
    deinterleave_gate_up,
    gate_up_order,
    interleave_gate_up,
    regroup_gate_up,
    swiglu_oai_unfused,
)
from cute_fp4.nvfp4 import quantize
from cute_fp4.plan import plan
from cute_fp4.planning.common import silu_group
from cute_fp4.schedule import Epilogue, EpilogueOp, Problem, gated_op


def test_ops_are_validated_and_put_in_order():
    assert Epilogue(ops=("silu_mul", "bias")).ops == ("bias", "silu_mul")
    assert Epilogue(ops="bias+silu_mul").ops == ("bias", "silu_mul")
    with pytest.raises(InputError, match="each of Epilogue.ops must be one of 'bias', "
                       "'silu_mul', 'swiglu_oai', 'nvfp4_out' .*got 'gelu'"):
        Epilogue(ops=("gelu",))
    with pytest.raises(InputError, match="got 'silu_mull'; did you mean 'silu_mul'"):
        Epilogue(ops="bias+silu_mull")
    assert all(isinstance(o, EpilogueOp) for o in Epilogue(ops="bias+silu_mul").ops)
    with pytest.raises(InputError, match="twice"):
        Epilogue(ops=("bias", "bias"))
    with pytest.raises(InputTypeError):
        Epilogue(ops=(1,))


def test_ops_name_the_schedule_and_leave_other_keys_alone():
    s = catalogue.get("sm90_grouped_decode")
    f = s.replace(ops=("bias", "silu_mul"))
    assert f.name == "sm90_grouped_decode+ops=bias+silu_mul"
    assert "bias+silu_mul" in f.label() and f.key() != s.key()
    assert "ops" not in s.key()  # keys (and caches) of schedules without ops are unchanged


def test_plan_refuses_silu_mul_with_n_not_in_gate_up_groups():
    s90 = catalogue.get("sm90_grouped_decode").replace(ops=("silu_mul",))
    s120 = catalogue.get("sm120_grouped").replace(ops=("silu_mul",))
    assert (silu_group(s90), silu_group(s120)) == (8, 32)
    assert plan(s90, Problem(16, 1536, 2048, "bf16", groups=8)).ok
    bad = plan(s90, Problem(16, 1544, 2048, "bf16", groups=8))
    assert any("N = 1544 is not a multiple of 16" in r for r in bad.reasons), bad.reasons
    bad = plan(s120, Problem(16, 1568, 2048, "nvfp4", groups=8))
    assert any("N = 1568 is not a multiple of 64" in r for r in bad.reasons), bad.reasons


def test_plan_stores_fused_tiles_from_registers():
    s = catalogue.get("sm120_default")
    c = {r.name: r for r in plan(s.replace(ops=("bias",))).regions}["C"]
    assert c.bytes == 0 and "fused" in c.note
    assert plan(s.replace(ops=("bias",))).stages > plan(s).stages  # the C buffer's bytes


@pytest.mark.parametrize("name", ["sm90_stream_decode", "sm120_stream_grouped_decode"])
def test_stream_takes_ops_with_gate_up_groups_of_8(name):
    s = catalogue.get(name).replace(ops=("bias", "silu_mul"))
    groups = 8 if s.scheduler.grouped else 0
    assert silu_group(s) == 8  # D^T rows lane / 4 + {0, 8} on both families
    assert plan(s, Problem(1, 1552, 2048, "bf16", groups=groups)).ok
    bad = plan(s, Problem(1, 1544, 2048, "bf16", groups=groups))
    assert any("N = 1544 is not a multiple of 16" in r for r in bad.reasons), bad.reasons


@pytest.mark.parametrize("group", [8, 32])
def test_gate_up_order_interleaves_groups(group):
    n = 4 * group
    order = gate_up_order(n, group).tolist()
    assert sorted(order) == list(range(n))
    assert order[:group] == list(range(group))  # gate rows 0..G-1
    assert order[group:2 * group] == list(range(n // 2, n // 2 + group))  # up rows 0..G-1
    with pytest.raises(InputError, match="multiple of"):
        gate_up_order(n + group, group)


def test_interleaved_weights_give_the_natural_gate_and_up():
    torch.manual_seed(0)
    w, x = torch.randn(3, 128, 64), torch.randn(5, 64)
    wi = interleave_gate_up(w, 32)
    q = quantize(w[0])
    qi = interleave_gate_up(q, 32)  # an NVFP4 weight: scales move with their rows
    assert torch.equal(qi.dequantize(), interleave_gate_up(q.dequantize(), 32))
    stack = interleave_gate_up(quantize(w), 8)  # an expert stack
    assert torch.equal(stack.dequantize(), interleave_gate_up(quantize(w).dequantize(), 8))
    g, u = deinterleave_gate_up(x @ wi[1].T, 32)
    torch.testing.assert_close(g, x @ w[1, :64].T)
    torch.testing.assert_close(u, x @ w[1, 64:].T)


def _trace_sm120(schedule, walk) -> None:
    """``walk(kernel)`` (plain Python over the layouts) inside a trace of the schedule's
    SM120 kernel after its setup; the arch is a compile option (CUTE_DSL_ARCH is read once,
    when the DSL first starts)."""
    import cutlass.cute as cute

    from cute_fp4.compile import kernel_class

    problem = Problem(groups=8) if schedule.scheduler.grouped else Problem()
    k = kernel_class(schedule)(schedule, problem)

    @cute.jit
    def trace():
        k._setup()
        walk(k)

    cute.compile(trace, options="--gpu-arch sm_120a")


def _sm120_pairs_hold(schedule) -> list[str]:
    import cutlass.cute as cute

    g = silu_group(schedule)
    bad = []

    def walk(k):
        tm, tn, _ = k.tile_mnk
        size = k.tiled_mma.size  # every lane of warp 0, then lanes 0 and 31 of each warp
        for t in sorted(set(range(32)) | {w + d for w in range(32, size, 32) for d in (0, 31)}):
            part = k.tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor((tm, tn)))
            held = {tuple(part[i]) for i in range(cute.size(part))}
            bad.extend(f"thread {t} ({m}, {n})" for m, n in held
                       if n % (2 * g) < g and (m, n + g) not in held)

    _trace_sm120(schedule, walk)
    return bad


def _sm120_mma_shapes() -> list[str]:
    """One catalogue schedule per SM120 (tile M, N, MMA warps): what the C layout depends on."""
    seen = {}
    for s in catalogue.all_schedules("sm120"):
        if s.mainloop.value != "stream" and plan(s).ok:
            seen.setdefault((s.tile.m, s.tile.n, s.warps.mma), s.name)
    return sorted(seen.values())


@pytest.mark.compile
@pytest.mark.parametrize("name", _sm120_mma_shapes())
def test_every_sm120_thread_holds_its_gate_and_up(name):
    assert _sm120_pairs_hold(catalogue.get(name)) == []


@pytest.mark.compile
def test_gated_view_is_the_gate_columns_formula():
    """``epilogue.gated_view``: the layout the gated stores write through puts GEMM tile
    coordinate (r, c) (N coordinate n, of either mode) at the output element ``n // (2
    group) * group + n % group`` of the half-wide tile, a gate and its up at the same one,
    for the tiles and groups the kernels store (D^T 64-row units with groups of 8, SM120's
    128 x 128 with 32, a 64 x 32 tile with 8)."""
    import cutlass
    import cutlass.cute as cute

    from cute_fp4.kernels.epilogue import gated_view

    cases = [((64, 128), 0, 8), ((128, 128), 1, 32), ((64, 32), 1, 8), ((128, 64), 0, 16)]
    got = {}

    def walk():
        for tile, nm, group in cases:
            out = tuple(v // 2 if m == nm else v for m, v in enumerate(tile))
            ptr = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem)
            gD = cute.make_tensor(ptr, cute.make_layout(out, stride=(1000, 1)))
            lay = gated_view(gD, tile, nm, group).layout
            got[tile, nm, group] = {(r, c): lay((r, c)) for r in range(tile[0])
                                    for c in range(tile[1])}

    @cute.jit
    def probe():
        walk()

    cute.compile(probe, options="--gpu-arch sm_90a")
    for (tile, nm, group), offsets in got.items():
        for (r, c), off in offsets.items():
            n = (r, c)[nm]
            o = n // (2 * group) * group + n % group
            want = (o * 1000 + c) if nm == 0 else (r * 1000 + o)
            assert off == want, (tile, nm, group, r, c)


# one per family, CI's time being short: sm_90a's D^T split-K store (the stream kernel) and
# SM120's grouped OMMA store, for sm_121a (GB10; the nvfp4_out compile below is sm_120a's;
# the other flavours compile in the GPU runs)
# swiglu_oai (gpt-oss's experts): MXFP4's grouped kernels, the stream decode and SM120's MMA
# and sm90_rs_packed's D^T store through epilogue.gated_view (86 spills before it)
FUSED_COMPILES = [("sm90_stream_decode", "bf16", "sm_90a", "silu_mul"),
                  ("sm90_rs_packed", "bf16", "sm_90a", "silu_mul"),
                  ("sm120_grouped_decode", "nvfp4", "sm_121a", "silu_mul"),
                  ("sm90_mxfp4_stream_grouped_decode", "bf16", "sm_90a", "swiglu_oai"),
                  ("sm90_mxfp4_grouped", "bf16", "sm_90a", "swiglu_oai"),
                  ("sm120_mxfp4_grouped", "mxfp4", "sm_120a", "swiglu_oai")]


@pytest.mark.compile
@pytest.mark.parametrize("name, fmt, target, gated", FUSED_COMPILES,
                         ids=[f"{n}-{g}" for n, _, _, g in FUSED_COMPILES])
def test_fused_kernels_compile_without_spills(name, fmt, target, gated):
    from cute_fp4.compile import compile_report

    s = catalogue.get(name).replace(ops=("bias", gated))
    groups = 8 if s.scheduler.grouped else 0
    weights = "mxfp4" if "mxfp4" in name else "nvfp4"
    row = compile_report(s, target, problem=Problem(a_format=fmt, groups=groups,
                                                    b_format=weights))
    assert row["target"] == target
    assert row["ok"], row.get("reason")
    assert row["spills"] == 0 and row["kernel_smem_bytes"] == row["smem_bytes"], row


# ----------------------------------------------------------------------------- nvfp4_out

def test_plan_refuses_nvfp4_out_where_it_is_not_built_with_the_numbers():
    nv = ("nvfp4_out",)
    ok = plan(catalogue.get("sm120_default").replace(ops=nv), Problem(16, 1088, 1024, "nvfp4"))
    assert ok.ok, ok.reasons
    swap = plan(catalogue.get("sm90_decode_swapab").replace(ops=nv), Problem(1, 1024, 512, "bf16"))
    assert any("D^T tiles of swap-AB" in r for r in swap.reasons), swap.reasons
    rs = plan(catalogue.get("sm90_rs_packed").replace(ops=nv), Problem(64, 1024, 512, "bf16"))
    assert any("mainloop=rs_packed" in r for r in rs.reasons), rs.reasons
    split = plan(catalogue.get("sm120_decode_splitk4").replace(ops=nv),
                 Problem(1, 1024, 4096, "nvfp4"))
    assert any("split_k 4" in r for r in split.reasons), split.reasons
    cols = plan(catalogue.get("sm90_default").replace(ops=nv), Problem(16, 1040, 512, "bf16"))
    assert any("1040 output columns are not a multiple of 32" in r for r in cols.reasons)
    both = catalogue.get("sm120_grouped").replace(ops=("silu_mul", "nvfp4_out"))
    assert plan(both, Problem(16, 576, 512, "nvfp4", groups=8)).ok  # 288 = 9 x 32 columns
    bad = plan(both, Problem(16, 640, 512, "nvfp4", groups=8))  # 320 = 10 x 32: fine too
    assert bad.ok, bad.reasons
    bad = plan(both, Problem(16, 704, 512, "nvfp4", groups=8))  # 352 = 11 x 32
    assert bad.ok, bad.reasons
    bad = plan(catalogue.get("sm120_default").replace(ops=("silu_mul", "nvfp4_out")),
               Problem(16, 1984, 512, "nvfp4"))  # 992 = 31 x 32 output columns
    assert bad.ok, bad.reasons
    bad = plan(catalogue.get("sm120_default").replace(ops=("silu_mul", "nvfp4_out")),
               Problem(16, 1088 + 16, 512, "nvfp4"))
    assert any("552 output columns are not a multiple of 32" in r for r in bad.reasons), \
        bad.reasons


def _sm120_nvfp4_blocks(schedule) -> list:
    """nvfp4_blocks over the threads of the schedule's tiled MMA (AssertionError if a 16-
    column output block is not a butterfly group of lanes with adjacent column pairs)."""
    from cute_fp4.kernels.epilogue import nvfp4_blocks

    found = []

    def walk(k):
        tm, tn, _ = k.tile_mnk
        size = k.tiled_mma.size  # whole warps (lanes group within one): the first, last
        every = sorted(set(range(32)) | set(range(size - 32, size)))
        for ops in (("nvfp4_out",), ("silu_mul", "nvfp4_out")):
            blocks, masks = nvfp4_blocks(k.tiled_mma, (tm, tn), 1, ops,
                                         silu_group(schedule), every)
            found.append((ops, len(blocks), len(blocks[0].refs), masks))

    _trace_sm120(schedule, walk)
    return found


@pytest.mark.compile
@pytest.mark.parametrize("name", _sm120_mma_shapes())
def test_every_sm120_thread_holds_its_nvfp4_blocks_in_a_quad(name):
    s = catalogue.get(name)
    wm, wn = s.warps.mma
    if wn > 2:  # plan() refuses these: a block spans two warps, which the trace finds
        assert any("at most 2 MMA warps along N" in r
                   for r in plan(s.replace(ops=("nvfp4_out",))).reasons)
        with pytest.raises(Exception, match="not a butterfly group of 8 lanes"):
            _sm120_nvfp4_blocks(s)
        return
    values = s.tile.m * s.tile.n // (32 * wm * wn)
    for ops, blocks, per, masks in _sm120_nvfp4_blocks(s):
        out_values = values // 2 if "silu_mul" in ops else values
        assert (per, masks) == (4, (1, 2)), (ops, per, masks)  # a quad, 2 x 2 columns each
        assert blocks * per == out_values, (ops, blocks, per, values)


@pytest.mark.compile
@pytest.mark.parametrize("name, fmt, ops", [
    ("sm120_default", "nvfp4", ("silu_mul", "nvfp4_out"))])
def test_nvfp4_out_kernels_compile_without_spills(name, fmt, ops):
    from cute_fp4.compile import compile_report

    s = catalogue.get(name).replace(ops=ops)
    row = compile_report(s, problem=Problem(a_format=fmt))
    assert row["ok"], row.get("reason")
    assert row["spills"] == 0 and row["kernel_smem_bytes"] == row["smem_bytes"], row


def test_auto_takes_a_tile_that_writes_nvfp4_for_nvfp4_out():
    """"auto" keeps its pick where plan() takes the ops on it; for nvfp4_out on a D^T,
    split-K or SM12x decode tile it takes the family's validated tile instead; a packed
    weight (D^T kernels only) is refused with the way out."""
    from cute_fp4.tuning import NVFP4_OUT_SCHEDULES, with_ops

    dims = (16, 4096, 4096, "nvfp4")
    for picked in ("sm90_decode_swapab", "sm90_decode", "sm120_decode_splitk4"):
        s = with_ops(catalogue.get(picked).replace(out_dtype="fp16"), ("nvfp4_out",), *dims)
        assert s.name.startswith(NVFP4_OUT_SCHEDULES[(s.arch.family, False)]), s.name
        assert s.epilogue.ops == ("nvfp4_out",) and s.epilogue.out_dtype.value == "fp16"
        assert plan(s, Problem(*dims)).ok
    s = with_ops(catalogue.get("sm90_decode_swapab"), ("bias", "silu_mul"), *dims)
    assert s.name.startswith("sm90_decode_swapab") and s.epilogue.ops == ("bias", "silu_mul")
    s = with_ops(catalogue.get("sm120_default"), ("nvfp4_out",), *dims)
    assert s.name.startswith("sm120_default")
    s = with_ops(catalogue.get("sm120_grouped_decode"), ("nvfp4_out",), 64, 1536, 2048,
                 "nvfp4", 8)  # grouped: the grouped tile
    assert s.name.startswith("sm120_grouped+") and s.scheduler.grouped
    with pytest.raises(InputError, match="nvfp4_out on a packed weight"):
        with_ops(catalogue.get("sm90_rs_packed_decode"), ("nvfp4_out",), 16, 4096, 4096,
                 "bf16")


# ----------------------------------------------------------------------------- swiglu_oai

def _gptoss_apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' own GptOssExperts._apply_gate (gate and up alternating)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    class Cfg:
        intermediate_size, num_local_experts, hidden_size = 4, 1, 4

    return GptOssExperts._apply_gate(GptOssExperts(Cfg()), gate_up)


@pytest.mark.parametrize("group", [8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_oai_unfused_is_transformers_gate(group, dtype):
    """On the kernels' interleave, the same bits as transformers' ``_apply_gate`` on
    gpt-oss's alternating gate/up columns (values past the clamps, NaN included)."""
    g = torch.Generator().manual_seed(group)
    alt = (torch.randn(6, 4 * group, generator=g) * 6).to(dtype)
    alt[0, :8] = torch.tensor([9.0, 9.0, -9.0, -9.0, 7.0, 7.0, float("nan"), 1.0]).to(dtype)
    want = _gptoss_apply_gate(alt)
    grouped = regroup_gate_up(alt, group, dim=-1)
    got = swiglu_oai_unfused(grouped, group)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))
    assert torch.equal(deinterleave_gate_up(grouped, group)[0].view(torch.int16),
                       alt[:, 0::2].view(torch.int16))


def test_regroup_weights_and_bias_from_gptoss_order():
    """gpt-oss's gate_up weight rows and bias alternate gate and up; regrouped into the
    kernels' groups the GEMM's columns are the kernels' interleave of the same gate and up
    (torch, NVFP4 and MXFP4 weights, expert stacks; a bias along its last dim)."""
    g = torch.Generator().manual_seed(3)
    w, x, bias = torch.randn(2, 64, 64, generator=g), torch.randn(3, 64, generator=g), \
        torch.randn(2, 64, generator=g)
    for group in (8, 32):
        wg = regroup_gate_up(w, group)
        gate, up = deinterleave_gate_up(x @ wg[1].T + regroup_gate_up(bias, group, dim=-1)[1],
                                        group)
        full = x @ w[1].T + bias[1]
        torch.testing.assert_close(gate, full[:, 0::2])
        torch.testing.assert_close(up, full[:, 1::2])
        for fmt in ("nvfp4", "mxfp4"):
            q = quantize(w, format=fmt)
            r = regroup_gate_up(q, group)
            assert type(r) is type(q)
            assert torch.equal(r.dequantize(), regroup_gate_up(q.dequantize(), group))
    with pytest.raises(InputError, match="dim"):
        regroup_gate_up(w, 8, dim=0)


def test_swiglu_oai_op_rules():
    assert Epilogue(ops="swiglu_oai+bias").ops == ("bias", "swiglu_oai")
    assert gated_op(("bias", "swiglu_oai", "nvfp4_out")) == "swiglu_oai"
    assert gated_op(("bias",)) is None
    with pytest.raises(InputError, match="one gated activation"):
        Epilogue(ops=("silu_mul", "swiglu_oai"))
    s = catalogue.get("sm90_mxfp4_stream_grouped_decode").replace(ops=("bias", "swiglu_oai"))
    p = Problem(1, 5760, 2880, "bf16", groups=32, b_format="mxfp4")
    assert plan(s, p).ok  # gpt-oss-20b's gate_up: 2 x 2880 rows, hidden 2880, 32 experts
    bad = plan(s, Problem(1, 5768, 2880, "bf16", groups=32, b_format="mxfp4"))
    assert any("N = 5768 is not a multiple of 16: swiglu_oai" in r for r in bad.reasons)
    raw = torch.randn(4, 64)
    out = reference.fused(raw, None, ("swiglu_oai",), 8, torch.bfloat16)
    assert torch.equal(out, swiglu_oai_unfused(raw.bfloat16(), 8)) and out.shape == (4, 32)
