"""NVFP4 checkpoints in transformers, end to end on one GPU: an 8-layer Llama-3-8B-like and an
8-layer Qwen3-30B-A3B-like model (random weights) quantized by ``cute_fp4.hf.quantize_model``,
written by ``save_pretrained``, loaded by ``from_pretrained``, run by transformers.

Per model, in one run:

* **load**: device memory allocated by ``from_pretrained`` at its peak against the bound
  (the checkpoint's tensor bytes: NVFP4 bytes plus the BF16 of the excluded modules, plus
  10%), seconds;
* **logits**: a prefill of 4 x 128 random tokens against the fake-quantized BF16 model
  (``cute_fp4.hf.fake_quantize``: the same weights' exact NVFP4 values): relative error
  ``||l - l_ref|| / ||l_ref||`` of the whole tensor, per position (median, 90th percentile:
  a MoE token may route to another expert), top-1 agreement; and both models' whole-tensor
  error against the same exact values in float32 (SDPA's math kernel): the reference's own
  rounding is part of the first figure;
* **decode**: batch-1 tokens/s on the fastest path transformers offers for the BF16 model,
  the same for both: ``generate(cache_implementation="static")``, which compiles the
  decode step with ``torch.compile(mode="reduce-overhead")`` (Inductor, CUDA graphs).
  Per token: ``(t(LONG) - t(SHORT)) / (LONG - SHORT)`` new tokens, same static cache,
  median of 3 (the prefill cancels);
* **where the time goes**: the GPU kernels of one ``generate(SHORT)`` under torch.profiler,
  summed per category per decode step, and the weight bytes a batch-1 decode step reads
  (MoE: the top-k experts) over the GPU's bandwidth: the floor.

    python perf/hf_generate.py --out DIR [--models dense,moe] [--layers 8] [--deadline S]

writes ``DIR/hf_generate.json`` (after each model) and ``DIR/hf_generate.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import cute_fp4.hf as hf
from cute_fp4 import nn as cnn
from cute_fp4.hf import experts as ex
from cute_fp4.hf.checkpoint import read_tensor_index

HBM_BYTES_S = 4.8e12  # H200 datasheet
SHORT, LONG, PROMPT = 32, 160, 32


def configs(layers: int) -> dict:
    import transformers as tf

    common = dict(num_hidden_layers=layers, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    return {
        "dense": tf.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                vocab_size=128256, rope_theta=500000.0, **common),
        "moe": tf.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144,
                                 moe_intermediate_size=768, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                 rope_theta=1000000.0, **common),
    }


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- measures

def load_measure(path: str) -> tuple:
    _free()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = hf.from_pretrained(path, device="cuda")
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    ckpt = sum(i.dtype.itemsize * _numel(i.shape) for i in read_tensor_index(path).values())
    peak = torch.cuda.max_memory_allocated() - base
    resident = torch.cuda.memory_allocated() - base
    return model, {"seconds": round(secs, 2), "checkpoint_bytes": ckpt,
                   "peak_bytes": peak, "resident_bytes": resident,
                   "bound_bytes": int(ckpt * 1.10), "peak_over_bound": peak / (ckpt * 1.10)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def logits_measure(nv, ref, vocab: int, truth=None) -> dict:
    """``nv``'s logits against ``ref`` (the fake-quantized BF16 model); with ``truth`` (the
    same exact values in float32, run on SDPA's math kernel) also ``nv``'s and ``ref``'s
    own relative error against it: how much of the difference is the reference's."""
    g = torch.Generator("cuda").manual_seed(5)
    x = torch.randint(0, vocab, (4, 128), device="cuda", generator=g)
    with torch.no_grad():
        a, b = nv(x).logits.double(), ref(x).logits.double()
    tok = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()
    res = {"rel_err": float((a - b).norm() / b.norm()), "token_median": float(tok.median()),
           "token_p90": float(tok.quantile(0.9)), "token_max": float(tok.max()),
           "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean())}
    if truth is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            t = truth(x).logits.double()
        res["nvfp4_vs_float32"] = float((a - t).norm() / t.norm())
        res["bf16_ref_vs_float32"] = float((b - t).norm() / t.norm())
    return res


def _generate(model, prompt, n: int, cache=None):
    """Greedy ``generate`` of ``n`` new tokens on a static cache: transformers' own (a new
    ``StaticCache`` every call, ``cache=None``) or ``cache``, reset first (one cache, so its
    tensors keep their addresses from call to call)."""
    kw = {"cache_implementation": "static"} if cache is None else {"past_key_values": cache}
    if cache is not None:
        cache.reset()
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


class CaptureCount:
    """Counts CUDA-graph captures (``torch.cuda.CUDAGraph.capture_begin``) while active:
    the cudagraph trees record a graph again when a static input (the cache's tensors)
    moved."""

    def __enter__(self):
        self.count, self._real = 0, torch.cuda.CUDAGraph.capture_begin

        def counted(graph, *a, **k):
            self.count += 1
            return self._real(graph, *a, **k)

        torch.cuda.CUDAGraph.capture_begin = counted
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.capture_begin = self._real


def decode_measure(model, vocab: int, reuse_cache: bool = False) -> dict:
    """ms per token: ``(t(LONG) - t(SHORT)) / (LONG - SHORT)``, median of 3; with
    ``reuse_cache`` one StaticCache serves every call. Graph captures counted per call."""
    from transformers import StaticCache

    g = torch.Generator("cuda").manual_seed(9)
    prompt = torch.randint(0, vocab, (1, PROMPT), device="cuda", generator=g)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + LONG) if reuse_cache \
        else None
    with CaptureCount() as c:  # compiles, records graphs
        first = _sync_time(lambda: _generate(model, prompt, LONG, cache))
    captures = {"first": c.count}
    warm = _sync_time(lambda: _generate(model, prompt, LONG, cache))
    per_token, caps = [], []
    for _ in range(3):
        with CaptureCount() as cs:
            ts = _sync_time(lambda: _generate(model, prompt, SHORT, cache))
        with CaptureCount() as cl:
            tl = _sync_time(lambda: _generate(model, prompt, LONG, cache))
        per_token.append((tl - ts) / (LONG - SHORT))
        caps.append((cs.count, cl.count))
    ms = statistics.median(per_token) * 1e3
    return {"first_generate_s": round(first, 2), "second_generate_s": round(warm, 3),
            "compiled": hasattr(model, "_compiled_call"), "ms_per_token": ms,
            "tokens_s": 1e3 / ms, "ms_per_token_all": [t * 1e3 for t in per_token],
            "cache": "reused" if reuse_cache else "new per call",
            "graph_captures": {**captures, "short_long": caps}}


