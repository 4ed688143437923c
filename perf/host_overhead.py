"""Host time per eager GEMM call: ``cute_fp4.gemm`` against torch's BF16 matmul and QuACK,
and the Python share of ours on a CPU with the launch stubbed.

    python3 perf/host_overhead.py [--out DIR]          # on a GPU (H200): the comparison
    python3 perf/host_overhead.py --stub [--out DIR]   # on a CPU: the Python share

GPU mode, N = K = 8192 and M in (1, 16), W4A16 (bf16 activations, NVFP4 weight):

* host us/call: a loop of ``--calls`` (200) calls without a sync, timed with
  ``perf_counter`` after a warm-up and a sync (the time Python needs to issue a call; the
  queue does not fill in 200 calls), median of ``--repeats`` loops. Providers in the same
  process: ``torch.nn.functional.linear`` on the BF16 weight, ``cute_fp4.gemm`` (output
  allocated, and into ``out=``), W4A4 ``gemm`` on NVFP4 activations, QuACK's
  ``gemm_w4a16(wformat="nvfp4")`` when ``quack`` imports.
* eager us/call with a sync at the end (whether a loop of calls is host- or GPU-bound).
* ``breakdown``: each step of one ``gemm`` call alone (operand checks, kernel lookup,
  alpha, output allocation, launch arguments, the compiled entry on prebuilt arguments).
* CUDA graphs: ``gemm(a, b, out=out)`` and ``gemm(a, b)`` captured with
  ``torch.cuda.graph`` (warm-up on a side stream first, as torch documents), replayed
  into NaN-poisoned outputs and compared bit for bit with the eager result.

Stub mode (no GPU): the same ``gemm`` path on CPU tensors, with the device description of
an H200 and the compiled kernel replaced by a host-only CuTe DSL function of the same
signature (``kernels.launch.NoopLaunch``): its TVM-FFI entry, or the DSL's own call path,
decodes the arguments as the real one does and launches nothing. Also the pure-Python floor (a no-op
callable), and ``torch.ops.cute_fp4.mm_packed`` called as compiled code calls it (the
custom op's dispatch and body). Stub timings keep the fastest loop (other processes on a
CPU only add time).

Writes ``host_overhead.json`` under ``--out`` and prints one line per measure. Exit status
1 if a graph replay differs from eager.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cute_fp4 as cf  # noqa: E402
from cute_fp4 import api, operands, run, workspaces  # noqa: E402
from cute_fp4.bench import capture_graph  # noqa: E402
from cute_fp4.kernels.launch import NoopLaunch  # noqa: E402

host = importlib.import_module("cute_fp4.compile")  # the module (cute_fp4.compile is a function)

N = K = 8192
MS = (1, 16)


STAT = statistics.median  # of the timed loops; --stub keeps the least disturbed (min)


def host_us(fn, calls: int, repeats: int, sync) -> float:
    """:data:`STAT` over ``repeats`` of the per-call time of ``calls`` calls with no sync."""
    for _ in range(20):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return STAT(runs)


def synced_us(fn, calls: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def breakdown(a, b, out, calls: int, repeats: int, sync) -> dict:
    """Each step of ``gemm(a, b, out=out)`` timed alone (memos warm)."""
    dims = api.check_operands(a, b, out, None, torch.bfloat16)
    dev = b.data.get_device()
    kern = run.kernel("auto", dims, torch.bfloat16, dev)
    alpha = operands.alpha_tensor(a, b, None)

    ws = None
    if kern.schedule.split_k > 1:  # the split-K workspace, as run_checked finds it
        from cute_fp4.workspaces import split_workspace

        ws = split_workspace(kern, dims[0], dims[1], b.data.device)

    def raw():
        return kern.raw_args(run.operands(a, b, out, alpha, dims[3], ws))
    if kern.ffi is not None:
        args, entry = raw, kern.ffi
    else:
        def args():
            return kern._dsl_args(raw())
        entry = kern._compiled
    prebuilt = args()
    steps = {
        "check_operands": lambda: api.check_operands(a, b, out, None, torch.bfloat16),
        "kernel_for": lambda: run.kernel("auto", dims, torch.bfloat16, dev),
        "alpha_tensor": lambda: operands.alpha_tensor(a, b, None),
        "torch.empty (out)": lambda: torch.empty((dims[0], N), dtype=torch.bfloat16,
                                                 device=b.data.device),
        "stream": lambda: kern._stream_of(dev),
        "launch args": args,
        "entry (prebuilt args)": lambda: entry(*prebuilt),
        "gemm(out=out)": lambda: cf.gemm(a, b, out=out),
    }
    return {name: round(host_us(fn, calls, repeats, sync), 2) for name, fn in steps.items()}


# ----------------------------------------------------------------------------- GPU

def quack_call(a, b):
    """QuACK's W4A16 NVFP4 call on the same weight, or None when quack is not importable."""
    try:
        from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight
    except Exception:  # noqa: BLE001 (absent, or its imports fail)
        return None
    blob, sf = prepare_w4_weight(b.data, b.scale_linear(), "nvfp4")
    gs = float(b.global_scale)
    return lambda: gemm_w4a16(a, blob, sf, tensor_scale=gs, wformat="nvfp4", n_out=N)


