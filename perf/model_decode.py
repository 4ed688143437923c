"""End-to-end decode: a Llama-architecture decoder in BF16 against the same model with its
attention and MLP projections converted to NVFP4 by ``cute_fp4.nn.convert``, in one run.

The model: hidden 4096, MLP 14336 (SiLU, gate/up/down), 32 query and 8 key/value heads of
128 (GQA), RMSNorm, rotary embedding, random weights N(0, 0.02), ``--layers`` decoder
layers (default 8), a BF16 ``lm_head`` of ``--vocab`` rows (not converted). With
``transformers`` importable (``--impl auto``/``hf``), the module tree is its
``LlamaForCausalLM`` built from a ``LlamaConfig`` (so ``convert`` works on HF's module
names and types); otherwise (``local``) a small definition here with the same names. The
decode step is this file's either way: embedding, per layer RMSNorm -> q/k/v projections
-> rotary -> a static KV cache written at a position held in a GPU tensor -> attention
over the cache with a mask -> o projection -> residual, RMSNorm -> MLP -> residual; final
norm, logits, greedy next token. Everything in it is static-shaped and sync-free, so the
whole step is captured in one CUDA graph.

Measured per model and batch (1 and 16): latency per token of ``--steps`` decode steps
eagerly (host included; the fastest of 2 x ``--repeats``: host-bound, so other processes only
add time; for the op-by-op step the models take turns, one run each per round, so that all
see the same host) and as replays of the captured step (median of ``--repeats``),
tokens/s, and the ratio to BF16. Accuracy: the same token sequence (teacher-forced, same
KV-cache prefix) through every model: relative error of the logits vs BF16
(``||l - l_bf16|| / ||l_bf16||``, mean and max over steps) and top-1 agreement.
W4A4 uses a static input scale per layer calibrated on the BF16 model's activations
(``--w4a4-scale static``) or a per-call dynamic one. Bars (issue 12): with W4A16 at batch
1, graphs >= 1.4x BF16's tokens/s and eager no slower than BF16.

    python perf/model_decode.py --out DIR [--layers 8] [--quick] [--modes w4a16,w4a4]

writes ``DIR/model_decode.json`` and ``DIR/model_decode.md``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import cute_fp4
from cute_fp4 import nn as cnn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import early_weights  # noqa: E402


@dataclass(frozen=True)
class Config:
    layers: int = 8
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000
    context: int = 512  # KV-cache length; a random prefix fills all but the decoded tail
    rope_theta: float = 500000.0
    eps: float = 1e-5
    model: str = "dense"  # "moe": Qwen3-MoE (q/k norms, experts_per_token of experts)
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0


def moe_config(layers: int, vocab: int, context: int) -> Config:
    """An 8-layer Qwen3-30B-A3B-like decoder: hidden 2048, 32/4 heads of 128, 128 experts
    of intermediate 768, top-8 (the lm_head's vocabulary is ``vocab``)."""
    return Config(layers=layers, hidden=2048, intermediate=6144, heads=32, kv_heads=4,
                  head_dim=128, vocab=vocab, context=context, rope_theta=1000000.0, eps=1e-6,
                  model="moe", experts=128, experts_per_token=8, moe_intermediate=768)


# ----------------------------------------------------------------------------- models

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):  # the projections; the attention itself is in decode_step
    def __init__(self, c: Config):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)


class Layer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)


class Body(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)


class LocalLlama(nn.Module):
    """The module tree of ``LlamaForCausalLM`` (same names), nothing else."""

    def __init__(self, c: Config):
        super().__init__()
        self.model, self.lm_head = Body(c), nn.Linear(c.hidden, c.vocab, bias=False)


