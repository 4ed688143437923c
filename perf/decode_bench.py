"""Decode GEMMs (M = 1..16) against what this GPU can read: torch BF16 and FP8, QuACK
W4A16 and cute_fp4, each beside the read floor of its weight, timed in the same run.

    python perf/decode_bench.py --out DIR [--quick] [--variants] [--ms 1 4 16]
    python perf/decode_bench.py --profile PROVIDER M N K    # launches for Nsight Compute

One process, one NVFP4 weight per shape, 8 distinct copies of it per provider (each copy
prepared as the provider prepares a weight, so each reads its own bytes), every output
checked against the exact reference (``cute_fp4.bench.check_output``) before its time
counts. Time: the 8 copies' calls back to back in one CUDA graph, L2 flushed before every
replay (cold: each weight comes from device memory, as a decoder's layers do), median of
30 replays, divided by 8 (``read_floor.time_copies``): launches overlap as they do in a
decoder's chain, a kernel's ramp-up and tail are paid as there. The floor of each shape
is ``read_floor.floor``: a plain streaming read of exactly the weight's bytes (``N K / 2
+ N K / 16``), timed the same way; every row says time / floor. Providers:

* ``torch_bf16``: cuBLAS on the weight's exact BF16 values (what the NVFP4 model replaces);
* ``torch_fp8``: ``torch._scaled_mm`` with per-tensor scales (FP8 bytes: 1.8x NVFP4's);
* ``quack_w4a16``: QuACK's ``gemm_w4a16(wformat="nvfp4")`` when ``import quack`` works;
* ``nvfp4linear_w4a16`` / ``nvfp4linear_w4a4``: ``cute_fp4.nn.NVFP4Linear`` forward, the
  call path of a converted model (``schedule="auto"``; W4A4 with a calibrated static input
  scale: its activation kernel and the GEMM);
* ``stream`` / ``stream_early``: the weight-streaming kernel "auto" picks at this M
  (``tuning.stream_decode_schedule``; tile M 16 at M > 8) with the launch's ``early``
  flag off and on (the weight read before the wait: each copy's weight is prepared before
  the timing, so the rule of kernels/stream.py holds);
* with ``--variants``: ``stream`` schedules over tile M, split-K and units in flight.

``--profile`` prepares one provider (``stream``, ``stream_early``, ``torch_bf16``, ...)
and launches it five times between ``cudaProfilerStart``/``Stop``, for ``ncu
--profile-from-start off``. Writes ``DIR/decode_bench.json`` (every row, the floors, the
environment) and ``DIR/decode_bench.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import read_floor  # noqa: E402
from outputs import write_outputs  # noqa: E402

SHAPES = [(1024, 4096), (4096, 4096), (4096, 14336), (8192, 8192), (28672, 4096),
          (28672, 8192), (128256, 4096)]
QUICK = [(8192, 8192), (1024, 4096)]
weight_bytes = read_floor.weight_bytes


def _linear(w, mode: str, x):
    from cute_fp4.nn import NVFP4Linear

    scale = None
    if mode == "w4a4":
        scale = float(x.abs().max()) / 2688.0  # calibrated on this very input
    return NVFP4Linear(w, mode=mode, input_scale=scale)


def weight_copy(ops):
    """``ops`` with a copy of its weight in new memory (the same values)."""
    from cute_fp4.nvfp4 import NVFP4Tensor

    b = ops.b
    return dataclasses.replace(ops, b=NVFP4Tensor(b.data.clone(), b.scale.clone(),
                                                  b.global_scale), memo={})


def stream_launch(kern, a, w, out, early: bool) -> None:
    """Launch the compiled stream kernel on the current stream with the launch's ``early``
    flag (``operands.Operands.early``), as a prepared layer with ``prefetch_weights`` does."""
    from cute_fp4.operands import Operands, alpha_tensor
    from cute_fp4.workspaces import split_workspace

    m, n = out.shape
    ws = split_workspace(kern, m, n, out.device) if kern.schedule.split_k > 1 else None
    kern.launch(Operands(a, None, w.data, w.scale, out, alpha_tensor(a, w, None), ws,
                         early=early))


@contextlib.contextmanager
def early_weights():
    """Inside: every dense launch of the stream kernel through the package's launch path
    (``CompiledGemm.raw_args``: NVFP4Linear, gemm, their bindings and graphs) sets the
    ``early`` flag. For benchmarks of weights that no kernel writes while it is on (a
    prepared layer passes the flag per weight instead: ``Linear.prefetch_weights``)."""
    from cute_fp4.compile import CompiledGemm
    from cute_fp4.schedule import Mainloop

    plain = CompiledGemm.raw_args

    def raw_args(self, ops):
        s = self.schedule
        if s.mainloop is Mainloop.STREAM and not s.scheduler.grouped:
            ops = ops._replace(early=True)
        return plain(self, ops)

    CompiledGemm.raw_args = raw_args
    try:
        yield
    finally:
        CompiledGemm.raw_args = plain


def providers(m: int, n: int, k: int, variants: list) -> list:
    """(name, prepare, A format) triples; ``prepare(ops)`` returns a graph-capturable call
    on ``ops``'s weight and an info dict."""
    from cute_fp4 import bench
    from cute_fp4.compile import Signature, compile
    from cute_fp4.packed import repack
    from cute_fp4.tuning import stream_decode_schedule

    def stream(s, early):
        def prep(ops):
            kern = compile(s, Signature("bf16"))
            pw = repack(ops.b)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def call():
                stream_launch(kern, ops.a16, pw, out, early)
                return out
            return call, {"schedule": s.label(), "early": early}
        return prep

    def layer(mode):
        def prep(ops):
            lin = _linear(ops.b, mode, ops.a16)
            with torch.no_grad():
                lin(ops.a16)
            return (lambda: lin(ops.a16)), {"layout": lin.layout}
        return prep

    def peer(p):
        def prep(ops):
            why = p.status()
            if why:
                raise bench.Unavailable(why)
            r = p.prepare(ops)
            return r.call, r.info
        return prep

    auto = stream_decode_schedule(_target(), m, n, k)
    out = [("torch_bf16", peer(bench.TORCH_BF16), "bf16"),
           ("torch_fp8", peer(bench.TORCH_FP8), "bf16"),
           ("quack_w4a16", peer(bench.QUACK_W4A16), "bf16"),
           ("nvfp4linear_w4a16", layer("w4a16"), "bf16"),
           ("nvfp4linear_w4a4", layer("w4a4"), "nvfp4"),
           ("stream", stream(auto, False), "bf16"),
           ("stream_early", stream(auto, True), "bf16")]
    for s in variants:
        out.append((f"stream {s.label()}", stream(s, False), "bf16"))
        out.append((f"stream_early {s.label()}", stream(s, True), "bf16"))
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


