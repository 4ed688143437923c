"""Schedules as a user writes them: value strings for enums, typed errors, keys that follow
the generated code, derived names, catalogue names and tuples, broken schedule files."""

from __future__ import annotations

import itertools
import warnings

import pytest

import cute_fp4 as cf
from cute_fp4 import catalogue
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.plan import plan
from cute_fp4.schedule import (
    Epilogue,
    OutDtype,
    Problem,
    Raster,
    Schedule,
    Scheduler,
    SFLoad,
    Tile,
    WarpRoles,
    Warps,
)

BASE = catalogue.get("sm120_default")


# ----------------------------------------------------------------------------- enum fields

@pytest.mark.parametrize("field, text, want", [
    ("roles", "pingpong", WarpRoles.PINGPONG), ("roles", "COOPERATIVE", WarpRoles.COOPERATIVE),
    ("raster", "n", Raster.ALONG_N), ("raster", "along_n", Raster.ALONG_N),
    ("raster", "m", Raster.ALONG_M), ("sf_load", "cp_async", SFLoad.CP_ASYNC),
    ("out_dtype", "fp16", OutDtype.FP16), ("out_dtype", "float32", OutDtype.FP32),
    ("out_dtype", "torch.bfloat16", OutDtype.BF16),
])
def test_replace_takes_enum_value_strings(field, text, want):
    s = BASE.replace(**{field: text})
    got = {"roles": s.warps.roles, "raster": s.scheduler.raster, "sf_load": s.sf_load,
           "out_dtype": s.epilogue.out_dtype}[field]
    assert got is want  # the kernels test with `is`: a string must never get through


def test_components_take_value_strings_and_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert Warps(roles="pingpong").roles is WarpRoles.PINGPONG
    assert Scheduler(raster="n").raster is Raster.ALONG_N
    assert Epilogue(out_dtype=torch.float16).out_dtype is OutDtype.FP16
    assert Schedule(sf_load="cp_async").sf_load is SFLoad.CP_ASYNC
    assert Warps(mma=[2, 2]).mma == (2, 2) and hash(Warps(mma=[2, 2]))  # list -> tuple


@pytest.mark.parametrize("field, bad, needles", [
    ("roles", "ping", ["Warps.roles", "'ping'", "'cooperative'", "'pingpong'"]),
    ("raster", "x", ["Scheduler.raster", "'x'", "'m'", "'n'"]),
    ("sf_load", "dma", ["Schedule.sf_load", "'dma'", "'tma'", "'cp_async'"]),
    ("out_dtype", "int8", ["Epilogue.out_dtype", "'int8'", "'bf16'", "'fp16'", "'fp32'"]),
    ("roles", 3, ["Warps.roles", "3"]),
    ("persistent", "yes", ["Scheduler.persistent", "'yes'"]),
    ("swap_ab", 1, ["Schedule.swap_ab", "1"]),
])
def test_bad_enum_values_name_field_value_and_choices(field, bad, needles):
    with pytest.raises(InputError) as e:
        BASE.replace(**{field: bad})
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_replace_rejects_unknown_fields_with_the_list():
    with pytest.raises(InputError, match="unknown field.*rolez.*roles"):
        BASE.replace(rolez="pingpong")


# ----------------------------------------------------------------------------- keys

def test_raster_string_builds_the_schedule_it_names():
    """The bug of issue 12: replace(raster="m") built ALONG_N code under ALONG_M's key."""
    along_n = catalogue.get("sm120_raster_n")
    m = along_n.replace(raster="m")
    assert m.scheduler.raster is Raster.ALONG_M
    assert m.key() != along_n.key() and m != along_n
    assert BASE.replace(raster="m") == BASE and BASE.replace(raster="m").key() == BASE.key()


