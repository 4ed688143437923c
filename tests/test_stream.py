"""The weight-streaming decode kernel (``mainloop=stream``) on the CPU: what plan() accepts
and refuses, the index arithmetic the kernel runs (against the packed layout and the 128x4
scale layout themselves), the "auto" picks, and the compile of both families' builds
(HMMA in SASS, no spills, shared memory == plan, the K loop's instruction budget).
"""

from __future__ import annotations

import pytest
import torch

from cute_fp4 import packed
from cute_fp4.api import heuristic, stream_decode_schedule
from cute_fp4.formats import sf_offset
from cute_fp4.kernels.stream import (
    expert_words,
    grouped_bound,
    scale_pair_index,
    scale_word_of,
    unit_word_index,
)
from cute_fp4.layers.common import resolve_layout
from cute_fp4.plan import plan
from cute_fp4.planning.stream import stream_schedule
from cute_fp4.schedule import Problem

TARGETS = ("sm_90a", "sm_120a", "sm_121a")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_plan_accepts_stream_on_every_family(target, fmt):
    for tm in (8, 16):
        for stages in (None, 1, 2, 4):
            s = stream_schedule(target, tm, 4, stages)
            pl = plan(s, Problem(1, 4096, 8192, fmt))
            assert pl.ok, pl.reasons
            assert pl.threads == 128 and pl.registers is None
            assert pl.stages == (stages or 2)
            assert pl.smem_bytes == 2 * 4 * pl.stages * (2048 + 256)



@pytest.mark.parametrize("target", TARGETS)
def test_plan_counts_eight_warps_over_the_k_units(target):
    for stages in (1, 2, 4):
        s = stream_schedule(target, 8, 1, stages, grouped=True, warps=8)
        pl = plan(s, Problem(4, 2880, 2880, "bf16", groups=4))
        if stages == 4 and target != "sm_90a":  # 147,456 B: past SM12x's 99 KiB
            assert pl.reasons[0].endswith("use stages <= 2"), pl.reasons
            continue
        assert pl.ok, pl.reasons
        assert pl.threads == 256
        assert pl.smem_bytes == 2 * 8 * stages * (2048 + 256)
    for warps in (2, 6, 16):
        pl = plan(stream_schedule(target, 8, warps=warps), Problem(1, 4096, 4096, "bf16"))
        assert not pl.ok and any("Warps(mma=(8, 1))" in r for r in pl.reasons), pl.reasons

@pytest.mark.parametrize("change, words", [
    (dict(tile=(32, 64, 64)), "tile (M, N, K)"),
    (dict(tile=(16, 128, 64)), "tile (M, N, K)"),
    (dict(mma=(2, 2)), "Warps(mma=(4, 1))"),
    (dict(roles="pingpong"), "Warps(mma=(4, 1))"),
    (dict(stages=9), "1..8"),
    (dict(persistent=True), "persistent=False"),
    (dict(epi_tile=(64, 32)), "epilogue tile"),
    (dict(sf_load="cp_async"), "sf_load"),
])
def test_plan_refuses_what_the_kernel_does_not_do(change, words):
    s = stream_schedule("sm_90a").replace(**change)
    pl = plan(s, Problem(1, 4096, 4096, "bf16"))
    assert not pl.ok and any(words in r for r in pl.reasons), pl.reasons


def test_plan_refuses_bad_problems_with_numbers():
    s = stream_schedule("sm_120a", split_k=8)
    (r,) = plan(s, Problem(1, 4096, 4096, "nvfp4")).reasons
    assert "16-bit activations" in r
    assert any("K = 4128 is not a multiple of 64" in r
               for r in plan(s, Problem(1, 4096, 4128, "bf16")).reasons)
    assert any("split_k 8 exceeds the 4 K units of K = 256" in r
               for r in plan(s, Problem(1, 4096, 256, "bf16")).reasons)
    dense = stream_schedule("sm_90a")
    assert any("needs a grouped schedule" in r
               for r in plan(dense, Problem(1, 4096, 4096, "bf16", groups=8)).reasons)


