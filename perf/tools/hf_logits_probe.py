"""Where the NVFP4 model's logits part from the fake-quantized BF16 reference (the 3e-2 bar
of perf/hf_generate.py), and whether that is BF16's own noise.

Per model (the 8-layer dense and moe configs of ``perf/hf_generate.py``, random weights,
quantized by ``cute_fp4.hf.quantize_model``, written by ``save_pretrained``, loaded by
``from_pretrained``), one prefill of 4 x 128 random tokens through:

* ``nvfp4``: the loaded model (gated MLPs fused); ``nvfp4_unfused``: loaded with
  ``fuse_mlp=False`` (three NVFP4Linear per MLP);
* ``bf16_ref``: the fake-quantized BF16 model (``hf.fake_quantize``: the exact NVFP4 values
  rounded once to BF16), the bar's reference; ``bf16_ref_strict``: the same with cuBLAS's
  reduced-precision BF16 reductions off (GPU only);
* ``truth``: the same exact values in float32, computed in float32 (SDPA's math kernel);
* ``unquantized``: the BF16 model before quantization (what the comparison can see);
* hybrids: ``bf16_ref`` with one kind of its modules replaced by the NVFP4 model's (attention
  q/k/v/o, the fused MLP, gate/up or down unfused, the experts).

1. Logits of every pair that matters (whole-tensor relative error, token median / p90, top-1
   agreement), 2. the relative difference of each decoder layer's output and the final
   norm's, 3. the hybrids' logits, and every NVFP4 module on the very inputs it saw against
   the float64 exact result of its weights' exact values (``truth``'s) beside the BF16
   reference module on the same inputs: a wrong scale, row order or rounding in one kind
   of module shows there as an error far over the BF16 reference module's.
   ``sensitivity``: the float32 truth with every decoder layer's output rounded to BF16
   (one rounding per layer): how far one rounding per layer moves these random-weight
   logits.

    python perf/tools/hf_logits_probe.py --out DIR [--models dense,moe] [--layers 8]
    python perf/tools/hf_logits_probe.py --out DIR --tiny     # CPU: small configs, the
        # NVFP4 GEMMs replaced by the exact reference (float64, one rounding: the W4A16
        # kernels' claim); --emulate does the same on a GPU

writes ``DIR/hf_logits_probe.json`` (after each model) and ``DIR/hf_logits_probe.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "tests"))

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4 import mlp as cmlp  # noqa: E402
from cute_fp4 import nn as cnn  # noqa: E402
from cute_fp4.hf import experts as ex  # noqa: E402

TOKENS = (4, 128)


def configs(layers: int, tiny: bool) -> dict:
    """hf_generate's configs, or small ones of the same shape families (``tiny``)."""
    if not tiny:
        from hf_generate import configs as full

        return full(layers)
    import transformers as tf

    common = dict(num_hidden_layers=layers, max_position_embeddings=512,
                  tie_word_embeddings=False)
    return {
        "dense": tf.LlamaConfig(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, vocab_size=2048,
                                rope_theta=500000.0, **common),
        "moe": tf.Qwen3MoeConfig(hidden_size=256, intermediate_size=768,
                                 moe_intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, vocab_size=2048,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 rope_theta=1000000.0, **common),
    }


# ----------------------------------------------------------------------------- helpers

class Patches:
    """``monkeypatch.setattr`` for a script: every attribute set is restored on exit."""

    def __init__(self):
        self._undo = []

    def setattr(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)


