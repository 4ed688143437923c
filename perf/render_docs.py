"""Render ``docs/performance.md`` from the raw JSON under ``perf/results/``.

    python perf/render_docs.py            # rewrite docs/performance.md
    python perf/render_docs.py --check    # exit 1 when docs/performance.md is out of date

One section per benchmark (:data:`SECTIONS`): of the files matching its pattern (and its
``accept`` test: e.g. the full matrix, not a ``--quick`` run), the **latest run** is
rendered, never the best; every table says which file it comes from. A run's time is the
date recorded inside the file (``env.date``, ``environment.date`` or ``date``), else the
newest date recorded by any file of its folder (a session's files without their own date
were written during it), else the date in its path; ties go to the higher ``callN`` in
the name, then the name. A benchmark with no run yet is listed as such.

To add a benchmark: write ``render_x(data, path) -> list[str]`` (markdown lines; figures
straight from ``data``) and add a :class:`Section` to :data:`SECTIONS`. The tests
(``tests/test_render_docs.py``) check that the page is up to date and that each renderer
runs on a minimal file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
PAGE = ROOT / "docs" / "performance.md"
RANDOM_WEIGHTS = ("Random weights: these errors say how closely the NVFP4 model follows "
                  "the same model with its weights' exact NVFP4 values, not how well a "
                  "trained checkpoint keeps its quality.")


@dataclasses.dataclass(frozen=True)
class Section:
    title: str
    pattern: str  # glob under perf/results/
    render: Callable[[dict, Path], list[str]]
    command: str  # what produces the file
    accept: Callable[[dict], bool] = lambda data: True
    variant: Callable[[dict], str] = lambda data: ""  # one latest run per variant


# ----------------------------------------------------------------------------- selection

def load(path: Path):
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def own_date(data) -> str | None:
    """The run time recorded inside a file, as ``YYYY-MM-DDTHH:MM:SS`` (or None)."""
    if not isinstance(data, dict):
        return None
    for holder in (data.get("env"), data.get("environment"), data):
        if isinstance(holder, dict) and isinstance(holder.get("date"), str):
            return _norm(holder["date"])
    return None


def _norm(text: str) -> str:
    text = text.replace(" ", "T")[:19]
    return text + "T00:00:00"[len(text) - 10:] if len(text) < 19 else text


def run_time(path: Path, data) -> tuple[str, int, str]:
    """(date, call number, name): the order of runs (see the module docstring)."""
    date = own_date(data)
    if date is None:
        env = path.parent / "env.json"
        dates = [own_date(load(p)) for p in sorted(path.parent.glob("*.json"))
                 if p != path and p.name != "env.json"]
        dates = [d for d in dates if d] + ([own_date(load(env))] if env.exists() else [])
        date = max((d for d in dates if d), default=None)
    if date is None:
        m = re.search(r"\d{4}-\d{2}-\d{2}", str(path.relative_to(RESULTS)))
        date = _norm(m.group(0)) if m else "0000-00-00T00:00:00"
    call = re.search(r"call(\d+)", path.name)
    return date, int(call.group(1)) if call else 0, path.name


def latest(section: Section, results: Path = RESULTS) -> list[tuple[Path, object]]:
    """The latest accepted run of ``section``, one per variant (sorted by variant)."""
    best: dict[str, tuple] = {}
    for path in sorted(results.glob(section.pattern)):
        try:
            data = load(path)
            ok = section.accept(data)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            continue  # another tool's file under the same name pattern
        if not ok:
            continue
        key = section.variant(data)
        when = run_time(path, data)
        if key not in best or when > best[key][0]:
            best[key] = (when, path, data)
    return [(best[k][1], best[k][2]) for k in sorted(best)]


# ----------------------------------------------------------------------------- helpers

def table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in rows]
    return out + [""]


def x(num, den, digits: int = 2) -> str | None:
    """``num / den`` as "1.23x" (None when either is missing)."""
    if not num or not den:
        return None
    return f"{num / den:.{digits}f}x"


def us(v) -> str | None:
    return None if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _us_or(v) -> str | None:
    return v if v == "FAIL" else us(v)


def source(path: Path, data) -> str:
    """The file, its date and machine, and the session's note when there is one."""
    env = {}
    if isinstance(data, dict):
        env = data.get("env") or data.get("environment") or {}
    bits = [f"`{_shown(path)}`", (own_date(data) or "").replace("T", " ")]
    for key, name in (("gpu", ""), ("driver", "driver "), ("torch", "torch "),
                      ("cute_dsl", "CuTe DSL "), ("cutlass_dsl", "CuTe DSL "),
                      ("quack_kernels", "QuACK ")):
        if isinstance(env, dict) and env.get(key):
            bits.append(f"{name}{env[key]}")
    note = RESULTS / f"{path.relative_to(RESULTS).parts[0]}.md"
    text = "Source: " + ", ".join(b for b in bits if b) + "."
    if path.is_relative_to(RESULTS) and note.exists():
        text += f" Note: `{_shown(note)}`."
    return text


