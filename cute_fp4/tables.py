"""Text tables for terminals: GitHub-markdown tables that fit a width, and progress lines.

Used by the CLI and the demo, and free to use from scripts. Nothing is cut: a table
wider than ``width`` first wraps the cells of its long text columns (``wrap=``, e.g.
docstrings) over several lines, then splits its columns into blocks printed one under the
other, each repeating the key columns (``keys=``, the row's name), as pandas does with wide
frames; if even one column cannot fit, every row becomes a block of ``key value`` lines.
Long reasons go under the table as numbered notes (:func:`notes`). ``--json`` gives every
field unwrapped.

The catalogue and compile-report tables are here too (:func:`schedules_table`,
:func:`compile_table`), so the CLI and the demo print the same thing.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import TextIO

WIDTH = 100  # columns every CLI table fits
MIN_WRAP = 24  # a wrapped column narrower than this is unreadable


def columns(rows: Iterable[dict]) -> list[str]:
    """Every key of ``rows``, in order of first appearance."""
    return list(dict.fromkeys(c for r in rows for c in r))


def width_of(text: str) -> int:
    """The widest line of ``text``."""
    return max((len(line) for line in text.splitlines()), default=0)


def _render(rows: Sequence[dict], cols: Sequence[str], wrap_at: dict[str, int]) -> str:
    """A GitHub-markdown table; numeric columns right-aligned (``--:``), the columns of
    ``wrap_at`` wrapped at word boundaries to that many characters."""
    right = [_numeric(rows, c) for c in cols]
    cells = [[_lines(_text(r.get(c, "")), wrap_at.get(c)) for c in cols] for r in rows]
    widths = [max([len(c), *(len(x) for row in cells for x in row[i])])
              for i, c in enumerate(cols)]

    def line(parts: Sequence[str]) -> str:
        return "| " + " | ".join(p.rjust(w) if r else p.ljust(w)
                                 for p, w, r in zip(parts, widths, right)) + " |"

    out = [line(cols), "|" + "|".join("-" * (w + 1) + (":" if r else "-")
                                      for w, r in zip(widths, right)) + "|"]
    for row in cells:
        for k in range(max(len(c) for c in row)):
            out.append(line([c[k] if k < len(c) else "" for c in row]))
    return "\n".join(out)


def _lines(text: str, wrap: int | None) -> list[str]:
    if wrap is None:
        return text.splitlines() or [""]
    return textwrap.wrap(text, wrap, break_on_hyphens=False) or [""]


def _numeric(rows: Sequence[dict], col: str) -> bool:
    """A column of numbers (``-`` and empty cells allowed): aligned right."""
    vals = [r.get(col, "") for r in rows]
    nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return bool(nums) and all(v in ("", "-", None) for v in vals if v not in nums)


def table(rows: Sequence[dict], cols: Sequence[str] | None = None, *, width: int = WIDTH,
          wrap: Sequence[str] = (), keys: Sequence[str] | None = None) -> str:
    """``rows`` (dicts) as GitHub-markdown tables no wider than ``width``.

    ``wrap``: text columns that may wrap (at least ``MIN_WRAP`` wide). ``keys``: the columns
    repeated in every block when the columns are split (default: the first column).
    """
    cols = columns(rows) if cols is None else list(cols)
    whole = _render(rows, cols, {})
    if width_of(whole) <= width or not rows:
        return whole
    keys = [c for c in (cols[:1] if keys is None else keys) if c in cols]
    blocks = _blocks(rows, cols, keys, set(wrap), width)
    if blocks is None:
        return records(rows, cols, width=width)
    out = [_render(rows, bcols, wrap_at) for bcols, wrap_at in blocks]
    if max(map(width_of, out)) > width:  # decimal alignment made a column wider
        return records(rows, cols, width=width)
    return "\n\n".join(out)


def _blocks(rows, cols, keys, wrap, width) -> list[tuple[list[str], dict[str, int]]] | None:
    """Greedy packing of the non-key columns into blocks that fit ``width``; None when a
    column does not fit even alone with the keys."""
    natural = {c: width_of(_render(rows, [c], {})) - 4 for c in cols}  # minus "| " " |"
    base = sum(natural[k] + 3 for k in keys) + 1
    blocks: list[tuple[list[str], dict[str, int]]] = []
    cur: list[str] = []
    used = base
    for c in (c for c in cols if c not in keys):
        need = natural[c] + 3
        if used + need <= width:
            cur.append(c)
            used += need
            continue
        room = width - used - 3
        if c in wrap and room >= MIN_WRAP:
            blocks.append(([*keys, *cur, c], {c: room}))
            cur, used = [], base
            continue
        if cur:
            blocks.append(([*keys, *cur], {}))
        room = width - base - 3
        if base + need <= width:
            cur, used = [c], base + need
        elif c in wrap and room >= MIN_WRAP:
            blocks.append(([*keys, c], {c: room}))
            cur, used = [], base
        else:
            return None
    if cur or not blocks:
        blocks.append(([*keys, *cur], {}))
    return blocks


def records(rows: Sequence[dict], cols: Sequence[str] | None = None, *,
            width: int = WIDTH) -> str:
    """Each row as a block of aligned ``key  value`` lines, values wrapped to ``width``."""
    cols = columns(rows) if cols is None else list(cols)
    pad = max(len(c) for c in cols) + 2
    if pad > width // 2:  # long keys: each on its own line, the value indented below
        pad = 4
    blocks = []
    for r in rows:
        lines = []
        for c in cols:
            body = textwrap.wrap(_text(r.get(c, "")), max(width - pad, 1)) or [""]
            head = [f"{c:<{pad}}{body.pop(0)}"] if len(c) + 2 <= pad else \
                textwrap.wrap(c, width, break_on_hyphens=False)
            lines += [*head, *(" " * pad + b for b in body)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _text(v: object) -> str:
    """A cell: ints with thousands separators, floats to 3 significant digits (whole
    numbers from 1,000 up), None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def notes(texts: Sequence[str], width: int = WIDTH) -> str:
    """``[1] text`` lines, wrapped to ``width`` with a hanging indent (for the reasons a
    table refers to by number)."""
    out = []
    for i, t in enumerate(texts, 1):
        tag = f"[{i}] "
        out.append(textwrap.fill(t, width, initial_indent=tag,
                                 subsequent_indent=" " * len(tag)))
    return "\n".join(out)


