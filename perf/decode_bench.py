"""Decode GEMMs (M = 1..16) against the weight bytes: torch BF16, QuACK W4A16 and cute_fp4.

    python perf/decode_bench.py --out DIR [--quick] [--variants] [--ms 1 4 16]
    python perf/decode_bench.py --profile PROVIDER M N K    # launches for Nsight Compute

One process, one NVFP4 weight per shape shared by every provider, every output checked
against the exact reference (``cute_fp4.bench.check_output``) before its time counts.
Device time of a CUDA-graph replay (``cute_fp4.bench.Timer``), twice: with L2 flushed
before every replay (``cold``: the weight comes from HBM, as in a model whose layers
together exceed the L2) and without (``warm``). Providers:

* ``torch_bf16``: cuBLAS on the weight's exact BF16 values (what the NVFP4 model replaces);
* ``quack_w4a16``: QuACK's ``gemm_w4a16(wformat="nvfp4")`` when ``import quack`` works;
* ``nvfp4linear_w4a16`` / ``nvfp4linear_w4a4``: ``cute_fp4.nn.NVFP4Linear`` forward, the
  call path of a converted model (``schedule="auto"``; W4A4 with a calibrated static input
  scale: its activation kernel and the GEMM);
* ``rs_packed_decode``: the register-sourced WGMMA decode schedule ``auto`` picked before
  the stream kernel (``cute_fp4.api.packed_decode_schedule``), for a same-run comparison;
* with ``--variants``: ``stream`` schedules over tile M, split-K and units in flight.

``--profile`` prepares one provider (``stream`` for the stream kernel "auto" picks,
``rs_packed_decode``, ``torch_bf16``, ``quack_w4a16``) and launches it five times between
``cudaProfilerStart``/``Stop``, for ``ncu --profile-from-start off``.

Floors: the weight and scale bytes (``N K / 2 + N K / 16``) at the H200's 4.8 TB/s peak
and at 4.0 TB/s (what torch BF16 reaches on large weights here). Writes
``DIR/decode_bench.json`` (every row, the environment) and ``DIR/decode_bench.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = [(8192, 8192), (28672, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]
QUICK = [(8192, 8192), (1024, 4096)]
PEAK_TBS = 4.8
TORCH_TBS = 4.0


def weight_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def _linear(w, mode: str, x):
    from cute_fp4.nn import NVFP4Linear

    scale = None
    if mode == "w4a4":
        scale = float(x.abs().max()) / 2688.0  # calibrated on this very input
    return NVFP4Linear(w, mode=mode, input_scale=scale)


def providers(ops, variants: list) -> list:
    """(name, prepare) pairs; ``prepare()`` returns a graph-capturable call and info."""
    from cute_fp4 import bench
    from cute_fp4.api import packed_decode_schedule, stream_decode_schedule
    from cute_fp4.compile import Signature, compile
    from cute_fp4.operands import alpha_tensor
    from cute_fp4.packed import repack
    from cute_fp4.run import run_compiled

    m, n, k = ops.mnk
    pw = repack(ops.b)
    alpha = alpha_tensor(ops.a16, pw, None)

    def schedule_call(s):
        def prep():
            kern = compile(s, Signature("bf16"))
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            return (lambda: run_compiled(kern, ops.a16, pw, out=out, alpha=alpha),
                    {"schedule": s.name or s.label()})
        return prep

    def layer(mode):
        def prep():
            lin = _linear(ops.b, mode, ops.a16)
            with torch.no_grad():
                lin(ops.a16)
            return (lambda: lin(ops.a16)), {"layout": lin.layout}
        return prep

    def peer(p):
        def prep():
            why = p.status()
            if why:
                raise bench.Unavailable(why)
            r = p.prepare(ops)
            return r.call, r.info
        return prep

    out = [("torch_bf16", peer(bench.TORCH_BF16), "bf16"),
           ("quack_w4a16", peer(bench.QUACK_W4A16), "bf16"),
           ("nvfp4linear_w4a16", layer("w4a16"), "bf16"),
           ("nvfp4linear_w4a4", layer("w4a4"), "nvfp4"),
           ("rs_packed_decode", schedule_call(packed_decode_schedule(n, k)), "bf16"),
           ("stream_auto", schedule_call(stream_decode_schedule(_target(), m, n, k)), "bf16")]
    for s in variants:
        out.append((f"stream {s.label()}", schedule_call(s), "bf16"))
    return out


def _target() -> str:
    from cute_fp4.targets import require_device

    return require_device().target.name


def variant_schedules(m: int, n: int, k: int) -> list:
    from cute_fp4.planning.stream import stream_schedule

    tm = 8 if m <= 8 else 16
    units = k // 64
    return [stream_schedule(_target(), tm, split, stages) for split in (1, 2, 4, 8, 16)
            if split * 4 <= units for stages in (1, 2, 4)]


def measure(name, prep, a_format, ops, timers) -> dict:
    from cute_fp4 import bench

    m, n, k = ops.mnk
    row = {"M": m, "N": n, "K": k, "provider": name}
    try:
        call, info = prep()
        row.update(info)
        for label, timer in timers.items():
            us, out = timer.timed(call)
            row[f"{label}_us"] = round(us, 2)
            row[f"{label}_TB/s"] = round(weight_bytes(n, k) / us / 1e6, 3)
        exact = name != "nvfp4linear_w4a4"
        row.update(bench.check_output(out[..., :n].reshape(m, n), ops,
                                      a_format if exact else "bf16", exact))
        if not exact:  # W4A4: the exact products of the quantized activation
            row.update({f"w4a4_{k_}": v for k_, v in
                        bench.check_output(out.reshape(m, n), ops, "nvfp4", True).items()})
        row["status"] = "ok"
    except bench.Unavailable as e:
        row["status"] = f"unavailable: {e}"
    except Exception as e:  # keep measuring the others
        row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    return row


def run(shapes, ms, variants: bool) -> dict:
    from cute_fp4 import bench

    timers = {"cold": bench.Timer(reps=30, flush=True),
              "warm": bench.Timer(reps=30, flush=False)}
    rows = []
    for n, k in shapes:
        for m in ms:
            ops = bench.bench_operands(m, n, k, seed=n + k + m)
            floor = weight_bytes(n, k) / PEAK_TBS / 1e6
            vs = variant_schedules(m, n, k) if variants else []
            for name, prep, fmt in providers(ops, vs):
                row = measure(name, prep, fmt, ops, timers)
                row["floor_peak_us"] = round(floor, 2)
                row["floor_4TBs_us"] = round(weight_bytes(n, k) / TORCH_TBS / 1e6, 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows, "env": bench.environment(), "date": time.strftime("%Y-%m-%d"),
            "formulas": {"weight_bytes": "N*K/2 + N*K/16", "peak_TB/s": PEAK_TBS,
                         "timing": "CUDA-graph replay, median of 30; cold: L2 flushed "
                                   "(256 MiB read) before each replay; warm: not"}}


def ratios(res: dict) -> list[dict]:
    """Per (M, N, K): the best stream variant and each provider against torch and QuACK."""
    by = {}
    for r in res["rows"]:
        if r.get("status") == "ok":
            by.setdefault((r["M"], r["N"], r["K"]), {})[r["provider"]] = r
    out = []
    for (m, n, k), p in sorted(by.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        line = {"M": m, "N": n, "K": k}
        for t in ("cold", "warm"):
            bf = p.get("torch_bf16", {}).get(f"{t}_us")
            qk = p.get("quack_w4a16", {}).get(f"{t}_us")
            streams = {name: r[f"{t}_us"] for name, r in p.items() if name.startswith("stream")}
            for name in ("nvfp4linear_w4a16", "nvfp4linear_w4a4", "rs_packed_decode",
                         "stream_auto"):
                us = p.get(name, {}).get(f"{t}_us")
                if us:
                    line[f"{t}_{name}_us"] = us
                    line[f"{t}_{name}_x_bf16"] = round(bf / us, 2) if bf else None
                    line[f"{t}_{name}_x_quack"] = round(qk / us, 2) if qk else None
            if streams:
                best = min(streams, key=streams.get)
                line[f"{t}_best_stream"] = best
                line[f"{t}_best_stream_us"] = streams[best]
                line[f"{t}_best_stream_x_bf16"] = round(bf / streams[best], 2) if bf else None
            line[f"{t}_torch_bf16_us"], line[f"{t}_quack_us"] = bf, qk
        out.append(line)
    return out


def render_md(res: dict) -> str:
    env = res["env"]
    lines = [f"# Decode GEMMs, {res['date']}", "",
             f"GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
             f"CuTe DSL {env.get('cutlass_dsl')}, QuACK {env.get('quack_kernels')}.",
             f"Timing: {res['formulas']['timing']}. Weight bytes "
             f"{res['formulas']['weight_bytes']}; TB/s columns are weight bytes / time.", ""]
    for t in ("cold", "warm"):
        lines += [f"## {t}", "",
                  "| N x K | M | torch BF16 us | QuACK us | W4A16 us | x BF16 | x QuACK | "
                  "W4A4 us | W4A4/W4A16 | rs_packed us | stream us | floor 4.8 TB/s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ratios(res):
            a16 = r.get(f"{t}_nvfp4linear_w4a16_us")
            a4 = r.get(f"{t}_nvfp4linear_w4a4_us")
            floor = next(x["floor_peak_us"] for x in res["rows"]
                         if (x["M"], x["N"], x["K"]) == (r["M"], r["N"], r["K"]))
            lines.append(
                f"| {r['N']} x {r['K']} | {r['M']} | {r.get(f'{t}_torch_bf16_us')} | "
                f"{r.get(f'{t}_quack_us')} | {a16} | "
                f"{r.get(f'{t}_nvfp4linear_w4a16_x_bf16')} | "
                f"{r.get(f'{t}_nvfp4linear_w4a16_x_quack')} | {a4} | "
                f"{round(a4 / a16, 2) if a4 and a16 else None} | "
                f"{r.get(f'{t}_rs_packed_decode_us')} | {r.get(f'{t}_stream_auto_us')} | "
                f"{floor} |")
        lines.append("")
    bad = [r for r in res["rows"] if r.get("status") == "ok" and r.get("check") != "ok"
           and r["provider"] != "nvfp4linear_w4a4"]
    bad += [r for r in res["rows"] if r["provider"] == "nvfp4linear_w4a4"
            and r.get("status") == "ok" and r.get("w4a4_check") != "ok"]
    lines.append(f"Outputs failing the exact reference: {len(bad)}.")
    return "\n".join(lines) + "\n"


def profile(name: str, m: int, n: int, k: int) -> None:
    from cute_fp4 import bench
    ops = bench.bench_operands(m, n, k)
    table = {p[0]: p[1] for p in providers(ops, [])}
    table["stream"] = table["stream_auto"]
    call, info = table[name]()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {name} {m}x{n}x{k}: {info}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--profile", nargs=4, metavar=("PROVIDER", "M", "N", "K"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        profile(args.profile[0], *(int(x) for x in args.profile[1:]))
        return 0
    if not args.out:
        ap.error("--out is required (or --profile)")
    res = run(QUICK if args.quick else SHAPES, args.ms, args.variants)
    res["ratios"] = ratios(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "decode_bench.md").write_text(render_md(res))
    print(render_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