def _shown(path: Path) -> str:
    """``perf/results/...`` as the page shows a file (whatever the results folder is)."""
    return "perf/results/" + path.relative_to(RESULTS).as_posix()


# ----------------------------------------------------------------------------- sections

def render_validate(data: dict, path: Path) -> list[str]:
    rows = [r for r in data["rows"] if "shapes" in r]
    refused = [r for r in data["rows"] if "refused" in r]
    cases = sum(r["shapes"] for r in rows)
    passed = sum(r["passed"] for r in rows)
    worst = max(r["max_err_over_bound"] for r in rows)
    return [f"{len(rows)} (schedule, A format) pairs of the catalogue x {cases // len(rows)} "
            f"shapes (M in {data['M']}, N in {data['N']}, K in {data['K']}), outputs "
            f"poisoned before each run: **{passed} of {cases} passed**, worst error "
            f"{worst:.3g} of the bound (`{data['rule']}`); {len(refused)} pairs refused by "
            "`plan()` on purpose.", ""]


def render_fuzz(data: dict, path: Path) -> list[str]:
    return [f"{data['count']} random (schedule, format, M, N, K, distribution) cases, seed "
            f"{data['seed']}: **{data['mismatches']} mismatches**.", ""]


def render_determinism(data: dict, path: Path) -> list[str]:
    same = sum(bool(r["bit_identical"]) for r in data["rows"])
    return [f"Reruns bit-identical: **{same} of {len(data['rows'])}** kernels (split-K "
            "included).", ""]


def render_emulated(data: dict, path: Path) -> list[str]:
    s = data["summary"]
    tot = {k: sum(v[k] for v in s.values()) for k in ("cases", "passed", "fail", "hang",
                                                       "crash")}
    worst = max(v["worst_err_over_bound"] for v in s.values())
    return [f"Every SM120 kernel built with its block-scaled MMA replaced by exact BF16 "
            f"`mma.sync` (`cute_fp4.compile.compile_emulated`), run on "
            f"{data['env'].get('gpu')}: {len(s)} schedules, **{tot['passed']} of "
            f"{tot['cases']} cases passed**, {tot['fail']} failed, {tot['hang']} hangs, "
            f"{tot['crash']} crashes; worst error {worst:.3g} of the bound. This checks the "
            "SM120 data path (TMA, barriers, ldmatrix, scales, scheduler, epilogue), not the "
            "OMMA instruction, the sm_120a binary or the 99 KiB limit: the kernels have "
            "never run on an SM12x GPU.", ""]


def render_grouped_validate(rows: list, path: Path) -> list[str]:
    passed = sum(bool(r["passed"]) for r in rows)
    same = sum(bool(r.get("rerun_identical")) for r in rows)
    scheds = sorted({r["schedule"] for r in rows})
    return [f"Grouped (MoE) kernels ({', '.join(scheds)}) over routings with empty experts, "
            f"single tokens and tails: **{passed} of {len(rows)} passed**, {same} reruns "
            "bit-identical.", ""]


def _nk(case) -> str:
    return f"{case['N']} x {case['K']}"


def render_rs_packed(data: dict, path: Path) -> list[str]:
    rows = []
    for c in data["cases"]:
        t = {r["provider"]: r for r in c["rows"] if r.get("status") == "ok"}
        get = {p: t.get(p, {}).get("us") for p in ("torch_bf16", "quack_w4a16",
                                                   "cute_auto_plain", "cute_rs_packed")}
        bad = [p for p, r in t.items() if r.get("check") not in ("ok", None)]
        rows.append([_nk(c), c["M"], us(get["torch_bf16"]), us(get["quack_w4a16"]),
                     us(get["cute_auto_plain"]), us(get["cute_rs_packed"]),
                     x(get["quack_w4a16"], get["cute_rs_packed"]),
                     x(get["torch_bf16"], get["cute_rs_packed"]), ", ".join(bad) or "ok"])
    return ["W4A16 (BF16 activations, NVFP4 weight), device time in us; ratios are the "
            "peer's time over the packed kernel's (> 1: faster). `packed` is what "
            "`NVFP4Linear` runs on SM90 (`layout=\"auto\"`), `plain` is `gemm` on the "
            "cuBLAS-layout weight.", ""] + table(
        ["N x K", "M", "torch BF16", "QuACK", "plain", "packed", "x QuACK", "x torch",
         "check"], rows)