@pytest.mark.parametrize("target", TARGETS)
def test_plan_accepts_the_grouped_stream_kernel(target):
    s = stream_schedule(target, 8, grouped=True)
    pl = plan(s, Problem(8, 1536, 2048, "bf16", groups=128))
    assert pl.ok, pl.reasons
    assert pl.smem_bytes == 2 * 4 * 2 * (2048 + 256)
    assert plan(s, Problem(16 * 8, 4096, 7168, "fp16", groups=256)).ok


@pytest.mark.parametrize("change, words", [
    (dict(split_k=2), "grouped schedules do not split K"),
    (dict(persistent=True), "grouped=True"),
    (dict(raster="along_n"), "default raster"),
])
def test_plan_refuses_what_the_grouped_kernel_does_not_do(change, words):
    s = stream_schedule("sm_90a", 8, grouped=True).replace(**change)
    pl = plan(s, Problem(8, 1536, 2048, "bf16", groups=128))
    assert not pl.ok and any(words in r for r in pl.reasons), pl.reasons
    (r,) = plan(stream_schedule("sm_120a", 8, grouped=True),
                Problem(8, 1536, 2048, "nvfp4", groups=128)).reasons
    assert "16-bit activations" in r
    assert any("257 groups exceed" in r for r in plan(
        stream_schedule("sm_90a", 8, grouped=True),
        Problem(8, 1536, 2048, "bf16", groups=257)).reasons)


