"""What bounds the weight-streaming decode kernel (``mainloop=stream``) on this GPU: its K loop
taken apart and varied, timed in one process beside torch BF16 and QuACK.

    python perf/tools/stream_probe.py --out DIR [--budget-s 300] [--jobs 4] [--reps 3]
    python perf/tools/stream_probe.py --launch LABEL M N K    # one variant, for Nsight Compute

Kernel variants (subclasses of :class:`~cute_fp4.kernels.stream.StreamGemm`, each compiled
for the schedule "auto" picks and a few split / stages neighbours):

* ``base``: the kernel as committed;
* ``load_only``: the rings only (the decode and MMA skipped): the memory pipeline's own rate;
* ``compute_only``: no loads (the decode and MMA of whatever the rings hold): the K loop's
  issue rate;
* ``null``: neither (launch, the shared-memory sum, the split-K reduction, the store): the
  fixed cost;
* ``per_kb_loads``: the activation pairs loaded per K block, next to their MMAs (the
  kernel before they were hoisted to the unit's start);
* ``ring3``: two batches in flight per warp instead of one;
* ``dual``: a batch's even and odd units into two accumulator sets.

The probes' outputs are not products (unchecked); every other variant's output is checked
against the exact reference. The kernels are compiled first by ``--jobs`` processes (into
the disk cache; the GPU is idle then), then timed one at a time. Times: CUDA-graph replay,
median of 30, cold (L2 flushed) and warm; TB/s = weight bytes (N K / 2 + N K / 16) / time.
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

SHAPES = ((1, 8192, 8192), (1, 28672, 4096), (1, 4096, 14336), (1, 1024, 4096),
          (16, 8192, 8192))
KNOBS = {  # label -> class attributes
    "base": {}, "null": {}, "load_only": {}, "compute_only": {},
    "per_kb_loads": {"act_hoist": False}, "ring3": {"ring": 3}, "dual": {"dual_acc": True},
}
PROBES = ("null", "load_only", "compute_only")  # outputs that are not products
NEIGHBOURS = ("base", "per_kb_loads")  # also run at split x2 / x0.5 and stages 1 / 4


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


def schedules(m: int, n: int, k: int) -> list[tuple[str, object]]:
    """(label, schedule) pairs of one shape."""
    from cute_fp4.planning.common import MAX_SPLIT_K
    from cute_fp4.tuning import stream_decode_schedule

    auto = stream_decode_schedule("sm_90a", m, n, k)
    out = [(label, auto) for label in KNOBS]
    units = k // 64
    for label in NEIGHBOURS:
        for split in (auto.split_k * 2, auto.split_k // 2):
            if 1 <= split <= MAX_SPLIT_K and units // split >= 4:
                out.append((label, auto.replace(split_k=split)))
        for stages in (1, 4):
            out.append((label, auto.replace(stages=stages)))
    return out


def build(label: str, s):
    import importlib

    cmp = importlib.import_module("cute_fp4.compile")
    from cute_fp4.schedule import Problem

    kernel = kernel_class(label)(s, Problem(a_format="bf16"))
    return cmp._build(s, cmp.Signature("bf16"), kernel, f"+probe-{label}")


def all_jobs() -> list[tuple[str, object]]:
    seen, out = set(), []
    for m, n, k in SHAPES:
        for label, s in schedules(m, n, k):
            if (label, s) not in seen:
                seen.add((label, s))
                out.append((label, s))
    return out


def compile_shard(i: int, n: int) -> None:
    for j, (label, s) in enumerate(all_jobs()):
        if j % n == i:
            t0 = time.perf_counter()
            try:
                build(label, s)
                print(f"built {label} {s.label()} {time.perf_counter() - t0:.1f}s", flush=True)
            except Exception as e:
                print(f"FAILED {label} {s.label()}: {type(e).__name__}: {e}", flush=True)


def _call(label, s, ops):
    import torch

    from cute_fp4.operands import alpha_tensor
    from cute_fp4.packed import repack
    from cute_fp4.run import run_compiled

    m, n, _ = ops.mnk
    kern = build(label, s)
    pw = repack(ops.b)
    alpha = alpha_tensor(ops.a16, pw, None)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    return lambda: run_compiled(kern, ops.a16, pw, out=out, alpha=alpha)


def _prep(label, s, ops):
    return _call(label, s, ops), {}


def measure_all(out_dir: Path, deadline: float, reps: int) -> None:
    from decode_bench import measure, providers

    from cute_fp4 import bench

    timers = {"cold": bench.Timer(reps=30, flush=True),
              "warm": bench.Timer(reps=30, flush=False)}
    res = {"rows": [], "env": bench.environment(), "date": time.strftime("%Y-%m-%d"),
           "formulas": {"weight_bytes": "N*K/2 + N*K/16", "timing": "CUDA-graph replay, "
                        "median of 30; cold: L2 flushed before each replay; warm: not"}}
    for m, n, k in SHAPES:
        if time.time() > deadline:
            break
        ops = bench.bench_operands(m, n, k, seed=n + k + m)
        peers = [p for p in providers(ops, []) if p[0] in ("torch_bf16", "quack_w4a16")]
        for rep in range(reps):  # repetitions interleaved: drift hits every variant alike
            for name, prep, fmt in peers:
                res["rows"].append(dict(measure(name, prep, fmt, ops, timers), rep=rep))
            for label, s in schedules(m, n, k):
                if time.time() > deadline:
                    break
                name = f"{label} split={s.split_k} stages={s.stages}"
                prep = functools.partial(_prep, label, s, ops)
                row = measure(name, prep, "bf16", ops, timers)
                row["rep"] = rep
                if label in PROBES:
                    row["check"] = "probe: output not a product"
                    row["status"] = "ok" if "cold_us" in row else row["status"]
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        (out_dir / "stream_probe.json").write_text(json.dumps(res, indent=1, default=str))


def launch(label: str, m: int, n: int, k: int) -> None:
    """A few launches of ``label`` at the "auto" schedule, the last one between
    cudaProfilerStart/Stop (for ``ncu --profile-from-start off``)."""
    import torch

    from cute_fp4 import bench
    from cute_fp4.tuning import stream_decode_schedule

    ops = bench.bench_operands(m, n, k)
    call = _call(label, stream_decode_schedule("sm_90a", m, n, k), ops)
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
    args = ap.parse_args(argv)
    if args.shard:
        compile_shard(*args.shard)
        return 0
    if args.launch:
        launch(args.launch[0], *(int(x) for x in args.launch[1:]))
        return 0
    deadline = time.time() + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), str(args.jobs)],
                              stdout=open(out / f"compile-{i}.txt", "w"),
                              stderr=subprocess.STDOUT) for i in range(args.jobs)]
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.time()))
    measure_all(out, deadline, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
