"""gpt-oss MXFP4 on one GPU against its peers in the same run (issue 43's bars).

* **grouped**: one MoE layer's experts of a gpt-oss-20b-like (32 experts) and -120b-like
  (128 experts) model, hidden 2880, expert width 2880, top-4, at 1, 4 and 16 tokens:
  ``cute_fp4.layers.Experts.from_gpt_oss`` (MXFP4 W4A16, bias + clamped SwiGLU fused) against
  the same layer on BF16 experts with ``torch._grouped_mm`` (bias and activation in torch),
  the whole layer (routing, gather, both GEMMs, combine) and the two grouped GEMMs alone;
  the weight bytes the routed experts read over the rate of a plain large read on this
  GPU (the floor, ``read_floor.read_rate``). Bar: >= 3x.
* **dense**: ``cute_fp4.gemm`` W4A16 at M = 1 on 2880x2880 and 8192x8192 weights, MXFP4
  against NVFP4 (both the packed weight, "auto"), and torch BF16 for scale. Bar: MXFP4
  within 10% of NVFP4.
* **decode**: batch-1 decode of an 8-layer gpt-oss-20b-like checkpoint (random weights,
  written as transformers' ``mxfp4`` quantization stores it) on transformers' static cache:
  ``cute_fp4.hf.from_pretrained`` against transformers' own load of the same checkpoint
  (``AutoModelForCausalLM.from_pretrained``: without the ``kernels`` package its
  ``Mxfp4HfQuantizer`` dequantizes the experts to BF16 at load, then runs its default
  experts implementation, ``grouped_mm`` where available; what it did is recorded) and
  against BF16 with the eager experts loop. Per token: one decode step (the same cache
  position each time; its attention masks made once, as ``generate`` does, since
  transformers' eager masks cannot be captured) captured in a CUDA graph and replayed, else
  timed eagerly (recorded which). Bar: faster than both.

Times: CUDA events around CUDA-graph replays of ``--iters`` calls (median of ``--reps``),
never host wall-clock per call; the calls of a graph read other weights (dense: copies of
the weight over 128 MB; grouped: eight routings in turn), so the times are of weights
read from HBM, not L2.

    python perf/gpt_oss.py --out DIR [--sections grouped,dense,decode] [--quick]

writes ``DIR/gpt_oss.json`` (after each section) and ``DIR/gpt_oss.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # gpt_oss_tiny: the checkpoint writer of the tests
sys.path.insert(0, str(ROOT / "perf"))

import gpt_oss_tiny as tiny  # noqa: E402
from render_docs import auto_names  # noqa: E402

import cute_fp4 as cf  # noqa: E402
from cute_fp4 import tuning  # noqa: E402
from cute_fp4.bench import torch_combine  # noqa: E402
from cute_fp4.fused import swiglu_oai_unfused  # noqa: E402
from cute_fp4.grouped import grouped_gemm  # noqa: E402
from cute_fp4.layers import Experts, softmax_topk  # noqa: E402
from cute_fp4.layers.routing import route  # noqa: E402
from cute_fp4.operands import GroupedDims  # noqa: E402
from cute_fp4.packed import repack  # noqa: E402
from cute_fp4.targets import gemm_device  # noqa: E402

HIDDEN = WIDTH = 2880
TOP_K = 4
HBM = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, datasheet: where no read can be timed
_RATE: dict[str, object] = {}


def bandwidth() -> float:
    """Bytes/s the floors divide by: the rate of a plain 1 GiB read on this GPU, timed once
    per run (``read_floor.read_rate``: 8 copies, L2 flushed, as the dense floors), or the
    datasheet rate where that read cannot run (no Triton); which one is in the JSON."""
    if "rate" not in _RATE:
        try:
            import read_floor

            _RATE["rate"], _RATE["how"] = read_floor.read_rate() * 1e6, "read_floor.read_rate"
        except Exception as e:  # no Triton on this host: say so in the results
            name = torch.cuda.get_device_name()
            _RATE["rate"] = next((v for k, v in HBM.items() if k in name), 3.35e12)
            _RATE["how"] = f"datasheet ({type(e).__name__}: {str(e)[:80]})"
    return _RATE["rate"]


# ----------------------------------------------------------------------------- timing

def graph_us(fn, iters: int, reps: int) -> float:
    """Median microseconds per call of ``fn`` over ``reps`` replays of a CUDA graph of
    ``iters`` calls (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return _events(g.replay, reps) / iters


def eager_us(fn, iters: int, reps: int) -> float:
    """Median microseconds per call of ``fn`` called ``iters`` times between two events."""
    for _ in range(3):
        fn()

    def run():
        for _ in range(iters):
            fn()

    return _events(run, reps) / iters


def _events(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def best_us(fn, iters: int, reps: int) -> tuple[float, str]:
    """CUDA-graph time, or the eager time where ``fn`` cannot be captured (recorded)."""
    try:
        return graph_us(fn, iters, reps), "graph"
    except Exception as e:  # a host sync or an uncapturable op: say so, time it eagerly
        why = f"{type(e).__name__}: {str(e)[:120]}"
    torch.cuda.synchronize()
    return eager_us(fn, iters, reps), f"eager (capture failed: {why})"


FAILURES: list[str] = []  # what was wrong: the run exits 1 after writing its results


def require(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAILED: {what}", flush=True)
        FAILURES.append(what)


# ----------------------------------------------------------------------------- grouped

def _experts(st: dict) -> Experts:
    """The experts layer of :func:`_stacks`' checkpoint tensors (``Experts.from_gpt_oss``)."""
    return Experts.from_gpt_oss(*st["gate_up_proj"][:2], st["gate_up_proj_bias"],
                                *st["down_proj"][:2], st["down_proj_bias"], name="experts")


def _stacks(experts: int, seed: int):
    """gpt-oss-sized random expert stacks: MXFP4 checkpoint tensors and their BF16 values
    (``[E, out, in]``), biases."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for proj, (n, k) in (("gate_up_proj", (2 * WIDTH, HIDDEN)), ("down_proj", (HIDDEN, WIDTH))):
        w = torch.randn(experts, n, k, generator=g, device="cuda") * 0.02
        q = cf.quantize(w, format="mxfp4")
        del w
        out[proj] = (*q.to_blocks(), q.dequantize(torch.bfloat16))
        out[f"{proj}_bias"] = (torch.randn(experts, n, generator=g, device="cuda")
                               * 0.02).bfloat16()
    return out


ROUTINGS = 8  # distinct routings cycled in a timed graph: each call reads other experts


def _routing(experts: int, tokens: int, seed: int, x_seed: int | None = None):
    """One call's operands: activations, gpt-oss routing, the sorted rows and their
    experts."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    ids, weights = softmax_topk(torch.randn(tokens, experts, generator=g,
                                            device="cuda").bfloat16(), TOP_K)
    r = route(ids, experts)
    rows = ids.reshape(-1).index_select(0, r.order).long()
    return {"x": x, "ids": ids, "weights": weights, "r": r, "rows": rows,
            "xs": x.index_select(0, r.token)}


def _cycle(calls):
    """A function calling ``calls`` in turn (unrolled into a graph as captured)."""
    state = {"i": 0}

    def call():
        fn = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn()

    return call


def grouped_case(experts: int, tokens: int, st: dict, ex: Experts, iters: int,
                 reps: int) -> dict:
    """One (experts, tokens) point: each timed call routes other tokens (:data:`ROUTINGS`
    routings cycled), so the experts it reads are mostly not in L2 from the call before."""
    w13 = st["gate_up_proj"][2].transpose(1, 2)  # [E, H, 2I]: _grouped_mm's B
    w2 = st["down_proj"][2].transpose(1, 2)
    b13, b2 = st["gate_up_proj_bias"], st["down_proj_bias"]
    bias13, bias2 = ex.biases
    cases = [_routing(experts, tokens, 100 * tokens + i) for i in range(ROUTINGS)]

    def torch_layer(c):
        rr = route(c["ids"], experts)
        gu = torch._grouped_mm(c["x"].index_select(0, rr.token), w13, offs=rr.offsets[1:])
        act = swiglu_oai_unfused(gu + b13.index_select(0, c["rows"]), 1)
        dn = torch._grouped_mm(act, w2, offs=rr.offsets[1:]) + b2.index_select(0, c["rows"])
        return torch_combine(dn, rr, c["weights"])  # the torch peer's: gather, bmm

    for c in cases:  # the second GEMMs' inputs
        ends = c["r"].offsets[1:]
        c["act_bf16"] = swiglu_oai_unfused(torch._grouped_mm(c["xs"], w13, offs=ends), 1)
        c["act"] = grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=bias13, swiglu_oai=True)

    def torch_gemms(c):
        ends = c["r"].offsets[1:]
        torch._grouped_mm(c["xs"], w13, offs=ends)
        torch._grouped_mm(c["act_bf16"], w2, offs=ends)

    def ours_gemms(c):
        grouped_gemm(c["xs"], ex.w13, c["r"].offsets, bias=bias13, swiglu_oai=True)
        grouped_gemm(c["act"], ex.w2, c["r"].offsets, bias=bias2)

    c0 = cases[0]
    ours, ref = ex(c0["x"], c0["ids"], c0["weights"]), torch_layer(c0)
    err = float((ours.float() - ref.float()).norm() / ref.float().norm())
    routed = statistics.mean(int(torch.unique(c["ids"]).numel()) for c in cases)
    weight_bytes = routed * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH) * (0.5 + 1 / 32)
    t = {}
    impls = {"ours_layer": lambda c: ex(c["x"], c["ids"], c["weights"]),
             "torch_layer": torch_layer, "ours_gemms": ours_gemms, "torch_gemms": torch_gemms}
    for name, impl in impls.items():
        fn = _cycle([lambda c=c, impl=impl: impl(c) for c in cases])
        t[name], t[f"{name}_how"] = best_us(fn, iters, reps)
    dims = GroupedDims(tokens * TOP_K, 2 * WIDTH, HIDDEN, experts, "bf16", True, "mxfp4")
    family = str(gemm_device().target.family)
    return {"experts": experts, "tokens": tokens, "routed_experts_mean": routed, **t,
            "speedup_layer": t["torch_layer"] / t["ours_layer"],
            "speedup_gemms": t["torch_gemms"] / t["ours_gemms"],
            "floor_us": weight_bytes / bandwidth() * 1e6, "rel_err_vs_bf16": err,
            "auto_schedule": tuning.grouped_auto_name(family, dims),
            "auto_schedule_down": tuning.grouped_auto_name(
                family, dims._replace(n=HIDDEN, k=WIDTH))}


