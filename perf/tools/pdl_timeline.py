"""A timeline of decode GEMMs in a row: does the next kernel start before the one before it
ends, and by how much, with the stream kernel's ``early`` flag off and on.

    python perf/tools/pdl_timeline.py --out DIR [--shapes 8192,8192 4096,4096] [--chain 8]

For each shape, ``--chain`` distinct weights (M = 1) run back to back on one stream, their
activations chained (each GEMM reads the output of the one before, as a decoder's
projections do), captured in one CUDA graph; one replay (L2 flushed first) is recorded
with ``torch.profiler`` (CUPTI kernel records: start and end of every kernel of the graph).
Per pair of neighbours: ``gap_us`` = next start - previous end (negative: the next kernel
was resident and running, its weight loads issued, before the previous one ended); and the
graph's replay time per GEMM, median of 30 cold replays, beside the read floor. Writes
``DIR/pdl_timeline.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chain_calls(n: int, k: int, chain: int, early: bool):
    """(the chain's call, its first input, its outputs) of ``chain`` square-ish GEMMs: the
    first reads x [1, k]; GEMM i reads GEMM i-1's output (so n == k or one GEMM in all)."""
    from decode_bench import stream_launch

    from cute_fp4.compile import Signature, compile
    from cute_fp4.operands import make_operands
    from cute_fp4.packed import repack
    from cute_fp4.tuning import stream_decode_schedule

    kern = compile(stream_decode_schedule(_target(), 1, n, k), Signature("bf16"))
    pws = [repack(make_operands(1, n, k, "bf16", seed=i)[1]) for i in range(chain)]
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    outs = [torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for _ in range(chain)]

    def call():
        src = x
        for pw, o in zip(pws, outs):
            stream_launch(kern, src if n == k else x, pw, o, early)
            src = o
        return outs[-1]

    return call, kern.schedule.label()


def _target() -> str:
    from cute_fp4.targets import require_device

    return require_device().target.name


def timeline(call) -> dict:
    """One cold replay of ``call`` captured in a graph, profiled; and 30 cold replays timed."""
    import read_floor

    g, _ = read_floor.capture(call)
    g.replay()
    torch.cuda.synchronize()
    read_floor.flush_l2()
    torch.cuda.synchronize()
    evs = [{**e, "name": e["name"][:80]} for e in read_floor.kernel_timeline(g.replay)]
    gaps = [round(b["start"] - a["end"], 2) for a, b in zip(evs, evs[1:])]
    times = []
    for _ in range(30):
        read_floor.flush_l2()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return {"kernels": evs, "gaps_us": gaps, "overlapping_pairs": sum(gp < 0 for gp in gaps),
            "replay_us": round(statistics.median(times), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=["8192,8192", "4096,4096"])
    ap.add_argument("--chain", type=int, default=8)
    args = ap.parse_args(argv)
    import read_floor

    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "chain": args.chain, "method": __doc__, "rows": []}
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split(","))
        floor = read_floor.FLOORS(n, k)["floor_us"]
        for early in (False, True):
            call, label = chain_calls(n, k, args.chain, early)
            row = {"N": n, "K": k, "early": early, "schedule": label, "floor_us": floor,
                   **timeline(call)}
            row["us_per_gemm"] = round(row["replay_us"] / args.chain, 2)
            add_row(res, row)
    save(args.out, "pdl_timeline", res)
    return 0


def add_row(res: dict, row: dict) -> None:
    """``row`` into ``res["rows"]``, and printed without its kernel records."""
    res["rows"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)


def save(out: str, stem: str, res: dict) -> None:
    """``res`` as ``out/stem.json``."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{stem}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
