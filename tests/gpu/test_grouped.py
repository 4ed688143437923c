"""The grouped (MoE) GEMM on a GPU through the host layer (``cute_fp4.grouped``): every
grouped catalogue schedule available for the device (sm_90a schedules natively on SM90;
sm_120a schedules through the emulated MMA on SM90, natively on SM12x) against the exact
reference (``reference.check_grouped``) with NaN-poisoned outputs.

Routings: ragged, empty experts (first and last included), one token per expert, every token
to one expert, total_M = 1, totals not a multiple of the tile, a prefill-sized ragged one;
K tails (32, 96, 160 for the plain weight, 64, 192, 320 for rs_packed), N tails (8, 72),
E = 1, 8, 16, 128. FP16 and BF16 activations for W4A16, NVFP4 for W4A4, each where plan()
accepts it (else skipped with the plan's reason); reruns bit-identical; FP16/FP32 outputs;
``grouped_gemm`` itself ("auto", check=True, total_M = 0, the refusals on a GPU, no sync,
torch.compile); a CUDA graph of ``grouped_gemm(out=...)`` replayed with changed offsets.
Offsets that break the contract (past the end, negative, decreasing, offsets[0] != 0) with
guard rows around ``a`` and ``out``: nothing outside them is read or written, and
``validate_offsets=True`` / ``check=True`` name the bad entry before launching.
Every test runs under a watchdog: a hang ends the run with a message (a failure).
"""

from __future__ import annotations

import pytest
import torch

import cute_fp4 as cf
from cute_fp4 import catalogue, operands, packed, reference, run, tuning
from cute_fp4.bench import capture_graph
from cute_fp4.compile import Signature, compile, compile_emulated  # noqa: A004
from cute_fp4.errors import InputError, OffsetsError
from cute_fp4.kernels.scheduler import group_rows
from cute_fp4.nvfp4 import NVFP4Tensor, scale_shape
from cute_fp4.plan import plan
from cute_fp4.schedule import Mainloop, Problem
from gpu import selection

pytestmark = pytest.mark.gpu("sm90", "sm120")

WATCHDOG_S = 300
GROUPED = [s for s in catalogue.all_schedules() if s.scheduler.grouped]
K_TAILS = {False: (32, 96, 160, 512), True: (64, 192, 320, 512)}  # by reads_packed


def _ragged(n_exp: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi + 1, (n_exp,), generator=g).tolist()


def _decode(n_exp: int, tokens: int, top_k: int, seed: int) -> list[int]:
    """Token counts per expert of ``tokens`` tokens routed to ``top_k`` distinct experts."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(tokens)])
    return torch.bincount(picks.flatten(), minlength=n_exp).tolist()


# (name, token counts per expert, N, index into K_TAILS)
CASES = [
    ("ragged", _ragged(8, 40, 1), 256, 3),
    ("empty_first_last", [0, 5, 17, 0, 3, 9, 2, 0], 256, 3),
    ("one_token_each", [1] * 16, 136, 2),
    ("all_to_one", [0, 0, 0, 300, 0, 0, 0, 0], 256, 1),
    ("total_m_1", [0, 0, 0, 0, 0, 1, 0, 0], 136, 3),
    ("tile_tails", [129, 17, 255, 1], 264, 3),
    ("prefill", [512, 300, 0, 1024, 7, 130, 0, 64], 256, 3),
    ("k_tail_0", _ragged(8, 40, 2), 256, 0),
    ("k_tail_1", _ragged(8, 40, 3), 136, 1),
    ("k_tail_2", _ragged(8, 40, 4), 72, 2),
    ("n_8", _ragged(8, 40, 5), 8, 3),
    ("n_72", _ragged(8, 40, 6), 72, 3),
    ("e_1", [77], 256, 3),
    ("e_128_ragged", _ragged(128, 12, 7), 256, 2),
    ("e_128_decode", _decode(128, 16, 8, 8), 512, 3),
]


# ----------------------------------------------------------------------------- helpers

def _emulated(s) -> bool:
    return s.arch.family == "sm120" and selection.family() == "sm90"


def _require_runnable(s) -> None:
    if s.arch.family == "sm90" and selection.family() != "sm90":
        pytest.skip(f"{s.name} is an sm_90a schedule; this GPU is {selection.target().name}")
    if s.mainloop is Mainloop.STREAM and s.arch.family != selection.family():
        pytest.skip(f"{s.name}: the stream kernel has no emulated build; it is one kernel "
                    "for both families, tested here as this GPU's own schedule")


def _formats(s) -> list[str]:
    return selection.grouped_formats(s)


def _kernel(s, fmt: str, n_exp: int = 8):
    """The compiled grouped kernel (emulated for an SM120 schedule on SM90); skipped with
    the plan's reasons when plan() refuses the format."""
    _require_runnable(s)
    p = plan(s, Problem(a_format=fmt, groups=n_exp))
    if not p.ok:
        pytest.skip(f"plan() refuses {s.name} for {fmt}: {'; '.join(p.reasons)}")
    return compile_emulated(s, Signature(fmt)) if _emulated(s) else compile(s, Signature(fmt))