def hf_config(c: Config):
    """The ``transformers`` config of ``c``: ``LlamaConfig``, or ``Qwen3MoeConfig`` (experts
    run by ``torch._grouped_mm`` in BF16: capturable) for ``c.model == "moe"``."""
    import transformers
    from transformers import LlamaConfig

    if c.model == "moe":
        return transformers.Qwen3MoeConfig(
            vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.intermediate,
            moe_intermediate_size=c.moe_intermediate, num_hidden_layers=c.layers,
            num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
            num_experts=c.experts, num_experts_per_tok=c.experts_per_token,
            norm_topk_prob=True, max_position_embeddings=c.context, rms_norm_eps=c.eps,
            rope_theta=c.rope_theta, tie_word_embeddings=False,
            experts_implementation="grouped_mm")

    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
            if int(transformers.__version__.split(".")[0]) >= 5 else
            {"rope_theta": c.rope_theta})
    return LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden,
                       intermediate_size=c.intermediate, num_hidden_layers=c.layers,
                       num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                       head_dim=c.head_dim, max_position_embeddings=c.context,
                       rms_norm_eps=c.eps, tie_word_embeddings=False, **rope)


def build_model(c: Config, impl: str, device="cuda",
                dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, str]:
    """(model with N(0, 0.02) weights, the implementation used: "hf" or "local")."""
    if impl in ("auto", "hf"):
        try:
            from transformers import LlamaForCausalLM
        except ImportError:
            if impl == "hf":
                raise
            impl = "local"
        else:
            impl = "hf"
    if c.model == "moe" and impl != "hf":
        raise RuntimeError("the MoE decoder is transformers' Qwen3MoeForCausalLM")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if c.model == "moe":
                from transformers import Qwen3MoeForCausalLM

                model = Qwen3MoeForCausalLM(hf_config(c))
            else:
                model = LlamaForCausalLM(hf_config(c)) if impl == "hf" else LocalLlama(c)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # projections, experts, router, embedding
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model, impl


# ----------------------------------------------------------------------------- decode

class DecodeState:
    """Static buffers of one decode loop: KV caches, position, tokens, rotary tables."""

    def __init__(self, c: Config, batch: int, prefix: int, device="cuda",
                 dtype: torch.dtype = torch.bfloat16):
        dev = torch.device(device)
        self.c, self.batch, self.prefix = c, batch, prefix
        shape = (batch, c.kv_heads, c.context, c.head_dim)
        self.k = [torch.empty(shape, device=dev, dtype=dtype) for _ in range(c.layers)]
        self.v = [torch.empty(shape, device=dev, dtype=dtype) for _ in range(c.layers)]
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.positions = torch.arange(c.context, device=dev)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=dev).float()
                                    / c.head_dim)
        ang = torch.outer(self.positions.float(), inv)
        ang = torch.cat((ang, ang), dim=-1)  # [S, D]: halves rotated together (HF layout)
        self.cos, self.sin = ang.cos(), ang.sin()

    def reset(self, seed: int = 0) -> None:
        """The same random prefix in every model's cache, position at its end."""
        g = torch.Generator(device=self.pos.device).manual_seed(seed)
        for t in (*self.k, *self.v):
            t.normal_(generator=g)
        self.pos.fill_(self.prefix)
        self.tokens.random_(0, self.c.vocab, generator=g)


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def _attention(attn: nn.Module, h, i: int, st: DecodeState, cos, sin, valid):
    c, b = st.c, h.shape[0]
    g = c.heads // c.kv_heads
    q = attn.q_proj(h).view(b, c.kv_heads, g, c.head_dim)
    k = attn.k_proj(h).view(b, c.kv_heads, 1, c.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    v = attn.v_proj(h).view(b, c.kv_heads, 1, c.head_dim)
    st.k[i].index_copy_(2, st.pos, k)
    st.v[i].index_copy_(2, st.pos, v)
    scores = torch.matmul(q, st.k[i].transpose(-1, -2)).float() * c.head_dim ** -0.5
    probs = scores.masked_fill(~valid, float("-inf")).softmax(-1).to(h.dtype)
    out = torch.matmul(probs, st.v[i])  # [B, KVH, G, D]
    return attn.o_proj(out.reshape(b, 1, c.heads * c.head_dim))


def decode_step(model: nn.Module, st: DecodeState, feedback: bool = True) -> torch.Tensor:
    """One token for every sequence: logits [B, vocab]; advances ``st.pos`` (and, with
    ``feedback``, writes the greedy next token into ``st.tokens``)."""
    body = model.model
    h = body.embed_tokens(st.tokens)  # [B, 1, hidden]
    cos, sin = st.cos.index_select(0, st.pos), st.sin.index_select(0, st.pos)
    valid = st.positions <= st.pos
    for i, layer in enumerate(body.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), i, st, cos, sin, valid)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = model.lm_head(body.norm(h))[:, -1]
    if feedback:
        st.tokens.copy_(logits.argmax(-1, keepdim=True))
    st.pos.add_(1)
    return logits