def measure(name, prep, a_format, ops, copies: int = read_floor.COPIES) -> dict:
    """One provider on ``copies`` copies of ``ops``'s weight: time per call (cold) and the
    check of the first and last copy's outputs."""
    from cute_fp4 import bench

    m, n, k = ops.mnk
    row = {"M": m, "N": n, "K": k, "provider": name}
    try:
        calls = []
        for i in range(copies):
            call, info = prep(ops if i == 0 else weight_copy(ops))
            calls.append(call)
        row.update(info)
        us, outs = read_floor.time_copies(calls)
        row["cold_us"] = round(us, 2)
        row["TB/s"] = round(weight_bytes(n, k) / us / 1e6, 3)
        exact = name not in ("nvfp4linear_w4a4", "torch_fp8")
        for out in (outs[0], outs[-1]):
            got = bench.check_output(out[..., :n].reshape(m, n), ops,
                                     a_format if exact else "bf16", exact)
            if row.get("check", "ok") == "ok":
                row.update(got)
        if name == "nvfp4linear_w4a4":  # the exact products of the quantized activation
            row.update({f"w4a4_{k_}": v for k_, v in
                        bench.check_output(outs[-1].reshape(m, n), ops, "nvfp4",
                                           True).items()})
        row["status"] = "ok"
    except bench.Unavailable as e:
        row["status"] = f"unavailable: {e}"
    except Exception as e:  # keep measuring the others
        row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    finally:
        calls = outs = None
        torch.cuda.empty_cache()
    return row


def run(shapes, ms, variants: bool, only: set | None = None) -> dict:
    from cute_fp4 import bench

    rows, floors = [], {}
    for n, k in shapes:
        floors[f"{n}x{k}"] = fl = read_floor.FLOORS(n, k)
        print(json.dumps({"floor": f"{n}x{k}", **fl}), file=sys.stderr, flush=True)
        for m in ms:
            ops = bench.bench_operands(m, n, k, seed=n + k + m)
            vs = variant_schedules(m, n, k) if variants else []
            for name, prep, fmt in providers(m, n, k, vs):
                if only and name not in only:
                    continue
                row = measure(name, prep, fmt, ops)
                row["floor_us"] = fl["floor_us"]
                if "cold_us" in row:
                    row["floor_over_time"] = round(fl["floor_us"] / row["cold_us"], 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows, "floors": floors, "env": bench.environment(),
            "date": time.strftime("%Y-%m-%d"),
            "formulas": {"weight_bytes": "N*K/2 + N*K/16",
                         "floor": "read_floor.floor: a plain read of the weight bytes, "
                                  "8 copies per graph, cold, best of read_floor.CONFIGS",
                         "timing": "8 distinct weight copies per CUDA graph, L2 flushed "
                                   "(256 MiB read) before each replay, median of 30 "
                                   "replays / 8"}}


