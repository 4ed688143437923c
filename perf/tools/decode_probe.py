"""Decode-size (M <= 16) SM90 W4A16 variants against torch BF16 and QuACK, in one process.

    python perf/tools/decode_probe.py --out DIR [--budget-s 240] [--ms 1 16]
    python perf/tools/decode_probe.py --launch LABEL M N K     # one variant, for Nsight Compute
                                  # (LABEL also quack, auto_plain, auto_packed: any M)

The sweep times every variant of :func:`_variants` (rs_packed tiles x warpgroups x split-K,
non-persistent fewer-stage twins for occupancy, the plain-weight swap-AB kernel) on the
model-decode shapes of :data:`SHAPES`, each output checked against the exact reference,
and writes ``DIR/decode_probe.json`` / ``.md`` after every shape. ``--launch`` runs one
variant (or ``quack``) a few times with ``cudaProfilerStart/Stop`` around the last launch,
for ``ncu --profile-from-start off``. Times: ``cute_fp4.bench.Timer`` (CUDA-graph replay,
L2 flushed, median); "wTB/s" = weight bytes (N K / 2 + N K / 16) / time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (N, K): the three of issue 11 and a Llama-8B layer's projections (q/o, k+v, qkv fused,
# gate/up, gate+up fused, down)
SPLITS = (1, 2, 3, 4, 6, 8, 16)  # split-K reduced in the kernel (epilogue.store_split_k)
SHAPES = ((8192, 8192), (28672, 4096), (4096, 14336), (4096, 4096), (1024, 4096),
          (6144, 4096), (14336, 4096))
OCCUPANCY_STAGES = (4, 6, 8)  # "_np<stages>" variants: non-persistent, this many stages


def _variants():
    """label -> Schedule (built lazily: the catalogue is loaded on first use)."""
    from cute_fp4 import catalogue
    from cute_fp4.schedule import Warps

    d4 = catalogue.get("sm90_rs_packed_decode")  # 16 x 256 x 128, 4 consumer WGs
    d2 = d4.replace(tile=(16, 128, 128), warps=Warps(mma=(2, 1)))
    w2 = d4.replace(warps=Warps(mma=(2, 1)))  # 2 WGs x 128 rows
    sw = catalogue.get("sm90_decode_swapab")
    out = {}
    for sk in SPLITS:
        out[f"d4_s{sk}"] = d4.replace(split_k=sk)
        out[f"d2_s{sk}"] = d2.replace(split_k=sk)
        if sk <= 4:
            out[f"w2_s{sk}"] = w2.replace(split_k=sk)
            out[f"swap_s{sk}"] = sw.replace(split_k=sk)
        # occupancy: one CTA per work unit and fewer stages, so that several CTAs share an
        # SM (the persistent grid holds one per SM)
        for st in OCCUPANCY_STAGES:
            out[f"d4_s{sk}_np{st}"] = d4.replace(split_k=sk, persistent=False, stages=st)
            out[f"d2_s{sk}_np{st}"] = d2.replace(split_k=sk, persistent=False, stages=st)
    return out


def _providers(variants):
    from cute_fp4.bench import QUACK_W4A16, TORCH_BF16, cute_fp4_provider

    provs = [("torch_bf16", TORCH_BF16), ("quack", QUACK_W4A16),
             ("auto_plain", cute_fp4_provider("auto", "bf16"))]
    provs += [(label, cute_fp4_provider(s, "bf16")) for label, s in variants.items()]
    return provs


def _row(label, provider, ops, timer):
    import torch

    from cute_fp4.bench import check_output

    why = provider.status()
    if why:
        return {"label": label, "status": f"unavailable: {why}"}
    try:
        prep = provider.prepare(ops)
        prep.call()
        torch.cuda.synchronize()
        us, out = timer.timed(prep.call)
    except Exception as e:  # a row, never a crash
        return {"label": label, "status": f"error: {type(e).__name__}: {str(e)[:160]}"}
    chk = check_output(out, ops, "bf16", True)["check"]
    return {"label": label, "status": "ok", "us": round(us, 2), "check": chk,
            "schedule": prep.info.get("schedule_name", "")}


def _markdown(cases, env) -> str:
    labels = []
    for c in cases:
        for r in c["rows"]:
            if r["label"] not in labels:
                labels.append(r["label"])
    lines = [f"# decode probe: {env.get('gpu')}, torch {env.get('torch')}, {env.get('date')}",
             "", "us (CUDA graph, L2 flushed, median); FAIL = reference check failed", "",
             "| N x K | M | " + " | ".join(labels) + " | best cute | x torch | x QuACK | wTB/s |",
             "|" + "---|" * (len(labels) + 6)]
    for c in cases:
        us = {r["label"]: r for r in c["rows"]}
        cells = []
        for lb in labels:
            r = us.get(lb)
            cells.append("-" if r is None or r.get("status") != "ok" else
                         f"{r['us']:.1f}" + ("" if r["check"] == "ok" else " FAIL"))
        ok = [(r["us"], lb) for lb, r in us.items() if r.get("status") == "ok"
              and r["check"] == "ok" and lb not in ("torch_bf16", "quack")]
        best = min(ok) if ok else None
        t, q = us.get("torch_bf16", {}).get("us"), us.get("quack", {}).get("us")
        wbytes = c["N"] * c["K"] * (1 / 2 + 1 / 16)
        extra = ["-"] * 4 if best is None else [
            best[1], f"{t / best[0]:.2f}x" if t else "-", f"{q / best[0]:.2f}x" if q else "-",
            f"{wbytes / best[0] / 1e6:.2f}"]
        lines.append(f"| {c['N']} x {c['K']} | {c['M']} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines) + "\n"


def sweep(args) -> int:
    from cute_fp4.api import heuristic
    from cute_fp4.bench import Timer, bench_operands, cute_fp4_provider, environment

    deadline = time.monotonic() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    timer = Timer(args.reps)
    variants = {k: v for k, v in _variants().items() if not args.only or k in args.only}
    provs = _providers(variants)
    cases = []
    for m in args.ms:
        for n, k in SHAPES:
            if args.shapes and f"{n}x{k}" not in args.shapes:
                continue
            if time.monotonic() > deadline:
                break
            ops = bench_operands(m, n, k)
            packed = cute_fp4_provider(heuristic("sm90", m, n, k, packed=True), "bf16")
            rows = [_row(label, p, ops, timer) for label, p in
                    [*provs[:3], ("auto_packed", packed), *provs[3:]]]
            cases.append({"N": n, "K": k, "M": m, "rows": rows})
            print(f"{n}x{k} M={m}: " + " ".join(
                f"{r['label']}={r.get('us', r['status'][:40])}" for r in rows), flush=True)
            (out / "decode_probe.json").write_text(json.dumps({"env": env, "cases": cases},
                                                              indent=1, default=str))
            (out / "decode_probe.md").write_text(_markdown(cases, env))
    print(_markdown(cases, env))
    return 0


def launch(label: str, m: int, n: int, k: int) -> int:
    import torch

    from cute_fp4.bench import QUACK_W4A16, bench_operands, cute_fp4_provider

    ops = bench_operands(m, n, k)
    if label == "quack":
        prov = QUACK_W4A16
    elif label == "auto_plain":
        prov = cute_fp4_provider("auto", "bf16")
    elif label == "auto_packed":  # the packed heuristic's kernel, any M (NVFP4Linear's)
        from cute_fp4.api import heuristic

        prov = cute_fp4_provider(heuristic("sm90", m, n, k, packed=True), "bf16")
    else:
        prov = cute_fp4_provider(_variants()[label], "bf16")
    prep = prov.prepare(ops)
    for _ in range(3):
        prep.call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    prep.call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"launched {label} {m}x{n}x{k}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ms", type=int, nargs="*", default=[1])
    ap.add_argument("--only", nargs="*", default=[], help="variant labels to time (all)")
    ap.add_argument("--shapes", nargs="*", default=[], help="NxK shapes to time (all)")
    ap.add_argument("--launch", nargs=4, metavar=("LABEL", "M", "N", "K"))
    args = ap.parse_args(argv)
    if args.launch:
        label, *mnk = args.launch
        return launch(label, *(int(x) for x in mnk))
    if not args.out:
        ap.error("--out is required for the sweep")
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
