"""What bounds the weight-streaming decode kernel (``mainloop=stream``) on this GPU: its K loop
and its launch taken apart and varied, timed in one process beside torch BF16 and the read
floor of each weight.

    python perf/tools/stream_probe.py --out DIR [--budget-s 300] [--jobs 4] [--reps 2]
        [--labels base l2_4 ...]
    python perf/tools/stream_probe.py --launch LABEL M N K [--early]   # for Nsight Compute

Kernel variants (subclasses of :class:`~cute_fp4.kernels.stream.StreamGemm`, each compiled
for the schedule "auto" picks and, where it says so, split-K neighbours), each timed with
the launch's ``early`` flag off and on:

* ``base``: the kernel as committed (ring filled, dependents released, then the wait);
* ``norelease``: no ``griddepcontrol.launch_dependents`` (the next kernel launches as this
  one's CTAs exit, as before 2026-12-06);
* ``l2_4`` / ``l2_16``: ``l2_ahead`` batches of the CTA's units asked into L2
  (``cp.async.bulk.prefetch.L2``) beyond the ring;
* ``ctas4``: launch bounds of 4 CTAs per SM (at most 128 registers), at the auto split
  and twice it (4 CTAs per SM of work);
* ``kb_major`` (``kb_major_ctas4``): a unit's MMAs K block by K block, all four row
  groups' words live (146 registers on sm_90a), the order before 2026-12-06;
* ``load_only`` (the rings alone), ``compute_only`` (no loads), ``null`` (neither): the
  memory pipeline's rate, the K loop's, the fixed cost.

The probes' outputs are not products (unchecked); every other variant's output is checked
against the exact reference. The kernels are compiled first by ``--jobs`` processes (into
the disk cache; the GPU is idle then), then timed one at a time, ``--reps`` times
interleaved. Times: ``read_floor.time_copies``, 8 distinct weight copies per CUDA graph,
cold, per call; floor: ``read_floor.floor`` of the weight's bytes.
Writes ``DIR/stream_probe.json`` after every shape.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((1, 4096, 4096), (1, 8192, 8192), (1, 1024, 4096), (1, 4096, 14336),
          (1, 28672, 4096), (16, 8192, 8192))
KNOBS = {  # label -> class attributes
    "base": {}, "norelease": {"release": False}, "l2_4": {"l2_ahead": 4},
    "l2_16": {"l2_ahead": 16}, "ctas4": {"min_ctas": 4},
    "kb_major": {"group_major": False}, "kb_major_ctas4": {"group_major": False, "min_ctas": 4},
    "null": {}, "load_only": {}, "compute_only": {},
}
PROBES = ("null", "load_only", "compute_only")  # outputs that are not products
NEIGHBOURS = {"base": (2,), "ctas4": (2,)}  # also run at these multiples of the split
LABELS = ("base", "norelease", "l2_4", "l2_16", "ctas4", "load_only", "compute_only", "null")


def kernel_class(label: str):
    from cute_fp4.kernels.stream import StreamGemm
    from cute_fp4.planning.stream import RING

    attrs = dict(KNOBS[label])

    def __init__(self, schedule, problem):
        StreamGemm.__init__(self, schedule, problem)
        # plan() counts RING batches per warp; both ring regions grow with the depth
        self.plan_smem_bytes = self.plan_smem_bytes * self.ring // RING

    attrs["__init__"] = __init__
    if label in ("load_only", "null"):
        attrs["_unit"] = lambda self, *args: None
    if label in ("compute_only", "null"):
        attrs["_issue"] = lambda self, *args: None
    return type(f"StreamProbe_{label}", (StreamGemm,), attrs)


def schedules(m: int, n: int, k: int, labels=LABELS) -> list[tuple[str, object]]:
    """(label, schedule) pairs of one shape."""
    from cute_fp4.planning.common import MAX_SPLIT_K
    from cute_fp4.tuning import stream_decode_schedule

    auto = stream_decode_schedule("sm_90a", m, n, k)
    out = [(label, auto) for label in labels]
    units = k // 64
    for label in labels:
        for f in NEIGHBOURS.get(label, ()):
            split = int(auto.split_k * f)
            if 1 <= split <= MAX_SPLIT_K and units // split >= 4 and split != auto.split_k:
                out.append((label, auto.replace(split_k=split)))
    return out


def build(label: str, s):
    import importlib

    cmp = importlib.import_module("cute_fp4.compile")
    from cute_fp4.schedule import Problem

    kernel = kernel_class(label)(s, Problem(a_format="bf16"))
    return cmp._build(s, cmp.Signature("bf16"), kernel, f"+probe-{label}")


def all_jobs(labels=LABELS) -> list[tuple[str, object]]:
    seen, out = set(), []
    for m, n, k in SHAPES:
        for label, s in schedules(m, n, k, labels):
            if (label, s) not in seen:
                seen.add((label, s))
                out.append((label, s))
    return out


def compile_shard(i: int, n: int, labels=LABELS) -> None:
    for j, (label, s) in enumerate(all_jobs(labels)):
        if j % n == i:
            t0 = time.perf_counter()
            try:
                build(label, s)
                print(f"built {label} {s.label()} {time.perf_counter() - t0:.1f}s", flush=True)
            except Exception as e:
                print(f"FAILED {label} {s.label()}: {type(e).__name__}: {e}", flush=True)


def _prep(label, s, early, ops):
    """One weight copy's call of variant ``label`` (the flag ``early``)."""
    import torch
    from decode_bench import stream_launch

    from cute_fp4.packed import repack

    m, n, _ = ops.mnk
    kern = build(label, s)
    pw = repack(ops.b)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def call():
        stream_launch(kern, ops.a16, pw, out, early)
        return out
    return call, {"schedule": s.label(), "early": early}


