"""Where the host time of an eager decode step goes: ``perf/model_decode.py``'s model (BF16
and W4A16, a few layers), eager decode steps under ``cProfile``, the functions with the
most own time, and the host time per call of a layer's converted projections (3-D
inputs, as the model passes them) against ``nn.Linear``.

    python perf/tools/profile_host.py [--layers 2] [--steps 20] [--out DIR]

Writes ``DIR/profile_host.txt`` (or prints it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/

import model_decode as md  # noqa: E402


def per_call_us(fn, x, calls: int = 200, repeats: int = 5) -> float:
    """Host time per call of ``fn(x)`` in a loop without syncs (median of ``repeats``)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--steps", type=int, default=20, help="profiled eager steps per model")
    ap.add_argument("--out", type=Path, help="folder for profile_host.txt")
    args = ap.parse_args(argv)
    c = md.Config(layers=args.layers, context=128)
    model, impl = md.build_model(c, "auto")
    q, _ = md.quantized_copy(model, "w4a16", None)
    out = io.StringIO()
    st = md.DecodeState(c, 1, prefix=8)
    for name, mdl in (("bf16", model), ("w4a16", q)):
        st.reset()
        for _ in range(3):
            md.decode_step(mdl, st)
        st.reset()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            md.decode_step(mdl, st)
        prof.disable()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        out.write(f"== {name} ({impl}, {args.layers} layers): {ms:.3f} ms per eager step "
                  f"under cProfile\n")
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(25)
    layer, qlayer = model.model.layers[0], q.model.layers[0]
    for m in (1, 16):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.down_proj"):
            lin, qlin = layer.get_submodule(name), qlayer.get_submodule(name)
            x = torch.randn(m, 1, lin.in_features, device="cuda", dtype=torch.bfloat16)
            out.write(f"M={m} {name} [{lin.out_features} x {lin.in_features}]: host us/call "
                      f"nn.Linear {per_call_us(lin, x):.1f}, NVFP4Linear "
                      f"{per_call_us(qlin, x):.1f} ({qlin.layout}, {qlin.mode})\n")
    text = out.getvalue()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_host.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
