"""The read floor of a decode GEMM: how long this GPU takes to read exactly the weight's
bytes, timed in the same run as the decode figures it stands beside.

    python perf/read_floor.py --out DIR [--shapes N,K ...]     # the floors alone

A decode GEMM (M = 1..16) has to read its weight once: ``N K / 2`` bytes of E2M1 codes and
``N K / 16`` of UE4M3 scales (``weight_bytes``). Its floor here is not a datasheet rate but
a plain streaming read of exactly those bytes on this GPU (:func:`floor`): a Triton kernel
that loads 16-byte words (``.cg``: L2 only), XORs them into one word per program and
stores it, over the bytes of 8 distinct copies (one launch per copy, one CUDA graph), L2
flushed before every replay (cold: each copy comes from device memory, as a decoder's
layers do), median of ``reps`` replays, divided by 8; the best of a few grid and block
sizes (:data:`CONFIGS`, each program walking the buffer with a grid stride). The same
8-copy, cold timing serves every decode provider (:func:`time_copies`), so a row's
``time / floor`` compares like with like. The floor of a chain of GEMMs (a decoder step)
is the sum of its weights' bytes over the rate of a large read (:func:`read_rate`, 1 GiB
by default): :func:`chain_floor_us`.

Importable without a GPU (the CPU tests check the byte count and the configurations);
Triton is imported when a floor is measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

COPIES = 8
REPS = 30
FLUSH_BYTES = 256 << 20
# (programs per SM, or 0: one program per block; int32 words per program and step; warps)
CONFIGS = ((0, 4096, 4), (2, 4096, 4), (4, 4096, 4), (8, 2048, 4), (2, 8192, 8),
           (4, 8192, 8))
RATE_BYTES = 1 << 30  # the large read behind a chain's floor


def weight_bytes(n: int, k: int) -> int:
    """Bytes a decode GEMM must read: the E2M1 codes and the UE4M3 block scales."""
    return n * k // 2 + n * k // 16


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n_words, step):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(x_ptr + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.xor_sum(acc, 0))

    return read


def read_call(buf: torch.Tensor, config: tuple[int, int, int]) -> Callable[[], torch.Tensor]:
    """A capturable read of ``buf`` (int32 words) with ``config`` (see :data:`CONFIGS`);
    returns its per-program XOR words (which depend on every word read)."""
    per_sm, block, warps = config
    words = buf.numel()
    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
    grid = -(-words // block) if per_sm == 0 else min(per_sm * sms, -(-words // block))
    out = torch.empty(grid, dtype=torch.int32, device=buf.device)
    kern = _kernel()

    def call():
        kern[(grid,)](buf, out, words, BLOCK=block, num_warps=warps)
        return out

    return call


def capture(fn):
    """``fn`` captured in a CUDA graph after one call on a side stream: (graph, result)."""
    from cute_fp4.bench import capture_graph

    return capture_graph(fn)


_FLUSH: dict = {}


def flush_l2(device=None) -> None:
    """Read a 256 MiB buffer: L2 then holds clean lines of it and none of the weights."""
    dev = torch.device(device or "cuda")
    buf = _FLUSH.get(dev)
    if buf is None:
        buf = _FLUSH[dev] = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=dev)
    buf.sum()


def time_copies(calls: Sequence[Callable], reps: int = REPS, cold: bool = True
                ) -> tuple[float, list]:
    """(median microseconds per call, what the calls returned after the last replay) of
    ``calls`` (one per weight copy) launched back to back in one CUDA graph, L2 flushed
    before every replay when ``cold``. Tensors returned are cloned while the graph lives."""
    def all_calls():
        return [c() for c in calls]

    g, results = capture(all_calls)
    g.replay()
    times = []
    for _ in range(reps):
        if cold:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    out = [r.clone() if isinstance(r, torch.Tensor) else r for r in results]
    del g
    return statistics.median(times), out


def copies_of(nbytes: int, copies: int = COPIES, device="cuda") -> list[torch.Tensor]:
    """``copies`` distinct buffers of ``nbytes`` (rounded up to 16) of random int32 words."""
    words = -(-nbytes // 16) * 4
    g = torch.Generator(device=device).manual_seed(nbytes % 2**31)
    return [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=device,
                          generator=g) for _ in range(copies)]


def floor(nbytes: int, configs=CONFIGS, reps: int = REPS) -> dict:
    """The read floor of ``nbytes``: the best config's microseconds per copy (8 copies per
    graph, cold), its TB/s, and every config's time."""
    bufs = copies_of(nbytes)
    per = {}
    for cfg in configs:
        us, _ = time_copies([read_call(b, cfg) for b in bufs], reps)
        per[str(cfg)] = round(us, 3)
    best = min(per, key=per.get)
    del bufs
    return {"bytes": nbytes, "floor_us": per[best], "TB/s": round(nbytes / per[best] / 1e6, 3),
            "config": best, "configs_us": per}