def graph_check(fn_eager, fn_capture, out_of) -> dict:
    """Capture ``fn_capture`` (warm-up on a side stream), replay into a poisoned output and
    compare bit for bit with ``fn_eager``'s result."""
    ref = fn_eager().clone()
    g, got = capture_graph(fn_capture, warmups=3)
    out = out_of(got)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    same = torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    return {"ok": bool(same), "max_abs_diff": float((out.float() - ref.float()).abs().max())}


def gpu_main(args) -> dict:
    sync = torch.cuda.synchronize
    res = {"mode": "gpu", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tvm_ffi": host.tvm_ffi_enabled(), "calls": args.calls, "rows": [],
           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}  # the run's time (perf/render_docs.py)
    for (N, K), m in ((nk, m) for nk in args.nk for m in MS):  # noqa: N806
        a16, b = operands.make_operands(m, N, K, "bf16", seed=m, dist="normal")
        a4 = cf.quantize(a16.float())
        w = b.dequantize(torch.bfloat16)
        out = torch.empty((m, N), dtype=torch.bfloat16, device="cuda")
        cf.gemm(a16, b, out=out)
        kern = run.kernel("auto", (m, N, K, "bf16"), torch.bfloat16, b.data.get_device())
        calls = {
            "torch F.linear bf16": lambda: torch.nn.functional.linear(a16, w),  # noqa: B023
            "cute_fp4 gemm W4A16": lambda: cf.gemm(a16, b),  # noqa: B023
            "cute_fp4 gemm W4A16 out=": lambda: cf.gemm(a16, b, out=out),  # noqa: B023
            "cute_fp4 gemm W4A4": lambda: cf.gemm(a4, b),  # noqa: B023
        }
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16, device="cuda")
        calls["torch nn.Linear bf16"] = lambda: lin(a16)  # noqa: B023
        for layout, layer in linear_layers(b).items():
            calls[f"cute_fp4 NVFP4Linear {layout}"] = lambda layer=layer: layer(a16)  # noqa: B023
        q = quack_call(a16, b)
        if q is not None:
            calls["quack gemm_w4a16 nvfp4"] = q
        row = {"m": m, "n": N, "k": K, "schedule": kern.schedule.label(),
               "call_path": kern.call_path, "host_us": {}, "synced_us": {}}
        for name, fn in calls.items():
            row["host_us"][name] = round(host_us(fn, args.calls, args.repeats, sync), 2)
            row["synced_us"][name] = round(synced_us(fn, args.calls, sync), 2)
        row["breakdown_us"] = breakdown(a16, b, out, args.calls, args.repeats, sync)
        row["graph_out"] = graph_check(lambda: cf.gemm(a16, b),  # noqa: B023
                                       lambda: cf.gemm(a16, b, out=out), lambda _: out)  # noqa: B023
        row["graph_alloc"] = graph_check(lambda: cf.gemm(a16, b), lambda: cf.gemm(a16, b),  # noqa: B023
                                         lambda got: got)
        res["rows"].append(row)
        h = row["host_us"]
        print(f"M={m} {row['call_path']}: " + ", ".join(f"{k} {v}" for k, v in h.items()),
              flush=True)
        print(f"M={m} breakdown: {row['breakdown_us']}", flush=True)
        print(f"M={m} graphs: out= {row['graph_out']}, allocating {row['graph_alloc']}",
              flush=True)
    return res


# ----------------------------------------------------------------------------- CPU stub