def render_vs_quack(data: dict, path: Path) -> list[str]:
    rows = []
    for c in data["cases"]:
        peers = {k: v.get("us") for k, v in c["peers"].items() if v.get("status") == "ok"}
        a16 = c["cute"]["w4a16"]["auto"]
        a4 = c["cute"]["w4a4"]["auto"]
        t16 = a16.get("us") if a16.get("status") == "ok" else None
        t4 = a4.get("us") if a4.get("status") == "ok" else None
        checks = {a16.get("check"), a4.get("check")} - {"ok"}
        rows.append([_nk(c), c["M"], us(peers.get("torch_bf16")), us(peers.get("torch_fp8")),
                     us(peers.get("quack_w4a16")), us(t16), us(t4),
                     x(peers.get("quack_w4a16"), t16), x(peers.get("torch_bf16"), t16),
                     x(t4, t16), ", ".join(sorted(map(str, checks))) or "ok"])
    return ["`cute_fp4.gemm(schedule=\"auto\")` on the plain weight, device time in us. "
            "W4A4 times exclude quantizing the activations. torch FP8 is requantized "
            "(inexact); the other outputs are checked against the exact reference.", ""] + \
        table(["N x K", "M", "torch BF16", "torch FP8", "QuACK", "W4A16", "W4A4",
               "W4A16 x QuACK", "W4A16 x torch", "W4A4 / W4A16", "check"], rows)


def render_decode_bench(data: dict, path: Path) -> list[str]:
    by: dict[tuple, dict] = {}
    for r in data["rows"]:
        if r.get("status") == "ok":
            by.setdefault((r["N"], r["K"], r["M"]), {})[r["provider"]] = r
    if "floors" in data:  # 2026-12-06 on: 8 weight copies per graph, the read floor
        return _render_decode_floor(data, by)
    out = ["Decode GEMMs through `NVFP4Linear` (the call path of a converted model), device "
           "time in us with L2 flushed before each replay (the weight comes from memory). "
           f"Floor: weight and scale bytes ({data['formulas']['weight_bytes']}) at "
           f"{data['formulas']['peak_TB/s']} TB/s. FAIL: the output failed its check.", ""]
    def cold(p, name, check="check"):  # None: absent; "FAIL": its output failed the check
        r = p.get(name)
        return None if r is None else r["cold_us"] if r.get(check) == "ok" else "FAIL"

    rows = []
    for (n, k, m), p in sorted(by.items()):
        bf, qk = cold(p, "torch_bf16"), cold(p, "quack_w4a16")
        a16 = cold(p, "nvfp4linear_w4a16")
        a4 = cold(p, "nvfp4linear_w4a4", "w4a4_check")
        floor = next(iter(p.values())).get("floor_peak_us")
        rows.append([f"{n} x {k}", m, *map(_us_or, (bf, qk, a16)), _ratio(bf, a16),
                     _ratio(qk, a16), _us_or(a4), _ratio(a4, a16), us(floor)])
    return out + table(["N x K", "M", "torch BF16", "QuACK", "W4A16", "x torch", "x QuACK",
                        "W4A4", "W4A4 / W4A16", "floor"], rows)


def _render_decode_floor(data: dict, by: dict) -> list[str]:
    """decode_bench's rows against the read floor measured in the same run."""
    def cold(p, name, check="check"):  # None: absent; "FAIL": its output failed the check
        r = p.get(name)
        return None if r is None else r["cold_us"] if r.get(check) in ("ok", "inexact") \
            else "FAIL"

    rows = []
    for (n, k, m), p in sorted(by.items()):
        floor = data["floors"][f"{n}x{k}"]["floor_us"]
        bf, f8, qk = cold(p, "torch_bf16"), cold(p, "torch_fp8"), cold(p, "quack_w4a16")
        a16, a4 = cold(p, "nvfp4linear_w4a16"), cold(p, "nvfp4linear_w4a4", "w4a4_check")
        early = cold(p, "stream_early")
        rows.append([f"{n} x {k}", m, us(floor), *map(_us_or, (bf, f8, qk, a16, a4, early)),
                     _ratio(floor, a16), _ratio(bf, a16), _ratio(f8, a16), _ratio(qk, a16)])
    return ["Decode GEMMs: 8 distinct copies of each weight per CUDA graph, L2 flushed before "
            "each replay, device time per call in us; `floor`: a plain streaming read of "
            f"the same bytes ({data['formulas']['weight_bytes']}) timed the same way "
            "(`perf/read_floor.py`). W4A16 and W4A4: `NVFP4Linear` (\"auto\"); `early`: "
            "the stream kernel with the launch's early flag (the weight read before the "
            "wait; what prepared layers run). FAIL: the output failed its check; torch FP8 "
            "is requantized (inexact).", ""] + table(
        ["N x K", "M", "floor", "torch BF16", "cuBLAS FP8", "QuACK", "W4A16", "W4A4",
         "early", "floor / W4A16", "W4A16 x BF16", "W4A16 x FP8", "W4A16 x QuACK"], rows)