def ratios(res: dict) -> list[dict]:
    """Per (M, N, K): every provider's time, its floor / time, and its speed-up over the
    peers (peer time / its time)."""
    by = {}
    for r in res["rows"]:
        if r.get("status") == "ok" and (r.get("check") == "ok" or r.get("check") == "inexact"):
            by.setdefault((r["M"], r["N"], r["K"]), {})[r["provider"]] = r
    out = []
    for (m, n, k), p in sorted(by.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        line = {"M": m, "N": n, "K": k, "floor_us": res["floors"][f"{n}x{k}"]["floor_us"]}
        peers = {q: p[q]["cold_us"] for q in ("torch_bf16", "torch_fp8", "quack_w4a16")
                 if q in p}
        for name, r in p.items():
            us = r["cold_us"]
            line[f"{name}_us"] = us
            line[f"{name}_floor_over_time"] = round(line["floor_us"] / us, 3)
            for q, qus in peers.items():
                if q != name:
                    line[f"{name}_x_{q}"] = round(qus / us, 2)
        out.append(line)
    return out


COLUMNS = (("torch_bf16", "torch BF16"), ("torch_fp8", "cuBLAS FP8"),
           ("quack_w4a16", "QuACK"), ("nvfp4linear_w4a16", "W4A16 (auto)"),
           ("nvfp4linear_w4a4", "W4A4 (auto)"), ("stream", "stream"),
           ("stream_early", "stream early"))


def render_md(res: dict) -> str:
    env = res["env"]
    lines = [f"# Decode GEMMs against the read floor, {res['date']}", "",
             f"GPU {env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, "
             f"CuTe DSL {env.get('cute_dsl')}, QuACK {env.get('quack_kernels')}.",
             f"Timing: {res['formulas']['timing']}. Weight bytes "
             f"{res['formulas']['weight_bytes']}; floor: {res['formulas']['floor']}. "
             "Cells: us per call, and floor / time.", "",
             "| N x K | M | floor us | " + " | ".join(c for _, c in COLUMNS)
             + " | early x BF16 | early x FP8 | early x QuACK |",
             "|---|---|---|" + "---|" * (len(COLUMNS) + 3)]
    for r in ratios(res):
        cells = []
        for name, _ in COLUMNS:
            us = r.get(f"{name}_us")
            cells.append("-" if us is None else
                         f"{us} ({r[f'{name}_floor_over_time']:.2f})")
        lines.append(f"| {r['N']} x {r['K']} | {r['M']} | {r['floor_us']} | "
                     + " | ".join(cells) + " | "
                     + " | ".join(str(r.get(f"stream_early_x_{q}", "-"))
                                  for q in ("torch_bf16", "torch_fp8", "quack_w4a16"))
                     + " |")
    bad = [r for r in res["rows"] if r.get("status") == "ok" and r.get("check") == "FAIL"]
    bad += [r for r in res["rows"] if r["provider"] == "nvfp4linear_w4a4"
            and r.get("status") == "ok" and r.get("w4a4_check") != "ok"]
    lines += ["", f"Outputs failing the exact reference: {len(bad)}."]
    return "\n".join(lines) + "\n"


def profile(name: str, m: int, n: int, k: int) -> None:
    from cute_fp4 import bench

    ops = bench.bench_operands(m, n, k)
    table = {p[0]: p[1] for p in providers(m, n, k, [])}
    call, info = table[name](ops)
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
    ap.add_argument("--shapes", nargs="*", help="N,K pairs (default: the issue's seven)")
    ap.add_argument("--providers", nargs="*", help="only these providers")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        profile(args.profile[0], *(int(x) for x in args.profile[1:]))
        return 0
    if not args.out:
        ap.error("--out is required (or --profile)")
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes
              else QUICK if args.quick else SHAPES)
    res = run(shapes, args.ms, args.variants, set(args.providers or ()))
    res["ratios"] = ratios(res)
    write_outputs(args.out, "decode_bench", res, render_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