@pytest.mark.parametrize("n, k", [(8, 64), (136, 192), (1536, 2048), (2048, 768)])
def test_expert_strides_are_the_packed_stack(n, k):
    """The grouped kernel's stride between experts (weight words, scale bytes) is the
    packed stack's: expert e's bytes start where the kernel points."""
    import cute_fp4 as cf

    pw = packed.repack(cf.quantize(torch.randn(3, n, k)))
    assert pw.data[1].data_ptr() - pw.data[0].data_ptr() == 4 * expert_words(n, k // 2)
    assert pw.data[0].numel() == 4 * expert_words(n, k // 2)
    sf_bytes = (n + 127) // 128 * ((k // 2 + 31) // 32) * 512  # launch.grouped_tensors'
    assert pw.scale[0].numel() == sf_bytes
    assert pw.scale[1].data_ptr() - pw.scale[0].data_ptr() == sf_bytes


def _row_tiles(counts, tile_m):
    return sum(-(-c // tile_m) for c in counts)


@pytest.mark.parametrize("tile_m", [8, 16])
def test_grouped_grid_covers_every_valid_routing(tile_m):
    """grouped_bound: at least the units of every valid offset table (random routings,
    all rows to one expert, one row each, rows just past a tile), and exactly the routed
    units for top-8 of one token, one row per expert."""
    gen = torch.Generator().manual_seed(0)
    tiles_n = 24
    for experts in (1, 8, 128, 256):
        for m in (1, 7, 8, 9, 16, 17, 64, 128, 300):
            routings = [[m] + [0] * (experts - 1)]
            if m <= experts:
                routings.append([1] * m + [0] * (experts - m))
            if experts >= 2:
                routings.append([tile_m + 1, m - tile_m - 1] + [0] * (experts - 2)
                                if m > tile_m + 1 else [m] + [0] * (experts - 1))
            for _ in range(20):
                ids = torch.randint(0, experts, (m,), generator=gen)
                routings.append(torch.bincount(ids, minlength=experts).tolist())
            bound = grouped_bound(m, experts, tile_m, tiles_n)
            for counts in routings:
                assert sum(counts) == m
                assert _row_tiles(counts, tile_m) * tiles_n <= bound, (experts, m, counts)
    assert grouped_bound(8, 128, 8, tiles_n) == 8 * tiles_n  # 1 token x top-8
    assert grouped_bound(8, 256, 8, 64) == 8 * 64


@pytest.mark.parametrize("row_block", [0, 1, 2, 5])
def test_scale_pairs_are_the_blocked_layout(row_block):
    """Pair p of quad g: the words of rows 16 (p % 2) + 8 (p // 2) + g of row groups j and
    j + 2, adjacent in the 128x4 layout: both words' bytes are those sf_offset gives."""
    k_units = 7
    for ku in range(k_units):
        for pair in range(4):
            for quad in range(8):
                w = scale_pair_index(row_block, ku, k_units, pair, quad)
                for second in (0, 1):
                    j = pair % 2 + 2 * second
                    h = pair // 2
                    row = 64 * row_block + 16 * j + 8 * h + quad
                    assert 4 * (w + second) == sf_offset(row, 4 * ku, k_units)
                    assert scale_word_of(j, h) == 2 * pair + second


@pytest.mark.parametrize("k", [64 * 7, 64 * 8])
def test_mxfp4_scale_words_and_bytes_are_the_blocked_layout(k):
    """MXFP4: K unit ``ku`` reads the word pair of scale atom ``ku // 2`` (StreamGemm's
    ``_scale_atom``, a word per two units), shifted by 16 (ku % 2) bits, and K block kb of
    it byte ``kb // 2`` (scale_select): MXFP4's own offset of (row, K / 32 column)."""
    from cute_fp4.formats import MXFP4
    from cute_fp4.kernels.sm90_rs_wide import scale_select

    k_units, k_atoms = k // 64, -(-k // 128)
    for row_block in (0, 1, 3):
        for ku in range(k_units):
            for pair in range(4):
                for quad in range(0, 8, 3):
                    w = scale_pair_index(row_block, ku // 2, k_atoms, pair, quad)
                    for second in (0, 1):
                        j = pair % 2 + 2 * second
                        row = 64 * row_block + 16 * j + 8 * (pair // 2) + quad
                        for kb in range(4):
                            odd, half = scale_select(MXFP4, kb)
                            byte = 4 * (w + second) + 2 * (ku % 2) + 2 * half + int(odd)
                            assert byte == MXFP4.scale_offset(row, (64 * ku + 16 * kb) // 32, k)


def test_unit_words_are_the_packed_layout():
    """Lane l's words of row group j in unit (rb, ku) hold the fragment bytes of rows
    16 j + g (+8) of that unit: unpacking the words the kernel reads gives those rows."""
    n, k = 192, 256
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    words = packed.pack(data).view(torch.int32).flatten()
    k_units = k // 64
    for rb in range(n // 64):
        for ku in range(k_units):
            got = torch.stack([words[unit_word_index(rb, ku, k_units) + 128 * j + 4 * lane:][:4]
                               for j in range(4) for lane in range(32)])
            # the same 2,048 bytes as the packed tensor's unit, in the same order
            unit = packed.pack(data)[64 * rb:64 * rb + 64]  # row-block major units
            flat = unit.view(torch.int32).reshape(-1)
            assert torch.equal(got.flatten(), flat[ku * 512:(ku + 1) * 512])


@pytest.mark.parametrize("m, n, k, tm, split, stages", [
    (1, 8192, 8192, 8, 2, None), (4, 28672, 4096, 8, 1, 1), (16, 4096, 14336, 16, 4, None),
    (1, 1024, 4096, 8, 4, None), (9, 4096, 4096, 16, 4, None)])
def test_auto_picks_the_stream_kernel_at_decode(m, n, k, tm, split, stages):
    """The split, and one K unit per batch only where the grid is over 3 CTAs per SM
    (28672 x 4096: 448 CTAs on 132 SMs)."""
    s = stream_decode_schedule("sm_90a", m, n, k)
    assert (s.tile.m, s.split_k, s.stages) == (tm, split, stages)
    assert plan(s, Problem(m, n, k, "bf16")).ok
    picked = heuristic("sm120", m, n, k, packed=True, a_format="bf16", target="sm_120a")
    assert picked.mainloop.value == "stream" and picked.target == "sm_120a"


def test_w4a16_layers_hold_the_packed_weight_on_sm12x(monkeypatch):
    """NVFP4Linear's "auto" layout: packed where a kernel reads it (SM90 always; SM12x for
    W4A16, whose only kernel is the stream one), plain for SM12x W4A4 (block-scaled MMA)
    and where K is not a multiple of 64."""
    from types import SimpleNamespace


    for cc, mode, k, want in [((12, 0), "w4a16", 4096, "packed"), ((12, 1), "w4a16", 4096,
                                                                   "packed"),
                              ((12, 0), "w4a4", 4096, "plain"), ((12, 0), "w4a16", 4128,
                                                                 "plain"),
                              ((9, 0), "w4a4", 4096, "packed"), ((9, 0), "w4a16", 4096,
                                                                 "packed")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev, cc=cc: cc)
        w = SimpleNamespace(device=torch.device("cuda", 0), shape=(1024, k))
        assert resolve_layout("auto", mode, w.shape[1], w.device) == want, (cc, mode, k)


def test_plain_weight_w4a16_on_sm12x_says_to_repack(monkeypatch):
    from cute_fp4 import api, targets
    from cute_fp4.errors import InputError

    """16-bit activations with a plain weight on SM12x: a typed error naming the fix (the
    packed weight the stream kernel reads), not plan()'s refusal of the OMMA kernels."""
    fake = type("Dev", (), {"target": targets.get_target("sm_120a")})()
    monkeypatch.setattr(targets, "require_device", lambda *a, **k: fake)
    with pytest.raises(InputError, match="repack"):
        api.resolve_schedule("auto", 1, 4096, 4096, "bf16", torch.bfloat16)


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
def test_weights_are_the_only_reads_before_the_wait(target, tmp_path):
    """The launch's ``early`` flag in the SASS (``ACQBULK`` = griddepcontrol.wait,
    ``PREEXIT`` = launch_dependents): a wait taken only when the flag is off comes before
    any global access; then the ring's cp.async (``LDGSTS``: the weight and its scale
    words) and nothing else up to the wait every thread passes before the activations,
    alpha and the split-K counters are read; the release after that wait (one kernel at
    most runs ahead)."""
    import re

    from test_pdl_sass import GLOBAL, _ops

    from cute_fp4.compile import compile_report

    s = stream_decode_schedule(target, 1, 8192, 8192)
    assert s.split_k > 1  # the split-K store's counters come after the wait too
    row = compile_report(s, target, Problem(1, 8192, 8192, "bf16"), dump_dir=str(tmp_path))
    assert row["ok"], row.get("reason")
    sass = next(tmp_path.glob("*.sass")).read_text()
    (fn,) = re.split(r"Function : ", sass)[1:]
    ops = [op for op in _ops(fn) if op != "LDGDEPBAR"]  # cp.async.commit_group: no access
    release = ops.index("PREEXIT")
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    first_global = next(i for i, op in enumerate(ops) if GLOBAL.match(op))
    assert waits[0] < first_global, "the flag-off wait comes after a global access"
    wait = max(i for i in waits if i < release)
    assert wait > first_global, "no wait between the ring's loads and the release"
    before = [op for op in ops[:wait] if GLOBAL.match(op)]
    assert before and all(op.startswith(("LDGSTS", "UBLKPF")) for op in before), before
    assert not [op for op in ops[wait:release] if GLOBAL.match(op)]


def _perf_module(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    perf = Path(__file__).resolve().parents[1] / "perf"
    if str(perf) not in sys.path:
        sys.path.insert(0, str(perf))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, perf / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_read_floor_reads_the_weight_bytes_and_early_weights_sets_only_the_stream_flag():
    """perf/read_floor.py imports without a GPU and counts a weight's bytes as the bench
    does; decode_bench.early_weights sets the launch's early flag (Operands.early) for
    dense stream kernels only, and only inside the block."""
    from types import SimpleNamespace

    from cute_fp4 import bench, catalogue
    from cute_fp4.compile import CompiledGemm
    from cute_fp4.operands import Operands

    rf = _perf_module("read_floor")
    assert rf.weight_bytes(8192, 8192) == bench.weight_bytes(8192, 8192, "nvfp4")
    assert all(per_sm >= 0 and block % 512 == 0 for per_sm, block, _ in rf.CONFIGS)
    assert rf.busy_us([{"start": 0, "end": 3}, {"start": 2, "end": 5},
                       {"start": 7, "end": 8}]) == 6
    db = _perf_module("decode_bench")
    ops = Operands(*range(6))
    plain = CompiledGemm.raw_args
    CompiledGemm.raw_args = lambda self, o: o.early
    try:
        kinds = {"dense": stream_schedule("sm_90a"),
                 "grouped": stream_schedule("sm_90a", 8, grouped=True),
                 "tma": catalogue.get("sm90_default")}
        with db.early_weights():
            got = {k: CompiledGemm.raw_args(SimpleNamespace(schedule=s), ops)
                   for k, s in kinds.items()}
        assert got == {"dense": True, "grouped": False, "tma": False}
        assert CompiledGemm.raw_args(SimpleNamespace(), ops) is False
    finally:
        CompiledGemm.raw_args = plain