def _moe_us(case: dict, op: str, provider: str):
    """The row's time, "FAIL" when its output failed its check, None when absent."""
    r = next((r for r in case["rows"] if r["op"] == op and r["provider"] == provider
              and r.get("status") == "ok"), None)
    if r is None:
        return None
    return r["us"] if r.get("check") in ("ok", None) else "FAIL"


def _ratio(num, den) -> str | None:
    return "FAIL" if "FAIL" in (num, den) else x(num, den)


def render_moe(data: dict, path: Path) -> list[str]:
    rows = []
    for c in data["cases"]:
        line = [c["model"], c["tokens"], c["routing"]]
        for op in ("gate_up", "down", "layer"):
            bf = _moe_us(c, op, "torch_bf16")
            line += [_ratio(bf, _moe_us(c, op, "cute_w4a16[auto]")),
                     _ratio(bf, _moe_us(c, op, "cute_w4a4[auto]"))]
        line.append(_ratio(_moe_us(c, "gate_up", "loop_w4a16"),
                           _moe_us(c, "gate_up", "cute_w4a16[auto]")))
        rows.append(line)
    return ["Speed-up over torch BF16 (`torch._grouped_mm`, and the BF16 layer for "
            "`layer`), per GEMM and for the whole layer (routing, gather, both GEMMs, "
            "activation, weighted sum); `x loop`: over a per-expert loop of the dense "
            "`gemm` (gate_up). FAIL: that output failed its check in this run (the run's "
            "note says why); empty: not measured.", ""] + table(
        ["model", "tokens", "routing", "gate_up W4A16", "gate_up W4A4", "down W4A16",
         "down W4A4", "layer W4A16", "layer W4A4", "x loop"], rows)


def render_fused_layer(data: dict, path: Path) -> list[str]:
    rows = []
    for c in data["cases"]:
        bf = _moe_us(c, "layer", "torch_bf16")
        fused = _moe_us(c, "layer", "cute_w4a16[auto]")
        unfused = _moe_us(c, "layer", "cute_w4a16_unfused[auto]")
        rows.append([c["model"], c["tokens"], us(unfused), us(fused),
                     _ratio(unfused, fused), _ratio(bf, fused)])
    return ["The MoE layer (W4A16, `NVFP4MoE`) with SiLU-and-mul fused into the gate_up "
            "GEMM's epilogue against the same layer unfused (`fused=False`: gate_up GEMM, "
            "activation kernel, down GEMM), microseconds per layer; `x torch`: over the "
            "BF16 layer.", ""] + table(
        ["model", "tokens", "unfused us", "fused us", "fused x unfused", "fused x torch"],
        rows)


def render_mlp(data: dict, path: Path) -> list[str]:
    by = {(r["tokens"], r["provider"]): r["us"] for r in data["rows"]}
    rows = []
    for m in sorted({r["tokens"] for r in data["rows"]}):
        bf, unf, fu = by.get((m, "torch_bf16")), by.get((m, "unfused")), by.get((m, "fused"))
        rows.append([m, us(bf), us(unf), us(fu), x(unf, fu), x(bf, fu)])
    return [f"A gated MLP (hidden {data['hidden']}, intermediate {data['inter']}), W4A16: "
            "`NVFP4GatedMLP` (SiLU-and-mul in the gate_up GEMM's epilogue) against three "
            "`NVFP4Linear` and `F.silu(g) * u` on the same weights and torch BF16, "
            f"microseconds; the weight bytes at 4.8 TB/s take {data['floor_us']} us.",
            ""] + table(["M", "torch BF16", "unfused", "fused", "fused x unfused",
                         "fused x torch"], rows)


