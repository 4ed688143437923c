"""GPU check of the pointer-argument launch path (run once on an H200; ~1-3 min).

    python3 perf/tools/check_launch.py   # twice, if the disk cache is
                                                              # on: the 2nd run launches
                                                              # kernels "loaded" from it

1. Every sm90 catalogue schedule x {nvfp4, bf16} on M in {1, 16, 129}, N in {136, 8192},
   K in {320, 8256}: output poisoned with NaN, run_compiled(kern, a, b, out=out), checked
   against cute_fp4.reference.check. Also: out=None, an explicit python-float alpha (vs the
   reference with that alpha), bitwise determinism of a repeat, and that a call refused by
   validation leaves the (poisoned) output untouched.
2. The split-K heuristic path (sm90_decode_swapab with split_k=2) on the same shapes.
3. CUDA-graph capture of run_compiled (as perf/gpu_session.py does) replays correctly.
4. Eager host us/call of run_compiled at M=16, N=K=8192 per schedule and format, with a
   breakdown (check_operands, _alpha_tensor, the launch arguments of the kernel's call
   path (TVM-FFI ints or DSL objects), the compiled entry on prebuilt arguments) and the
   whole-call time without synchronising (host-issue rate). perf/host_overhead.py compares
   gemm's host time with torch and QuACK.

Exit status 1 if any check fails. Prints one line per check and a summary.
"""

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue, reference
from cute_fp4.api import _alpha_tensor, check_operands, make_operands, out_dtype_of, run_compiled
from cute_fp4.bench import capture_graph
from cute_fp4.compile import Signature, compile
from cute_fp4.errors import InputError
from cute_fp4.kernels.launch import sm_count
from cute_fp4.operands import Operands  # noqa: E402

SHAPES = [(m, n, k) for m in (1, 16, 129) for n in (136, 8192) for k in (320, 8256)]
FAILS: list[str] = []


def fail(msg: str) -> None:
    FAILS.append(msg)
    print("FAIL", msg, flush=True)


def poisoned(m, n, dt):
    return torch.full((m, n), float("nan"), dtype=dt, device="cuda")


def check_kernel(kern, label: str, fmt: str) -> None:
    dt = out_dtype_of(kern.schedule)
    n_ok = 0
    for i, (m, n, k) in enumerate(SHAPES):
        a, b = make_operands(m, n, k, fmt, seed=100 + i)
        try:
            out = poisoned(m, n, dt)
            run_compiled(kern, a, b, out=out)
            torch.cuda.synchronize()
            r = reference.check(out, a, b)
            if not r.passed:
                fail(f"{label} {fmt} M={m} N={n} K={k}: {r}")
                continue
            again = poisoned(m, n, dt)
            run_compiled(kern, a, b, out=again)
            torch.cuda.synchronize()
            if not torch.equal(out.view(torch.uint8), again.view(torch.uint8)):
                fail(f"{label} {fmt} M={m} N={n} K={k}: repeat not bitwise identical")
                continue
            n_ok += 1
        except Exception as e:  # noqa: BLE001
            fail(f"{label} {fmt} M={m} N={n} K={k}: {type(e).__name__}: {e}")
            traceback.print_exc()
    # out=None and an explicit alpha (python float) on one shape
    m, n, k = 16, 136, 320
    a, b = make_operands(m, n, k, fmt, seed=7)
    try:
        res = run_compiled(kern, a, b)
        torch.cuda.synchronize()
        r = reference.check(res, a, b)
        if not r.passed:
            fail(f"{label} {fmt} out=None: {r}")
        res = run_compiled(kern, a, b, alpha=0.375)
        torch.cuda.synchronize()
        r = reference.check(res, a, b, 0.375)
        if not r.passed:
            fail(f"{label} {fmt} alpha=0.375: {r}")
    except Exception as e:  # noqa: BLE001
        fail(f"{label} {fmt} out=None/alpha: {type(e).__name__}: {e}")
    # a refused call must not write the output
    out = poisoned(m, n, dt)
    bad = poisoned(m, n + 8, dt)  # wrong shape: refused
    try:
        run_compiled(kern, a, b, out=bad)
        fail(f"{label} {fmt}: wrong-shape out was accepted")
    except InputError:
        pass
    torch.cuda.synchronize()
    if not (torch.isnan(bad.float()).all() and torch.isnan(out.float()).all()):
        fail(f"{label} {fmt}: a refused call wrote an output")
    print(f"{label} [{fmt}] ({kern.source}): {n_ok}/{len(SHAPES)} shapes pass", flush=True)