def grouped(args) -> list[dict]:
    rows = []
    for experts in (32, 128):
        st = _stacks(experts, experts)
        ex = _experts(st)
        for tokens in (1, 4, 16):
            row = grouped_case(experts, tokens, st, ex, args.iters, args.reps)
            print(f"grouped E={experts} T={tokens}: ours {row['ours_layer']:.1f} us, torch "
                  f"{row['torch_layer']:.1f} us ({row['speedup_layer']:.2f}x; GEMMs "
                  f"{row['speedup_gemms']:.2f}x; floor {row['floor_us']:.1f} us)", flush=True)
            require(row["rel_err_vs_bf16"] < 0.05, f"grouped E={experts} T={tokens}: "
                    f"output differs from torch's by {row['rel_err_vs_bf16']:.3g} (relative)")
            rows.append(row)
        del st, ex
        _free()
    return rows


# ----------------------------------------------------------------------------- dense

L2_COLD_BYTES = 128e6  # weight bytes cycled per graph: over twice an H100/H200's 50 MB L2


def _copies(w, count: int) -> list:
    """``count`` copies of a packed weight at other addresses (the same bytes)."""
    return [w] + [type(w)(w.data.clone(), w.scale.clone(), w.global_scale, w.shape)
                  for _ in range(count - 1)]


