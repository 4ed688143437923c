"""Device time of ``route`` (the MoE pair sort) at decode sizes: torch's ops against the
one-CTA kernel (``cute_fp4.sorting``), same run, same ids.

    python perf/tools/route_bench.py [--out route.json] [--calls 50] [--replays 200]

Per (T, top_k, E) and method, ``--calls`` calls of ``route(ids, E, method=...)`` are captured
back to back in one CUDA graph (so each call's launches are graph nodes, as in a decoder
under CUDA graphs); the graph is replayed ``--replays`` times between two CUDA events after
a warm-up, five times over; the median over the five of (elapsed / replays / calls) is the
time per call. Both outputs are compared first (bit for bit). Prints a table (us per call,
kernel / torch) and writes the rows with the GPU, torch and DSL versions as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SIZES = [(1, 4, 32), (1, 4, 128), (4, 4, 32), (16, 4, 128), (1, 8, 128), (4, 8, 128),
         (16, 8, 128), (16, 8, 256), (64, 8, 256), (128, 8, 256)]


def time_method(ids: torch.Tensor, e: int, method: str, calls: int, replays: int) -> float:
    """Median device microseconds per ``route`` call of ``method`` (see the docstring)."""
    from cute_fp4.bench import capture_graph
    from cute_fp4.layers.routing import route

    graph, _ = capture_graph(lambda: [route(ids, e, method=method) for _ in range(calls)],
                             warmups=2)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / calls)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()

    import cutlass

    from cute_fp4.layers.routing import route

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, bad = [], 0
    print(f"{'T':>4} {'k':>2} {'E':>4} {'torch us':>9} {'kernel us':>10} {'kernel/torch':>13}")
    for t, k, e in SIZES:
        ids = torch.randint(0, e, (t, k), generator=g, device="cuda")
        same = all(torch.equal(a, b) for a, b in zip(route(ids, e, method="torch"),
                                                      route(ids, e, method="kernel")))
        bad += not same
        us = {m: time_method(ids, e, m, args.calls, args.replays) for m in ("torch", "kernel")}
        ratio = us["kernel"] / us["torch"]
        rows.append({"T": t, "top_k": k, "E": e, "torch_us": round(us["torch"], 3),
                     "kernel_us": round(us["kernel"], 3), "ratio": round(ratio, 3),
                     "equal": same})
        print(f"{t:>4} {k:>2} {e:>4} {us['torch']:>9.2f} {us['kernel']:>10.2f} "
              f"{ratio:>13.2f}{'' if same else '  OUTPUTS DIFFER'}")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "cutlass_dsl": getattr(cutlass, "__version__", "?"),
                "calls_per_graph": args.calls, "replays": args.replays}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
