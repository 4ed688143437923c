"""One vLLM engine on a checkpoint, run by tests/test_vllm.py in a process of its own (vLLM's
workers re-import the main module: hence the ``__main__`` guard): the greedy tokens of the
given prompts, on the last line of stdout as ``RESULT {json}``, with the quantization method
vLLM chose. An engine that fails prints ``ERROR <type>: <message>`` (the first line of the
error that stopped it, from any process) and exits 1.

    python tests/vllm_run.py CKPT --prompts '[[1, 2, 3]]' [--tp 2] [--quantization cute_fp4]
        [--compile]   (vLLM's torch.compile of the model, else eager)
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quantization", default=None)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=args.model, tensor_parallel_size=args.tp,
                  quantization=args.quantization, dtype="bfloat16",
                  enforce_eager=not args.compile,
                  skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4, seed=0)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                detokenize=False)
        prompts = [{"prompt_token_ids": ids} for ids in json.loads(args.prompts)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as e:  # the engine's error, for the test to match
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return 1
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "quantization": llm.llm_engine.model_config.quantization}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