def progress(i: int, n: int, what: str, stream: TextIO | None = None) -> None:
    """One progress line to stderr, e.g. ``[3/12] compile sm120_pingpong for sm_120a``."""
    print(f"[{i}/{n}] {what}", file=stream or sys.stderr, flush=True)


def shorten_mma(instructions: Iterable[str]) -> str:
    """``OMMA.SF`` from ``['OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X']``: the mnemonics without
    their shape and type suffixes (the full names are in the JSON report)."""
    names = [".".join(itertools.takewhile(lambda p: not p[:1].isdigit(), i.split(".")))
             for i in instructions]
    return ",".join(dict.fromkeys(names))


# ----------------------------------------------------------------------------- the CLI's tables

def target_heading(target_name: str) -> str:
    """``sm_120a (RTX PRO 6000 Blackwell, RTX 5090; 101,376 B shared memory per block)``."""
    from cute_fp4.targets import get_target

    t = get_target(target_name)
    return f"{t.name} ({', '.join(t.gpus)}; {t.smem_per_block:,} B shared memory per block)"


def options(schedule) -> str:
    """The choices of a schedule that differ from a plain ``Schedule()`` (besides its tile),
    e.g. ``pingpong splitk=4``; ``-`` when none do."""
    from cute_fp4.schedule import OutDtype, Raster, SFLoad, WarpRoles

    s = schedule
    parts = [s.warps.roles.value if s.warps.roles is not WarpRoles.COOPERATIVE else "",
             f"sf={s.sf_load.value}" if s.sf_load is not SFLoad.TMA else "",
             f"s={s.stages}" if s.stages else "",
             f"splitk={s.split_k}" if s.split_k > 1 else "",
             "epi={}x{}".format(*s.epilogue.tile) if s.epilogue.tile else "",
             "per-tile" if not s.scheduler.persistent else "",
             "raster=n" if s.scheduler.raster is Raster.ALONG_N else "",
             s.epilogue.out_dtype.value if s.epilogue.out_dtype is not OutDtype.BF16 else "",
             "swap_ab" if s.swap_ab else ""]
    return " ".join(p for p in parts if p) or "-"


