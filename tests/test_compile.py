"""Every catalogue schedule compiles for every target of its family, without a GPU.

Checks (the issue's CI bar): shared memory == plan() and within the target's limit, no
spills, >= 2 stages, and the intended tensor-core instructions in the SASS (OMMA.SF on
SM120/SM121, HGMMA on SM90). The SM100-style schedule is refused with byte counts.

SM120 K-loop budget (issue 10), from each compile's own SASS (``cute_fp4.inspect``):
cooperative tiles of two or more K blocks issue every MMA of the last K block after the
next stage's wait, on data loaded before it (16 on 128x128 tiles); no ldmatrix register
is loaded and never read, except where the tile's warp layout repeats B rows (the 64x128
decode tiles: listed); non-MMA instructions per MMA stay under the ceilings reached on
2026-12-01 (``KLOOP_CEILING``). Those ceilings are regression guards: the issue's bars
(1.8 for 128x128x128, 1.45 for 128x128x256) are met by neither yet.
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


# non-MMA instructions per OMMA in the K loop, reached 2026-12-01 (sm_120a and sm_121a alike)
KLOOP_CEILING = {"sm120_default": 2.05, "sm120_epi64x32": 2.05, "sm120_nonpersistent": 2.05,
                 "sm120_raster_n": 2.05, "sm120_sf_cp_async": 2.05, "sm120_k256_epi64x32": 1.7,
                 "sm120_k64_deep": 2.35, "sm120_128x64": 3.9, "sm120_decode_64x128": 3.85,
                 "sm120_decode_splitk4": 3.4, "sm120_pingpong": 1.0}
DEAD_LDSM_ALLOWED = {"sm120_decode_64x128": 16, "sm120_decode_splitk4": 16}


def check_sm120_kloop(s, row):
    k = row["kloop"]
    assert k and k["mma"] > 0, row.get("kloop")
    wm, wn = s.warps.mma
    per_kb = s.tile.m * s.tile.n // (16 * 8 * wm * wn)  # one warp's MMAs per 64-wide K block
    if s.warps.roles.value == "cooperative" and s.tile.k > 64:
        assert min(k["overlap_per_wait"]) >= per_kb, k
    non_mma = (k["instructions"] - k["mma"]) / k["mma"]
    assert non_mma <= KLOOP_CEILING[s.name], f"{non_mma:.2f} non-MMA instructions per OMMA"
    assert k["ldsm_dead_registers"] <= DEAD_LDSM_ALLOWED.get(s.name, 0), k


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
    if TARGETS[target].family == "sm120":
        check_sm120_kloop(s, row)


def test_cli_compile_json(capsys):
    assert main(["compile", "sm120_default", "--target", "sm_121a", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    for key in ("name", "target", "tile", "stages", "smem_bytes", "smem_limit", "registers",
                "spills", "mma_instructions", "compile_s"):
        assert key in row
    assert row["target"] == "sm_121a" and row["tile"] == [128, 128, 128]