def render_model_decode(data: dict, path: Path) -> list[str]:
    res = data["results"]
    base = {(r["batch"], r.get("step")): r for r in res if r["model"] == "bf16"}
    floors = any("floor_ms" in r for r in res)
    rows = []
    for r in res:
        if "graph_ms" not in r:
            continue
        b = base.get((r["batch"], r.get("step")), {})
        line = [r["model"], r["batch"], r.get("step") or "torch", f"{r['graph_ms']:.3f}",
                x(b.get("graph_ms"), r["graph_ms"]),
                f"{r['eager_ms']:.3f}" if "eager_ms" in r else None,
                x(b.get("eager_ms"), r.get("eager_ms"))]
        if floors:
            line.append(x(r["graph_ms"], r.get("floor_ms")))
        rows.append(line)
    cfg = data["config"]
    moe = cfg.get("model") == "moe"
    what = (f"{cfg['layers']} Qwen3-MoE layers (hidden {cfg['hidden']}, {cfg['experts']} "
            f"experts of {cfg['moe_intermediate']}, top-{cfg['experts_per_token']}), random "
            "weights, `cute_fp4.hf.quantize_model`" if moe else
            f"{cfg['layers']} Llama layers (hidden {cfg['hidden']}, MLP "
            f"{cfg['intermediate']}), random weights, `cute_fp4.nn.convert`; W4A4 with a "
            f"{data.get('w4a4_scale', 'static')} input scale")
    out = [f"{what}. ms per decode step; `step`: op by op (`torch`) or through "
           "`torch.compile` (`compiled`); `graph`: the step under CUDA graphs. x BF16: the "
           "BF16 model's time over this one's" + ("; `/ floor`: the step's time over its "
           "weights' bytes at the rate of a 1 GiB read (MoE: the expected share of the "
           "experts); `_early`: the stream kernel's early flag on." if floors else "."), ""]
    headers = ["model", "batch", "step", "graph ms", "x BF16", "eager ms", "x BF16"]
    out += table(headers + (["/ floor"] if floors else []), rows)
    prof = data.get("profiles") or {}
    prow = [[name, p["span_us"], p["cute_fp4_busy_us"], p["projections_floor_us"],
             x(p["cute_fp4_busy_us"], p["projections_floor_us"])]
            for name, p in prof.items() if p.get("cute_fp4_busy_us")]
    if prow:
        out += ["One replay of the step at batch 1, profiled: the time during which the "
                "cute_fp4 kernels ran against their weights' read floor.", ""] + table(
            ["model", "step span us", "cute_fp4 busy us", "floor us", "busy / floor"], prow)
    return out


def render_hf(data: dict, path: Path) -> list[str]:
    rows = []
    for m in data["models"]:
        d = m["decode"]
        lg = m["logits"]
        truth = (f"{lg['nvfp4_vs_float32']:.4f} / {lg['bf16_ref_vs_float32']:.4f}"
                 if "nvfp4_vs_float32" in lg else "not measured")
        rows.append([m["model"], m["layers"], f"{m['load']['peak_over_bound']:.3f}",
                     f"{lg['rel_err']:.4f}", truth, f"{lg['top1_agreement']:.3f}",
                     f"{d['bf16']['ms_per_token']:.2f}", f"{d['nvfp4']['ms_per_token']:.2f}",
                     f"{m['speedup']:.2f}x", f"{m['ideal_speedup']:.2f}x"])
    return ["Checkpoints quantized by `cute_fp4.hf.quantize_model`, saved, loaded by "
            "`from_pretrained` and run by transformers (`generate`, `torch.compile`). "
            "`peak / bound`: device memory at the load's peak over the checkpoint's bytes "
            "plus 10%. Logits against the fake-quantized BF16 model (relative error, top-1 "
            "agreement), and NVFP4's and that reference's own error against the same exact "
            "values computed in float32. `ideal`: the bytes per token of BF16 over NVFP4.",
            "", RANDOM_WEIGHTS, ""] + table(
        ["model", "layers", "peak / bound", "logits rel. err", "vs float32: NVFP4 / ref",
         "top-1", "BF16 ms/token", "NVFP4 ms/token", "speed-up", "ideal"], rows)


def _quant_full(data) -> bool:
    rows = data["rows"]
    return (any(r.get("m", 99) <= 16 for r in rows) and any(r.get("m", 0) >= 4096 for r in rows)
            and any(str(r.get("spec", "")).startswith("quantize-") for r in rows)
            and not any("thr" in str(r.get("spec", "")) for r in rows))


def render_quantize(data: dict, path: Path) -> list[str]:
    peak = data["env"].get("datasheet_gbs", 4800.0)
    large: dict[tuple, dict] = {}
    decode = []
    for r in data["rows"]:
        key = (r["m"], r["k"], r["dtype"])
        if r["spec"] == "torch copy_":
            large.setdefault(key, {})["copy"] = r["pct_peak"]
        # a run lists each kind's default spec first; the general path and the ring
        # variants (``...s<sets>``) are not the kernel users run
        elif r["m"] >= 4096 and not re.search(r"-(general|t\d+i\d+v\d+p\d+s)", r["spec"]):
            if "values" in r["spec"]:
                continue  # its own section
            kind = r.get("gs_kind") if r["scale"] == "static" else r["scale"]
            large.setdefault(key, {}).setdefault(
                kind, (r["graphN_us"], r["pct_peak"], r.get("bit_identical")))
        elif r["m"] <= 16 and r["dtype"] == "bfloat16":
            decode.append(r)
    rows = []
    for (m, k, dt), v in sorted(large.items()):
        def cell(kind, v=v):
            if kind not in v:
                return None
            t, pct, same = v[kind]
            return f"{t:.1f} us, {pct:.0f}%" if same is not False else "FAIL"
        rows.append([f"{m} x {k}", dt, cell("calibrated"), cell("arbitrary"), cell("dynamic"),
                     f"{v['copy']:.0f}%" if "copy" in v else None])
    out = [f"Quantizing BF16/FP16 activations to NVFP4 (`cute_fp4.quant`), device time per "
           f"call and share of the {peak:.0f} GB/s datasheet bandwidth; every row checked "
           "bit for bit against `cute_fp4.quantize` first. Static scale: calibrated (no "
           "block saturates) or arbitrary (about half the blocks clamp); dynamic: the scale "
           "computed per call; copy_: torch copying the same input bytes; FAIL: not "
           "bit-identical.", ""]
    out += table(["[M, K]", "dtype", "static, calibrated", "static, arbitrary", "dynamic",
                  "copy_"], rows)
    for scale in ("static", "dynamic"):
        t = [r["graphN_us"] for r in decode if r["scale"] == scale]
        if t:
            out.append(f"Decode sizes (M 1-16, K 4096 and 8192, BF16), {scale} scale: "
                       f"{min(t):.2f}-{max(t):.2f} us per launch in a CUDA graph.")
    return out + [""]