def checked_read(nbytes: int = (1 << 24) + 48) -> bool:
    """The read kernel reads every word (a tail too), with every config: the XOR of its
    per-program words equals the XOR of the buffer."""
    import numpy as np

    (buf,) = copies_of(nbytes, 1)
    want = int(np.bitwise_xor.reduce(buf.cpu().numpy()))
    return all(int(np.bitwise_xor.reduce(read_call(buf, cfg)().cpu().numpy())) == want
               for cfg in CONFIGS)


_RATES: dict = {}


def read_rate(nbytes: int = RATE_BYTES) -> float:
    """Bytes per microsecond of a large read (``nbytes``, 8 copies, cold), memoised."""
    if nbytes not in _RATES:
        _RATES[nbytes] = floor(nbytes, reps=10)
    return _RATES[nbytes]["bytes"] / _RATES[nbytes]["floor_us"]


def chain_floor_us(total_bytes: int, rate: float | None = None) -> float:
    """The floor of a chain of GEMMs: the sum of their weights' bytes over the read rate."""
    return total_bytes / (rate or read_rate())


def kernel_timeline(fn) -> list[dict]:
    """The device kernels of one call of ``fn`` (a graph replay too: CUPTI records each
    kernel of the graph) under ``torch.profiler``: name, start and end (us, from the first
    kernel's start), sorted by start."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted(({"name": e.name, "start": e.time_range.start, "end": e.time_range.end}
                  for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.time_range.elapsed_us() > 0), key=lambda e: e["start"])
    t0 = evs[0]["start"] if evs else 0
    return [{**e, "start": round(e["start"] - t0, 3), "end": round(e["end"] - t0, 3)}
            for e in evs]


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one of ``events`` ran (overlaps counted once)."""
    total, end = 0.0, -1e30
    for e in sorted(events, key=lambda e: e["start"]):
        if e["end"] > end:
            total += e["end"] - max(e["start"], end)
            end = e["end"]
    return total


class Floors:
    """Read floors per weight size, measured once per process (every benchmark of a run
    shares them)."""

    def __init__(self):
        self._by: dict[int, dict] = {}

    def __call__(self, n: int, k: int) -> dict:
        b = weight_bytes(n, k)
        if b not in self._by:
            self._by[b] = floor(b)
        return self._by[b]


FLOORS = Floors()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=["1024,4096", "4096,4096", "4096,14336",
                                                   "8192,8192", "28672,4096", "28672,8192",
                                                   "128256,4096"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("read_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    ok = checked_read()
    for s in args.shapes:
        n, k = (int(x) for x in s.split(","))
        rows.append({"N": n, "K": k, **FLOORS(n, k)})
        print(json.dumps(rows[-1]), flush=True)
    read_rate()
    big = _RATES[RATE_BYTES]
    res = {"rows": rows, "read_check": ok, "large_read": big,
           "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "method": __doc__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_floor.json").write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
