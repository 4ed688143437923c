"""Tensor-parallel loads and greedy generation, run by tests/test_hf_tp.py under torchrun
(one process per rank, gloo on the CPU, the layers on the exact reference:
``CUTE_FP4_REFERENCE=1``): for each checkpoint in turn,
``cute_fp4.hf.from_pretrained(CKPT, device="cpu", tp_plan="auto")`` and the greedy tokens of
the prompts, or the error the load raised (every rank raises it at the same point). Rank 0
prints ``RESULT {json}`` on stdout: checkpoint -> {"tokens", "shards": layer -> local
[out, in] (experts: [hidden, intermediate])} or {"error": "<type>: <message>"}.

    torchrun --nproc_per_node 2 tests/hf_tp_run.py '[[1, 2, 3]]' 4 CKPT [CKPT ...]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def run(path: str, prompts: list, new: int) -> dict:
    import cute_fp4.hf as hf
    from cute_fp4.hf.quantizer import QuantizedLinear

    try:
        model = hf.from_pretrained(path, device="cpu", tp_plan="auto")
    except Exception as e:  # the refusal a test expects
        return {"error": f"{type(e).__name__}: {e}"}
    model.generation_config.eos_token_id = None
    tokens = []
    with torch.no_grad():
        for ids in prompts:
            g = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
            tokens.append(g[0, len(ids):].tolist())
    shards = {n: [m.layer.out_features, m.layer.in_features]
              for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    shards.update({n: [m.nvfp4.experts.hidden, m.nvfp4.experts.intermediate]
                   for n, m in model.named_modules() if hasattr(m, "nvfp4")})
    return {"tokens": tokens, "shards": shards}


def main() -> int:
    prompts, new, paths = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    try:
        results = {p: run(p, prompts, new) for p in paths}
        if dist.is_initialized() and dist.get_rank() == 0:
            print("RESULT " + json.dumps(results), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # without it the run ends with rc -6
    return 0


if __name__ == "__main__":
    sys.exit(main())