# ----------------------------------------------------------------------------- timing

STEP_KINDS = ("torch", "compiled")


def _per_token_ms(run_steps, reset, steps: int, repeats: int, keep=statistics.median
                  ) -> float:
    """Latency per token of ``run_steps(steps)``, ``keep`` (median or min) of ``repeats``."""
    times = []
    for _ in range(repeats):
        reset()  # the cache has room for `steps` tokens after the prefix
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_steps(steps)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return keep(times)


_STEPS: dict = {}  # (model, state, compiled) -> step: one torch.compile per model and batch


def step_function(model: nn.Module, st: DecodeState, compiled: bool,
                  backend: str = "inductor") -> Callable[[], Any]:
    """The decode step of ``model`` on ``st``: eager torch, or ``torch.compile``d whole
    (Inductor fuses the norms, rotary, softmax and residual adds; the projections stay
    cuBLAS or cute_fp4 custom ops). The same for every model, so the comparison is fair.
    Memoised: the turns of :func:`interleaved_eager` reuse the compiled step."""
    key = (id(model), id(st), compiled, backend)
    if key in _STEPS:
        return _STEPS[key]

    def step():
        return decode_step(model, st)

    fn = torch.compile(step, fullgraph=True, dynamic=False, backend=backend) if compiled \
        else step
    _STEPS[key] = fn
    return fn


def full_path_launches(step, steps: int = 4) -> float:
    """cute_fp4 GEMM launches per step that took the full path (checks, kernel lookup,
    argument building) rather than a binding: 0 once every projection is bound."""
    from cute_fp4 import nn, run

    calls, inner = [0], run.run_checked
    users = [m for m in (run, nn) if getattr(m, "run_checked", None) is inner]

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    for m in users:  # every module that calls it by its own name
        m.run_checked = counted
    try:
        for _ in range(steps):
            step()
    finally:
        for m in users:
            m.run_checked = inner
    return calls[0] / steps


@torch.no_grad()
def measure(model: nn.Module, st: DecodeState, steps: int, repeats: int, warmup: int,
            compiled: bool = False, eager_timing: bool = True) -> dict:
    """Eager and CUDA-graph latency per token (ms) of ``model``'s decode step on ``st``
    (with ``compiled``, of its ``torch.compile``d step, whose first logits are also
    compared with the eager step's)."""
    step = step_function(model, st, compiled)
    out = {}
    if compiled:  # the compiled step computes what the eager one does
        st.reset()
        ref = decode_step(model, st).float()
        st.reset()
        got = step().float()
        out["vs_eager_rel_err"] = float((got - ref).norm() / ref.norm())

    def eager(n):
        for _ in range(n):
            step()

    st.reset()
    eager(warmup)  # compiles kernels, resolves schedules
    if eager_timing:
        out["full_path_launches_per_step"] = full_path_launches(step)
        # eager steps are host-bound: other processes on the host only add time (runs of
        # the same model measured 5.3-13 ms per token), so the fastest of more repeats
        out["eager_ms"] = _per_token_ms(eager, st.reset, steps, 2 * repeats, keep=min)
    st.reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager(2)
    torch.cuda.current_stream().wait_stream(side)
    st.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    st.reset()

    def replay(n):
        for _ in range(n):
            graph.replay()

    replay(warmup)
    out["graph_ms"] = _per_token_ms(replay, st.reset, steps, repeats)
    return out


@torch.no_grad()
def teacher_forced_logits(model: nn.Module, st: DecodeState, ids: torch.Tensor
                          ) -> torch.Tensor:
    st.reset()
    out = []
    for t in range(ids.shape[0]):
        st.tokens.copy_(ids[t])
        out.append(decode_step(model, st, feedback=False).float())
    return torch.stack(out)