def _category(name: str) -> str:
    n = name.lower()
    if "cutlass" in n or "cute" in n or "kernel_cutlass" in n or "gemmkernel" in n:
        return "nvfp4 gemm (cute_fp4)"
    if "quantiz" in n or "dequant" in n:
        return "nvfp4 activation"
    if "flash" in n or "attention" in n or "fmha" in n or "sdpa" in n:
        return "attention"
    if ("gemm" in n or "nvjet" in n or "xmma" in n or "gemv" in n or "sm90_" in n
            or "cublas" in n or "splitk" in n or "grouped_mm" in n):
        return "torch gemm (bf16)"
    if "triton" in n:
        return "inductor fused"
    if "sort" in n or "scatter" in n or "index" in n or "gather" in n or "radix" in n:
        return "routing / index"
    return "other"


def profile_measure(model, vocab: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator("cuda").manual_seed(9)
    prompt = torch.randint(0, vocab, (1, PROMPT), device="cuda", generator=g)
    _generate(model, prompt, SHORT)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate(model, prompt, SHORT)
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type == torch.autograd.DeviceType.CUDA and us:
            c = _category(ev.key)
            cats[c] = cats.get(c, 0.0) + us
    steps = SHORT  # the prefill is in there too: it is one step's worth of launches
    top = sorted(((ev.key[:60], (getattr(ev, "device_time_total", 0.0) or 0.0) / steps)
                  for ev in prof.key_averages()
                  if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda kv: -kv[1])
    return {"us_per_step": {k: round(v / steps, 1) for k, v in sorted(cats.items())},
            "kernel_us_per_step": round(sum(cats.values()) / steps, 1),
            "top_kernels_us_per_step": [(k, round(v, 1)) for k, v in top[:12]]}


def _events_ms(fn, n: int) -> float:
    """Milliseconds per call of ``n`` back-to-back calls of ``fn``, CUDA events (the host
    enqueues ahead unless something in ``fn`` waits on the GPU)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _host_us(fn, n: int) -> float:
    """Median host microseconds of one call of ``fn`` (the GPU drained before each)."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


LAUNCH_APIS = ("cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel",
               "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaStreamSynchronize",
               "cudaMemsetAsync")


def trace_summary(fn, steps: int = 5) -> dict:
    """torch.profiler (CPU and CUDA) over ``steps`` calls of ``fn``: per call, the top CPU
    ops by self time, the count of each launch API, the GPU kernel time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    cpu, launches, kernel_us = [], {}, 0.0
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += getattr(ev, "device_time_total", 0.0) or 0.0
            continue
        if ev.key in LAUNCH_APIS:
            launches[ev.key] = ev.count / steps
        cpu.append((ev.key[:70], round(ev.self_cpu_time_total / steps, 1), ev.count / steps))
    cpu.sort(key=lambda r: -r[1])
    return {"kernel_us_per_call": round(kernel_us / steps, 1), "launch_calls_per_call": launches,
            "cpu_self_us_per_call": round(sum(r[1] for r in cpu), 1),
            "top_cpu_self_us": cpu[:18]}


def _tree_nodes() -> dict:
    """The cudagraph trees of this process: recorded graphs and functions."""
    from torch._inductor import cudagraph_trees as ct

    mgr = ct.get_container(torch.cuda.current_device()).tree_manager
    if mgr is None:
        return {"tree_manager": None}
    todo = [n for nodes in mgr.roots.values() for n in nodes]
    count = 0
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(c for cs in node.children.values() for c in cs)
    hints = getattr(mgr, "non_cudagraph_managed_mutation_hint", {})
    return {"graphs": count, "functions": len(mgr.ids_to_funcs),
            "warmed_up": len(getattr(mgr, "warmed_up_functions", ())),
            "eager_by_mutation": sum(bool(v) for h in hints.values() for v in h.values())}


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {f"{g}.{k}": v for g in ("inductor", "stats", "graph_break", "recompiles")
            for k, v in counters[g].items()
            if g != "inductor" or "cudagraph" in k or "partition" in k}


def _rewind(cache, position: int) -> None:
    """Set a static cache's write position (``cumulative_length``, a device tensor the step
    advances) back to ``position``: repeated calls of one step stay inside the cache."""
    for layer in cache.layers:
        n = getattr(layer, "cumulative_length", None)
        if isinstance(n, torch.Tensor):
            n.fill_(position)


def generate_step_diag(model, vocab: int, cache=None) -> dict:
    """generate's own compiled decode call (``model._compiled_call``, the kwargs of its last
    decode step recorded) run alone: graph replays per call, host time per call, calls
    back to back, and the CPU trace of a call."""
    g = torch.Generator("cuda").manual_seed(9)
    prompt = torch.randint(0, vocab, (1, PROMPT), device="cuda", generator=g)
    orig, rec = model._compiled_call, {}

    def spy(*a, **k):
        rec.update(a=a, k=k)
        return orig(*a, **k)

    model._compiled_call = spy
    try:
        _generate(model, prompt, 8, cache)
    finally:
        model._compiled_call = orig
    a, k = rec["a"], rec["k"]
    cache = next(v for v in (*k.values(), *a) if hasattr(v, "layers"))
    at = PROMPT + 8

    def call():
        with torch.no_grad():
            return orig(*a, **k)

    def batch(fn, *args):  # every batch starts at the same cache position (<= 60 calls)
        _rewind(cache, at)
        return fn(*args)

    _rewind(cache, at)
    call()
    replays, real = [0], torch.cuda.CUDAGraph.replay

    def counted(self):
        replays[0] += 1
        return real(self)

    torch.cuda.CUDAGraph.replay = counted
    _rewind(cache, at)
    try:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = real
    return {"graph_replays_per_call": replays[0] / 10, "tree": _tree_nodes(),
            "host_us_per_call": round(batch(_host_us, call, 30), 1),
            "ms_per_call_back_to_back": batch(_events_ms, call, 50),
            "trace": batch(trace_summary, call), "kwargs": sorted(k)}


def own_step_measure(model, vocab: int) -> dict:
    """A decode step of our own: static cache after a prefill, ``torch.compile`` (Inductor,
    no CUDA graphs) of one token's forward, then that compiled step captured in one
    ``torch.cuda.CUDAGraph`` and replayed (CUDA events): the kernels and the graph's own
    overhead, without generate's loop or the cudagraph trees' bookkeeping."""
    from transformers import StaticCache

    g = torch.Generator("cuda").manual_seed(9)
    prompt = torch.randint(0, vocab, (1, PROMPT), device="cuda", generator=g)
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + 16)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(PROMPT, device="cuda"))
    ids = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([PROMPT], device="cuda")

    def step():  # writes position PROMPT every time (the rewind is in the graph)
        _rewind(cache, PROMPT)
        return model(input_ids=ids, past_key_values=cache, cache_position=pos,
                     position_ids=pos.view(1, 1), use_cache=True).logits

    fn = torch.compile(step, dynamic=False)
    res: dict = {}
    with torch.no_grad():
        res["compile_s"] = round(_sync_time(fn), 1)
        ref = fn().float()
        res["inductor_ms_back_to_back"] = _events_ms(fn, 30)
        res["inductor_host_us"] = round(_host_us(fn, 20), 1)
        res["inductor_trace"] = trace_summary(fn, 3)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = fn()
        graph.replay()
        torch.cuda.synchronize()
        res["graph_vs_compiled_rel"] = float((logits.float() - ref).norm() / ref.norm())
        res["graph_ms"] = _events_ms(graph.replay, 100)
        res["graph_host_us"] = round(_host_us(graph.replay, 20), 1)
        res["graph_trace"] = trace_summary(graph.replay, 5)
    return res


def bytes_per_token(model) -> int:
    """Weight bytes a batch-1 decode step reads: every linear, the lm_head, one embedding
    row; MoE experts: top-k of E."""
    cfg = model.config
    total = model.get_input_embeddings().weight[0].numel() * 2
    for _, m in model.named_modules():
        if isinstance(m, cnn.NVFP4Linear):
            total += m.weight_packed.numel() + m.weight_scale.numel() + 4
        elif type(m) is torch.nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
        elif ex.holds_nvfp4(m):
            moe = m.nvfp4
            per = sum(b.numel() * b.element_size() for b in (
                moe.w13_weight, moe.w13_weight_scale, moe.w2_weight, moe.w2_weight_scale))
            total += per * cfg.num_experts_per_tok // moe.num_experts
        elif ex.is_experts(m):
            per = (m.gate_up_proj.numel() + m.down_proj.numel()) * 2
            total += per * cfg.num_experts_per_tok // m.num_experts
        elif hasattr(m, "weight") and m.weight is not None and "Router" in type(m).__name__:
            total += m.weight.numel() * m.weight.element_size()
    return total


# ----------------------------------------------------------------------------- a model

def _diagnose(out: dict, kind: str, config, bf16, model, opts: dict) -> None:
    """generate's step alone (on one reused cache) and, with ``own_step``, a captured step
    of our own, per weights; errors recorded, never raised."""
    from transformers import StaticCache

    out["generate_step"], out["own_step"] = {}, {}
    for name, m in (("bf16", bf16), ("nvfp4", model)):
        cache = StaticCache(config=m.config, max_cache_len=PROMPT + LONG)
        fns = [("generate_step", lambda m=m, c=cache: generate_step_diag(
            m, config.vocab_size, c))]
        if opts.get("own_step"):
            fns.append(("own_step", lambda m=m: own_step_measure(m, config.vocab_size)))
        for key, fn in fns:
            try:
                out[key][name] = fn()
            except Exception as e:  # a diagnosis must not lose the run
                import traceback

                traceback.print_exc()
                out[key][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"[{kind}] {key} {name} {json.dumps(out[key][name], default=str)}",
                  flush=True)


def run_model(kind: str, config, workdir: str, opts: dict | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    opts = opts or {}
    out: dict = {"model": kind, "layers": config.num_hidden_layers}
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        bf16 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    nv = copy.deepcopy(bf16)
    out["build_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    rep = hf.quantize_model(nv)
    out["quantize"] = {"seconds": round(time.perf_counter() - t, 1), "mode": rep.mode,
                       "quantized": len(rep.quantized), "kept": [n for n, _ in rep.skipped]}
    path = os.path.join(workdir, kind)
    t = time.perf_counter()
    hf.save_pretrained(nv, path)
    out["save_s"] = round(time.perf_counter() - t, 1)
    del nv
    model, out["load"] = load_measure(path)
    print(f"[{kind}] load {out['load']}", flush=True)
    truth = hf.fake_quantize(copy.deepcopy(bf16).float(), model)  # exact values, float32
    hf.fake_quantize(bf16, model)
    out["logits"] = logits_measure(model, bf16, config.vocab_size, truth)
    del truth
    _free()
    print(f"[{kind}] logits {out['logits']}", flush=True)
    out["bytes_per_token"] = {"nvfp4": bytes_per_token(model), "bf16": bytes_per_token(bf16)}
    out["decode"], out["compile_counters"] = {}, {}
    modes = {"reused": (True,), "new": (False,), "both": (True, False)}[opts.get("cache", "new")]
    for name, m in (("bf16", bf16), ("nvfp4", model)):
        before = _counters()
        for reuse in modes:  # a reused cache first: its graphs are recorded before others
            key = "decode_reused" if reuse and len(modes) == 2 else "decode"
            out.setdefault(key, {})[name] = decode_measure(m, config.vocab_size, reuse)
            print(f"[{kind}] {key} {name} {out[key][name]}", flush=True)
        after = _counters()
        out["compile_counters"][name] = {k: v - before.get(k, 0) for k, v in after.items()
                                         if v != before.get(k, 0)}
    if opts.get("diagnose"):
        _diagnose(out, kind, config, bf16, model, opts)
    d = out["decode"]
    out["speedup"] = d["bf16"]["ms_per_token"] / d["nvfp4"]["ms_per_token"]
    out["floor"] = {k: {"ms_per_token": b / HBM_BYTES_S * 1e3,
                        "measured_over_floor": d[k]["ms_per_token"] / (b / HBM_BYTES_S * 1e3)}
                    for k, b in out["bytes_per_token"].items()}
    out["ideal_speedup"] = out["bytes_per_token"]["bf16"] / out["bytes_per_token"]["nvfp4"]
    if "decode_reused" in out:
        r = out["decode_reused"]
        out["speedup_reused"] = r["bf16"]["ms_per_token"] / r["nvfp4"]["ms_per_token"]
    out["profile"] = {}
    for name, m in (("bf16", bf16), ("nvfp4", model)):
        try:
            out["profile"][name] = profile_measure(m, config.vocab_size)
        except Exception as e:  # the profile explains; it must not lose the run
            out["profile"][name] = {"error": f"{type(e).__name__}: {e}"}
    del model, bf16
    _free()
    return out


# ----------------------------------------------------------------------------- report

def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
        import cutlass

        env["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except ImportError:
        pass
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = "?"
    return env


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# NVFP4 checkpoints in transformers, {env['gpu']}", "",
             f"{env['date']}; driver {env.get('driver')}, torch {env['torch']} (CUDA "
             f"{env['cuda']}), transformers {env.get('transformers')}, CuTe DSL "
             f"{env.get('cutlass_dsl')}; batch-1 decode through generate(cache_implementation="
             f"'static') (torch.compile reduce-overhead), {LONG - SHORT} tokens, median of 3.",
             "", "| model | load peak / bound | logits rel. err (whole / token median / p90) "
             "| top-1 | BF16 tok/s | NVFP4 tok/s | speedup | ideal (bytes) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["models"]:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'][:80]} | | | | | | |")
            continue
        ld, lg, d = r["load"], r["logits"], r["decode"]
        lines.append(
            f"| {r['model']} ({r['layers']} layers) | {ld['peak_bytes'] / 2**30:.2f} / "
            f"{ld['bound_bytes'] / 2**30:.2f} GiB ({ld['peak_over_bound']:.2f}) | "
            f"{lg['rel_err']:.3g} / {lg['token_median']:.3g} / {lg['token_p90']:.3g} | "
            f"{lg['top1_agreement']:.3f} | {d['bf16']['tokens_s']:.0f} | "
            f"{d['nvfp4']['tokens_s']:.0f} | **{r['speedup']:.2f}x** | "
            f"{r['ideal_speedup']:.2f}x |")
        if "speedup_reused" in r:
            dr = r["decode_reused"]
            lines.append(f"| {r['model']}, one reused cache | | | | "
                         f"{dr['bf16']['tokens_s']:.0f} | {dr['nvfp4']['tokens_s']:.0f} | "
                         f"**{r['speedup_reused']:.2f}x** | |")
    lines += _diag_lines(res)
    return "\n".join(lines) + "\n"


def _diag_lines(res: dict) -> list[str]:
    """With --diagnose: where a token's time goes, per model and weights."""
    rows = [r for r in res["models"] if "generate_step" in r]
    if not rows:
        return []
    out = ["", "| model | weights | generate ms/token | generate's step alone ms | host us "
           "per step | graph replays per step | own graph replay ms | its kernels ms | "
           "own step without graph ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for w in ("bf16", "nvfp4"):
            gs, own = r["generate_step"].get(w, {}), r["own_step"].get(w)
            own = own or {"graph_ms": math.nan, "inductor_ms_back_to_back": math.nan,
                          "graph_trace": {"kernel_us_per_call": math.nan}}
            if "error" in own or "error" in gs:
                out.append(f"| {r['model']} | {w} | error: "
                           f"{(gs.get('error') or own.get('error'))[:100]} |||||||")
                continue
            out.append(
                f"| {r['model']} | {w} | {r['decode'][w]['ms_per_token']:.3f} | "
                f"{gs['ms_per_call_back_to_back']:.3f} | {gs['host_us_per_call']:.0f} | "
                f"{gs['graph_replays_per_call']:g} | {own['graph_ms']:.3f} | "
                f"{own['graph_trace']['kernel_us_per_call'] / 1e3:.3f} | "
                f"{own['inductor_ms_back_to_back']:.3f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from start after which no new model is started")
    p.add_argument("--min-model-s", type=float, default=120.0)
    p.add_argument("--diagnose", action="store_true",
                   help="also generate's compiled step alone (CPU trace, graph replays) "
                        "and perf_hints / recompiles / graph_breaks logs")
    p.add_argument("--own-step", action="store_true",
                   help="with --diagnose: a decode step of our own captured in one CUDA graph")
    p.add_argument("--cudagraph-log", action="store_true",
                   help="torch's cudagraphs debug log (slow: it formats every failed graph "
                        "match, which inflates the timings)")
    p.add_argument("--cache", choices=("new", "reused", "both"), default="both",
                   help="generate's static cache: transformers' new one per call, one "
                        "reused cache, or both")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.diagnose:
        torch._logging.set_logs(perf_hints=True, recompiles=True, graph_breaks=True,
                                cudagraphs=args.cudagraph_log)
    opts = {"diagnose": args.diagnose, "own_step": args.own_step, "cache": args.cache}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"env": environment(), "models": []}
    cfgs = configs(args.layers)
    with tempfile.TemporaryDirectory(dir=os.environ.get("HF_GEN_DIR")) as work:
        for kind in args.models.split(","):
            left = args.deadline - (time.perf_counter() - start)
            if args.deadline and left < args.min_model_s:
                res["models"].append({"model": kind, "error": f"skipped: {left:.0f} s left"})
                continue
            try:
                res["models"].append(run_model(kind, cfgs[kind], work, opts))
            except Exception as e:
                import traceback

                traceback.print_exc()
                res["models"].append({"model": kind, "error": f"{type(e).__name__}: {e}"})
            _free()
            (out / "hf_generate.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "hf_generate.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