def _values(data) -> bool:
    return any("-values" in str(r.get("spec", "")) for r in data["rows"])


def render_quantize_values(data: dict, path: Path) -> list[str]:
    by: dict[tuple, dict] = {}
    for r in data["rows"]:
        cell = by.setdefault((r["m"], r["k"], r["dtype"]), {})
        if r["spec"] == "torch copy_":
            cell["copy"] = f"{r['pct_peak']:.0f}%"
        elif "-values" in r["spec"]:
            cell["values"] = (f"{r['graphN_us']:.1f} us, {r['pct_peak']:.0f}%"
                              if r.get("bit_identical") is not False else "FAIL")
    rows = [[f"{m} x {k}", dt, v.get("values"), v.get("copy")]
            for (m, k, dt), v in sorted(by.items()) if "values" in v]
    return ["`quant.quantize_values`: the W4A4 activation written as its exact BF16 block "
            "values in one pass (calibrated static scale; 4 bytes per element of traffic), "
            "checked bit for bit against `quantize(x).block_values()`; share of the "
            "datasheet bandwidth, and torch `copy_` of the same input in the same run.", ""] + \
        table(["[M, K]", "dtype", "quantize_values", "copy_"], rows)


def render_host(data: dict, path: Path) -> list[str]:
    names = list(dict.fromkeys(k for r in data["rows"] for k in r["host_us"]))
    rows = [[r["m"], *(r["host_us"].get(n) for n in names)] for r in data["rows"]]
    n, k = data["rows"][0]["n"], data["rows"][0]["k"]
    return [f"Host time per eager call (no sync), us, N = K = {n if n == k else (n, k)}, "
            f"{data['calls']} calls per loop; call path `{data['rows'][0].get('call_path')}`.",
            ""] + table(["M", *names], rows)


def render_mxfp4_decode(data: dict, path: Path) -> list[str]:
    out = ["MXFP4 W4A16 against NVFP4 on the same shape, same kernel family (the stream "
           "kernel \"auto\" picks), device time in us, 8 weight copies per graph, L2 "
           f"flushed; weight bytes {data['formulas']['weight_bytes']}; floor: a plain read of "
           "them.", ""]
    rows = [[f"{r['N']} x {r['K']}", r["M"], us(r["nvfp4_us"]), us(r["mxfp4_us"]),
             f"{r['mxfp4_over_nvfp4']:.3f}"] for r in data["ratios"]]
    floors = {(r["N"], r["K"], r["M"]): r for r in data["rows"] if r["format"] == "mxfp4"}
    for row, r in zip(rows, data["ratios"]):
        f = floors.get((r["N"], r["K"], r["M"]))
        row.append(None if f is None else f"{f['floor_over_time']:.2f}")
    return out + table(["N x K", "M", "NVFP4", "MXFP4", "MXFP4 / NVFP4", "MXFP4 floor / time"],
                       rows)


def auto_names(row: dict) -> str:
    """gpt_oss.py's grouped row: "auto"'s gate_up schedule, and its down one where it
    differs (a run before 2026-12-06 11:00 UTC names the gate_up one alone)."""
    up, down = row["auto_schedule"], row.get("auto_schedule_down", row["auto_schedule"])
    return up if down == up else f"{up} / {down}"


def render_gpt_oss(data: dict, path: Path) -> list[str]:
    out = ["gpt-oss-like MoE layers (hidden = expert width = 2880, top-4), MXFP4 W4A16 "
           "experts against torch `_grouped_mm` on their BF16 values, same routing; "
           "\"layer\": routing, both GEMMs, bias, clamped SwiGLU, combine; \"GEMMs\": the two "
           "grouped GEMMs alone, back to back; auto: the gate_up GEMM's schedule (/ the "
           "down GEMM's where it differs). Floor: "
           f"{data['formulas']['floor']}.", ""]
    rows = [[g["experts"], g["tokens"], us(g["ours_layer"]), us(g["torch_layer"]),
             x(g["torch_layer"], g["ours_layer"]), us(g["ours_gemms"]),
             x(g["torch_gemms"], g["ours_gemms"]), us(g["floor_us"]), auto_names(g)]
            for g in data["grouped"]]
    return out + table(["experts", "tokens", "layer", "torch layer", "x torch", "GEMMs",
                        "GEMMs x torch", "floor", "auto"], rows)


