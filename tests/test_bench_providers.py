"""The bench providers' plumbing on the CPU: QuACK absent is reported as unavailable (never
a crash), a provider that raises or writes a wrong output is recorded as such, the QuACK
provider's call convention (against a stand-in module), the operands every provider
shares, the byte formulas, and perf/sm90_vs_quack.py's cases, candidates, bars and
markdown. Nothing here times anything: speed is measured in perf/, never asserted."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from cute_fp4 import bench
from cute_fp4.bench import (
    QUACK_W4A16,
    TORCH_BF16,
    TORCH_FP8,
    BenchOperands,
    Prepared,
    Provider,
    Unavailable,
    bench_operands,
    measure,
    nbytes,
    provider_status,
    weight_bytes,
)
from cute_fp4.errors import CuteFp4Error
from cute_fp4.nvfp4 import e2m1_decode, unpack_e2m1

ROOT = Path(__file__).resolve().parent.parent


class OnceTimer:
    """Stands in for bench.Timer on the CPU: one call, a fixed time."""

    def __init__(self, us: float = 10.0):
        self.us, self.calls = us, 0

    def timed(self, fn):
        self.calls += 1
        return self.us, fn()


@pytest.fixture(scope="module")
def ops() -> BenchOperands:
    return bench_operands(3, 96, 128, seed=5, device="cpu")


def _provider(prepare, exact=True, name="fake") -> Provider:
    return Provider(name, "bf16", "bf16", exact, "a test provider", lambda: None, prepare)


@pytest.fixture
def no_quack(monkeypatch):
    """An interpreter where ``import quack`` fails, whether or not it is installed."""
    for mod in [m for m in sys.modules if m == "quack" or m.startswith("quack.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "quack", None)  # import raises ModuleNotFoundError


# ----------------------------------------------------------------------------- providers

def test_quack_absent_is_unavailable_not_a_crash(no_quack, ops):
    why = provider_status()["quack_w4a16"]
    assert why is not None and "not importable" in why and "cute-fp4[bench]" in why
    row = measure(QUACK_W4A16, ops, OnceTimer())
    assert row["status"].startswith("unavailable: quack-kernels is not importable")
    assert "us" not in row and "check" not in row


def test_status_that_raises_is_reported(ops):
    def broken():
        raise RuntimeError("driver on fire")

    got = provider_status([_provider(None)._replace(status=broken)])
    assert got == {"fake": "status check failed: RuntimeError: driver on fire"}


def test_torch_bf16_is_the_same_exact_gemm(ops):
    timer = OnceTimer(us=4.0)
    row = measure(TORCH_BF16, ops, timer)
    assert timer.calls == 1
    assert row["status"] == "ok" and row["check"] == "ok", row
    assert 0 < row["err_over_bound"] <= 1 and row["nonfinite"] == 0
    m, n, k = ops.mnk
    assert row["us"] == 4.0
    assert row["weight_TB/s"] == round(2 * n * k / 4.0 / 1e6, 3)
    assert row["TFLOP/s"] == round(2 * m * n * k / 4.0 / 1e6, 1)


def test_fp8_without_a_gpu_is_unavailable(ops):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    row = measure(TORCH_FP8, ops, OnceTimer())
    assert row["status"].startswith("unavailable: ") and "us" not in row


def test_wrong_outputs_are_recorded(ops):
    m, n, _ = ops.mnk
    zeros = _provider(lambda o: Prepared(lambda: torch.zeros(m, n, dtype=torch.bfloat16), {}))
    nan = _provider(lambda o: Prepared(
        lambda: torch.full((m, n), float("nan"), dtype=torch.bfloat16), {}))
    inexact = zeros._replace(exact=False)
    r = measure(zeros, ops, OnceTimer())
    assert r["status"] == "ok" and r["check"] == "FAIL" and r["err_over_bound"] > 1
    assert r["rel_err"] == pytest.approx(1.0)  # every element is off by the whole result
    r = measure(nan, ops, OnceTimer())
    assert r["check"] == "FAIL" and r["nonfinite"] == m * n
    assert measure(inexact, ops, OnceTimer())["check"] == "inexact"


def test_raising_providers_are_rows_not_exceptions(ops):
    def boom(o):
        raise RuntimeError("CUDA error: an illegal instruction was encountered")

    def refuse(o):
        raise Unavailable("K = 96 is not a multiple of 64")

    def call_fails(o):
        return Prepared(lambda: (_ for _ in ()).throw(ValueError("bad launch")), {})

    assert measure(_provider(boom), ops, OnceTimer())["status"] == \
        "error: RuntimeError: CUDA error: an illegal instruction was encountered"
    assert measure(_provider(refuse), ops, OnceTimer())["status"] == \
        "unavailable: K = 96 is not a multiple of 64"
    timer = OnceTimer()
    assert measure(_provider(call_fails), ops, timer)["status"] == "error: ValueError: bad launch"
    assert timer.calls == 0  # the failing first call is not timed


def _fake_quack(calls: list) -> types.ModuleType:
    """A stand-in for ``quack.gemm_w4`` that checks how it is called and computes the
    product exactly (the layout of its blob is its own business: here, padded rows)."""
    def prepare_w4_weight(q, sf=None, wformat="qtip2s"):
        calls.append(("prepare", q.dtype, tuple(q.shape), sf.dtype, tuple(sf.shape), wformat))
        pad = -q.shape[0] % 128
        qp = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        sfp = torch.cat([sf.view(torch.uint8), sf.new_zeros(pad, sf.shape[1]).view(torch.uint8)])
        return qp.reshape(qp.shape[0] // 64, 64, -1), sfp

    def gemm_w4a16(act, blob, sf=None, tensor_scale=1.0, out=None, n_out=None,
                   wformat="qtip2s", **kw):
        calls.append(("gemm", act.dtype, type(tensor_scale), wformat, tuple(out.shape)))
        q = blob.reshape(-1, blob.shape[-1])
        vals = e2m1_decode(unpack_e2m1(q), torch.float64)
        scales = sf.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
        out.copy_((act.double() @ (vals * scales).T * tensor_scale).to(out.dtype))
        return out

    mod = types.ModuleType("quack.gemm_w4")
    mod.prepare_w4_weight, mod.gemm_w4a16 = prepare_w4_weight, gemm_w4a16
    return mod


def test_quack_provider_call_convention(monkeypatch, ops):
    calls = []
    pkg = types.ModuleType("quack")
    pkg.gemm_w4 = _fake_quack(calls)
    monkeypatch.setitem(sys.modules, "quack", pkg)
    monkeypatch.setitem(sys.modules, "quack.gemm_w4", pkg.gemm_w4)
    row = measure(QUACK_W4A16._replace(status=lambda: None), ops, OnceTimer())
    m, n, k = ops.mnk
    assert row["status"] == "ok" and row["check"] == "ok", row
    assert row["n_padded"] == 128  # N = 96 padded by the repack; the check saw [M, 96]
    assert calls[0] == ("prepare", torch.uint8, (n, k // 2), torch.float8_e4m3fn,
                        (n, k // 16), "nvfp4")
    assert calls[1] == ("gemm", torch.bfloat16, float, "nvfp4", (m, 128))


def test_quack_provider_refuses_k_not_a_multiple_of_64(monkeypatch):
    pkg = types.ModuleType("quack")
    pkg.gemm_w4 = _fake_quack([])
    monkeypatch.setitem(sys.modules, "quack", pkg)
    monkeypatch.setitem(sys.modules, "quack.gemm_w4", pkg.gemm_w4)
    odd = bench_operands(2, 64, 96, device="cpu")
    row = measure(QUACK_W4A16._replace(status=lambda: None), odd, OnceTimer())
    assert row["status"] == "unavailable: QuACK's NVFP4 repack needs K a multiple of 64, K = 96"


def test_cli_bench_peer_rows(no_quack, ops, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: FP8 would run")
    said = set()
    rows, base = bench._peer_rows(ops, OnceTimer(us=2.0), said)
    assert [r["schedule"] for r in rows] == ["torch_bf16"] and rows[0]["check"] == "ok"
    assert base == {"torch_bf16": 2.0} and said == {"torch_fp8", "quack_w4a16"}
    err = capsys.readouterr().err
    assert "torch_fp8 unavailable" in err and "quack_w4a16 unavailable" in err
    bench._peer_rows(ops, OnceTimer(), said)
    assert capsys.readouterr().err == ""  # said once per run
    row = bench._row("s", "bf16", 3, 96, 128, 1.0, types.SimpleNamespace(
        target=types.SimpleNamespace(peak_tflops=989.0), mem_bw_gbs=4800.0),
        {"torch_bf16": 2.0, "quack_w4a16": 1.5})
    assert row["x_bf16"] == 2.0 and row["x_quack"] == 1.5 and "x_fp8" not in row


# ----------------------------------------------------------------------------- operands

def test_operands_share_one_weight(ops):
    m, n, k = ops.mnk
    assert (m, n, k) == (3, 96, 128)
    assert ops.a16.dtype == torch.bfloat16 and ops.activation("bf16") is ops.a16
    assert ops.activation("fp16").dtype == torch.float16
    assert ops.activation("nvfp4") is ops.a4 and ops.a4.shape == (m, k)
    # a4 is the NVFP4 quantization of a16: within one E2M1 step of each block's scale
    err = (ops.a4.dequantize() - ops.a16.float()).abs().max()
    assert 0 < float(err) <= float(ops.a16.float().abs().max()) / 6
    again = bench_operands(3, 96, 128, seed=5, device="cpu")
    assert torch.equal(again.b.data, ops.b.data) and torch.equal(again.a16, ops.a16)
    with pytest.raises(CuteFp4Error, match="unknown A format 'int8'"):
        ops.activation("int8")


def test_byte_formulas():
    m, n, k = 16, 8192, 8192
    assert nbytes(m, n, k, "bf16") == n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2
    assert nbytes(m, n, k, "quack_w4a16") == nbytes(m, n, k, "cute_fp4_w4a16")
    assert nbytes(m, n, k, "cute_fp4_w4a4") == n * k // 2 + n * k // 16 + m * k // 2 + \
        m * k // 16 + m * n * 2
    assert nbytes(m, n, k, "torch_bf16") == 2 * n * k + 2 * m * k + 2 * m * n
    assert weight_bytes(n, k, "quack_w4a16") == 9 * n * k // 16
    assert weight_bytes(n, k, "torch_fp8") == n * k
    with pytest.raises(ValueError):
        nbytes(m, n, k, "int8")
    assert bench.FORMULAS["flop"] == "2*M*N*K"


def test_bench_extra_names_quack():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["bench"] == ["quack-kernels"]


# ----------------------------------------------------------------------------- the script

@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sm90_vs_quack",
                                                  ROOT / "perf" / "sm90_vs_quack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cases_are_issue_11s(script):
    full = script.cases(quick=False)
    assert len(full) == 21 and full[0] == (8192, 8192, 1) and full[-1] == (4096, 14336, 8192)
    assert {(n, k) for n, k, _ in full} == {(8192, 8192), (28672, 4096), (4096, 14336)}
    assert sorted({m for *_, m in full}) == [1, 16, 64, 256, 1024, 4096, 8192]
    assert script.cases(quick=True) == [(8192, 8192, m) for m in (1, 16, 256, 4096)]


def test_candidates_plan_ok_and_stay_few(script):
    from cute_fp4.plan import plan
    from cute_fp4.schedule import OutDtype, Problem

    for m in (1, 64, 256, 4096):
        for fmt in ("bf16", "nvfp4"):
            got = script.candidates(m, 8192, 8192, fmt, "regime")
            assert 1 <= len(got) <= 3
            assert all(s.name in script.regime_names(m) for s in got)
            assert all(plan(s, Problem(m, 8192, 8192, fmt)).ok for s in got)
            assert all(s.epilogue.out_dtype is OutDtype.BF16 for s in got)
    assert script.candidates(1, 8192, 8192, "bf16", "none") == []
    extra = script.candidates(4096, 8192, 8192, "bf16", "none", ["sm90_nonpersistent_fp32"])
    assert [s.name for s in extra] == ["sm90_nonpersistent_fp32"]
    assert extra[0].epilogue.out_dtype is OutDtype.BF16  # timed as BF16 like the rest
    with pytest.raises(ValueError, match="--candidates"):
        script.candidates(1, 8192, 8192, "bf16", "most")


def _row(us, check="ok", name="s", **kw):
    return {"provider": "cute_fp4_w4a16", "us": us, "check": check, "schedule_name": name,
            "err_over_bound": 0.5, "nonfinite": 0, **kw}


def _case(script, m=1, quack=20.4, a16=24.5, best16=18.0, a4=26.0, check="ok"):
    case = {"N": 8192, "K": 8192, "M": m,
            "peers": {"torch_bf16": _row(33.9, provider="torch_bf16"),
                      "torch_fp8": {"provider": "torch_fp8",
                                    "status": "error: RuntimeError: M = 1"},
                      "quack_w4a16": _row(quack, provider="quack_w4a16") if quack else
                      {"status": "unavailable: quack-kernels is not importable"}},
            "cute": {"w4a16": {"auto": _row(a16, check, "auto16", **{"weight_TB/s": 1.5}),
                               "candidates": [_row(best16, name="fast",
                                                   **{"weight_TB/s": 2.1}),
                                              _row(5.0, "FAIL", name="wrong")]},
                     "w4a4": {"auto": _row(a4, name="auto4"), "candidates": []}}}
    return script._finish(case)


def test_best_skips_failed_outputs_and_ratios(script):
    case = _case(script)
    assert case["cute"]["w4a16"]["best"]["schedule_name"] == "fast"  # not the 5 us FAIL
    r = case["ratios"]
    assert r["w4a16_auto_x_quack"] == round(20.4 / 24.5, 3)
    assert r["w4a16_best_x_quack"] == round(20.4 / 18.0, 3)
    assert r["w4a16_best_x_fp8"] is None  # FP8 did not run
    assert r["w4a4_over_w4a16_best"] == round(26.0 / 18.0, 3)
    case["peers"]["quack_w4a16"]["check"] = "FAIL"  # a peer's time counts regardless
    assert script.ratios(case)["w4a16_best_x_quack"] == round(20.4 / 18.0, 3)


def test_bars_verdicts(script):
    got = {(b["bar"], b["variant"]): b for b in script.bars([_case(script)])}
    q = "W4A16 >= 1.10x QuACK W4A16"
    assert got[(q, "auto")]["verdict"] == "missed" and got[(q, "best")]["verdict"] == "met"
    assert got[("M <= 16: W4A16 >= 3.3 TB/s of weight", "best")]["value"] == 2.1
    assert got[("M <= 16: W4A16 >= 2.2x torch BF16", "best")]["verdict"] == "missed"
    a4 = "W4A4 within 10% of W4A16 (time ratio <= 1.10)"
    assert got[(a4, "auto")]["verdict"] == "met"  # 26.0 / 24.5 = 1.06
    assert got[(a4, "best")]["verdict"] == "missed"  # 26.0 / 18.0
    assert not any("M >= 1024" in bar for bar, _ in got)  # M = 1
    bad = {(b["bar"], b["variant"]): b for b in script.bars([_case(script, check="FAIL")])}
    assert bad[(q, "auto")]["verdict"].startswith("invalid")
    gone = {(b["bar"], b["variant"]): b for b in script.bars([_case(script, quack=None)])}
    assert gone[(q, "best")]["verdict"].startswith("n/a")
    big = script.bars([_case(script, m=4096, a16=800.0, best16=700.0, a4=760.0)])
    assert any(b["bar"].startswith("M >= 1024") for b in big)
    summary = {(s["bar"], s["variant"]): s for s in script.bar_summary(big)}
    assert summary[(q, "auto")]["missed"] == 1 and summary[(q, "auto")]["met"] == 0


def test_markdown_records_the_run(script):
    cases = [_case(script), _case(script, m=4096, a16=800.0, best16=700.0, a4=760.0)]
    res = {"env": {"date": "2026-12-02T00:00:00+00:00", "gpu": "NVIDIA H200",
                   "driver": "580.1", "torch": "2.11", "cuda": "13.0", "cute_dsl": "4.8.1",
                   "quack_kernels": "0.6.5"},
           "formulas": bench.FORMULAS, "method": "graph replay",
           "providers": {p.name: {"what": p.what, "status": None} for p in bench.PEERS},
           "config": {"candidates": "regime", "schedules": [], "budget_s": 330},
           "cases": cases, "skipped": [], "elapsed_s": 12.0}
    res["bars"] = script.bars(cases)
    res["bar_summary"] = script.bar_summary(res["bars"])
    md = script.render_md(res)
    for needle in ("NVIDIA H200", "driver: 580.1", "quack_kernels: 0.6.5", "2*M*N*K",
                   "N*K/2 (weight) + N*K/16 (scales) + M*K*2 (activations) + M*N*2 (output)",
                   "| 8192x8192 | 1 | 33.9 | err | 20.4 | 24.5 | 18.0 | 26.0 | 26.0 |",
                   "W4A16 >= 1.10x QuACK W4A16", "8192x8192 M=1 torch_fp8: error",
                   "8192x8192 M=1 cute_fp4_w4a16 wrong: FAIL"):
        assert needle in md, needle
    text = script.text_table(script.SHORT, script.table_rows(cases))
    assert len(text.splitlines()) == 3 and max(map(len, text.splitlines())) <= 100


def test_script_without_an_sm90_gpu_exits_2(script, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this would run the benchmark")
    assert script.main(["--out", str(tmp_path / "o"), "--quick"]) == 2
    assert "needs an SM90 GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture
def stand_ins(monkeypatch, no_quack, script):
    """main() on the CPU: an SM90 device, a timer that calls once, small CPU operands and
    a cute_fp4 provider computing the exact product (the real one is in tests/gpu)."""
    from cute_fp4 import reference, targets

    dev = targets.Device(0, "NVIDIA H200 (stand-in)", (9, 0), 132, targets.TARGETS["sm_90a"],
                         4800.0)
    monkeypatch.setattr(targets, "detect_device", lambda index=None: dev)
    ticks = iter(range(1, 10_000))

    class CountingTimer:
        def __init__(self, reps=20, flush=True):
            pass

        def timed(self, fn):
            return float(next(ticks)), fn()

    def fake_cute(schedule, a_format):
        label = schedule if isinstance(schedule, str) else schedule.name

        def prepare(o):
            a = o.activation(a_format)
            return Prepared(lambda: reference.gemm(a, o.b, out_dtype=torch.bfloat16),
                            {"schedule_name": label, "schedule_key": label})

        name = "cute_fp4_w4a4" if a_format == "nvfp4" else "cute_fp4_w4a16"
        return Provider(name, a_format, a_format, True, "stand-in", lambda: None, prepare)

    monkeypatch.setattr(bench, "Timer", CountingTimer)
    monkeypatch.setattr(bench, "cute_fp4_provider", fake_cute)
    monkeypatch.setattr(bench, "bench_operands",
                        lambda m, n, k, seed=0: bench_operands(m, n, k, seed, device="cpu"))
    monkeypatch.setattr(script, "cases", lambda quick: [(64, 128, 1), (64, 128, 1024)])


def test_script_main_end_to_end(stand_ins, script, tmp_path, capsys):
    import json

    assert script.main(["--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "sm90_vs_quack.json").read_text())
    assert [c["M"] for c in res["cases"]] == [1, 1024] and res["skipped"] == []
    assert res["env"]["cute_fp4_sources"] and res["formulas"]["flop"] == "2*M*N*K"
    assert res["providers"]["quack_w4a16"]["status"].startswith("quack-kernels is not")
    for c in res["cases"]:
        assert c["peers"]["torch_bf16"]["check"] == "ok"
        assert c["peers"]["quack_w4a16"]["status"].startswith("unavailable")
        for fmt in ("w4a16", "w4a4"):
            slot = c["cute"][fmt]
            assert slot["auto"]["check"] == "ok" and slot["candidates"]  # regime ones ran
            assert slot["best"]["us"] == min(r["us"] for r in [slot["auto"],
                                                               *slot["candidates"]])
    verdicts = {b["verdict"] for b in res["bars"]}
    assert verdicts <= {"met", "missed", "n/a (a side is missing: see the table)"}
    assert any(b["bar"].startswith("M >= 1024") for b in res["bars"])
    md = (tmp_path / "sm90_vs_quack.md").read_text()
    assert "NVIDIA H200" in md or "gpu: None" in md  # env from torch, absent on a CPU
    assert "| 64x128 | 1024 |" in md and "## Issue 11's bars" in md
    out = capsys.readouterr().out
    assert "64x128  1024" in out and "wrote" in out


def test_script_budget_skips_but_writes(stand_ins, script, tmp_path):
    import json

    assert script.main(["--out", str(tmp_path), "--budget-s", "0"]) == 0
    res = json.loads((tmp_path / "sm90_vs_quack.json").read_text())
    first = [x for x in res["skipped"] if x.endswith(" auto") or "cute_fp4" not in x]
    assert len(first) == 2 * (3 + 2)  # 2 cases x (3 peers + 2 auto), then the candidates
    assert len(res["skipped"]) > len(first)
    assert all(r["status"] == "skipped: time budget" for r in res["cases"][0]["peers"].values())
    assert "skip" in (tmp_path / "sm90_vs_quack.md").read_text()


def test_script_unknown_schedule_is_a_usage_error(stand_ins, script, tmp_path, capsys):
    assert script.main(["--out", str(tmp_path), "--schedules", "sm90_defualt"]) == 2
    assert "sm90_default" in capsys.readouterr().err  # did you mean
