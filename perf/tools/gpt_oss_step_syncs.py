"""Why a batch-1 decode step of a gpt-oss model does not capture into a CUDA graph: one step
on transformers' static cache with torch's sync debug mode on, each synchronising call
(a host copy, ``.item()``, a pageable CPU-to-GPU copy) printed once with the frames that
made it; for ``cute_fp4.hf.from_pretrained``'s model and transformers' own load of the
same random checkpoint (perf/gpt_oss.py's decode section, 2 layers).

    python3 perf/tools/gpt_oss_step_syncs.py
"""

from __future__ import annotations

import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import gpt_oss_tiny as tiny  # noqa: E402

import cute_fp4 as cf  # noqa: E402


def syncs_of_step(model, prompt_len: int = 8) -> dict[str, int]:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt_len + 8)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")
    seen: dict[str, int] = {}
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(prompt_len, device="cuda"))
        tok, pos = prompt[:, -1:].clone(), torch.tensor([prompt_len], device="cuda")
        torch.cuda.synchronize()

        def note(message, *args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-2]
                      if "warnings" not in f.filename][-6:]
            key = f"{message}\n" + "".join(f"    {f.filename}:{f.lineno} {f.name}\n"
                                          for f in frames)
            seen[key] = seen.get(key, 0) + 1

        old = warnings.showwarning
        warnings.showwarning = note
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return seen


def main() -> None:
    import transformers as tf

    cfg = tiny.config(layers=2, hidden=2880, intermediate=2880, experts=32, top_k=4,
                      vocab_size=32768, head_dim=64, num_attention_heads=64,
                      num_key_value_heads=8, sliding_window=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.GptOssForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory(prefix="gpt_oss_") as path:
        tiny.write(model, path)
        del model
        for who, load in (("cute_fp4", lambda: cf.hf.from_pretrained(path, device="cuda")),
                          ("transformers", lambda: tf.AutoModelForCausalLM.from_pretrained(
                              path, dtype=torch.bfloat16, device_map={"": "cuda"}).eval())):
            m = load()
            seen = syncs_of_step(m)
            print(f"## {who}: {sum(seen.values())} synchronising calls in one step, "
                  f"{len(seen)} distinct", flush=True)
            for key, n in sorted(seen.items(), key=lambda kv: -kv[1]):
                print(f"x{n} {key}", flush=True)
            del m
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