def render_gpt_oss_dense(data: dict, path: Path) -> list[str]:
    rows = [[f"{d['n']} x {d['k']}", d["m"], us(d["nvfp4"]), us(d["mxfp4"]),
             f"{d['mxfp4_over_nvfp4']:.3f}", us(d["bf16"])] for d in data["dense"]]
    out = ["gpt-oss's dense shapes, M = 1: MXFP4 against NVFP4 and BF16 (us).", ""]
    return out + table(["N x K", "M", "NVFP4", "MXFP4", "MXFP4 / NVFP4", "BF16"], rows)


def render_gpt_oss_decode(data: dict, path: Path) -> list[str]:
    dec = data["decode"]

    def how(key: str) -> str:
        return "a CUDA graph" if dec[key].startswith("graph") else "eager: no graph captured"

    err = dec["logits_rel_err_vs_transformers"]
    return [f"Batch-1 decode of a {dec['layers']}-layer gpt-oss-20b-like checkpoint "
            f"({dec['experts']} experts, top-{dec['top_k']}, vocabulary {dec['vocab']}): "
            f"{us(dec['ours_us'])} us/token through cute_fp4 ({how('ours_how')}); "
            f"transformers' own load of it {us(dec['transformers_us'])} "
            f"({how('transformers_how')}), "
            f"{x(dec['transformers_us'], dec['ours_us'])}; BF16 with the eager experts loop "
            f"{us(dec['bf16_eager_loop_us'])} ({how('bf16_eager_loop_how')}), "
            f"{x(dec['bf16_eager_loop_us'], dec['ours_us'])}. Logits {err:.3f} (relative) "
            "from transformers' on the dequantized weights; random weights, so this says how "
            "closely the model follows its weights' exact MXFP4 values, not a trained "
            "checkpoint's quality.", ""]


def render_route(data: dict, path: Path) -> list[str]:
    rows = [[r["T"], r["top_k"], r["E"], us(r["torch_us"]), us(r["kernel_us"]),
             f"{r['ratio']:.2f}", "yes" if r["equal"] else "NO"] for r in data["rows"]]
    return (["The routing sort of a MoE call (`cute_fp4.layers.routing.route`): torch's ops "
             "against the one-CTA kernel (`cute_fp4.sorting`), device us per call, "
             f"{data['calls_per_graph']} calls per CUDA graph; outputs compared bit for bit.",
             ""] + table(["T", "top_k", "E", "torch", "kernel", "kernel / torch", "equal"],
                         rows))


def render_shards(data: dict, path: Path) -> list[str]:
    out = ["What one rank of a tensor-parallel group runs, on one GPU: each layer's shard "
           "through `cute_fp4.layers` (W4A16, \"auto\") against torch BF16 at the same "
           "shard (experts: `_grouped_mm` on BF16 experts), us; no collective. Sum over "
           "each model's layers:", ""]
    sums: dict[tuple, list[float]] = {}
    refused: set = set()
    for r in data["rows"]:
        key = (r["model"], r["m"])
        if "error" in r:
            refused.add((r["model"], r["tp"]))
            continue
        t = sums.setdefault(key, {}).setdefault(r["tp"], [0.0, 0.0])
        t[0] += r["nvfp4_us"]
        t[1] += r["bf16_us"]
    tps = sorted({r["tp"] for r in data["rows"]})
    rows = []
    for (model, m), by_tp in sorted(sums.items()):
        rows.append([model, m, *("refused" if (model, tp) in refused else
                                 x(by_tp[tp][1], by_tp[tp][0]) if tp in by_tp else None
                                 for tp in tps)])
    return out + table(["model", "M", *(f"TP {tp}" for tp in tps)], rows)


def _has(*keys):
    return lambda data: isinstance(data, dict) and all(k in data for k in keys)