def check_graph(kern, label: str, fmt: str) -> None:
    m, n, k = 16, 8192, 8192
    a, b = make_operands(m, n, k, fmt, seed=3)
    dt = out_dtype_of(kern.schedule)
    out = poisoned(m, n, dt)
    try:
        run_compiled(kern, a, b, out=out)  # warm
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        g, _ = capture_graph(lambda: run_compiled(kern, a, b, out=out))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        r = reference.check(out, a, b)
        if not r.passed:
            fail(f"{label} {fmt} CUDA graph replay: {r}")
        else:
            print(f"{label} [{fmt}]: CUDA graph replay ok", flush=True)
    except Exception as e:  # noqa: BLE001
        fail(f"{label} {fmt} CUDA graph: {type(e).__name__}: {e}")
        traceback.print_exc()


def per_call_us(fn, calls=300, sync=True) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync:
        torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def timings(kern, label: str, fmt: str) -> dict:
    m, n, k = 16, 8192, 8192
    a, b = make_operands(m, n, k, fmt, seed=1)
    dt = out_dtype_of(kern.schedule)
    out = torch.empty((m, n), dtype=dt, device="cuda")
    s = kern.schedule
    alpha = _alpha_tensor(a, b, None)
    ws = (torch.empty((s.split_k, m, n), dtype=torch.float32, device="cuda")
          if s.split_k > 1 else None)
    a_data, a_scale = (a.data, a.scale) if fmt == "nvfp4" else (a, None)
    dev = out.get_device()
    stream = kern._stream_of(dev)

    def raw():
        return kern._kernel.raw_args(Operands(a_data, a_scale, b.data, b.scale, out, alpha, ws),
                                     sm_count(dev), stream)

    launch_args = raw if kern.call_path == "tvm-ffi" else (lambda: kern._dsl_args(raw()))
    entry = kern._ffi if kern.call_path == "tvm-ffi" else kern._compiled
    args = launch_args()
    row = {
        "check_operands": per_call_us(lambda: check_operands(a, b, out, None, dt)),
        "alpha_tensor": per_call_us(lambda: _alpha_tensor(a, b, None)),
        "launch args": per_call_us(launch_args),
        "compiled_call": per_call_us(lambda: entry(*args)),
        "run_compiled (host issue, no sync)": per_call_us(
            lambda: run_compiled(kern, a, b, out=out), sync=False),
        "run_compiled (eager, synced)": per_call_us(lambda: run_compiled(kern, a, b, out=out)),
    }
    print(f"TIMING {label} [{fmt}] ({kern.call_path}) M=16 N=K=8192 us/call: "
          + ", ".join(f"{key} {v:.1f}" for key, v in row.items()), flush=True)
    return row


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    scheds = catalogue.all_schedules("sm90", grouped=False)
    split = catalogue.get("sm90_decode_swapab").replace(split_k=2)
    kerns = []
    for s in [*scheds, split]:
        label = s.name or s.label()
        if s is split:
            label = "sm90_decode_swapab+split_k=2"
        for fmt in ("nvfp4", "bf16"):
            try:
                kern = compile(s, Signature(fmt))
            except Exception as e:  # noqa: BLE001
                fail(f"{label} {fmt}: compile: {type(e).__name__}: {e}")
                continue
            kerns.append((kern, label, fmt))
    for kern, label, fmt in kerns:
        check_kernel(kern, label, fmt)
    for kern, label, fmt in kerns[:4]:
        check_graph(kern, label, fmt)
    for kern, label, fmt in kerns:
        try:
            timings(kern, label, fmt)
        except Exception as e:  # noqa: BLE001
            fail(f"{label} {fmt} timing: {type(e).__name__}: {e}")
    print(f"\n{'ALL PASS' if not FAILS else f'{len(FAILS)} FAILURES'}", flush=True)
    for f in FAILS:
        print("  ", f)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
