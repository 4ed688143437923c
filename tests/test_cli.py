"""The CLI on a machine without a GPU: tables, plans, refusals, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cute_fp4.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedules_table(capsys):
    code, out, _ = run(capsys, "schedules")
    assert code == 0 and "sm120_default" in out and "sm100_style_256x128x256" in out
    code, out, _ = run(capsys, "schedules", "--json")
    rows = json.loads(out)
    assert {r["name"] for r in rows} >= {"sm120_default", "sm120_pingpong"}


def test_plan_ok_and_refused(capsys):
    code, out, _ = run(capsys, "plan", "sm120_default")
    assert code == 0 and "89,088 B of 101,376 B" in out
    code, out, _ = run(capsys, "plan", "sm100_style_256x128x256")
    assert code == 1 and "REFUSED" in out and "121,856 B" in out
    code, out, _ = run(capsys, "plan", "sm120_default", "--target", "sm_121a")
    assert code == 0 and "sm_121a" in out
    code, out, _ = run(capsys, "plan", "sm120_default", "--shape", "1", "4096", "48")
    assert code == 1 and "K = 48" in out


def test_compile_json_reports_refusal_without_compiling(capsys):
    code, out, _ = run(capsys, "compile", "sm100_style_256x128x256", "--json")
    (row,) = json.loads(out)
    assert code == 1 and row["ok"] is False and "121,856 B" in row["reason"]
    assert row["tile"] == [256, 128, 256] and row["smem_limit"] == 101_376


@pytest.mark.parametrize("argv, needle", [
    (["plan", "no_such_schedule"], "no schedule named 'no_such_schedule'"),
    (["plan", "sm120_default", "--target", "sm_90a"], "cannot be compiled for sm_90a"),
    (["plan", "sm120_default", "--target", "sm_75"], "unknown target 'sm_75'"),
    (["compile", "sm120_default", "--target", "sm_999"], "unknown target"),
])
def test_errors_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="GPU present")
@pytest.mark.parametrize("cmd", [["validate", "sm120_default"], ["bench"], ["tune"]])
def test_gpu_commands_say_no_gpu(capsys, cmd):
    code, out, err = run(capsys, *cmd)
    assert code == 2 and "no CUDA GPU" in err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["plan"], ["bench", "--shapes", "1,2"],
                                  ["compile", "--target"]])
def test_bad_arguments(capsys, argv):
    if argv == ["bench", "--shapes", "1,2"]:
        code, _, err = run(capsys, *argv)  # parsed, then refused with a message
        assert code == 2 and ("M,N,K" in err or "no CUDA GPU" in err)
        return
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_help_on_every_subcommand():
    for sub in ("schedules", "plan", "compile", "validate", "bench", "tune", "demo"):
        r = subprocess.run([sys.executable, "-m", "cute_fp4.cli", sub, "--help"],
                           capture_output=True, text=True)
        assert r.returncode == 0 and "usage: cute-fp4" in r.stdout


def test_compile_all_fails_on_a_compile_error(capsys, monkeypatch):
    import sys

    from cute_fp4.errors import CompileError

    host = sys.modules["cute_fp4.compile"]  # the package binds the name to the function

    def broken(*a, **k):
        raise CompileError("CuTe DSL failed on x: boom")

    monkeypatch.setattr(host, "cross_compile", broken)
    code, out, _ = run(capsys, "compile", "--all", "--target", "sm_121a", "--json")
    rows = json.loads(out)
    assert code == 1 and any("boom" in r.get("reason", "") for r in rows)
    assert all(not r["ok"] for r in rows)


def test_roofline_plot_from_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from cute_fp4.bench import plot_roofline
    from cute_fp4.targets import TARGETS, Device

    dev = Device(0, "H200 (stand-in)", (9, 0), 132, TARGETS["sm_90a"], 4800.0)
    rows = [{"M": m, "N": 8192, "K": 8192, "schedule": s, "A": a, "TFLOP/s": t}
            for m, s, a, t in [(1, "torch_bf16", "-", 3.6), (1, "sm90_decode_swapab", "nvfp4",
                                                                 4.9), (4096, "sm90_default",
                                                                        "nvfp4", 480.0)]]
    out = tmp_path / "roof.png"
    plot_roofline(rows, str(out), dev)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_readme_example_runs_up_to_the_gpu_call():
    """The README's Python example, on the CPU: everything before the GEMM runs as written;
    the GEMM itself says plainly that it needs a GPU."""
    from pathlib import Path

    import torch

    from cute_fp4.errors import DeviceError

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'device="cuda"' in code and "cf.gemm(" in code
    code = code.replace('device="cuda"', 'device="cpu"')
    if torch.cuda.is_available():
        pytest.skip("GPU present: tests/gpu covers the real call")
    with pytest.raises(DeviceError):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102
