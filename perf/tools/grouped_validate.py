"""Grouped (MoE) GEMM kernels against the exact reference on the GPU: every grouped catalogue
schedule (SM90 natively; SM120 through the emulated MMA on an SM90 GPU, natively on SM12x),
NaN-poisoned outputs, over the routings MoE layers produce.

    python perf/tools/grouped_validate.py --out "$OUT" [--only NAME,...] [--quick]

Routings (token counts per expert, tokens sorted by expert): ragged random (seeded), empty
experts first, last and in between, one token per expert, every token to one expert,
a single token in total, totals that are not a multiple of the tile, with K and N tails.
Each case launches on a NaN-filled output and compares every expert's rows with the exact
float64 reference under the project's error rule (``cute_fp4.reference``); a second launch
must be bit-identical. One JSON line per case goes to ``<out>/grouped_validate.jsonl`` as it
finishes (a hang leaves the cases before it), and a summary line per schedule to stdout.
The operands are built from 2-D primitives (``quantize``, ``packed.pack``) so this script
checks the kernels independently of the grouped API layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cute_fp4 import catalogue, reference  # noqa: E402
from cute_fp4.compile import Signature, compile, compile_emulated  # noqa: A004, E402
from cute_fp4.nvfp4 import quantize  # noqa: E402
from cute_fp4.operands import Operands  # noqa: E402
from cute_fp4.packed import pack  # noqa: E402
from cute_fp4.plan import plan  # noqa: E402
from cute_fp4.schedule import Mainloop, Problem, Schedule  # noqa: E402


def routings(experts: int, seed: int, quick: bool) -> dict[str, list[int]]:
    """Named token counts per expert."""
    g = torch.Generator().manual_seed(seed)
    e = experts
    ragged = torch.randint(0, 40, (e,), generator=g).tolist()
    out = {
        "ragged": ragged,
        "empty_ends": [0] + torch.randint(1, 20, (e - 2,), generator=g).tolist() + [0]
        if e > 2 else [0] * (e - 1) + [5],
        "one_each": [1] * e,
        "all_to_one": [0] * (e // 2) + [300] + [0] * (e - e // 2 - 1),
        "single_token": [0] * (e - 1) + [1],
        "big_tail": [129 + 17 * (i % 3) for i in range(e)],
    }
    if quick:
        out = {k: out[k] for k in ("ragged", "empty_ends", "one_each", "single_token")}
    return out


def shapes(packed: bool, quick: bool) -> list[tuple[int, int, int]]:
    """(experts, N, K): K and N tails (rs_packed needs K % 64 == 0)."""
    ks = (64, 192, 512) if packed else (32, 160, 512)
    out = [(8, 256, ks[2]), (8, 72, ks[1]), (1, 128, ks[0]), (16, 136, ks[1])]
    if not quick:
        out.append((128, 256, 256))
    return out


def make_case(counts, n, k, a_format, packed, seed):
    """Operands on the GPU and what the reference needs."""
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    total = sum(counts)
    ws = [quantize(torch.randn(n, k, generator=g) * (0.5 + i % 3)) for i in range(e)]
    b_data = torch.stack([pack(w.data) if packed else w.data for w in ws]).cuda()
    b_scale = torch.stack([w.scale.view(torch.uint8) for w in ws]).cuda()
    x = torch.randn(max(total, 1), k, generator=g)[:total]
    if a_format == "nvfp4":
        a = quantize(x) if total else None
        a_data, a_scale = a.data.cuda(), a.scale.view(torch.uint8).cuda()
        a_vals = a.block_values(torch.float64)
        alpha = torch.stack([a.global_scale * w.global_scale for w in ws])
    else:
        dt = torch.bfloat16 if a_format == "bf16" else torch.float16
        a_data = x.to(dt).cuda()
        a_scale = None
        a_vals = x.to(dt).double()
        alpha = torch.stack([w.global_scale for w in ws])
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    return dict(a_data=a_data, a_scale=a_scale, b_data=b_data, b_scale=b_scale,
                alpha=alpha.float().cuda(), offsets=offsets.cuda(), a_vals=a_vals,
                w_vals=[w.block_values(torch.float64) for w in ws], alpha_cpu=alpha.double(),
                offsets_cpu=offsets, total=total, n=n)


def check(out: torch.Tensor, c: dict) -> dict:
    """Every expert's rows against the float64 reference (the project's error rule)."""
    got = out.double().cpu()
    worst, nonfinite = 0.0, int((~torch.isfinite(got)).sum())
    for e, wv in enumerate(c["w_vals"]):
        lo, hi = int(c["offsets_cpu"][e]), int(c["offsets_cpu"][e + 1])
        if hi == lo:
            continue
        av = c["a_vals"][lo:hi]
        alpha = c["alpha_cpu"][e]
        ref = (av @ wv.T) * alpha
        bound = reference._bound(av, wv, alpha, out.dtype, ref)
        err = (got[lo:hi] - ref).abs()
        err = torch.where(torch.isfinite(got[lo:hi]), err, torch.inf)
        worst = max(worst, float((err / bound).max()))
    return {"err_over_bound": worst, "nonfinite": nonfinite,
            "passed": nonfinite == 0 and worst <= 1.0}


def run_case(kern, c: dict, out_dtype) -> dict:
    out = torch.full((c["total"], c["n"]), float("nan"), dtype=out_dtype, device="cuda")
    args = Operands(c["a_data"], c["a_scale"], c["b_data"], c["b_scale"], out, c["alpha"],
                    offsets=c["offsets"])
    kern.launch(args)
    torch.cuda.synchronize()
    first = out.clone()
    res = check(out, c)
    out.fill_(float("nan"))
    kern.launch(args)
    torch.cuda.synchronize()
    res["rerun_identical"] = bool(torch.equal(first.view(torch.int16 if first.element_size()
                                                         == 2 else torch.int32),
                                              out.view(torch.int16 if out.element_size()
                                                       == 2 else torch.int32)))
    res["passed"] = res["passed"] and res["rerun_identical"]
    return res


def grouped_schedules(only: set[str] | None) -> list[Schedule]:
    major = torch.cuda.get_device_capability()[0]
    out = []
    for s in catalogue.all_schedules(grouped=True):
        if only and s.name not in only:
            continue
        fam = s.arch.family
        if fam == "sm90" and major == 9 or fam == "sm120" and major in (9, 12):
            out.append(s)
    return out


def formats(s: Schedule) -> list[str]:
    """The activation formats ``plan()`` accepts for ``s`` (SM120: NVFP4 only)."""
    return [f for f in ("nvfp4", "bf16", "fp16") if plan(s, Problem(a_format=f)).ok]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--only", default="")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = (out_dir / "grouped_validate.jsonl").open("w")
    only = set(args.only.split(",")) if args.only else None
    emulated = torch.cuda.get_device_capability()[0] == 9
    failed = 0
    for s in grouped_schedules(only):
        packed = s.mainloop is Mainloop.RS_PACKED
        n_pass = n_all = 0
        for fmt in formats(s):
            t0 = time.time()
            try:
                if s.arch.family == "sm120" and emulated:
                    kern = compile_emulated(s, Signature(fmt))
                else:
                    kern = compile(s, Signature(fmt))
            except Exception as e:  # record and go on
                row = {"schedule": s.name, "format": fmt, "case": "compile", "passed": False,
                       "error": f"{type(e).__name__}: {e}"[:2000]}
                log.write(json.dumps(row) + "\n")
                log.flush()
                n_all += 1
                continue
            for e_, n, k in shapes(packed, args.quick):
                for rname, counts in routings(e_, 7, args.quick).items():
                    if sum(counts) == 0:
                        continue
                    row = {"schedule": s.name, "format": fmt, "experts": e_, "n": n, "k": k,
                           "routing": rname, "total_m": sum(counts)}
                    try:
                        c = make_case(counts, n, k, fmt, packed, seed=n + k + e_)
                        row.update(run_case(kern, c, torch.bfloat16))
                    except Exception as err:
                        row.update(passed=False, error=f"{type(err).__name__}: {err}"[:2000])
                    n_all += 1
                    n_pass += bool(row["passed"])
                    log.write(json.dumps(row) + "\n")
                    log.flush()
            print(f"{s.name} {fmt}: compiled+ran in {time.time() - t0:.1f} s", flush=True)
        failed += n_all - n_pass
        print(f"{s.name}: {n_pass}/{n_all} passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
