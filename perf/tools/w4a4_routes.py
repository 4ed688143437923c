"""W4A4 on SM90 by three exact routes, against the W4A16 kernel they are measured by (issue
11's bar: W4A4 within 10% of W4A16 at every M), on the same NVFP4 weight, in one process.

    python perf/tools/w4a4_routes.py --out DIR [--quick] [--budget-s 200] [--shapes N,K ...]
        [--routes ROUTE ...]

Per case (N x K in {8192 x 8192, 28672 x 4096, 4096 x 14336}, M in {1, 16, 64, 256, 1024,
4096, 8192}; ``--quick``: 8192 x 8192):

* ``w4a16_packed``: W4A16 on the fragment-order weight, the packed heuristic's schedule
  (what ``NVFP4Linear`` runs): the reference time;
* ``w4a4_plain``: ``schedule="auto"`` on the plain weight (the plain-layout W4A4 kernels);
* ``w4a4_packed``: the rs_packed mainloop's own W4A4 route (the packed activation stage
  converted in shared memory by the consumers, once per stage);
* ``w4a4_via_bf16``: ``gemm(a4, packed_weight)`` (``schedule="auto"``): the NVFP4
  activation decoded to its exact BF16 block values by one kernel
  (``quant.dequantize_activation``), then the W4A16 packed kernel with alpha = the product
  of the two global scales (one elementwise op). Timed together.

Timing: ``cute_fp4.bench.Timer`` (CUDA-graph replay, L2 flushed, median); every output is
checked against the exact W4A4 (or W4A16) reference on its first and last 64 rows.
Writes ``DIR/w4a4_routes.json`` and ``.md`` after every case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = ((8192, 8192), (28672, 4096), (4096, 14336))  # (N, K)
MS = (1, 16, 64, 256, 1024, 4096, 8192)
ROUTES = ("w4a16_packed", "w4a4_plain", "w4a4_packed", "w4a4_via_bf16")
CHECK_ROWS = 64


def _check(out, a, b, alpha=None) -> str:
    """The exact reference's rule on the first and last CHECK_ROWS rows; ``a``: BF16 rows
    (W4A16, or a W4A4 activation's exact ``block_values`` with ``alpha`` = the product of
    the global scales: the same products as the W4A4 reference)."""
    from cute_fp4 import reference

    m = out.shape[0]
    for rows in (slice(0, CHECK_ROWS), slice(max(0, m - CHECK_ROWS), m)):
        if not reference.check(out[rows], a[rows], b, alpha).passed:
            return "FAIL"
    return "ok"


def _calls(route: str, ops):
    """(graph-capturable call, schedule name) of one route."""
    import torch

    from cute_fp4.api import heuristic
    from cute_fp4.compile import Signature, compile
    from cute_fp4.operands import alpha_tensor
    from cute_fp4.packed import repack
    from cute_fp4.run import run_compiled

    m, n, k = ops.mnk
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=ops.b.device)
    packed = repack(ops.b)
    if route == "w4a4_plain":
        from cute_fp4.api import resolve_schedule

        s = resolve_schedule("auto", m, n, k, "nvfp4", torch.bfloat16)
        kern, a, b = compile(s, Signature("nvfp4")), ops.a4, ops.b
    else:
        fmt = "nvfp4" if route == "w4a4_packed" else "bf16"
        s = heuristic("sm90", m, n, k, packed=True, a_format=fmt)
        kern, a, b = compile(s, Signature(fmt)), (ops.a4 if fmt == "nvfp4" else ops.a16), packed
    if route == "w4a4_via_bf16":  # what gemm runs for W4A4 on a packed weight, "auto"
        import cute_fp4 as cf

        a4 = ops.a4
        return (lambda: cf.gemm(a4, packed, out=out)), "dequantize + " + (s.name or s.label())
    alpha = alpha_tensor(a, b, None)
    return (lambda: run_compiled(kern, a, b, out=out, alpha=alpha)), s.name or s.label()


def _case(n, k, m, timer, deadline, routes=ROUTES) -> dict:
    import torch

    from cute_fp4.bench import bench_operands

    ops = bench_operands(m, n, k)
    alpha4 = (ops.a4.global_scale.float() * ops.b.global_scale.float()).reshape(())
    rows = []
    for route in routes:
        if time.monotonic() > deadline:
            rows.append({"route": route, "status": "skipped: time budget"})
            continue
        try:
            call, name = _calls(route, ops)
            call()
            torch.cuda.synchronize()
            us, out = timer.timed(call)
            if route == "w4a16_packed":
                verdict = _check(out, ops.a16, ops.b)
            else:
                verdict = _check(out, ops.a4.block_values(torch.bfloat16), ops.b, alpha4)
            rows.append({"route": route, "status": "ok", "us": round(us, 2),
                         "schedule": name, "check": verdict})
        except Exception as e:  # a row, never a crash
            rows.append({"route": route, "status": f"error: {type(e).__name__}: {e}"[:300]})
    return {"N": n, "K": k, "M": m, "rows": rows}


def _markdown(cases: list[dict]) -> str:
    lines = ["| N x K | M | " + " | ".join(ROUTES) + " | best W4A4 / W4A16 |",
             "|" + "---|" * (len(ROUTES) + 3)]
    for c in cases:
        us = {r["route"]: r for r in c["rows"]}

        def cell(route, us=us):
            r = us.get(route, {})
            if r.get("status") != "ok":
                return "-"
            return f"{r['us']:.1f}" + ("" if r["check"] == "ok" else " FAIL")
        ok = {r: us[r]["us"] for r in us if us[r].get("status") == "ok"
              and us[r]["check"] == "ok"}
        best = min((ok[r] for r in ok if r.startswith("w4a4")), default=None)
        ratio = "-" if best is None or "w4a16_packed" not in ok else \
            f"{best / ok['w4a16_packed']:.2f}"
        lines.append(f"| {c['N']} x {c['K']} | {c['M']} | "
                     + " | ".join(cell(r) for r in ROUTES) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the JSON and markdown")
    ap.add_argument("--quick", action="store_true", help="8192 x 8192 only")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall-clock budget")
    ap.add_argument("--shapes", nargs="*", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="N,K pairs instead of the three defaults")
    ap.add_argument("--routes", nargs="*", choices=ROUTES, help="a subset of the routes")
    args = ap.parse_args(argv)
    from cute_fp4.bench import Timer

    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    timer, cases = Timer(), []
    shapes = args.shapes or (SHAPES[:1] if args.quick else SHAPES)
    for n, k in shapes:
        for m in MS:
            cases.append(_case(n, k, m, timer, deadline, args.routes or ROUTES))
            (args.out / "w4a4_routes.json").write_text(json.dumps(cases, indent=1))
            (args.out / "w4a4_routes.md").write_text(_markdown(cases))
            print(_markdown(cases[-1:]).splitlines()[-1], flush=True)
    print(_markdown(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
