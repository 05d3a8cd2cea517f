"""Runs in its own process for test_tensor_parallel.py (MPI and its signal handlers stay out of the
pytest process): TP = 1, then TP = 2 twice on one model directory; prints one JSON line."""

from __future__ import annotations

import json
import sys

from fantai import LLM, SamplingParams, _C
from tiny_models import random_prompts

# A shared 40-token prefix (prefix caching), long prompts over a 16-token step budget (chunked
# prefill), and a pool of 10 blocks for 4 sequences of up to 73 tokens (preemption).
ENGINE = dict(dtype="float32", num_kv_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=True)


def prompts() -> list[list[int]]:
    prefix = random_prompts(1, 320, [40], seed=5)[0]
    tails = random_prompts(4, 320, [3, 9, 1, 17], seed=6)
    return [prefix + t for t in tails[:2]] + tails[2:]


def run(llm: LLM) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.stats()
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            # the chosen token's logprob at every step
            "logprobs": [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs],
            "free_blocks": stats["num_free_blocks"], "total_blocks": stats["num_total_blocks"],
            "preemptions": stats.get("num_preemptions", -1)}


def main() -> None:
    path, tp = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "refuse":
        try:
            LLM(path, tensor_parallel_size=tp, dtype="float32", num_kv_blocks=8)
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
        return
    out = {"tp1": run(LLM(path, **ENGINE))}
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    out["heads_per_rank"] = llm._model.config.num_heads
    out["tp"] = run(llm)
    out["tp_again"] = run(llm)
    out["comm"] = _C.tp_stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