@contextlib.contextmanager
def exact_kernels(enabled: bool):
    """The NVFP4 GEMMs replaced by the exact reference (tests/hf_tiny.exact_kernels: float64,
    one rounding to BF16), for the CPU or ``--emulate``."""
    if not enabled:
        yield
        return
    import hf_tiny

    p = Patches()
    try:
        hf_tiny.exact_kernels(p)
        yield
    finally:
        p.undo()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def logits_cmp(a: torch.Tensor, b: torch.Tensor) -> dict:
    """``a`` against ``b`` ([..., vocab]): as perf/hf_generate.py's logits_measure."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    tok = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return {"rel_err": float((a - b).norm() / b.norm()), "token_median": float(tok.median()),
            "token_p90": float(tok.quantile(0.9)),
            "top1": float((a.argmax(-1) == b.argmax(-1)).double().mean())}


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def forward(model, ids, *, fp32: bool = False, round_layers: bool = False,
            strict: bool = False) -> dict:
    """Logits and every decoder layer's (and the final norm's) output, float32.
    ``fp32``: SDPA's math kernel (no reduced precision); ``round_layers``: each decoder
    layer's output rounded to BF16 (the sensitivity run); ``strict``: cuBLAS without its
    reduced-precision BF16 reductions."""
    seen, hooks = {}, []
    layers = model.model.layers

    def keep(name):
        def hook(mod, args, out):
            o = _out(out)
            if round_layers:
                o = o.to(torch.bfloat16).to(o.dtype)
            seen[name] = o.detach().float().clone()
            if round_layers:
                return (o, *out[1:]) if isinstance(out, tuple) else o
        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(keep(f"layer{i}")))
    hooks.append(model.model.norm.register_forward_hook(keep("norm")))
    ctx = contextlib.ExitStack()
    if fp32:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx.enter_context(sdpa_kernel(SDPBackend.MATH))
    cuda = torch.backends.cuda.matmul
    old = cuda.allow_bf16_reduced_precision_reduction
    try:
        cuda.allow_bf16_reduced_precision_reduction = old and not strict
        with ctx, torch.no_grad():
            seen["logits"] = model(ids).logits.float()
    finally:
        cuda.allow_bf16_reduced_precision_reduction = old
        for h in hooks:
            h.remove()
    return seen


def layer_cmp(a: dict, b: dict) -> list[float]:
    keys = [k for k in a if k.startswith("layer")] + ["norm"]
    return [round(rel(a[k], b[k]), 6) for k in keys]


# ----------------------------------------------------------------------------- modules

def _kind(name: str, module) -> str:
    if isinstance(module, cmlp.NVFP4GatedMLP):
        return "fused gate_up + silu*up"
    if ex.holds_nvfp4(module):
        return "experts"
    return name.rsplit(".", 1)[-1]


def _exact_experts(truth_mod, x, ids, weights) -> torch.Tensor:
    """The routed experts in float64 on the exact weights (``truth``'s float32 values)."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    w13, w2 = truth_mod.gate_up_proj, truth_mod.down_proj
    i = w2.shape[-1]
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = x64[tok] @ w13[e].double().T
        act = F.silu(h[:, :i]) * h[:, i:]
        out.index_add_(0, tok, (act @ w2[e].double().T) * weights[tok, slot, None].double())
    return out


def module_check(nv, ref, truth, ids, emulate: bool) -> dict:
    """Every NVFP4 module of ``nv`` on the inputs it saw in one forward: its output's
    relative error against the float64 exact result (weights: ``truth``'s exact values),
    the share of elements equal to that result rounded once to BF16 (the W4A16 kernels'
    claim; fused MLP: ``silu(round(g)) * round(u)`` in BF16, the epilogue's), and the BF16
    reference module (``ref``) on the same inputs against the same exact result. Per kind:
    mean and max over layers."""
    rows, hooks, stash = {}, [], {}

    def linear_hook(name):
        def hook(mod, args, out):
            x = args[0]
            w = truth.get_submodule(name).weight.double()
            exact = x.double() @ w.T
            rows[name] = (_kind(name, mod), rel(out, exact),
                          float((out == exact.to(out.dtype)).double().mean()),
                          rel(ref.get_submodule(name)(x), exact))
            stash[name] = x
        return hook

    def mlp_hook(name):
        def hook(mod, args, out):
            x, h = args[0].double(), stash[f"{name}.down_proj"]
            t = truth.get_submodule(name)
            g, u = x @ t.gate_proj.weight.double().T, x @ t.up_proj.weight.double().T
            exact = F.silu(g) * u
            claim = F.silu(g.to(h.dtype)) * u.to(h.dtype)
            r = ref.get_submodule(name)
            rows[name] = (_kind(name, mod), rel(h, exact), float((h == claim).double().mean()),
                          rel(r.act_fn(r.gate_proj(args[0])) * r.up_proj(args[0]), exact))
        return hook

    def experts_hook(name):
        def hook(mod, args, out):
            x, ids_, w = args[:3]
            exact = _exact_experts(truth.get_submodule(name), x, ids_, w)
            rows[name] = (_kind(name, mod), rel(out, exact),
                          float((out == exact.to(out.dtype)).double().mean()),
                          rel(ref.get_submodule(name)(x, ids_, w), exact))
        return hook

    for name, m in nv.named_modules():
        if isinstance(m, cmlp.GateUpLinear):
            continue
        if isinstance(m, cmlp.NVFP4GatedMLP):
            hooks.append(m.register_forward_hook(mlp_hook(name)))
        elif isinstance(m, cnn.NVFP4Linear):
            hooks.append(m.register_forward_hook(linear_hook(name)))
        elif ex.holds_nvfp4(m):
            hooks.append(m.register_forward_hook(experts_hook(name)))
    try:
        with torch.no_grad(), exact_kernels(emulate):
            nv(ids)
    finally:
        for h in hooks:
            h.remove()
    kinds: dict[str, list] = {}
    for kind, e_nv, same, e_ref in rows.values():
        kinds.setdefault(kind, []).append((e_nv, same, e_ref))
    out = {}
    for kind, v in kinds.items():
        nvs, sames, refs = zip(*v)
        out[kind] = {"modules": len(v), "nvfp4_vs_exact_mean": sum(nvs) / len(v),
                     "nvfp4_vs_exact_max": max(nvs),
                     "nvfp4_equal_to_claim_min": min(sames),
                     "bf16_ref_vs_exact_mean": sum(refs) / len(v),
                     "bf16_ref_vs_exact_max": max(refs)}
    return out


# ----------------------------------------------------------------------------- hybrids

def _swaps(nv, nvu, ref) -> dict[str, dict[str, torch.nn.Module]]:
    """kind of module -> {module name in ``ref``: the NVFP4 module that replaces it}."""
    groups: dict[str, dict] = {}
    for i in range(len(ref.model.layers)):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"{p}.self_attn.{proj}"
            if isinstance(nv.get_submodule(name), cnn.NVFP4Linear):
                groups.setdefault("attention q/k/v/o", {})[name] = nv.get_submodule(name)
        mlp = nv.get_submodule(f"{p}.mlp")
        if isinstance(mlp, cmlp.NVFP4GatedMLP):
            groups.setdefault("mlp fused (gate_up+act, down)", {})[f"{p}.mlp"] = mlp
        if gated := cmlp.gated_mlp_projections(nvu.get_submodule(f"{p}.mlp")):
            for proj, m in zip(("gate_proj", "up_proj", "down_proj"), gated):
                key = "mlp down_proj" if proj == "down_proj" else "mlp gate/up unfused"
                groups.setdefault(key, {})[f"{p}.mlp.{proj}"] = m
        experts = getattr(mlp, "experts", None)
        if experts is not None and ex.holds_nvfp4(experts):
            groups.setdefault("experts", {})[f"{p}.mlp.experts"] = experts
    return groups


def hybrids(nv, nvu, ref, ids, base: dict, truth: dict, emulate: bool) -> dict:
    """``ref`` with one kind of module replaced by the NVFP4 model's, one kind at a time:
    logits against ``ref`` (that kind's share of the difference) and against the truth."""
    out = {}
    for kind, swap in _swaps(nv, nvu, ref).items():
        old = {n: ref.get_submodule(n) for n in swap}
        try:
            for n, m in swap.items():
                parent, _, attr = n.rpartition(".")
                setattr(ref.get_submodule(parent), attr, m)
            with exact_kernels(emulate):
                got = forward(ref, ids)
        finally:
            for n, m in old.items():
                parent, _, attr = n.rpartition(".")
                setattr(ref.get_submodule(parent), attr, m)
        out[kind] = {"modules": len(swap),
                     "vs_bf16_ref": logits_cmp(got["logits"], base["logits"]),
                     "vs_truth": logits_cmp(got["logits"], truth["logits"])}
    return out


# ----------------------------------------------------------------------------- one model

def _load(path: str, device: str, fuse: bool):
    group = 8 if device == "cpu" and fuse else None  # CPU: build for sm_90a's gate/up group
    return hf.from_pretrained(path, device=device, fuse_mlp=fuse, gate_up_group=group)


def run_model(kind: str, config, device: str, workdir: str, emulate: bool, res: dict,
              save=lambda: None) -> dict:
    """Fills ``res`` stage by stage, calling ``save`` after each (a run cut short keeps
    what it measured)."""
    from transformers import AutoModelForCausalLM

    res.update({"model": kind, "layers": config.num_hidden_layers, "emulated": emulate})
    t0 = time.perf_counter()
    stage = res.setdefault("stage_s", {})

    def stamp(what: str) -> None:
        stage[what] = round(time.perf_counter() - t0, 1)
        print(f"[{kind}] {what} at {stage[what]} s", flush=True)

    torch.manual_seed(0)
    with torch.device(device):
        bf16 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    nv = copy.deepcopy(bf16)
    hf.quantize_model(nv)
    path = str(Path(workdir) / kind)
    hf.save_pretrained(nv, path)
    del nv
    stamp("saved")
    nv, nvu = _load(path, device, True), _load(path, device, False)
    stamp("loaded")
    res["fused_mlps"] = len(nv.cute_fp4_mlps[0])
    truth_model = hf.fake_quantize(copy.deepcopy(bf16).float(), nv)
    g = torch.Generator(device).manual_seed(5)
    ids = torch.randint(0, config.vocab_size, TOKENS, device=device, generator=g)
    runs = {"unquantized": forward(bf16, ids)}
    ref = hf.fake_quantize(bf16, nv)  # in place: bf16 is the reference from here on
    runs["truth"] = forward(truth_model, ids, fp32=True)
    runs["bf16_ref"] = forward(ref, ids)
    if device == "cuda":
        runs["bf16_ref_strict"] = forward(ref, ids, strict=True)
    with exact_kernels(emulate):
        runs["nvfp4"] = forward(nv, ids)
        runs["nvfp4_unfused"] = forward(nvu, ids)
    runs["sensitivity"] = forward(truth_model, ids, fp32=True, round_layers=True)
    stamp("forwards")
    pairs = [("nvfp4", "bf16_ref"), ("nvfp4", "truth"), ("bf16_ref", "truth"),
             ("nvfp4_unfused", "bf16_ref"), ("nvfp4_unfused", "truth"),
             ("nvfp4", "nvfp4_unfused"), ("bf16_ref_strict", "truth"),
             ("bf16_ref_strict", "bf16_ref"), ("sensitivity", "truth"),
             ("unquantized", "truth")]
    res["logits"], res["layers_rel"] = {}, {}
    for a, b in pairs:
        if a in runs and b in runs:
            res["logits"][f"{a} vs {b}"] = logits_cmp(runs[a]["logits"], runs[b]["logits"])
            res["layers_rel"][f"{a} vs {b}"] = layer_cmp(runs[a], runs[b])
    save()
    res["hybrids"] = hybrids(nv, nvu, ref, ids, runs["bf16_ref"], runs["truth"], emulate)
    stamp("hybrids")
    save()
    res["modules"] = module_check(nv, ref, truth_model, ids, emulate)
    save()
    res["modules_unfused"] = module_check(nvu, ref, truth_model, ids, emulate)
    stamp("modules")
    del nv, nvu, ref, truth_model, runs, bf16
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- report

def environment(device: str) -> dict:
    import transformers

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": device,
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "bf16_reduced_precision_reduction":
               torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _module_rows(title: str, mods: dict) -> list[str]:
    lines = ["", f"| module ({title}), on its own inputs | n | NVFP4 vs exact (mean / max) | "
                 "equal to the claim (min) | BF16 ref vs exact (mean / max) |",
             "|---|---|---|---|---|"]
    for k, v in mods.items():
        claim = "n/a" if k == "experts" else f"{v['nvfp4_equal_to_claim_min']:.4f}"
        lines.append(f"| {k} | {v['modules']} | {v['nvfp4_vs_exact_mean']:.2e} / "
                     f"{v['nvfp4_vs_exact_max']:.2e} | {claim} | "
                     f"{v['bf16_ref_vs_exact_mean']:.2e} / {v['bf16_ref_vs_exact_max']:.2e} |")
    return lines


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# hf_logits_probe ({env.get('gpu', env['device'])}, {env['date']})", ""]
    for r in res["models"]:
        if "logits" not in r:
            lines += [f"## {r.get('model')}: no results (cut short)", ""]
            continue
        lines += [f"## {r['model']} ({r['layers']} layers{', emulated' if r['emulated'] else ''})",
                  "", "| logits | rel. err | token median | p90 | top-1 |", "|---|---|---|---|---|"]
        for k, v in r["logits"].items():
            lines.append(f"| {k} | {v['rel_err']:.4f} | {v['token_median']:.4f} | "
                         f"{v['token_p90']:.4f} | {v['top1']:.3f} |")
        lines += ["", "| per layer: rel. diff of each layer's output (last: final norm) | |",
                  "|---|---|"]
        for k, v in r["layers_rel"].items():
            lines.append(f"| {k} | {' '.join(f'{x:.4f}' for x in v)} |")
        if "hybrids" in r:
            lines += ["", "| hybrid: bf16_ref with these modules NVFP4 | n | logits vs bf16_ref "
                          "| vs truth |", "|---|---|---|---|"]
            for k, v in r["hybrids"].items():
                lines.append(f"| {k} | {v['modules']} | {v['vs_bf16_ref']['rel_err']:.4f} | "
                             f"{v['vs_truth']['rel_err']:.4f} |")
        for title, key in (("fused", "modules"), ("unfused", "modules_unfused")):
            if key in r:
                lines += _module_rows(title, r[key])
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="small configs (the CPU)")
    ap.add_argument("--emulate", action="store_true",
                    help="the NVFP4 GEMMs replaced by the exact reference (always on the CPU)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    emulate = args.emulate or device == "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"env": environment(device), "tokens": list(TOKENS), "models": []}
    cfgs = configs(args.layers, args.tiny)
    with tempfile.TemporaryDirectory() as work:
        def save():
            (out / "hf_logits_probe.json").write_text(json.dumps(res, indent=1))
            (out / "hf_logits_probe.md").write_text(markdown(res))

        for kind in args.models.split(","):
            r: dict = {}
            res["models"].append(r)
            run_model(kind, cfgs[kind], device, work, emulate, r, save)
            print(f"[{kind}]", {k: round(v["rel_err"], 4) for k, v in r["logits"].items()},
                  flush=True)
            save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
