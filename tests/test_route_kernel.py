"""The routing kernel (``cute_fp4.kernels.route``, ``cute_fp4.sorting``) without a GPU: a
model of its algorithm (per-warp counts by ``match.any`` rounds, one scan in (bucket, warp)
order) against torch's ``route`` on many shapes, its cross-compiles for sm_90a and sm_120a,
its launch arguments, and the choice ``route`` makes between it and torch's ops. On a GPU:
tests/gpu/test_routing.py."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from cubins import one_kernel

from cute_fp4 import quant, sorting
from cute_fp4.errors import DeviceError, InputError
from cute_fp4.layers import routing
from cute_fp4.targets import reference_execution

THREADS = sorting.default_spec("sm_90a").threads


# ----------------------------------------------------------------------------- model

def model_route(ids: list[int], k: int, e: int, threads: int = THREADS):
    """The kernel's algorithm step by step on Python ints (see its module docstring)."""
    n = len(ids)
    rounds = -(-n // threads)
    chunk = 32 * rounds
    aw = -(-n // chunk)
    bucket = [min(max(v, -1), e) + 1 for v in ids]
    hist = [0] * ((e + 2) * aw)
    rank = [0] * n
    for w in range(aw):
        for r in range(rounds):
            lanes = [i for i in range(w * chunk + 32 * r, w * chunk + 32 * r + 32) if i < n]
            before = {b: hist[b * aw + w] for b in (bucket[i] for i in lanes)}
            for i in lanes:  # match.any: the group's lanes below i
                rank[i] = before[bucket[i]] + sum(bucket[j] == bucket[i] for j in lanes
                                                  if j < i)
            for b, c in collections.Counter(bucket[i] for i in lanes).items():
                hist[b * aw + w] += c
    run = 0
    for j, c in enumerate(hist):  # exclusive scan
        hist[j], run = run, run + c
    order, inverse, token = [None] * n, [None] * n, [None] * n
    for i in range(n):
        p = hist[bucket[i] * aw + i // chunk] + rank[i]
        inverse[i], order[p], token[p] = p, i, i // k
    offsets = [hist[(j + 1) * aw] for j in range(e + 1)]
    return [torch.tensor(v, dtype=dt) for v, dt in ((order, torch.int64),
                                                     (inverse, torch.int64),
                                                     (token, torch.int64),
                                                     (offsets, torch.int32))]


SHAPES = [(t, k, e) for t in (1, 2, 3, 16, 64, 255) for k in (1, 2, 4, 8) for e in (1, 4, 32, 128)
          if t * k <= sorting.MAX_PAIRS]


@pytest.mark.parametrize("t, k, e", SHAPES, ids=[f"T{t}-k{k}-E{e}" for t, k, e in SHAPES])
def test_model_equals_torch_route(t, k, e):
    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    for ids in (torch.randint(0, e, (t, k), generator=g),  # many ties
                torch.randint(0, min(e, 3), (t, k), generator=g),  # a few hot experts
                torch.full((t, k), e - 1)):  # every pair on one expert
        want = routing.route(ids, e, method="torch")
        got = model_route(ids.flatten().tolist(), k, e)
        for name, a, b in zip(want._fields, want, got, strict=True):
            assert torch.equal(a, b), (name, ids.tolist())


@pytest.mark.parametrize("n", [sorting.MAX_PAIRS, 257, 33])
def test_model_at_the_limits_and_out_of_range(n):
    """Several rounds per warp, E = MAX_EXPERTS; ids out of range: offsets as torch's, the
    negative ids first and those >= E last, each group in pair order."""
    e = sorting.MAX_EXPERTS
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 5, (n,), generator=g)
    assert all(torch.equal(a, b) for a, b in zip(routing.route(ids.view(n, 1), e, method="torch"),
                                                  model_route(ids.tolist(), 1, e)))
    ids = torch.randint(-3, 12, (n,), generator=g)
    small = 8
    want = routing.route(ids.view(n, 1), small, method="torch")
    order, inverse, token, offsets = model_route(ids.tolist(), 1, small)
    assert torch.equal(offsets, want.offsets)
    assert torch.equal(order, torch.sort(ids.clamp(-1, small), stable=True).indices)
    assert torch.equal(inverse[order], torch.arange(n)) and torch.equal(token, order)


def test_model_can_fail():
    """A model that drops the within-round rank gives other positions: the comparison
    above can fail."""
    ids = [3, 3, 1, 3]
    good = model_route(ids, 1, 4)[0].tolist()
    assert good == [2, 0, 1, 3]
    assert sorted(ids, key=lambda v: -v) != [ids[i] for i in good]


# ----------------------------------------------------------------------------- compile

COMPILE_CASES = [(t, d) for t in ("sm_90a", "sm_120a") for d in ("int32", "int64")]


@pytest.mark.compile
@pytest.mark.parametrize("target, id_dtype", COMPILE_CASES,
                         ids=[f"{t}-{d}" for t, d in COMPILE_CASES])
def test_kernel_compiles(target, id_dtype, tmp_path):
    """One kernel, no spills, the warp match and shuffles the algorithm rests on, four CTA
    barriers, no global atomics, one load per round of the ids' width."""
    spec = sorting.default_spec(target, id_dtype)
    sorting.cross_compile_route(spec, dump_dir=str(tmp_path))
    rep, ops = one_kernel(tmp_path)
    assert rep.spills == 0 and rep.registers <= 64, rep
    assert sum(op.startswith("MATCH.ANY") for op in ops) == spec.rounds, ops
    assert sum(op.startswith("SHFL.UP") for op in ops) == 5
    assert sum(op.startswith("BAR.SYNC") for op in ops) == 4
    assert not any(op.startswith(("ATOM", "RED")) for op in ops)
    wide = 8 if id_dtype == "int64" else 4
    loads = [op for op in ops if op.startswith("LDG")]
    assert len(loads) == spec.rounds and all(("64" in op) == (wide == 8) for op in loads), loads


def test_spec_validation():
    from cute_fp4.kernels.route import RouteSpec

    assert RouteSpec().rounds == 4 and RouteSpec().smem_bytes == 4 * (1026 * 8 + 8)
    for bad in ({"id_dtype": "int16"}, {"threads": 48}, {"max_pairs": 300},
                {"max_experts": 0}, {"max_experts": 4096}):
        with pytest.raises(ValueError):
            RouteSpec(**bad)
    assert sorting.default_spec("sm_121a").target == "sm_121a"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_launch_arguments_match_the_compiled_signature(dtype):
    from cute_fp4.kernels.route import RouteKernel

    kern = sorting.route_kernel(sorting.default_spec("sm_90a", sorting._DTYPES[dtype]))
    assert isinstance(kern, RouteKernel)
    ids = torch.zeros(12, dtype=dtype)
    outs = [torch.zeros(12, dtype=torch.int64) for _ in range(3)]
    offsets = torch.zeros(33, dtype=torch.int32)
    fake = kern.fake_args()
    real = kern.runtime_args(ids, *outs, offsets, 4, fake[-1])
    raw = kern.raw_args(ids, *outs, offsets, 4, 0x5000)
    assert len(fake) == len(real) == len(raw) == 9
    for f, r in zip(fake[:5], real[:5], strict=True):
        assert (f.dtype, f._assumed_align) == (r.dtype, r._assumed_align)
    assert [r._pointer for r in real[:5]] == list(raw[:5])
    assert [int(v) for v in real[5:8]] == list(raw[5:8]) == [12, 4, 32] and raw[8] == 0x5000


# ----------------------------------------------------------------------------- the choice

def _cuda_ids(n: int):
    """What ``kernel_applies`` reads of a tensor, on cuda:0."""
    return types.SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: n)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(quant._TARGETS, 0, "sm_90a")


def test_kernel_applies_within_the_limits(fake_gpu, monkeypatch):
    n, e = sorting.MAX_PAIRS, sorting.MAX_EXPERTS
    assert sorting.kernel_applies(_cuda_ids(n), e)
    assert sorting.kernel_applies(_cuda_ids(1), 1)
    assert not sorting.kernel_applies(_cuda_ids(n + 1), e)
    assert not sorting.kernel_applies(_cuda_ids(n), e + 1)
    assert not sorting.kernel_applies(_cuda_ids(0), e)
    assert not sorting.kernel_applies(torch.zeros(4, dtype=torch.int64), 8)  # the CPU
    with reference_execution():
        assert not sorting.kernel_applies(_cuda_ids(8), 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(sorting, "reference_mode", _untraceable)  # never reached then
    assert not sorting.kernel_applies(_cuda_ids(8), 8)


def _untraceable():
    raise AssertionError("kernel_applies read more than is_compiling under torch.compile")


def test_kernel_applies_only_on_the_current_device_of_a_known_gpu(fake_gpu, monkeypatch):
    other = types.SimpleNamespace(device=torch.device("cuda", 1), numel=lambda: 8)
    assert not sorting.kernel_applies(other, 8)
    monkeypatch.setitem(quant._TARGETS, 0, None)  # a GPU without kernels here
    assert not sorting.kernel_applies(_cuda_ids(8), 8)


def test_route_takes_the_kernel_where_it_applies(monkeypatch):
    """``route`` calls ``sort_pairs`` exactly where ``kernel_applies``; "torch" never does,
    "kernel" raises where it does not apply; bad methods are typed errors."""
    calls = []

    def fake_sort(flat, k, e):
        calls.append((tuple(flat.shape), k, e))
        return tuple(torch.full((flat.numel(),), -1) for _ in range(3)) + (torch.zeros(e + 1),)

    ids = torch.tensor([[1, 0], [1, 1]])
    monkeypatch.setattr(sorting, "sort_pairs", fake_sort)
    monkeypatch.setattr(sorting, "kernel_applies", lambda flat, e: e <= 4)
    assert routing.route(ids, 4).order.tolist() == [-1] * 4 and calls == [((4,), 2, 4)]
    assert routing.route(ids, 5).order.tolist() == [1, 0, 2, 3]  # torch's, stable
    assert routing.route(ids, 4, method="torch").order.tolist() == [1, 0, 2, 3]
    assert routing.route(ids, 4, method="kernel").order.tolist() == [-1] * 4
    assert len(calls) == 2
    with pytest.raises(DeviceError, match="does not apply"):
        routing.route(ids, 5, method="kernel")
    with pytest.raises(InputError, match="method"):
        routing.route(ids, 4, method="cuda")


def test_route_on_the_cpu_is_torchs():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    r = routing.route(ids, 3)
    assert r.order.tolist() == [1, 4, 3, 0, 2, 5]
    assert r.inverse.tolist() == [3, 0, 4, 2, 1, 5]
    assert r.token.tolist() == [0, 2, 1, 0, 1, 2]
    assert r.offsets.tolist() == [0, 2, 3, 6] and r.offsets.dtype == torch.int32
    with pytest.raises(DeviceError):
        routing.route(ids, 3, method="kernel")


def test_sort_pairs_checks_sizes_and_outputs():
    with pytest.raises(InputError, match="pairs"):
        sorting.sort_pairs(torch.zeros(sorting.MAX_PAIRS + 1, dtype=torch.int64), 1, 4)
    with pytest.raises(InputError, match="int32/int64"):
        sorting.sort_pairs(torch.zeros(4, dtype=torch.int16), 1, 4)
    shapes = ((4, torch.int64),) * 3 + ((5, torch.int32),)
    good = [torch.empty(m, dtype=dt) for m, dt in shapes]
    sorting._check_out(good, shapes, torch.device("cpu"))
    with pytest.raises(InputError, match="offsets"):
        sorting._check_out(good[:3] + [torch.empty(4, dtype=torch.int32)], shapes,
                           torch.device("cpu"))
    buf = torch.empty(8, dtype=torch.int64)
    with pytest.raises(InputError, match="overlap"):
        sorting._check_out([buf[:4], buf[2:6], good[2], good[3]], shapes, torch.device("cpu"))