def _awkward(*shape, seed: int) -> torch.Tensor:
    """Rows spanning 2^-6..2^6, 5% zero blocks, 2% blocks 16x larger (as make_operands)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x *= torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=g).float())
    blocks = x.view(*shape[:-1], shape[-1] // 16, 16)
    blocks[torch.rand(*shape[:-1], shape[-1] // 16, generator=g) < 0.05] = 0.0
    blocks[torch.rand(*shape[:-1], shape[-1] // 16, generator=g) < 0.02] *= 16.0
    return x


def _offsets(counts) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def make_case(s, fmt: str, counts, n: int, k: int, seed: int = 0):
    """(a, b, offsets) on the GPU: b quantized as a 3-D stack (packed for rs_packed)."""
    total = sum(counts)
    b = cf.quantize(_awkward(len(counts), n, k, seed=seed + 1).cuda())
    if s.mainloop.reads_packed:
        b = packed.repack(b)
    return _activations(fmt, total, k, seed), b, _offsets(counts)


def _activations(fmt: str, total: int, k: int, seed: int = 0):
    """[total, K] activations on the GPU (NVFP4 or 16-bit); total = 0 gives an empty one."""
    if fmt == "nvfp4" and total == 0:  # quantize() refuses an empty tensor
        return NVFP4Tensor(torch.zeros(0, k // 2, dtype=torch.uint8, device="cuda"),
                           torch.zeros(scale_shape(0, k), dtype=torch.float8_e4m3fn,
                                       device="cuda"), 1.0)
    x = _awkward(max(total, 1), k, seed=seed)[:total].cuda()
    if fmt == "nvfp4":
        return cf.quantize(x)
    dt = torch.bfloat16 if fmt == "bf16" else torch.float16
    peak = x.abs().max().clamp(min=1e-30) if total else 1.0  # max() of nothing raises
    return (x / peak).to(dt)


def poisoned_run(kern, a, b, offsets, n: int, alpha=None):
    out = torch.full((int(offsets[-1]), n), float("nan"), dtype=kern.out_dtype, device="cuda")
    run.run_grouped(kern, a, b, offsets, out=out, alpha=alpha)
    torch.cuda.synchronize()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _params():
    out = []
    for s in GROUPED:
        for fmt in _formats(s):
            for name, counts, n, ki in CASES:
                out.append(pytest.param(s, fmt, counts, n, ki, id=f"{s.name}-{fmt}-{name}"))
    return out


# ----------------------------------------------------------------------------- kernels

def test_there_are_grouped_schedules_for_both_families():
    fams = {s.arch.family for s in GROUPED}
    assert {"sm90", "sm120"} <= fams, [s.name for s in GROUPED]


@pytest.mark.parametrize("s, fmt, counts, n, ki", _params())
def test_grouped_matches_reference(s, fmt, counts, n, ki):
    k = K_TAILS[s.mainloop.reads_packed][ki]
    kern = _kernel(s, fmt, len(counts))
    p = plan(kern.schedule, Problem(m=sum(counts), n=n, k=k, a_format=fmt, groups=len(counts)))
    if not p.ok:
        pytest.skip(f"plan() refuses this problem: {'; '.join(p.reasons)}")
    a, b, offs = make_case(s, fmt, counts, n, k, seed=n + k + len(counts))
    poison = torch.full((sum(counts), n), float("nan"), dtype=kern.out_dtype, device="cuda")
    assert not reference.check_grouped(poison, a, b, offs).passed  # the poison is detectable
    out = poisoned_run(kern, a, b, offs, n)
    res = reference.check_grouped(out, a, b, offs)
    assert res.passed, f"{s.name} {fmt} E={len(counts)} N={n} K={k}: {res}"
    again = poisoned_run(kern, a, b, offs, n)
    assert torch.equal(bits(out), bits(again)), "rerun not bit-identical"


@pytest.mark.parametrize("s", GROUPED, ids=lambda s: s.name)
@pytest.mark.parametrize("out_dtype", ["fp16", "fp32"])
def test_other_output_dtypes_and_alpha(s, out_dtype):
    fmt = _formats(s)[0]
    kern = _kernel(s.replace(out_dtype=out_dtype), fmt)
    counts, n = [0, 33, 1, 150, 0, 7, 64, 0], 136
    k = K_TAILS[s.mainloop.reads_packed][1]
    a, b, offs = make_case(s, fmt, counts, n, k, seed=11)
    out = poisoned_run(kern, a, b, offs, n)
    assert reference.check_grouped(out, a, b, offs).passed
    alpha = torch.linspace(0.25, 4.0, len(counts), device="cuda")
    out = poisoned_run(kern, a, b, offs, n, alpha=alpha)
    res = reference.check_grouped(out, a, b, offs, alpha)
    assert res.passed, res
    assert not reference.check_grouped(out, a, b, offs).passed  # alpha really applied


@pytest.mark.parametrize("s", GROUPED, ids=lambda s: s.name)
def test_no_tokens_launches_nothing(s):
    fmt = _formats(s)[0]
    kern = _kernel(s, fmt)
    a, b, offs = make_case(s, fmt, [0] * 4, 64, K_TAILS[s.mainloop.reads_packed][0])
    assert offs.tolist() == [0] * 5
    got = run.run_grouped(kern, a, b, offs)
    assert got.shape == (0, 64) and got.dtype == kern.out_dtype
    out = torch.empty(0, 64, dtype=kern.out_dtype, device="cuda")
    assert run.run_grouped(kern, a, b, offs, out=out) is out


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("s", GROUPED, ids=lambda s: s.name)
def test_cuda_graph_replays_with_changed_offsets(s):
    fmt = _formats(s)[0]
    kern = _kernel(s, fmt)
    n, k = 136, K_TAILS[s.mainloop.reads_packed][3]
    routes = [[25] * 8, [0, 100, 0, 50, 0, 0, 49, 1], [0, 0, 0, 0, 0, 0, 0, 200],
              [200, 0, 0, 0, 0, 0, 0, 0]]
    a, b, offs = make_case(s, fmt, routes[0], n, k, seed=21)
    out = torch.empty(200, n, dtype=kern.out_dtype, device="cuda")
    native = not _emulated(s)

    def call():
        if native:  # the public API, as a model's forward would call it
            return cf.grouped_gemm(a, b, offs, schedule=s, out=out)
        return run.run_grouped(kern, a, b, offs, out=out)

    g, got = capture_graph(call, warmups=2)
    assert got is out
    eager = {}
    for counts in routes:
        offs.copy_(_offsets(counts))  # same shape, new values: no recapture
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        res = reference.check_grouped(out, a, b, offs)
        assert res.passed, f"{s.name} replay with {counts}: {res}"
        eager[tuple(counts)] = out.clone()
    for counts, replayed in eager.items():  # replays equal eager runs bit for bit
        offs.copy_(_offsets(counts))
        assert torch.equal(bits(poisoned_run(kern, a, b, offs, n)), bits(replayed)), counts


# ----------------------------------------------------------------------------- the API

def _native_auto():
    """(schedule "auto" names here, its first A format) on this GPU."""
    return selection.grouped_auto()


def test_auto_grouped_gemm_with_check():
    s, fmt = _native_auto()
    counts, n, k = _ragged(16, 30, 31), 264, 512
    a, b, offs = make_case(s, fmt, counts, n, k, seed=31)
    out = torch.full((sum(counts), n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = cf.grouped_gemm(a, b, offs, out=out, check=True)
    assert y is out and reference.check_grouped(out, a, b, offs).passed
    family = selection.family()
    picked = tuning.grouped_auto_name(family, operands.check_grouped_operands(
        a, b, offs, out, None))  # auto depends on the rows per expert
    kern = compile(tuning.resolve_grouped(picked), Signature(fmt))
    assert kern.validated  # check=True validated the kernel auto picked
    alloc = cf.grouped_gemm(a, b, offs)  # allocated output, same bits
    assert alloc.shape == (sum(counts), n) and torch.equal(bits(alloc), bits(out))
    for dt in (torch.float16, torch.float32):
        y = cf.grouped_gemm(a, b, offs, out_dtype=dt)
        assert y.dtype == dt and reference.check_grouped(y, a, b, offs).passed
    empty = cf.grouped_gemm(_activations(fmt, 0, k), b, torch.zeros_like(offs))
    assert empty.shape == (0, n)  # no tokens: nothing launched


def test_refusals_on_the_gpu_leave_output_untouched():
    s, fmt = _native_auto()
    a, b, offs = make_case(s, fmt, [3, 0, 9, 4], 128, 256, seed=41)
    out = torch.full((16, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    before = out.clone()
    plain = b.unpack() if isinstance(b, packed.PackedNVFP4Weight) else b
    wrong_layout = plain if s.mainloop is Mainloop.RS_PACKED else packed.repack(plain)
    match = "repack" if s.mainloop is Mainloop.RS_PACKED else "plain weight layout"
    with pytest.raises(InputError, match=match):
        cf.grouped_gemm(a, wrong_layout, offs, out=out)
    with pytest.raises(InputError, match="offsets is on cpu"):
        cf.grouped_gemm(a, b, offs.cpu(), out=out)
    with pytest.raises(InputError, match=r"offsets must be \[E \+ 1\] = \[5\]"):
        cf.grouped_gemm(a, b, offs[:4], out=out)
    with pytest.raises(InputError, match="not a grouped schedule"):
        cf.grouped_gemm(a, b, offs, out=out, schedule=f"{s.arch.family}_default")
    torch.cuda.synchronize()
    assert torch.equal(out, before)


def test_no_call_syncs_with_the_gpu():
    s, fmt = _native_auto()
    a, b, offs = make_case(s, fmt, _ragged(8, 40, 51), 256, 512, seed=51)
    out = torch.empty(int(offs[-1]), 256, dtype=torch.bfloat16, device="cuda")
    alpha = torch.ones(8, device="cuda")
    for kw in ({}, {"out": out}, {"alpha": alpha}, {"alpha": 0.5}):  # warm: compile, memos
        cf.grouped_gemm(a, b, offs, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            cf.grouped_gemm(a, b, offs)
            cf.grouped_gemm(a, b, offs, out=out)
            cf.grouped_gemm(a, b, offs, out=out, alpha=alpha)
            cf.grouped_gemm(a, b, offs, alpha=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_torch_compile_runs_the_op():
    s, fmt = _native_auto()
    counts, n, k = [4, 0, 11, 1, 0, 30, 2, 8], 72, 192
    a, b, offs = make_case(s, fmt, counts, n, k, seed=61)
    eager = cf.grouped_gemm(a, b, offs)
    f = torch.compile(lambda x, w, o: cf.grouped_gemm(x, w, o), backend="eager",
                      fullgraph=True)
    got = f(a, b, offs)
    assert torch.equal(bits(got), bits(eager))
    assert reference.check_grouped(got, a, b, offs).passed


def test_w4a4_on_a_packed_stack_runs_on_the_block_values():
    """W4A4 with "auto" on a packed stack (sm_90a): decoded to the activation's exact BF16
    block values, then the W4A16 grouped kernel (run.via_values): the same products as
    the reference over the routings, with the default and a given alpha, in a graph with
    changed offsets, and bit-identical reruns."""
    selection.skip_unless_packed()
    for name, counts, n, ki in CASES[:6]:
        k = K_TAILS[True][ki]
        a = _activations("nvfp4", sum(counts), k, seed=70)
        b = packed.repack(cf.quantize(_awkward(len(counts), n, k, seed=71).cuda()))
        offs = _offsets(counts)
        dims = operands.check_grouped_operands(a, b, offs, None, None)
        assert run.via_values("auto", dims.a_format, dims.packed)
        out = torch.full((sum(counts), n), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = cf.grouped_gemm(a, b, offs, out=out)
        assert y is out and reference.check_grouped(out, a, b, offs).passed, name
        assert torch.equal(bits(cf.grouped_gemm(a, b, offs)), bits(out)), name
        alpha = torch.rand(len(counts), device="cuda") + 0.5
        y = cf.grouped_gemm(a, b, offs, alpha=alpha, check=True)
        assert reference.check_grouped(y, a, b, offs, alpha).passed, name
    counts = [3, 0, 9, 4]
    a = _activations("nvfp4", 16, 256, seed=72)
    b = packed.repack(cf.quantize(_awkward(4, 136, 256, seed=73).cuda()))
    offs = _offsets(counts)
    out = torch.full((16, 136), float("nan"), dtype=torch.bfloat16, device="cuda")
    g, _ = capture_graph(lambda: cf.grouped_gemm(a, b, offs, out=out))
    offs.copy_(_offsets([0, 10, 0, 6]))
    g.replay()
    torch.cuda.synchronize()
    assert reference.check_grouped(out, a, b, offs).passed


def test_quantize_stack_on_the_gpu_is_per_expert():
    x = _awkward(6, 136, 320, seed=71).cuda()
    t = cf.quantize(x)
    assert t.device.type == "cuda" and t.global_scale.device.type == "cuda"
    for e in range(6):
        r = cf.quantize(x[e])
        te = t.expert(e)
        assert torch.equal(te.data, r.data) and torch.equal(bits(te.scale), bits(r.scale))
        assert torch.equal(te.global_scale, r.global_scale)


# ----------------------------------------------------------------------------- bad offsets

BAD_M = 300  # total_M of the bad-offset cases (3 experts)
GUARD = 64  # guard rows before and after a and out
# name -> (offsets, index and value the validation names)
BAD_OFFSETS = {
    "last_past_end": ([0, 100, 200, BAD_M + 300], 3, BAD_M + 300),
    "negative": ([0, 100, -50, BAD_M], 2, -50),
    "decreasing": ([0, 250, 40, BAD_M], 2, 40),
    "first_not_zero": ([37, 100, 200, BAD_M], 0, 37),
    "first_negative": ([-200, 100, 200, BAD_M], 0, -200),
    "all_past_end": ([400, 500, 600, 700], 0, 400),
}


def _bad_cases():
    out = []
    for s in GROUPED:
        for fmt in ("bf16", "nvfp4") if s.arch.family == "sm90" else ("nvfp4",):
            for name in BAD_OFFSETS:
                out.append(pytest.param(s, fmt, name, id=f"{s.name}-{fmt}-{name}"))
    return out


def _guarded_activations(fmt: str, x: torch.Tensor):
    """(a over rows GUARD .. GUARD + M of a larger buffer, the float rows, its global scale):
    16-bit guards are NaN, NVFP4 guards 0xFF codes and NaN (0x7F) scale bytes, so a value
    read from a guard makes an output row non-finite or wrong."""
    m, k = x.shape
    if fmt != "nvfp4":
        dt = torch.bfloat16 if fmt == "bf16" else torch.float16
        big = torch.full((GUARD + m + GUARD, k), float("nan"), dtype=dt, device="cuda")
        big[GUARD:GUARD + m] = x.to(dt)
        return big[GUARD:GUARD + m], big
    q = cf.quantize(x)
    data = torch.full((GUARD + m + GUARD, k // 2), 0xFF, dtype=torch.uint8, device="cuda")
    data[GUARD:GUARD + m] = q.data
    sf = q.scale.view(torch.uint8).reshape(-1)
    pad = 128 * 16  # bytes of guard scales before and after (whole 128-row atoms' worth)
    sbig = torch.full((pad + sf.numel() + pad,), 0x7F, dtype=torch.uint8, device="cuda")
    sbig[pad:pad + sf.numel()] = sf
    scale = sbig[pad:pad + sf.numel()].view(torch.float8_e4m3fn).view(q.scale.shape)
    a = NVFP4Tensor._unchecked(data[GUARD:GUARD + m], scale, q.global_scale, (m, k))
    return a, (data, sbig)


def _sub_activations(fmt: str, x: torch.Tensor, gs, lo: int, hi: int):
    """Rows lo .. hi of the activations, as an operand of their own (NVFP4: quantized with
    the same global scale, so its rows equal those of the whole tensor)."""
    if fmt != "nvfp4":
        return x[lo:hi].to(torch.bfloat16 if fmt == "bf16" else torch.float16)
    return cf.quantize(x[lo:hi], gs)


@pytest.mark.parametrize("s, fmt, name", _bad_cases())
def test_bad_offsets_stay_inside_a_and_out(s, fmt, name):
    """Whatever the offsets hold, nothing outside ``a`` is read and nothing outside
    ``out`` is written: guards around both keep their sentinels, no output row is
    non-finite, rows no expert's clamped range covers keep their poison, and where the
    clamped ranges do not overlap the rows they cover match the exact reference of those
    ranges."""
    kern = _kernel(s, fmt, 3)
    offsets, _, _ = BAD_OFFSETS[name]
    n, k = 136, K_TAILS[s.mainloop.reads_packed][1]
    x = (_awkward(BAD_M, k, seed=81) / 64).cuda()
    a, guards = _guarded_activations(fmt, x)
    _, b, _ = make_case(s, "bf16", [1, 1, 1], n, k, seed=82)
    offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    sentinel = 7.0
    big = torch.full((GUARD + BAD_M + GUARD, n), sentinel, dtype=kern.out_dtype, device="cuda")
    out = big[GUARD:GUARD + BAD_M]
    out.fill_(float("nan"))
    guards_before = [g.clone() for g in (guards if isinstance(guards, tuple) else (guards,))]
    run.run_grouped(kern, a, b, offs, out=out)
    torch.cuda.synchronize()
    assert bool((big[:GUARD] == sentinel).all()), f"{name}: a row before out was written"
    assert bool((big[GUARD + BAD_M:] == sentinel).all()), f"{name}: a row after out was written"
    for g0, g1 in zip(guards_before, guards if isinstance(guards, tuple) else (guards,)):
        assert torch.equal(g0.view(torch.uint8), g1.view(torch.uint8))  # a's buffer unchanged
    ranges = [group_rows(offsets[g], offsets[g + 1], BAD_M) for g in range(3)]
    covered = torch.zeros(BAD_M, dtype=torch.bool)
    for lo, hi in ranges:
        covered[lo:hi] = True
    rows_nan = out.isnan().any(dim=1).cpu()
    assert bool(rows_nan[~covered].all()), f"{name}: a row no expert owns was written"
    assert not bool(rows_nan[covered].any()), f"{name}: an expert's row is unwritten/NaN"
    assert bool(out[covered.cuda()].isfinite().all()), f"{name}: a guard value was read"
    spans = [(lo, hi) for lo, hi in ranges if hi > lo]
    disjoint = all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    if spans and disjoint:  # the covered rows, one contiguous run: check them exactly
        lo0, hi1 = spans[0][0], spans[-1][1]
        sub = torch.tensor([min(max(lo - lo0, 0), hi1 - lo0) for lo, _ in ranges]
                           + [hi1 - lo0], dtype=torch.int32, device="cuda")
        sub[1:-1] = torch.tensor([hi - lo0 for _, hi in ranges[:-1]], dtype=torch.int32)
        a_sub = _sub_activations(fmt, x, getattr(a, "global_scale", None), lo0, hi1)
        res = reference.check_grouped(out[lo0:hi1], a_sub, b, sub)
        assert res.passed, f"{name}: {res}"


@pytest.mark.parametrize("name", sorted(BAD_OFFSETS))
def test_validate_offsets_names_the_bad_entry(name):
    s, fmt = _native_auto()
    offsets, index, value = BAD_OFFSETS[name]
    n, k = 136, 256
    a = _activations(fmt, BAD_M, k, seed=91)
    _, b, _ = make_case(s, fmt, [1, 1, 1], n, k, seed=92)
    offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    out = torch.full((BAD_M, n), 7.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(OffsetsError, match=rf"offsets\[{index}\] = {value}\b") as e:
        cf.grouped_gemm(a, b, offs, out=out, validate_offsets=True)
    assert (e.value.index, e.value.value) == (index, value)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())  # nothing launched
    valid = torch.tensor([0, 100, 200, BAD_M], dtype=torch.int32, device="cuda")
    y = cf.grouped_gemm(a, b, valid, validate_offsets=True)  # a valid table passes
    assert reference.check_grouped(y, a, b, valid).passed


def test_check_true_validates_the_offsets_first(monkeypatch):
    s, fmt = _native_auto()
    n, k = 136, 256
    a = _activations(fmt, BAD_M, k, seed=93)
    _, b, _ = make_case(s, fmt, [1, 1, 1], n, k, seed=94)
    offs = torch.tensor(BAD_OFFSETS["negative"][0], dtype=torch.int32, device="cuda")
    out = torch.full((BAD_M, n), 7.0, dtype=torch.bfloat16, device="cuda")
    dims = operands.check_grouped_operands(a, b, offs, out, None)
    kern = compile(tuning.resolve_grouped(tuning.grouped_auto_name(selection.family(), dims)),
                   Signature(fmt))
    monkeypatch.setattr(kern, "validated", False)  # the call check=True validates
    with pytest.raises(OffsetsError, match=r"offsets\[2\] = -50 is negative"):
        cf.grouped_gemm(a, b, offs, out=out, check=True)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())