def dense(args) -> list[dict]:
    """M = 1, each timed call on another copy of the weight (cold: :data:`L2_COLD_BYTES`)."""
    rows = []
    for n, k in ((2880, 2880), (8192, 8192)):
        g = torch.Generator(device="cuda").manual_seed(n)
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
        count = max(2, -(-int(L2_COLD_BYTES) // int(n * k * (0.5 + 1 / 32))))
        mx = _copies(repack(cf.quantize(w, format="mxfp4")), count)
        nv = _copies(repack(cf.quantize(w)), count)
        bf = [w.bfloat16() for _ in range(max(2, -(-int(L2_COLD_BYTES) // (2 * n * k))))]
        t = {}
        calls = {"mxfp4": [lambda b=b, x=x: cf.gemm(x, b) for b in mx],
                 "nvfp4": [lambda b=b, x=x: cf.gemm(x, b) for b in nv],
                 "bf16": [lambda b=b, x=x: x @ b.T for b in bf]}
        for name, fns in calls.items():
            t[name], t[f"{name}_how"] = best_us(_cycle(fns), args.iters, args.reps)
        row = {"m": 1, "n": n, "k": k, "weight_copies": count, **t,
               "mxfp4_over_nvfp4": t["mxfp4"] / t["nvfp4"],
               "floor_mxfp4_us": n * k * (0.5 + 1 / 32) / bandwidth() * 1e6}
        print(f"dense {n}x{k} M=1: MXFP4 {t['mxfp4']:.2f} us, NVFP4 {t['nvfp4']:.2f} us "
              f"({row['mxfp4_over_nvfp4']:.3f}x), BF16 {t['bf16']:.2f} us", flush=True)
        rows.append(row)
        del mx, nv, bf
    return rows


# ----------------------------------------------------------------------------- decode

def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def prefill_logits(model, vocab: int) -> torch.Tensor:
    """The last position's logits of a fixed prompt (the models' agreement, on the CPU)."""
    x = torch.randint(0, vocab, (2, 32), device="cuda",
                      generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        return model(x).logits[:, -1].float().cpu()


def step_masks(model, tok: torch.Tensor, cache, pos: torch.Tensor) -> dict:
    """A decode step's attention masks, made once by transformers' own functions and passed
    to every timed step (as ``generate`` passes prepared ones): made inside the step,
    its eager masks copy a CPU scalar to the GPU (``masking_utils.eager_mask``), which no
    CUDA graph can capture (perf/tools/gpt_oss_step_syncs.py, 2026-12-06)."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    kw = {"config": model.config, "inputs_embeds": model.get_input_embeddings()(tok),
          "attention_mask": None, "past_key_values": cache, "position_ids": pos}
    return {"full_attention": create_causal_mask(**kw),
            "sliding_attention": create_sliding_window_causal_mask(**kw)}


def decode_us(model, args, prompt_len: int = 32) -> tuple[float, str]:
    """One batch-1 decode step on a static cache (module docstring)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt_len + 64)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(prompt_len, device="cuda"))
        tok = prompt[:, -1:].clone()
        pos = torch.tensor([[prompt_len]], device="cuda")
        masks = step_masks(model, tok, cache, pos)

        def step():
            return model(input_ids=tok, past_key_values=cache, attention_mask=masks,
                         position_ids=pos, use_cache=True).logits

        return best_us(step, max(args.iters // 4, 2), args.reps)


def decode(args) -> dict:
    import transformers as tf

    cfg = tiny.config(layers=args.layers, hidden=HIDDEN, intermediate=WIDTH, experts=32,
                      top_k=TOP_K, vocab_size=args.vocab, head_dim=64, num_attention_heads=64,
                      num_key_value_heads=8, sliding_window=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.GptOssForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.02)
    out: dict = {"layers": args.layers, "vocab": args.vocab, "experts": 32, "top_k": TOP_K}
    with tempfile.TemporaryDirectory(prefix="gpt_oss_") as path:
        t0 = time.perf_counter()
        tiny.write(model, path)
        out["write_s"] = time.perf_counter() - t0
        del model
        _free()
        t0 = time.perf_counter()
        ours = cf.hf.from_pretrained(path, device="cuda")
        out["load_s"] = time.perf_counter() - t0
        mine = prefill_logits(ours, args.vocab)
        out["ours_us"], out["ours_how"] = decode_us(ours, args)
        print(f"decode ours: {out['ours_us']:.0f} us/token ({out['ours_how']})", flush=True)
        del ours
        _free()
        t0 = time.perf_counter()
        theirs = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                         device_map={"": "cuda"}).eval()
        out["transformers_load_s"] = time.perf_counter() - t0
        experts = theirs.model.layers[0].mlp.experts
        qc = getattr(theirs.config, "quantization_config", None)  # gone once dequantized
        out["transformers_path"] = {
            "quantizer": type(getattr(theirs, "hf_quantizer", None)).__name__,
            "quantization_config": None if qc is None else str(qc.to_dict()),
            "experts_class": type(experts).__name__,
            "experts_weight_dtype": str(getattr(getattr(experts, "gate_up_proj", None),
                                                "dtype", "?")),
            "experts_implementation": theirs.config._experts_implementation}
        want = prefill_logits(theirs, args.vocab)
        out["logits_rel_err_vs_transformers"] = float((mine - want).norm() / want.norm())
        require(bool(torch.isfinite(mine).all()) and out["logits_rel_err_vs_transformers"]
                < 0.05, f"decode model: logits differ from transformers' (dequantized) "
                f"by {out['logits_rel_err_vs_transformers']:.3g} (relative)")
        out["transformers_us"], out["transformers_how"] = decode_us(theirs, args)
        print(f"decode transformers ({out['transformers_path']}): "
              f"{out['transformers_us']:.0f} us/token ({out['transformers_how']})", flush=True)
        theirs.set_experts_implementation("eager")
        out["bf16_eager_loop_us"], out["bf16_eager_loop_how"] = decode_us(theirs, args)
        print(f"decode BF16 eager experts loop: {out['bf16_eager_loop_us']:.0f} us/token "
              f"({out['bf16_eager_loop_how']})", flush=True)
        del theirs
        _free()
    out["speedup_vs_transformers"] = out["transformers_us"] / out["ours_us"]
    out["speedup_vs_bf16_eager_loop"] = out["bf16_eager_loop_us"] / out["ours_us"]
    return out


# ----------------------------------------------------------------------------- report

def markdown(res: dict) -> str:
    lines = [f"# gpt-oss MXFP4, {res['env'].get('gpu', '?')} ({res['env'].get('date', '')})",
             ""]
    if "grouped" in res:
        lines += ["## Grouped MXFP4 W4A16 vs torch._grouped_mm on BF16 (bar >= 3x)", "",
                  "| experts | tokens | routed | ours layer us | torch layer us | x | ours "
                  "GEMMs us | torch GEMMs us | x | floor us | auto |", "|" + "---|" * 11]
        for r in res["grouped"]:
            lines.append(f"| {r['experts']} | {r['tokens']} | {r['routed_experts_mean']:.1f} | "
                         f"{r['ours_layer']:.1f} | {r['torch_layer']:.1f} | "
                         f"{r['speedup_layer']:.2f} | {r['ours_gemms']:.1f} | "
                         f"{r['torch_gemms']:.1f} | {r['speedup_gemms']:.2f} | "
                         f"{r['floor_us']:.1f} | {auto_names(r)} |")
    if "dense" in res:
        lines += ["", "## Dense W4A16 M = 1: MXFP4 vs NVFP4 (bar <= 1.10)", "",
                  "| N x K | MXFP4 us | NVFP4 us | ratio | BF16 us | floor us |",
                  "|---|---|---|---|---|---|"]
        for r in res["dense"]:
            lines.append(f"| {r['n']}x{r['k']} | {r['mxfp4']:.2f} | {r['nvfp4']:.2f} | "
                         f"{r['mxfp4_over_nvfp4']:.3f} | {r['bf16']:.2f} | "
                         f"{r['floor_mxfp4_us']:.2f} |")
    if "decode" in res:
        d = res["decode"]
        lines += ["", f"## Batch-1 decode, {d['layers']}-layer gpt-oss-20b-like, vocab "
                  f"{d['vocab']} (bar: faster than both)", "",
                  f"- cute_fp4: {d['ours_us']:.0f} us/token ({d['ours_how']})",
                  f"- transformers' own load of the checkpoint {d['transformers_path']}: "
                  f"{d['transformers_us']:.0f} us/token ({d['transformers_how']}), "
                  f"{d['speedup_vs_transformers']:.2f}x",
                  f"- BF16, eager experts loop: {d['bf16_eager_loop_us']:.0f} us/token "
                  f"({d['bf16_eager_loop_how']}), {d['speedup_vs_bf16_eager_loop']:.2f}x"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sections", default="grouped,dense,decode")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=201088)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = p.parse_args()
    if args.quick:
        args.iters, args.reps = 8, 3
    args.out.mkdir(parents=True, exist_ok=True)
    from gpu_session import env

    res: dict = {"env": env(), "args": {k: str(v) for k, v in vars(args).items()},
                 "formulas": {"floor": "bytes of the weights read (MXFP4: 0.5 + 1/32 byte per "
                                       "element; grouped: the routed experts) / the rate of "
                                       "a plain 1 GiB read on this GPU (read_floor.read_rate"
                                       "; bandwidth.how says if the datasheet stood in)",
                              "speedup": "peer time / cute_fp4 time"}}
    sections = {"grouped": grouped, "dense": dense, "decode": decode}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        res[name] = sections[name](args)
        res.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        if _RATE:
            res["bandwidth"] = {"bytes_per_s": _RATE["rate"], "how": _RATE["how"]}
        (args.out / "gpt_oss.json").write_text(json.dumps(res, indent=1, default=str))
        _free()
    res["failures"] = FAILURES
    (args.out / "gpt_oss.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out / "gpt_oss.md").write_text(markdown(res))
    print(markdown(res))
    if FAILURES:
        sys.exit(f"{len(FAILURES)} check(s) failed: {FAILURES}")


if __name__ == "__main__":
    main()