VARIANTS = {
    "target": ["sm_120a", "sm_121a"], "tile": [Tile(128, 128, 128), Tile(128, 64, 128)],
    "stages": [None, 2, 3], "roles": ["cooperative", "pingpong"], "mma": [(4, 2), (2, 4)],
    "sf_load": ["tma", "cp_async"], "persistent": [True, False], "raster": ["m", "n"],
    "group_size": [8, 16], "split_k": [1, 2], "out_dtype": ["bf16", "fp16", "fp32"],
    "epi_tile": [None, (64, 32)], "swap_ab": [False, True],
}


def test_every_code_field_changes_the_key():
    base = Schedule()
    for field, values in VARIANTS.items():
        keys = {base.replace(**{field: v}).key() for v in values}
        assert len(keys) == len(values), f"{field}: {len(keys)} keys for {len(values)} values"


def test_distinct_schedules_have_distinct_keys():
    """Over pairs of fields varied together: key equality is schedule equality."""
    scheds = [Schedule()]
    for (f1, v1), (f2, v2) in itertools.combinations(VARIANTS.items(), 2):
        scheds += [Schedule().replace(**{f1: a, f2: b}) for a in v1 for b in v2]
    by_key: dict[str, Schedule] = {}
    for s in scheds:
        other = by_key.setdefault(s.key(), s)
        assert other == s, f"{s.label()} and {other.label()} share the key {s.key()}"
    assert len(by_key) == len(set(scheds)) > 100


def test_key_ignores_labels():
    assert BASE.replace(name="mine", doc="text").key() == BASE.key()


# ----------------------------------------------------------------------------- names

def test_derived_schedules_say_so():
    s = BASE.replace(epi_tile=(64, 32))
    assert s.name == "sm120_default+epi_tile=64x32"
    t = s.replace(stages=3, roles="pingpong").replace(stages=4)
    assert t.name == "sm120_default+epi_tile=64x32+stages=4+roles=pingpong"
    assert BASE.replace(tile=(128, 128, 256)).name == "sm120_default+tile=128x128x256"
    assert BASE.replace(raster="m").name == "sm120_default"  # nothing changed
    assert BASE.replace(target="sm_121a").name == "sm120_default"  # same code, other chip
    assert BASE.replace(stages=2, name="mine").name == "mine"
    assert Schedule().replace(stages=2).name == ""  # unnamed stays unnamed (label() is used)


# ----------------------------------------------------------------------------- names and tuples

def test_plan_takes_names_and_tuples():
    by_name = cf.plan("sm120_default")
    assert by_name.ok and by_name.schedule == BASE
    p = cf.plan(BASE, (16, 4096, 4096))
    assert p.problem == Problem(16, 4096, 4096)
    assert cf.plan("sm120_default", (16, 4096, 4096, "bf16")).problem.w4a16
    assert not cf.plan("sm120_default", (1, 4096, 48)).ok  # K = 48 is refused
    with pytest.raises(InputError, match="did you mean 'sm120_default'"):
        cf.plan("sm120_defualt")
    with pytest.raises(InputTypeError, match="Schedule or a catalogue name, got int"):
        cf.plan(7)
    with pytest.raises(InputTypeError, match=r"\(m, n, k\) tuple, got str"):
        cf.plan(BASE, "16x4096x4096")


def test_compile_report_takes_names_and_tuples():
    row = cf.compile_report("sm100_style_256x128x256", None, (16, 4096, 4096))
    assert row["name"] == "sm100_style_256x128x256" and not row["ok"]
    assert "121,856 B" in row["reason"] and row["refused_by_plan"]


# ----------------------------------------------------------------------------- catalogue files

GOOD = '"""A user schedule."""\nfrom cute_fp4.schedule import Schedule\nSCHEDULE = Schedule()\n'