SECTIONS: list[Section] = [
    Section("Validation on the GPU", "**/validate.json", render_validate,
            "perf/gpu_session.py --only validate", _has("rows", "rule")),
    Section("Fuzzing", "**/fuzz.json", render_fuzz, "perf/gpu_session.py --only fuzz",
            _has("seed", "mismatches")),
    Section("Determinism", "**/determinism.json", render_determinism,
            "perf/gpu_session.py --only determinism", _has("rows")),
    Section("SM120 kernels, emulated on SM90", "**/sm120_emulated*.json", render_emulated,
            "perf/tools/sm120_emulated.py", _has("summary")),
    Section("Grouped kernels", "**/grouped_validate.jsonl", render_grouped_validate,
            "perf/tools/grouped_validate.py"),
    Section("Dense GEMM on SM90: the packed weight", "**/sm90_rs_packed*.json",
            render_rs_packed, "perf/sm90_rs_packed.py",
            lambda d: len({(c["N"], c["K"]) for c in d["cases"]}) >= 3),
    Section("Dense GEMM on SM90: `gemm`, W4A16 and W4A4", "**/sm90_vs_quack.json",
            render_vs_quack, "perf/sm90_vs_quack.py",
            lambda d: len({(c["N"], c["K"]) for c in d["cases"]}) >= 3),
    Section("Decode GEMMs", "**/decode_bench*.json", render_decode_bench,
            "perf/decode_bench.py", _has("rows", "formulas")),
    Section("MoE layers", "**/*moe.json", render_moe, "perf/moe_bench.py",
            lambda d: not d["config"].get("quick")),
    Section("Fused epilogue: the MoE layer", "**/moe-fused.json", render_fused_layer,
            "perf/moe_bench.py --ops layer --stem moe-fused", _has("cases")),
    Section("Fused epilogue: a gated MLP", "**/mlp.json", render_mlp, "perf/mlp_bench.py",
            _has("rows", "hidden", "floor_us")),
    Section("A decoder step", "**/*model_decode*.json", render_model_decode,
            "perf/model_decode.py", _has("results", "config"),
            lambda d: ("Qwen3-MoE-like" if d["config"].get("model") == "moe" else
                       f"Llama-like, {d.get('w4a4_scale', 'static')} input scale")),
    Section("NVFP4 checkpoints in transformers", "**/hf_generate*.json", render_hf,
            "perf/hf_generate.py", _has("models")),
    Section("Activation quantizer", "**/*quant*.json", render_quantize,
            "perf/quantize_bench.py", _quant_full),
    Section("Activation quantizer: BF16 block values", "**/*quant*.json",
            render_quantize_values, "perf/quantize_bench.py", _values),
    Section("Host time per call", "**/host_overhead*.json", render_host,
            "perf/host_overhead.py", lambda d: d.get("mode") == "gpu"),
    Section("MXFP4 against NVFP4: dense decode", "**/mxfp4_decode.json", render_mxfp4_decode,
            "perf/mxfp4_decode.py", _has("rows", "ratios")),
    Section("gpt-oss (MXFP4): MoE layers", "**/gpt_oss.json", render_gpt_oss,
            "perf/gpt_oss.py --sections grouped", _has("grouped")),
    Section("gpt-oss (MXFP4): dense", "**/gpt_oss.json", render_gpt_oss_dense,
            "perf/gpt_oss.py --sections dense", _has("dense")),
    Section("gpt-oss (MXFP4): batch-1 decode", "**/gpt_oss.json", render_gpt_oss_decode,
            "perf/gpt_oss.py --sections decode", _has("decode")),
    Section("MoE routing sort", "**/route.json", render_route, "perf/tools/route_bench.py",
            _has("rows", "calls_per_graph")),
    Section("The layer API per tensor-parallel shard", "**/shards.json", render_shards,
            "perf/shards.py", _has("rows", "env")),
]

NOT_HERE = [
    "Nsight Compute profiles (the `ncu_*.txt` files of the results folders): read in the "
    "results notes, not rendered here.",
    "SASS instruction counts and K-loop measures: measured on every CI run from the "
    "cross-compiled kernels (`cute-fp4 compile --json`, docs/inspection.md), not on a GPU.",
    "Figures of the results notes that have no raw file beside them (tables written by "
    "hand during a session): not shown here until they are measured again.",
]


def render(results: Path = RESULTS) -> str:
    lines = ["# Performance", "",
             "<!-- generated by `python perf/render_docs.py` from perf/results/: do not edit "
             "by hand -->", "",
             "The latest run of each benchmark in `perf/results/`, never the best; each "
             "table names its file. Every output was checked against the exact reference in "
             "the same run, and every ratio compares providers timed in that same run "
             "(device time of a CUDA-graph replay, L2 flushed, median; `perf/README.md`). "
             "The results notes beside the files say what was measured and why.", ""]
    missing = []
    for sec in SECTIONS:
        runs = latest(sec, results)
        if not runs:
            missing.append(sec)
            continue
        lines += [f"## {sec.title}", ""]
        for path, data in runs:
            variant = sec.variant(data)
            if variant and len(runs) > 1:
                lines += [f"### {variant}", ""]
            lines += sec.render(data, path) + [source(path, data), ""]
    lines += ["## Not on this page", ""]
    lines += [f"* {s.title}: no run yet (`python {s.command}`)." for s in missing]
    lines += [f"* {t}" for t in NOT_HERE]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/performance.md differs from a fresh render")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/performance.md is out of date: run python perf/render_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