def schedule_rows(schedules) -> list[dict]:
    """One row per schedule: its design, its plan (stages, shared memory) and its idea."""
    from cute_fp4.plan import plan

    rows = []
    for s in schedules:
        p = plan(s)
        rows.append({"name": s.name or s.label(), "target": s.target, "tile": str(s.tile),
                     "roles": s.warps.roles.value, "options": options(s),
                     "stages": p.stages if p.ok else "-", "smem": p.smem_bytes,
                     "fits": "yes" if p.ok else "NO",
                     "idea": (s.doc.strip().splitlines() or [""])[0]})
    return rows


def schedules_table(rows: Sequence[dict], width: int = WIDTH) -> str:
    """:func:`schedule_rows` grouped by target, each group under a heading."""
    out = []
    for target, group in _by_target(rows):
        out.append(f"{target_heading(target)}\n\n" + table(
            group, ["name", "tile", "options", "stages", "smem", "fits", "idea"],
            width=width, wrap=["idea"], keys=["name"]))
    return "\n\n".join(out)


def compile_table(reports: Sequence[dict], width: int = WIDTH) -> str:
    """Compile reports (``compile_report`` rows) grouped by target: stages, shared memory,
    registers, spills and tensor-core instructions per kernel; refusals and failures
    point to numbered notes under the table that give their full reasons."""
    out = []
    for target, group in _by_target(reports):
        reasons: list[str] = []
        rows = []
        for r in group:
            row = {"name": r["name"], "tile": "x".join(map(str, r["tile"])),
                   "stages": r["stages"] if r["ok"] else "-", "smem": r["smem_bytes"],
                   "regs": r.get("registers", "-"), "spills": r.get("spills", "-"),
                   "MMA": f"{r['mma_count']} {shorten_mma(r['mma_instructions'])}"
                   if r.get("mma_instructions") else "-"}
            row["status"] = "ok"
            if not r["ok"]:
                reasons.append(f"{r['name']}: {r.get('reason', '')}")
                word = "refused" if r.get("refused_by_plan") else "FAILED"
                row["status"] = f"{word} [{len(reasons)}]"
            if "k-loop" in r:
                row["k-loop"] = r["k-loop"]
            rows.append(row)
        _mma_header(rows, group)
        text = f"{target_heading(target)}\n\n" + table(rows, width=width, keys=["name"])
        out.append(text + ("\n\n" + notes(reasons, width) if reasons else ""))
    return "\n\n".join(out)


def result_table(rows: Sequence[dict], width: int = WIDTH) -> str:
    """Bench and tune rows: ``M, N, K`` shown as one ``shape`` column (``16x8192x8192``),
    which with the schedule and the A format is repeated in every block of a split table."""
    shown = []
    for r in rows:
        if {"M", "N", "K"} <= r.keys():
            r = {"shape": f"{r['M']}x{r['N']}x{r['K']}",
                 **{k: v for k, v in r.items() if k not in ("M", "N", "K")}}
        shown.append(r)
    keys = [k for k in ("shape", "schedule", "A") if any(k in r for r in shown)]
    return table(shown, width=width, keys=keys or None)


def _mma_header(rows: list[dict], reports: Sequence[dict]) -> None:
    """When every compiled kernel of a table uses the same tensor-core instructions, name
    them in the header (``OMMA.SF``) and keep the counts in the cells."""
    kinds = {shorten_mma(r["mma_instructions"]) for r in reports if r.get("mma_instructions")}
    if len(kinds) != 1:
        return
    (kind,) = kinds
    for row, r in zip(rows, reports):
        row["MMA"] = r["mma_count"] if r.get("mma_instructions") else "-"
        row[kind] = row.pop("MMA")
    for row in rows:  # keep the column order: the renamed column where MMA was
        row.update({k: row.pop(k) for k in [k for k in row if k in ("status", "k-loop")]})


def _by_target(rows: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["target"], []).append(r)
    return list(groups.items())