def stub_gemm_path(entry: str):
    """Point ``gemm``'s device and compile steps at CPU stand-ins: an H200 description,
    operand checks without the device-type check, stream 0, and ``entry`` ("tvm-ffi",
    "dsl" or "none": a no-op callable) as the compiled kernel."""
    from cute_fp4 import targets
    from cute_fp4.kernels import launch

    h200 = targets.Device(0, "NVIDIA H200 (stub)", (9, 0), 132, targets.get_target("sm_90a"),
                          4800.0)
    targets.require_device = lambda family=None: h200
    check, check_call = operands.check_operands, operands.check_call
    # a CPU build of torch cannot ask whether a capture is on
    api.check_operands = (
        lambda a, b, out, alpha, dt: check(a, b, out, alpha, dt, require_cuda=False))
    run.check_call = (  # the launch path calls run's name
        lambda a, b, out, alpha, dt, ops=(), bias=None, require_cuda=True:
        check_call(a, b, out, alpha, dt, ops, bias, require_cuda=False))
    host.stream_getter = lambda: (lambda index: 0)
    workspaces.capturing_now = lambda: False
    fake = launch.fake_args(launch.PointerTypes(cutlass.BFloat16, cutlass.BFloat16), 1, 132)
    if entry == "none":
        fn = None
    else:
        opts = "--enable-tvm-ffi" if entry == "tvm-ffi" else None
        fn = cute.compile(NoopLaunch(), *fake, **({"options": opts} if opts else {}))

    def build(schedule, sig, kernel=None, tag=""):
        kernel = kernel or host._make_kernel(schedule, host.Problem(a_format=sig.a_format))
        kern = host.CompiledGemm(schedule, sig, fn, kernel, 0.0, "built", None, max_ctas=132)
        if fn is None:
            kern._ffi, kern.call_path = (lambda *args: None), "none"
        return kern

    host._build = build
    host.clear_cache()


def linear_layers(b) -> dict:
    """NVFP4Linear W4A16 layers over ``b``'s tensors, in both weight layouts."""
    from cute_fp4.nn import NVFP4Linear

    return {layout: NVFP4Linear(b, mode="w4a16", layout=layout)
            for layout in ("plain", "packed")}


def stub_main(args) -> dict:
    from cute_fp4.nvfp4 import NVFP4Tensor, scale_shape

    res = {"mode": "stub", "torch": torch.__version__, "calls": args.calls, "rows": []}
    for entry in ("tvm-ffi", "dsl", "none"):
        if entry == "tvm-ffi" and not host.tvm_ffi_enabled():
            continue
        stub_gemm_path(entry)
        for m in MS:
            b = NVFP4Tensor._unchecked(torch.zeros(N, K // 2, dtype=torch.uint8),
                                       torch.zeros(*scale_shape(N, K), dtype=torch.float8_e4m3fn),
                                       torch.tensor(1.0), (N, K))
            a = torch.zeros(m, K, dtype=torch.bfloat16)
            out = torch.empty((m, N), dtype=torch.bfloat16)
            cf.gemm(a, b, out=out)
            row = {"entry": entry, "m": m, "gemm(out=out)_us": round(host_us(
                lambda: cf.gemm(a, b, out=out), args.calls, args.repeats, lambda: None), 2)}  # noqa: B023
            row["breakdown_us"] = breakdown(a, b, out, args.calls, args.repeats, lambda: None)
            by_layout = linear_layers(b)
            for layout, layer in by_layout.items():
                layer(a)
                row[f"NVFP4Linear {layout}_us"] = round(host_us(
                    lambda: layer(a), args.calls, args.repeats, lambda: None), 2)  # noqa: B023
            packed = by_layout["packed"]
            op_args = (a, None, packed.weight_packed, packed.weight_scale,
                       packed.weight_scale_2, N, K, torch.bfloat16, "auto")
            op = api.register_op().mm_packed
            op(*op_args)
            row["cute_fp4::mm_packed op_us"] = round(host_us(  # what compiled code calls
                lambda: op(*op_args), args.calls, args.repeats, lambda: None), 2)  # noqa: B023
            res["rows"].append(row)
            layers = {k: v for k, v in row.items() if k.startswith(("NVFP4Linear", "cute_fp4::"))}
            print(f"stub {entry} M={m}: gemm(out=out) {row['gemm(out=out)_us']} us; "
                  f"{layers}; {row['breakdown_us']}", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stub", action="store_true", help="CPU: the Python share, launch stubbed")
    p.add_argument("--out", type=Path, help="folder for host_overhead.json")
    p.add_argument("--nk", type=lambda v: tuple(int(x) for x in v.split(",")), nargs="*",
                   default=[(N, K)], help="weight shapes N,K (GPU mode; default 8192,8192; "
                   "4096,4096 and 1024,4096 run split-K decode kernels)")
    p.add_argument("--calls", type=int, default=200, help="calls per timed loop (200)")
    p.add_argument("--repeats", type=int, default=7, help="timed loops; the median is kept")
    args = p.parse_args()
    if args.stub:  # a shared CPU: other processes only ever add time
        global STAT
        STAT = min
    res = stub_main(args) if args.stub else gpu_main(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_overhead.json").write_text(json.dumps(res, indent=1))
    bad = [r for r in res["rows"] for g in ("graph_out", "graph_alloc")
           if g in r and not r[g]["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
