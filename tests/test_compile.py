"""Every catalogue schedule compiles for every target of its family, without a GPU.

Checks (the issue's CI bar): shared memory == plan() and within the target's limit, no
spills, >= 2 stages, and the intended tensor-core instructions in the SASS (OMMA.SF on
SM120/SM121, HGMMA on SM90). The SM100-style schedule is refused with byte counts.
"""

from __future__ import annotations

import json

import pytest

from cute_fp4 import catalogue
from cute_fp4.cli import main
from cute_fp4.compile import compile_report
from cute_fp4.schedule import Problem
from cute_fp4.targets import TARGETS

pytestmark = pytest.mark.compile
REFUSED = {"sm100_style_256x128x256"}
CASES = [(s, t.name, fmt) for s in catalogue.all_schedules() for t in TARGETS.values()
         if t.family == s.arch.family
         for fmt in (("nvfp4", "bf16") if t.family == "sm90" else ("nvfp4",))]


@pytest.mark.parametrize("s, target, fmt", CASES,
                         ids=[f"{s.name}@{t}-{f}" for s, t, f in CASES])
def test_catalogue_compiles(s, target, fmt):
    row = compile_report(s, target, Problem(a_format=fmt))
    if s.name in REFUSED:
        assert not row["ok"] and "B of shared memory per block" in row["reason"]
        return
    assert row["ok"], row.get("reason")
    assert row["spills"] == 0, f"{row['spills']} spilled loads/stores"
    assert row["kernel_smem_bytes"] == row["smem_bytes"] <= row["smem_limit"]
    assert row["stages"] >= 2
    prefix = TARGETS[target].sass_mma_prefix
    assert any(op.startswith(prefix) for op in row["mma_instructions"]), row["mma_instructions"]
    assert row["registers"] <= 255


def test_cli_compile_json(capsys):
    assert main(["compile", "sm120_default", "--target", "sm_121a", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    for key in ("name", "target", "tile", "stages", "smem_bytes", "smem_limit", "registers",
                "spills", "mma_instructions", "compile_s"):
        assert key in row
    assert row["target"] == "sm_121a" and row["tile"] == [128, 128, 128]
