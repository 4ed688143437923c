"""perf/render_docs.py: docs/performance.md is the render of perf/results/ (re-run the
script after adding results), the latest run of a benchmark is shown and not the best,
and a benchmark without a run yet (decode_bench) renders once its file appears."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("render_docs",
                                                  ROOT / "perf" / "render_docs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_performance_page_is_the_render_of_the_results():
    rd = _module()
    assert (ROOT / "docs" / "performance.md").read_text() == rd.render(), \
        "docs/performance.md is out of date: run python perf/render_docs.py"


def _host(us: float, date: str | None = None) -> dict:
    d = {"mode": "gpu", "calls": 200, "rows": [
        {"m": 1, "n": 8192, "k": 8192, "call_path": "tvm-ffi", "host_us": {"gemm": us}}]}
    if date:
        d["env"] = {"date": date}
    return d


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_latest_run_is_shown_not_the_best(tmp_path, monkeypatch):
    rd = _module()
    monkeypatch.setattr(rd, "RESULTS", tmp_path)
    sec = next(s for s in rd.SECTIONS if s.pattern.endswith("host_overhead*.json"))
    # its own date wins over the folder's name
    _write(tmp_path / "2026-12-05-x" / "host_overhead.json", _host(5.0, "2026-12-01T09:00"))
    _write(tmp_path / "2026-12-02-y" / "host_overhead.json", _host(9.0, "2026-12-02 10:00"))
    [(path, data)] = rd.latest(sec, tmp_path)
    assert path.parent.name == "2026-12-02-y" and data["rows"][0]["host_us"]["gemm"] == 9.0
    # a file without a date takes its folder's newest; then the higher callN wins
    _write(tmp_path / "2026-12-03-z" / "quant.json", {"env": {"date": "2026-12-03T08:00:00"},
                                                      "rows": []})
    _write(tmp_path / "2026-12-03-z" / "host_overhead.json", _host(1.0))
    _write(tmp_path / "2026-12-03-z" / "host_overhead-call6.json", _host(12.0))
    [(path, data)] = rd.latest(sec, tmp_path)
    assert path.name == "host_overhead-call6.json"
    assert rd.run_time(path, data) == ("2026-12-03T08:00:00", 6, "host_overhead-call6.json")
    # a CPU-mode file is not this benchmark's run
    _write(tmp_path / "2026-12-09-cpu" / "host_overhead.json", {**_host(0.5), "mode": "stub"})
    assert rd.latest(sec, tmp_path)[0][0].name == "host_overhead-call6.json"
    page = rd.render(tmp_path)
    assert "12.0" in page and "host_overhead-call6.json" in page and "| 1.0 |" not in page


def test_decode_bench_renders_when_its_file_appears(tmp_path, monkeypatch):
    rd = _module()
    monkeypatch.setattr(rd, "RESULTS", tmp_path)
    assert "Decode GEMMs: no run yet (`python perf/decode_bench.py`)" in rd.render(tmp_path)
    rows = [{"provider": p, "M": m, "N": 8192, "K": 8192, "status": "ok", "check": "ok",
             "w4a4_check": "ok", "cold_us": t, "warm_us": t / 2, "floor_peak_us": 7.46}
            for m in (1, 4) for p, t in (("torch_bf16", 35.0), ("quack_w4a16", 24.0),
                                         ("nvfp4linear_w4a16", 20.0),
                                         ("nvfp4linear_w4a4", 22.0))]
    rows[6]["check"] = "FAIL"  # M = 4's W4A16 output failed: no ratio for it
    _write(tmp_path / "2026-12-03-h200-decode" / "decode_bench.json",
           {"rows": rows, "env": {"gpu": "NVIDIA H200"}, "date": "2026-12-03",
            "formulas": {"weight_bytes": "N*K/2 + N*K/16", "peak_TB/s": 4.8}})
    page = rd.render(tmp_path)
    assert "## Decode GEMMs" in page and "Decode GEMMs: no run yet" not in page
    assert "| 8192 x 8192 | 1 | 35.0 | 24.0 | 20.0 | 1.75x | 1.20x | 22.0 | 1.10x | 7.46 |" \
        in page
    assert "| 8192 x 8192 | 4 | 35.0 | 24.0 | FAIL | FAIL | FAIL | 22.0 | FAIL | 7.46 |" in page
