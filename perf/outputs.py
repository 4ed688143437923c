"""Where a perf script's results go: ``<out>/<stem>.json`` (the raw numbers) beside
``<out>/<stem>.md`` (the table), the table also printed."""

from __future__ import annotations

import json
from pathlib import Path


def write_outputs(out: str | Path, stem: str, res: dict, md: str) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(md)
    print(md)
