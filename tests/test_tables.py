"""cute_fp4.tables: tables that fit a width without cutting anything."""

from __future__ import annotations

import random
import re

from cute_fp4 import tables

LONG = ("needs 121,856 B of shared memory per block for even 1 stage; sm_120a allows "
        "101,376 B: use a smaller tile or a 64x32 epilogue tile (3 stages fit)")


def _words(text: str) -> list[str]:
    return re.sub(r"[|:-]", " ", text).split()


def test_a_narrow_table_is_left_alone():
    text = tables.table([{"name": "a", "n": 1_234, "x": 0.5}, {"name": "bb", "n": 5, "x": 12.25}])
    assert text.splitlines() == ["| name |     n |    x |",
                                 "|------|------:|-----:|",
                                 "| a    | 1,234 |  0.5 |",
                                 "| bb   |     5 | 12.2 |"]


def test_long_text_wraps_without_losing_words():
    rows = [{"name": f"schedule_{i}", "stages": i, "reason": LONG} for i in range(3)]
    text = tables.table(rows, wrap=["reason"], width=60)
    assert tables.width_of(text) <= 60 and len(text.splitlines()) > 5
    assert " ".join(_words(text)).count("epilogue") == 3
    assert all(w in _words(text) for w in _words(LONG))


def test_wide_tables_split_into_blocks_repeating_the_keys():
    rows = [{"shape": f"{m}x8192x8192", **{f"col{i}": 1000.0 * i + m for i in range(12)}}
            for m in (1, 16)]
    text = tables.table(rows, keys=["shape"], width=80)
    blocks = text.split("\n\n")
    assert len(blocks) >= 2 and tables.width_of(text) <= 80
    assert all(b.splitlines()[2].startswith("| 1x8192x8192") for b in blocks)
    assert all(f"col{i} " in text for i in range(12))


def test_records_when_nothing_else_fits():
    rows = [{"a_very_long_name_" * 3: "x" * 50, "b": LONG}]
    text = tables.table(rows, width=40)
    assert tables.width_of(text) <= 40 and text.startswith("a_very_long_name_")


def test_random_tables_always_fit():
    rng = random.Random(0)
    for _ in range(200):
        width = rng.randint(40, 120)
        ncol = rng.randint(1, 12)
        rows = [{f"c{j}": rng.choice([rng.randint(0, 10**6), rng.random() * 10**rng.randint(0, 5),
                                      "word " * rng.randint(0, 20), "-"])
                 for j in range(ncol)} for _ in range(rng.randint(1, 6))]
        text = tables.table(rows, width=width, wrap=[f"c{j}" for j in range(0, ncol, 2)])
        assert tables.width_of(text) <= width, (width, text)


def test_notes_wrap_with_a_hanging_indent():
    text = tables.notes([LONG, "short"], width=50)
    lines = text.splitlines()
    assert lines[0].startswith("[1] needs") and lines[1].startswith("    ")
    assert lines[-1] == "[2] short" and max(map(len, lines)) <= 50


def test_numbers_are_readable():
    text = tables.table([{"GB/s": 3781.2, "us": 35.54, "M": 8192, "x": None}])
    assert "3,781" in text and "35.5" in text and "8,192" in text and "e+03" not in text


def test_mma_names_are_shortened():
    assert tables.shorten_mma(["OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"]) == "OMMA.SF"
    assert tables.shorten_mma(["HGMMA.64x128x16.F32", "HGMMA.64x64x16.F32"]) == "HGMMA"


def test_schedule_options_name_what_differs():
    from cute_fp4 import catalogue

    assert tables.options(catalogue.get("sm120_default")) == "-"
    assert tables.options(catalogue.get("sm90_nonpersistent_fp32")) == "per-tile raster=n fp32"
    assert tables.options(catalogue.get("sm120_pingpong").replace(split_k=2)) == \
        "pingpong splitk=2"


def test_bench_rows_show_one_shape_column():
    rows = [{"M": 16, "N": 8192, "K": 8192, "schedule": "torch_bf16", "A": "-", "us": 39.1}]
    text = tables.result_table(rows)
    assert "16x8192x8192" in text and "| M " not in text