def _user_dir(tmp_path, monkeypatch, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("CUTE_FP4_SCHEDULES", str(tmp_path))


def test_broken_user_file_is_reported_once_and_the_rest_works(tmp_path, monkeypatch):
    _user_dir(tmp_path, monkeypatch, {"mine_ok.py": GOOD,
                                      "mine_typo.py": GOOD.replace("Schedule()", "Schedul()"),
                                      "mine_empty.py": '"""No SCHEDULE here."""\n'})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        names = catalogue.names()
        catalogue.all_schedules()
        catalogue.get("sm120_default")
    msgs = [str(w.message) for w in seen if issubclass(w.category, catalogue.CatalogueWarning)]
    assert len(msgs) == 2, msgs  # once per broken file, not once per call
    assert any(str(tmp_path / "mine_typo.py") in m and "NameError" in m for m in msgs)
    assert any("mine_empty.py" in m and "SCHEDULE" in m for m in msgs)
    assert "mine_ok" in names and "sm120_default" in names and "mine_typo" not in names
    assert [e.path.name for e in catalogue.load_errors()] == ["mine_empty.py", "mine_typo.py"]
    with pytest.raises(InputError, match="'mine_typo' did not load: .*mine_typo.py.*NameError"):
        catalogue.get("mine_typo")


def test_unknown_name_without_a_close_match_lists_the_catalogue():
    with pytest.raises(InputError, match="known: .*sm120_default"):
        catalogue.get("zzzz")


# ----------------------------------------------------------------------------- where it lives

def test_builtin_folder_in_an_installed_layout(tmp_path):
    site = tmp_path / "site-packages"
    (site / "cute_fp4" / "schedules").mkdir(parents=True)
    (site / "schedules").mkdir()  # some other distribution's folder: never taken
    assert catalogue.builtin_dir(site / "cute_fp4") == site / "cute_fp4" / "schedules"
    (site / "cute_fp4" / "schedules").rmdir()
    assert catalogue.builtin_dir(site / "cute_fp4") is None


def test_builtin_folder_in_a_checkout(tmp_path):
    (tmp_path / "cute_fp4").mkdir()
    (tmp_path / "schedules").mkdir()
    assert catalogue.builtin_dir(tmp_path / "cute_fp4") is None  # no pyproject.toml
    (tmp_path / "pyproject.toml").write_text("")
    assert catalogue.builtin_dir(tmp_path / "cute_fp4") == tmp_path / "schedules"
    assert catalogue.builtin_dir() is not None and len(catalogue.names()) >= 10


def test_a_catalogue_file_names_the_formats_its_schedule_is_for():
    """An MXFP4 schedule plans, compiles and is listed with MXFP4 operands when no problem
    (or a bare (m, n, k)) is given, and so do its variants; NVFP4 schedules keep NVFP4."""
    s, p = catalogue.resolve("sm90_mxfp4_rs_packed")
    assert (p.a_format, p.b_format) == ("bf16", "mxfp4")
    assert plan(s).problem.b_format == "mxfp4"
    _, p = catalogue.resolve(s.replace(stages=3), (1, 2880, 2880))
    assert (p.m, p.n, p.k, p.a_format, p.b_format) == (1, 2880, 2880, "bf16", "mxfp4")
    _, p = catalogue.resolve("sm120_mxfp4")
    assert (p.a_format, p.b_format) == ("mxfp4", "mxfp4")
    assert catalogue.resolve("sm120_default")[1] is None
    # an explicit problem wins
    _, p = catalogue.resolve("sm90_mxfp4_rs_packed", Problem(a_format="bf16"))
    assert p.b_format == "nvfp4"


@pytest.mark.parametrize("text, match", [
    ('PROBLEM = "mxfp4"\n', "PROBLEM must be a Problem"),
    ('PROBLEM = Problem(m=1, n=64, k=64, a_format="bf16", b_format="mxfp4")\n',
     "leave its sizes open, got m=1, n=64, k=64"),
])
def test_a_wrong_problem_in_a_catalogue_file_is_reported(tmp_path, monkeypatch, text, match):
    body = GOOD + "from cute_fp4.schedule import Problem\n" + text
    _user_dir(tmp_path, monkeypatch, {"mine_fmt.py": body})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match=match):
            catalogue.get("mine_fmt")
