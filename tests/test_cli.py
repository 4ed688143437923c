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
    (["compile", "sm120_default", "--dump-dir", "/proc/nope"],
     "--dump-dir /proc/nope: cannot write there"),
    (["plan", "sm120_default", "--shape", "0", "256", "256"], "M = 0; a problem's sizes"),
    (["plan", "sm120_default", "--shape", "16", "0", "0"], "N = 0, K = 0"),
])
def test_errors_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == {mod!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from cute_fp4.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("mod, argv, package", [
    ("cutlass", ["compile", "sm120_default"], "pip install nvidia-cutlass-dsl==4.8.1"),
    ("torch", ["validate", "sm120_default"], "pip install torch"),
])
def test_a_missing_package_is_one_line(mod, argv, package):
    """A wheel installed without torch or the CuTe DSL: one line naming what to install,
    exit 2, no traceback (the module blocked in a fresh interpreter)."""
    p = subprocess.run([sys.executable, "-c", _BLOCK.format(mod=mod, argv=argv)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert package in p.stderr and "Traceback" not in p.stderr


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


# ----------------------------------------------------------------------------- issue 12 item 6

WIDTH = 100
REASON = ("needs 121,856 B of shared memory per block for even 1 stage; sm_120a allows "
          "101,376 B: use a smaller tile; tile 256x128: M and N must be 32, 64 or 128 on SM120")


def _fake_report(schedule, target=None, problem=None, dump_dir=None):
    """A compile_report row without the DSL: refusals as plan() gives them, the rest ok."""
    from cute_fp4.compile import retarget
    from cute_fp4.plan import plan

    s = retarget(schedule, target)
    p = plan(s, problem)
    row = {"name": s.name, "target": s.target, "tile": list(s.tile),
           "roles": s.warps.roles.value, "stages": p.stages, "smem_bytes": p.smem_bytes,
           "smem_limit": p.smem_limit, "ok": p.ok}
    if not p.ok:
        return {**row, "reason": "; ".join(p.reasons), "refused_by_plan": True}
    return {**row, "registers": 168, "spills": 0, "kernel_smem_bytes": p.smem_bytes,
            "mma_instructions": [s.arch.sass_mma_prefix + ".16864.F32.E2M1.E2M1.UE4M3.4X"],
            "mma_count": 32, "compile_s": 0.5,
            "kloop": {"instructions": 151, "non_mma_per_mma": 3.72, "mma_overlap": 0}}


@pytest.fixture
def fake_compile(monkeypatch):
    host = sys.modules["cute_fp4.compile"]
    monkeypatch.setattr(host, "compile_report", _fake_report)


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_schedules_table_fits_100_columns_and_json_has_the_full_text(capsys):
    code, out, _ = run(capsys, "schedules")
    assert code == 0 and _widest(out) <= WIDTH, _widest(out)
    for s in __import__("cute_fp4").catalogue.all_schedules():
        assert s.name in out
    code, out, _ = run(capsys, "schedules", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    doc = rows["sm120_default"]["doc"]
    assert doc.startswith("The default SM120 schedule") and len(doc.splitlines()) > 1
    assert rows["sm100_style_256x128x256"]["fits"] == "NO"


@pytest.mark.parametrize("target", ["sm_120a", "sm_121a", "sm_90a", None])
def test_compile_table_fits_100_columns(capsys, fake_compile, target):
    argv = ["compile", "--all"] + (["--target", target] if target else [])
    code, out, err = run(capsys, *argv)
    assert code == 0 and _widest(out) <= WIDTH, _widest(out)
    if target in ("sm_120a", None):
        # the refusal: marked in the table, its reason in full in a note under it
        assert "refused [1]" in out and "[1] sm100_style_256x128x256: needs 121,856 B" in out
        assert "255 registers per thread" in out  # the end of the reason is not cut
    n = len(err.strip().splitlines())
    assert n >= 6 and all(line.startswith(f"[{i}/{n}] compile ")
                          for i, line in enumerate(err.strip().splitlines(), 1))


def test_compile_exit_codes(capsys, fake_compile):
    code, _, err = run(capsys, "compile")
    assert code == 2 and "name the schedules to compile or pass --all" in err
    code, _, err = run(capsys, "compile", "sm120_default", "--all")
    assert code == 2 and "not both" in err
    assert run(capsys, "compile", "--all", "--target", "sm_120a")[0] == 0  # refusal passes
    assert run(capsys, "compile", "sm100_style_256x128x256")[0] == 1  # named: it fails
    assert run(capsys, "compile", "sm120_default", "sm120_pingpong")[0] == 0


def test_help_on_every_option():
    from cute_fp4.cli import build_parser

    missing = []
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, __import__("argparse")
                                                      ._SubParsersAction)]
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help" and not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help: {missing}"


def test_closed_pipe_is_quiet():
    """`cute-fp4 schedules --json | head -1`: the reader leaves; no traceback."""
    code = ("import sys\nfrom cute_fp4.cli import main\n"
            "sys.argv = ['cute-fp4', 'schedules', '--json']\n"
            "for _ in range(200):  # until the pipe's buffer is full and the reader gone\n"
            "    code = main(sys.argv[1:])\n"
            "    if code:\n        break\n"
            "raise SystemExit(code)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # like head -1
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_broken_user_schedule_is_one_warning_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "typo.py").write_text("from cute_fp4.schedule import Schedule\n"
                                      "SCHEDULE = Schedule(tile=Tile())\n")
    monkeypatch.setenv("CUTE_FP4_SCHEDULES", str(tmp_path))
    code, out, err = run(capsys, "schedules")
    assert code == 0 and "sm120_default" in out and "typo" not in out
    (line,) = [x for x in err.splitlines() if "typo.py" in x]
    assert line.startswith("cute-fp4: warning: schedule file ") and "NameError" in line
    assert str(tmp_path / "typo.py") in line and "Traceback" not in err
    code, _, err = run(capsys, "plan", "typo")
    assert code == 2 and "did not load" in err and "NameError" in err


def test_unknown_name_suggests_close_ones(capsys):
    code, _, err = run(capsys, "plan", "sm120_defualt")
    assert code == 2 and "did you mean 'sm120_default'" in err


def test_demo_on_a_cpu_fits_and_passes_refusals(capsys, monkeypatch, fake_compile):
    from cute_fp4 import demo

    monkeypatch.setattr(demo, "detect_device", lambda: None)
    assert demo.demo(quick=False) == 0
    out, err = capsys.readouterr()
    assert _widest(out) <= WIDTH and "refused [1]" in out and "OMMA.SF" in out
    assert "[1/" in err and " compile sm120_default for sm_121a" in err

    host = sys.modules["cute_fp4.compile"]

    def failing(s, target=None, problem=None, dump_dir=None):
        row = _fake_report(s, target, problem)
        return {**row, "ok": False, "reason": "CuTe DSL failed: boom"} if row["ok"] else row

    monkeypatch.setattr(host, "compile_report", failing)
    assert demo.demo(quick=True) == 1
    assert "FAILED [1]" in capsys.readouterr().out


def test_demo_does_not_import_the_cli():
    r = subprocess.run([sys.executable, "-c", "import sys, cute_fp4.demo; "
                        "print('cute_fp4.cli' in sys.modules)"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