def accuracy(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    err = [(float((a - b).norm() / b.norm())) for a, b in zip(logits, ref, strict=True)]
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    return {"logits_rel_err_mean": statistics.mean(err), "logits_rel_err_max": max(err),
            "top1_agreement": agree}


@torch.no_grad()
def layer_error(ref: nn.Module, q: nn.Module, name: str = "model.layers.0.self_attn.q_proj",
                rows: int = 16) -> float:
    """Relative error of one converted projection against its BF16 original on N(0, 1)
    inputs: the quantization error of a single layer, which the logits' error compounds
    through every layer of a random-weight model."""
    a, b = ref.get_submodule(name), q.get_submodule(name)
    g = torch.Generator(device=a.weight.device).manual_seed(2)
    x = torch.randn(rows, a.in_features, generator=g, device=a.weight.device,
                    dtype=a.weight.dtype)
    want = a(x).float()
    return float((b(x).float() - want).norm() / want.norm())


# ----------------------------------------------------------------------------- calibration

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_projection(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in PROJECTIONS


@torch.no_grad()
def calibrate(model: nn.Module, st: DecodeState, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per projection: the amax of its inputs over a teacher-forced run (on the GPU)."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and _is_projection(name):
            def hook(m, args, name=name):
                a = args[0].abs().amax().float()
                amax[name] = a if name not in amax else torch.maximum(amax[name], a)
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        teacher_forced_logits(model, st, ids)
    finally:
        for h in hooks:
            h.remove()
    return amax


def quantized_copy(model: nn.Module, mode: str, amax: dict | None) -> tuple[nn.Module, dict]:
    q = copy.deepcopy(model)
    if getattr(getattr(model, "config", None), "model_type", "") == "qwen3_moe":
        from cute_fp4 import hf

        rep = hf.quantize_model(q, mode=mode, fuse_mlp=False)  # projections and experts
        return q, {"converted": len(rep.quantized), "skipped": [n for n, _ in rep.skipped]}
    # W4A16: gate and up as one GEMM with SiLU-and-mul in its epilogue (NVFP4GatedMLP);
    # W4A4: unfused (per-layer input scales below)
    rep = cute_fp4.convert(q, mode, skip=lambda name, lin: not _is_projection(name),
                           fuse_mlp=mode == "w4a16")
    if amax is not None:
        for name in rep.converted:
            q.get_submodule(name).set_input_scale(amax[name] / 2688.0)
    info = {"converted": len(rep.converted),
            "skipped": [f"{n}: {r}" for n, r in rep.skipped]}
    return q, info


def weight_bytes(model: nn.Module, batch: int | None = None) -> int:
    """Bytes of the projection weights (NVFP4: packed elements and block scales); MoE
    experts: all of them, or with ``batch`` the expected share a decode step of that many
    tokens reads (``1 - (1 - k / E) ** batch`` of the experts: k routed of E per token)."""
    from cute_fp4.hf import experts as ex

    total = 0
    for name, mod in model.named_modules():
        if isinstance(mod, cnn.NVFP4Linear):
            total += sum(b.numel() * b.element_size() for b in
                         (mod.weight_packed, mod.weight_scale))
        elif isinstance(mod, nn.Linear) and _is_projection(name):
            total += mod.weight.numel() * mod.weight.element_size()
        elif ex.holds_nvfp4(mod) or ex.is_experts(mod):
            moe = getattr(mod, "nvfp4", None)
            parts = ((moe.w13_weight, moe.w13_weight_scale, moe.w2_weight, moe.w2_weight_scale)
                     if ex.holds_nvfp4(mod) else (mod.gate_up_proj, mod.down_proj))
            every = sum(b.numel() * b.element_size() for b in parts)
            k = model.config.num_experts_per_tok
            e = moe.num_experts if ex.holds_nvfp4(mod) else mod.num_experts
            share = 1.0 if batch is None else 1 - (1 - k / e) ** batch
            total += int(every * share)
    return total


GEMM_KERNELS = r"cute_fp4|gemm|gemv|nvjet|xmma|cutlass"  # GEMM kernels of either model


@torch.no_grad()
def graph_profile(model: nn.Module, st: DecodeState) -> dict:
    """One decode step under a CUDA graph, one replay profiled (``torch.profiler``: CUPTI
    records every kernel of the graph): the step's span, the time during which a GEMM ran
    (:data:`GEMM_KERNELS`, overlaps counted once), that of the cute_fp4 kernels alone (the
    NVFP4 projections and experts), and the kernels by total time."""
    import re

    import read_floor

    step = step_function(model, st, False)
    st.reset()
    g, _ = read_floor.capture(step)
    st.reset()
    g.replay()
    st.reset()
    torch.cuda.synchronize()
    evs = read_floor.kernel_timeline(g.replay)
    by: dict[str, float] = {}
    for e in evs:
        key = e["name"][:90]
        by[key] = by.get(key, 0.0) + e["end"] - e["start"]
    gemm = [e for e in evs if re.search(GEMM_KERNELS, e["name"], re.I)]
    ours = [e for e in evs if "cute_fp4" in e["name"]]
    return {"span_us": round(evs[-1]["end"] if evs else 0.0, 1), "kernels": len(evs),
            "gemm_busy_us": round(read_floor.busy_us(gemm), 1),
            "cute_fp4_busy_us": round(read_floor.busy_us(ours), 1),
            "overlapping_neighbours": sum(b["start"] < a["end"] for a, b in zip(evs, evs[1:])),
            "top_kernels_us": sorted(((k, round(v, 1)) for k, v in by.items()),
                                     key=lambda kv: -kv[1])[:25]}


# ----------------------------------------------------------------------------- report

def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    try:
        import cutlass
        dsl = getattr(cutlass, "__version__", "?")
    except ImportError:
        dsl = None
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cute_fp4": cute_fp4.__version__, "cutlass_dsl": dsl,
            "transformers": tf, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def bars(res: dict) -> list[dict]:
    """Issue 44's bars: the step under graphs against BF16 (dense >= 1.75x, MoE >= 1.5x,
    batch 1, each step kind measured), the NVFP4 kernels' busy time in a profiled step
    within 1.3x of their weights' read floor."""
    want = 1.5 if res["config"]["model"] == "moe" else 1.75
    by = {(r["model"], r["batch"], r["step"]): r for r in res["results"] if "error" not in r}
    out = []
    for (name, batch, kind), r in by.items():
        base = by.get(("bf16", batch, kind))
        if name == "bf16" or batch != 1 or not base:
            continue
        sp = base["graph_ms"] / r["graph_ms"]
        out.append({"bar": f"{name} batch 1, {kind} step under graphs: >= {want}x BF16",
                    "value": round(sp, 3), "passed": sp >= want})
    for name, prof in res.get("profiles", {}).items():
        if name != "bf16" and "cute_fp4_busy_us" in prof:
            ratio = prof["cute_fp4_busy_us"] / prof["projections_floor_us"]
            out.append({"bar": f"{name}: NVFP4 kernels' time in the step <= 1.3x their "
                               "weights' read floor", "value": round(ratio, 3),
                        "passed": ratio <= 1.3})
    return out


def markdown(res: dict) -> str:
    env, cfg = res["environment"], res["config"]
    arch = ("Qwen3-MoE-architecture" if cfg["model"] == "moe" else "Llama-architecture")
    lines = [f"# Decode, {arch} {cfg['layers']} layers ({res['impl']}), {env['gpu']}", "",
             f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}), CuTe DSL "
             f"{env['cutlass_dsl']}, transformers {env['transformers']}; hidden "
             f"{cfg['hidden']}, MLP {cfg['intermediate']}, {cfg['heads']}/{cfg['kv_heads']} "
             f"heads of {cfg['head_dim']}, vocab {cfg['vocab']} (BF16 lm_head), KV cache "
             f"{cfg['context']} (prefix {res['prefix']}); {res['steps']} steps x "
             f"{res['repeats']} repeats, median (eager: fastest of {2 * res['repeats']}, "
             f"each step's models in turns); "
             f"W4A4 input scale: {res['w4a4_scale']}.", "",
             "Step: `torch` runs the decode step's ops one by one; `compiled` is the same "
             "step through `torch.compile(fullgraph=True)` (Inductor), for every model.", "",
             f"Floor: the step's weight bytes (projections; MoE: the expected share of the "
             f"experts) over the read rate of a 1 GiB read ({res.get('read_rate_TBs')} TB/s, "
             "perf/read_floor.py), per model; `_early`: the same NVFP4 model with the "
             "stream kernel's early flag on.", "",
             "| model | step | batch | eager ms/token | graph ms/token | graph tokens/s | "
             "graph vs BF16 | eager vs BF16 | floor ms | graph / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["batch"], r["step"]): r for r in res["results"]
            if r["model"] == "bf16" and "error" not in r}
    for r in res["results"]:
        head = f"| {r['model']} | {r['step']} | {r['batch']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:150]} | | | | |")
            continue
        b = base.get((r["batch"], r["step"]))
        tok = r["batch"] * 1e3 / r["graph_ms"]
        sg = f"{b['graph_ms'] / r['graph_ms']:.2f}x" if b else "-"
        se = (f"{b['eager_ms'] / r['eager_ms']:.2f}x" if b and "eager_ms" in b
              and "eager_ms" in r else "-")
        eager = f"{r['eager_ms']:.3f}" if "eager_ms" in r else "-"
        floor = r.get("floor_ms")
        over = f"{r['graph_ms'] / floor:.2f}" if floor else "-"
        lines.append(f"{head} {eager} | {r['graph_ms']:.3f} | {tok:,.0f} | {sg} | {se} | "
                     f"{floor if floor is not None else '-'} | {over} |")
    full = {f"{r['model']} {r['step']} {r['batch']}": r["full_path_launches_per_step"]
            for r in res["results"] if r.get("full_path_launches_per_step")}
    lines += ["", "cute_fp4 launches per step through the full path instead of a binding: "
              + (", ".join(f"{k}: {v:g}" for k, v in full.items()) if full else "none.")]
    compiled = [r for r in res["results"] if "vs_eager_rel_err" in r]
    if compiled:
        worst = max(r["vs_eager_rel_err"] for r in compiled)
        lines += ["", f"Compiled step vs eager step, first logits, worst relative "
                  f"difference: {worst:.2e}."]
    lines += ["", "| model | projection weights | one layer's rel. err | logits rel. err vs "
              "BF16 (mean / max) | top-1 agreement |", "|---|---|---|---|---|",
              f"| bf16 | {res['weight_bytes'].get('bf16', 0) / 2**20:,.0f} MiB | reference | "
              "reference | 1.000 |"]
    for name, acc in res["accuracy"].items():
        mb = res["weight_bytes"].get(name, 0) / 2**20
        if "error" in acc:
            lines.append(f"| {name} | {mb:,.0f} MiB | error: {acc['error'][:150]} | | |")
        else:
            layer = acc.get("layer_rel_err")
            layer = "-" if layer is None else f"{layer:.4f}"
            lines.append(f"| {name} | {mb:,.0f} MiB | {layer} | "
                         f"{acc['logits_rel_err_mean']:.4f} / {acc['logits_rel_err_max']:.4f} | "
                         f"{acc['top1_agreement']:.3f} |")
    if res.get("profiles"):
        lines += ["", "One step under a graph, profiled (batch 1): span, time during which "
                  "any GEMM ran, the cute_fp4 kernels' (NVFP4 projections and experts) "
                  "against their weights' read floor.", "",
                  "| model | span us | kernels | GEMM busy us | cute_fp4 busy us | NVFP4 "
                  "weights' floor us | busy / floor | next starts before previous ends |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, pr in res["profiles"].items():
            if "error" in pr:
                lines.append(f"| {name} | error: {pr['error'][:120]} |||||||")
                continue
            fl = pr.get("projections_floor_us")
            lines.append(f"| {name} | {pr['span_us']} | {pr['kernels']} | "
                         f"{pr['gemm_busy_us']} | {pr['cute_fp4_busy_us']} | {fl} | "
                         f"{pr['cute_fp4_busy_us'] / fl if fl else 0:.2f} | "
                         f"{pr['overlapping_neighbours']} |")
    if res["bars"]:
        lines += ["", "Bars (issue 44):", ""]
        lines += [f"* {b['bar']}: {b['value']}x, {'PASS' if b['passed'] else 'FAIL'}"
                  for b in res["bars"]]
    lines += ["", f"Converted per mode: {res['convert']}", "",
              f"Wall time {res['wall_s']:.0f} s (build {res['build_s']:.0f} s).", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

@torch.no_grad()
def interleaved_eager(results: list, models: dict, states: dict, steps: int, rounds: int,
                      kind: str = "torch"):
    """Eager latency of the ``kind`` step again, the models taking turns (BF16, W4A16, ...
    then again, ``rounds`` times), the fastest run of each kept: host-bound runs drift with
    the host's load (BF16 alone measured 5.3-13 ms per token across runs), and turns give
    every model the same conditions. The earlier, one-model-at-a-time figure moves to
    ``eager_ms_sequential``."""
    for b, st in states.items():
        rows = {r["model"]: r for r in results
                if r["batch"] == b and r["step"] == kind and "eager_ms" in r}
        best = {name: math.inf for name in rows}
        for _ in range(rounds):
            for name in rows:
                step = step_function(models[name], st, compiled=kind == "compiled")
                best[name] = min(best[name], _per_token_ms(
                    lambda n, step=step: [step() for _ in range(n)], st.reset, steps, 1))
        for name, row in rows.items():
            row["eager_ms_sequential"], row["eager_ms"] = row["eager_ms"], best[name]
        print(f"eager {kind} step, models in turn, batch {b}: {best}", flush=True)


def flag(name: str):
    """The context a model is run in: ``*_early`` models with the stream kernel's early
    flag on (``decode_bench.early_weights``: every weight here is prepared before)."""
    import contextlib

    return early_weights() if name.endswith("_early") else contextlib.nullcontext()


def _measured(model, st, steps, repeats, warmup, kind: str, eager_timing: bool) -> dict:
    """:func:`measure`, a failure recorded rather than raised (the other rows go on)."""
    try:
        return measure(model, st, steps, repeats, warmup, compiled=kind == "compiled",
                       eager_timing=eager_timing)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for model_decode.json and .md")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; "
                    "4 with --quick)")
    ap.add_argument("--quick", action="store_true", help="4 layers, fewer steps and repeats")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--modes", default=None, help="comma-separated NVFP4 modes (default: "
                    "w4a16,w4a4 on SM90, w4a4 on SM12x)")
    ap.add_argument("--w4a4-scale", choices=("static", "dynamic"), default="static",
                    help="W4A4 activation scale: calibrated per layer, or per call")
    ap.add_argument("--impl", choices=("auto", "hf", "local"), default="auto",
                    help="module tree: transformers' LlamaForCausalLM or the local one")
    ap.add_argument("--vocab", type=int, default=32000, help="lm_head rows")
    ap.add_argument("--context", type=int, default=512, help="KV-cache length")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timing")
    ap.add_argument("--repeats", type=int, default=None, help="timings per measure")
    ap.add_argument("--step", default="torch", help="comma-separated decode-step kinds: "
                    "torch (op by op), compiled (torch.compile of the whole step)")
    ap.add_argument("--budget-s", type=float, default=220.0, help="skip the modes not "
                    "started after this many seconds (the run must fit ~4 minutes)")
    ap.add_argument("--model", choices=("dense", "moe"), default="dense",
                    help="dense: Llama-8B-like; moe: Qwen3-30B-A3B-like (transformers)")
    ap.add_argument("--eager", action="store_true", help="also time the eager step (host "
                    "included; slow)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_decode: no CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    layers = args.layers or (4 if args.quick else 8)
    steps = args.steps or (16 if args.quick else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    warmup, check_steps = (3, 4) if args.quick else (4, 8)
    c = (moe_config(layers, args.vocab, args.context) if args.model == "moe" else
         Config(layers=layers, vocab=args.vocab, context=args.context))
    prefix = c.context - (warmup + steps) - 2  # room for the decoded tail
    if prefix < 1:
        ap.error(f"--context {c.context} leaves no prefix for {warmup + steps} steps")
    sm90 = torch.cuda.get_device_capability()[0] == 9
    modes = (args.modes.split(",") if args.modes else
             ["w4a16", "w4a16_early", "w4a4"] if sm90 else ["w4a4"])
    batches = [int(b) for b in args.batches.split(",")]
    kinds = args.step.split(",")
    if unknown := set(kinds) - set(STEP_KINDS):
        ap.error(f"--step: unknown kinds {sorted(unknown)} (choose from {STEP_KINDS})")

    import read_floor

    rate = read_floor.read_rate()  # bytes per us of a 1 GiB read, before the models load
    model, impl = build_model(c, "hf" if args.model == "moe" else args.impl)
    build_s = time.perf_counter() - t_start
    print(f"built {impl} model, {layers} layers, in {build_s:.1f} s", flush=True)
    states = {b: DecodeState(c, b, prefix) for b in batches}
    check_b = max(batches)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, c.vocab, (check_steps, check_b, 1), generator=g, device="cuda")
    ref_logits = teacher_forced_logits(model, states[check_b], ids)
    amax = calibrate(model, states[check_b], ids) if "w4a4" in modes and \
        args.w4a4_scale == "static" else None

    results, acc, convert_info, wbytes = [], {}, {}, {"bf16": weight_bytes(model)}
    models = {"bf16": model}
    for mode in modes:  # every model first, so that the timings below run back to back
        if time.perf_counter() - t_start > args.budget_s:
            acc[mode] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            print(f"{mode}: {acc[mode]['error']}", flush=True)
            continue
        try:
            t0 = time.perf_counter()
            base = mode.removesuffix("_early")
            q, convert_info[mode] = quantized_copy(model, base, amax if base == "w4a4"
                                                   else None)
            convert_info[mode]["seconds"] = round(time.perf_counter() - t0, 1)
            wbytes[mode] = weight_bytes(q)
            with flag(mode):
                acc[mode] = accuracy(teacher_forced_logits(q, states[check_b], ids),
                                     ref_logits)
            if args.model == "dense":
                acc[mode]["layer_rel_err"] = layer_error(model, q)
            models[mode] = q
            print(f"{mode}: {convert_info[mode]['converted']} layers converted, {acc[mode]}",
                  flush=True)
        except Exception as e:  # record and go on with the other modes
            acc[mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{mode}: {acc[mode]['error']}", flush=True)
    # op-by-op steps of every model before any torch.compile: Inductor's compile workers
    # stay alive in the background and would perturb the eager (host-bound) timings
    profiles = {}
    for kind, (name, mdl), b in itertools.product(kinds, models.items(), batches):
        with flag(name):
            r = _measured(mdl, states[b], steps, repeats, warmup, kind, args.eager)
            if b == 1 and kind == kinds[0]:
                try:
                    profiles[name] = graph_profile(mdl, states[b])
                    profiles[name]["projections_floor_us"] = round(
                        weight_bytes(mdl, 1) / rate, 1)
                except Exception as e:
                    profiles[name] = {"error": f"{type(e).__name__}: {e}"}
        r["floor_ms"] = round(weight_bytes(mdl, b) / rate / 1e3, 4)
        results.append({"model": name, "batch": b, "step": kind, **r})
        print(f"{name} {kind} batch {b}: {r}", flush=True)
    if args.eager:
        for kind in kinds:
            interleaved_eager(results, models, states, steps, 2 * repeats, kind)

    res = {"config": asdict(c), "impl": impl, "environment": environment(), "prefix": prefix,
           "steps": steps, "repeats": repeats, "w4a4_scale": args.w4a4_scale,
           "results": results, "accuracy": acc, "convert": convert_info,
           "weight_bytes": wbytes, "profiles": profiles, "build_s": build_s,
           "read_rate_TBs": round(rate / 1e6, 3),
           "wall_s": time.perf_counter() - t_start,
           "method": "latency per token = wall time of `steps` decode steps (eager: host "
                     "included; graphs: replays of one captured step) / steps, "
                     "synchronised before and after; graphs: median of `repeats`, eager: "
                     "fastest of 2 x `repeats` runs, the models taking turns (host-bound, "
                     "noisy host; `eager_ms_sequential`: one model after the other)"}
    res["bars"] = bars(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_decode.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (out / "model_decode.md").write_text(md)
    print(md)
    return 0 if all(math.isfinite(r.get("graph_ms", math.nan)) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
