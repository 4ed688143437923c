"""Grouped GEMMs with offset tables that break the contract, on a GPU: for memcheck, and
the clamp's cost timed against the scheduler without it, in one process.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python3 perf/tools/grouped_offsets_check.py sanitize            # every grouped kernel
    ... python3 perf/tools/grouped_offsets_check.py sanitize --unclamped  # control: must fail
    python3 perf/tools/grouped_offsets_check.py time --out times.json

``sanitize`` runs every grouped catalogue schedule this GPU can run (SM120 ones emulated on
SM90) on each bad table of ``BAD`` with tensors of exactly their size (no caching
allocator: each tensor its own allocation, so memcheck sees any access outside one);
``--unclamped`` builds the kernels with the scheduler as it was before the clamp
(``UnclampedScheduler``), which memcheck must catch writing outside ``out``.
``time`` replays CUDA graphs of 20 launches of each grouped GEMM below, the clamped and
the unclamped build alternating, and reports the median time per launch of each and
their ratio (new / old).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cute_fp4 as cf  # noqa: E402
from cute_fp4 import catalogue, packed, run  # noqa: E402
from cute_fp4.compile import Signature, _build, compile, compile_emulated, retarget  # noqa: E402
from cute_fp4.kernels import sm90, sm120  # noqa: E402
from cute_fp4.kernels.scheduler import GroupedScheduler  # noqa: E402
from cute_fp4.operands import Operands  # noqa: E402
from cute_fp4.plan import plan  # noqa: E402
from cute_fp4.schedule import Mainloop, Problem  # noqa: E402
from cute_fp4.targets import require_device  # noqa: E402

M = 300
BAD = {"last_past_end": [0, 100, 200, M + 300], "negative": [0, 100, -50, M],
       "decreasing": [0, 250, 40, M], "first_not_zero": [37, 100, 200, M],
       "first_negative": [-200, 100, 200, M], "all_past_end": [400, 500, 600, 700]}


class UnclampedScheduler(GroupedScheduler):
    """The grouped scheduler before the clamp: a group's rows straight from the offsets
    (for the memcheck control and the timing baseline only)."""

    def rows(self, lo_offset, hi_offset):
        return lo_offset, hi_offset


def unclamped_kernel(s, fmt: str):
    """``s`` compiled with :class:`UnclampedScheduler` (native builds only)."""
    s = retarget(s, require_device().target.name)
    for mod in (sm90, sm120):
        mod.GroupedScheduler = UnclampedScheduler
    try:
        return _build(s, Signature(fmt), tag="+unclamped")
    finally:
        for mod in (sm90, sm120):
            mod.GroupedScheduler = GroupedScheduler


def runnable(family: str):
    """(schedule, A format, emulated) of every grouped schedule this GPU runs."""
    out = []
    for s in catalogue.all_schedules(grouped=True):
        emulated = s.arch.family == "sm120" and family == "sm90"
        if s.arch.family != family and not emulated:
            continue
        for fmt in ("bf16", "nvfp4") if s.arch.family == "sm90" else ("nvfp4",):
            if plan(s, Problem(a_format=fmt, groups=3)).ok:
                out.append((s, fmt, emulated))
    return out


def operands(s, fmt: str, m: int, n: int, k: int, experts: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    a = cf.quantize(x) if fmt == "nvfp4" else x.to(torch.bfloat16)
    b = cf.quantize(torch.randn(experts, n, k, generator=g, device="cuda"))
    return a, (packed.repack(b) if s.mainloop is Mainloop.RS_PACKED else b)


def sanitize(unclamped: bool) -> int:
    family = require_device().target.family
    cases = runnable(family)
    if unclamped:
        cases = [(s, f, e) for s, f, e in cases if not e and s.name == "sm90_grouped"][:1] \
            or [(s, f, e) for s, f, e in cases if not e][:1]
    n = 136
    for s, fmt, emulated in cases:
        if unclamped:
            kern = unclamped_kernel(s, fmt)
        else:
            kern = compile_emulated(s, Signature(fmt)) if emulated else compile(s, Signature(fmt))
        k = 192 if s.mainloop is Mainloop.RS_PACKED else 160
        a, b = operands(s, fmt, M, n, k, 3, seed=1)
        for name, offsets in BAD.items():
            offs = torch.tensor(offsets, dtype=torch.int32, device="cuda")
            out = torch.full((M, n), float("nan"), dtype=kern.out_dtype, device="cuda")
            run.run_grouped(kern, a, b, offs, out=out)
            torch.cuda.synchronize()
            print(f"{'unclamped ' if unclamped else ''}{s.name} {fmt}"
                  f"{' (emulated)' if emulated else ''} {name} {offsets}: ran", flush=True)
    print("done", flush=True)
    return 0


# (name, schedule, A format, tokens per expert, N, K)
TIMED = [
    ("prefill E=8 8192 tokens", "sm90_grouped", "bf16", [1024] * 8, 4096, 4096),
    ("ragged E=64 4752 tokens", "sm90_grouped", "bf16",
     [0, 3, 200, 17, 64, 1, 300, 9] * 8, 2048, 2048),
    ("large E=8 16384 tokens", "sm90_grouped_large", "nvfp4", [2048] * 8, 4096, 4096),
    ("decode E=128 16 tokens top-8", "sm90_grouped_decode", "bf16",
     [1] * 128, 1536, 4096),
]


def graph_of(kern, a, b, offs, out, reps: int = 20):
    alpha = operands.grouped_alpha(a, b, None, b.shape[0])
    a_data, a_scale = (a.data, a.scale) if isinstance(a, cf.NVFP4Tensor) else (a, None)

    def launch():
        for _ in range(reps):
            kern.launch(Operands(a_data, a_scale, b.data, b.scale, out, alpha, offsets=offs))

    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    return g, reps


def timed(g, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps  # us per launch


def time_all(out_path: str | None) -> int:
    rows = []
    for label, name, fmt, counts, n, k in TIMED:
        s = catalogue.get(name)
        a, b = operands(s, fmt, sum(counts), n, k, len(counts), seed=7)
        offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                            device="cuda")
        new, old = compile(s, Signature(fmt)), unclamped_kernel(s, fmt)
        outs = [torch.empty(sum(counts), n, dtype=torch.bfloat16, device="cuda")
                for _ in range(2)]
        graphs = [graph_of(kern, a, b, offs, o) for kern, o in ((new, outs[0]), (old, outs[1]))]
        torch.cuda.synchronize()
        same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
        for gr in graphs:  # warm
            timed(*gr)
        t_new, t_old = [], []
        for _ in range(25):
            t_new.append(timed(*graphs[0]))
            t_old.append(timed(*graphs[1]))
        row = {"case": label, "schedule": name, "a_format": fmt, "experts": len(counts),
               "total_m": sum(counts), "n": n, "k": k,
               "new_us": round(statistics.median(t_new), 2),
               "old_us": round(statistics.median(t_old), 2),
               "new_min_us": round(min(t_new), 2), "old_min_us": round(min(t_old), 2),
               "bit_identical": same}
        row["ratio_new_over_old"] = round(row["new_us"] / row["old_us"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out_path:
        Path(out_path).write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["sanitize", "time"])
    p.add_argument("--unclamped", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "sanitize":
        return sanitize(args.unclamped)
    return time_all(args.out)


if __name__ == "__main__":
    sys.exit(main())