def measure_all(out_dir: Path, deadline: float, reps: int, labels=LABELS) -> None:
    import read_floor
    from decode_bench import measure, providers

    from cute_fp4 import bench

    res = {"rows": [], "floors": {}, "env": bench.environment(),
           "date": time.strftime("%Y-%m-%d"),
           "formulas": {"weight_bytes": "N*K/2 + N*K/16", "timing": "read_floor.time_copies:"
                        " 8 weight copies per CUDA graph, L2 flushed before each replay, "
                        "median of 30 replays / 8"}}
    for m, n, k in SHAPES:
        if time.time() > deadline:
            break
        res["floors"][f"{n}x{k}"] = read_floor.FLOORS(n, k)
        ops = bench.bench_operands(m, n, k, seed=n + k + m)
        peers = [p for p in providers(m, n, k, []) if p[0] == "torch_bf16"]
        for rep in range(reps):  # repetitions interleaved: drift hits every variant alike
            for name, prep, fmt in peers:
                res["rows"].append(dict(measure(name, prep, fmt, ops), rep=rep))
            for label, s in schedules(m, n, k, labels):
                for early in ((False,) if label in PROBES else (False, True)):
                    if time.time() > deadline:
                        break
                    name = f"{label} split={s.split_k} stages={s.stages} early={int(early)}"
                    row = measure(name, functools.partial(_prep, label, s, early), "bf16",
                                  ops)
                    row.update(rep=rep, label=label, split=s.split_k, early=early)
                    if label in PROBES:
                        row["check"] = "probe: output not a product"
                        row["status"] = "ok" if "cold_us" in row else row["status"]
                    res["rows"].append(row)
                    print(json.dumps(row), flush=True)
        (out_dir / "stream_probe.json").write_text(json.dumps(res, indent=1, default=str))


def launch(label: str, m: int, n: int, k: int, early: bool = False) -> None:
    """A few launches of ``label`` at the "auto" schedule, the last one between
    cudaProfilerStart/Stop (for ``ncu --profile-from-start off``)."""
    import torch

    from cute_fp4 import bench
    from cute_fp4.tuning import stream_decode_schedule

    ops = bench.bench_operands(m, n, k)
    call, _ = _prep(label, stream_decode_schedule("sm_90a", m, n, k), early, ops)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shard", nargs=2, type=int, metavar=("I", "N"))
    ap.add_argument("--launch", nargs=4, metavar=("LABEL", "M", "N", "K"))
    ap.add_argument("--early", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="compile the variants "
                    "(into the disk cache) and exit")
    ap.add_argument("--labels", nargs="*", default=list(LABELS))
    args = ap.parse_args(argv)
    if args.shard:
        compile_shard(*args.shard, labels=args.labels)
        return 0
    if args.launch:
        launch(args.launch[0], *(int(x) for x in args.launch[1:]), early=args.early)
        return 0
    deadline = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), str(args.jobs),
                               "--labels", *args.labels],
                              stdout=open(out / f"compile-{i}.txt", "w"),
                              stderr=subprocess.STDOUT) for i in range(args.jobs)]
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.time()))
    if args.compile_only:
        return 0
    measure_all(out, deadline, args.reps, args.labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
