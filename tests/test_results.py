"""perf/results: every results note has its raw files beside it (a folder or files whose
names begin with the note's), and every raw file a note names in backticks exists there."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "perf" / "results"


def test_every_note_has_its_raw_files():
    files = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    notes = sorted(RESULTS.glob("*.md"))
    assert notes
    for note in notes:
        raw = [p for p in RESULTS.iterdir() if p.name.startswith(note.stem) and p != note]
        assert raw, f"{note.name} has no raw files beside it"
        named = set(re.findall(r"`([\w.-]+\.(?:json|txt|csv|png|tgz|log))`", note.read_text()))
        # patterns ("decode_bench-callN.json", "quant_sweep1..3.json") are not file names
        missing = sorted(n for n in named if n not in files and not re.search(r"N\.|\.\.", n)
                         and not n.startswith("-"))
        assert not missing, f"{note.name} names raw files that are not there: {missing}"
