"""The packed-weight register-sourced SM90 kernels (``mainloop=rs_packed``) timed against
today's best SM90 path (``schedule="auto"`` on the plain weight), torch BF16 and QuACK's
W4A16 NVFP4 kernel (when importable), in one process, on the same NVFP4 weights.

    python perf/sm90_rs_packed.py --out DIR [--quick] [--budget-s 170] [--reps 20]
        [--schedules NAME ...]

Cases: N x K in {8192 x 8192, 28672 x 4096, 4096 x 14336}, M in {1, 16, 64, 256, 1024,
4096, 8192} (``--quick``: 8192 x 8192 only). Per case: torch BF16, QuACK, cute_fp4 auto
(plain weight) and cute_fp4 rs_packed with the packed heuristic's schedule
(``cute_fp4.api.heuristic(..., packed=True)``; the weight packed once, outside the timed
region), plus ``--schedules`` (rs_packed catalogue names). Timing: ``cute_fp4.bench.Timer``
(CUDA-graph replay, device time, L2 flushed, median). Every output is checked against the
exact reference on its first and last 64 rows (a full float64 reference at M = 8192 would
take longer than the whole run); failures are marked FAIL. Writes ``DIR/sm90_rs_packed.json``
and ``.md`` after every case, so a run cut short by the budget keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((8192, 8192), (28672, 4096), (4096, 14336))  # (N, K)
MS = (1, 16, 64, 256, 1024, 4096, 8192)
CHECK_ROWS = 64


def _check(out, ops) -> str:
    """The exact reference's rule on the first and last CHECK_ROWS rows."""
    from cute_fp4 import reference

    m = out.shape[0]
    for rows in (slice(0, CHECK_ROWS), slice(max(0, m - CHECK_ROWS), m)):
        if not reference.check(out[rows], ops.a16[rows], ops.b).passed:
            return "FAIL"
    return "ok"


def _measure(provider, ops, timer, label: str, deadline: float) -> dict:
    import torch

    row = {"provider": label}
    if time.monotonic() > deadline:
        return {**row, "status": "skipped: time budget"}
    why = provider.status()
    if why:
        return {**row, "status": f"unavailable: {why}"}
    t0 = time.perf_counter()
    try:
        prep = provider.prepare(ops)
        prep.call()
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        us, out = timer.timed(prep.call)
    except Exception as e:  # a row, never a crash
        return {**row, "status": f"error: {type(e).__name__}: {str(e)[:200]}"}
    info = {k: v for k, v in prep.info.items() if k in ("schedule_name", "compile_s")}
    return {**row, "status": "ok", "us": round(us, 2), "setup_s": round(setup, 1),
            "check": _check(out, ops), **info}


def _case(n, k, m, timer, deadline, extra) -> dict:
    from cute_fp4 import catalogue
    from cute_fp4.api import heuristic
    from cute_fp4.bench import QUACK_W4A16, TORCH_BF16, bench_operands, cute_fp4_provider

    ops = bench_operands(m, n, k)
    packed = heuristic("sm90", m, n, k, packed=True)
    provs = [(TORCH_BF16, "torch_bf16"), (QUACK_W4A16, "quack_w4a16"),
             (cute_fp4_provider("auto", "bf16"), "cute_auto_plain"),
             (cute_fp4_provider(packed, "bf16"), "cute_rs_packed")]
    provs += [(cute_fp4_provider(catalogue.get(x), "bf16"), f"cute_{x}") for x in extra]
    rows = [_measure(p, ops, timer, label, deadline) for p, label in provs]
    return {"N": n, "K": k, "M": m, "rows": rows}


def _us(case: dict, label: str):
    for r in case["rows"]:
        if r["provider"] == label and r.get("status") == "ok":
            return r["us"], r["check"]
    return None, None


def _markdown(cases: list[dict], env: dict) -> str:
    lines = ["# rs_packed (packed-weight register-sourced WGMMA) vs today's SM90, torch, QuACK",
             "", f"{env.get('gpu')} driver {env.get('driver', '?')}, torch {env.get('torch')},"
             f" CUDA {env.get('cuda')}, {env.get('date')}. CUDA-graph device time, L2 "
             "flushed, median, us; W4A16 (BF16 activations); checks: exact reference on "
             "the first/last 64 rows.", "",
             "| N x K | M | torch BF16 | QuACK | cute auto (plain) | cute rs_packed | "
             "schedule | vs plain | vs torch | vs QuACK |", "|" + "---|" * 10]
    for c in cases:
        t, _ = _us(c, "torch_bf16")
        q, _ = _us(c, "quack_w4a16")
        a, ca = _us(c, "cute_auto_plain")
        r, cr = _us(c, "cute_rs_packed")
        name = next((x.get("schedule_name", "") for x in c["rows"]
                     if x["provider"] == "cute_rs_packed"), "")

        def f(v, chk=None):
            return "-" if v is None else f"{v:.1f}" + ("" if chk in (None, "ok") else " FAIL")

        def ratio(x, r=r):
            return "-" if x is None or r is None else f"{x / r:.2f}x"

        lines.append(f"| {c['N']} x {c['K']} | {c['M']} | {f(t)} | {f(q)} | {f(a, ca)} | "
                     f"{f(r, cr)} | {name} | {ratio(a)} | {ratio(t)} | {ratio(q)} |")
    lines += ["", "Ratios: other provider's time / rs_packed time (> 1: rs_packed faster).",
              "Rows with errors or skips are in the JSON."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=170.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--schedules", nargs="*", default=[])
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("sm90_rs_packed: needs an SM90 GPU", file=sys.stderr)
        return 2
    from cute_fp4.bench import Timer, environment

    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    timer = Timer(args.reps)
    cases = []
    for n, k in (SHAPES[:1] if args.quick else SHAPES):
        for m in MS:
            cases.append(_case(n, k, m, timer, deadline, args.schedules))
            c = cases[-1]
            print(f"{n}x{k} M={m}: " + ", ".join(
                f"{r['provider']}={r.get('us', r['status'])}" for r in c["rows"]),
                file=sys.stderr, flush=True)
            (out / "sm90_rs_packed.json").write_text(json.dumps(
                {"env": env, "cases": cases}, indent=1, default=str))
            (out / "sm90_rs_packed.md").write_text(_markdown(cases, env))
    print(_markdown(cases, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
