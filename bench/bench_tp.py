"""Tensor-parallel figures: all-reduce calls, bytes and time per decode step at batch 1 and 64,
each step split into compute and communication (rank 0's view: time inside collectives includes
waiting for the slowest rank), weight and KV bytes per rank, and the engine's start-up time.
A benchmark, never a test: prints figures, asserts nothing about time.

    python bench/bench_tp.py --tp 3                      # the default model (9 heads: TP 1, 3)
    python bench/bench_tp.py --model DIR --tp 2
"""

from __future__ import annotations

import argparse
import json
import random
import time

from fantai import LLM, SamplingParams, _C


def decode_figures(llm: LLM, batch: int, prompt_len: int, out_len: int) -> dict[str, float]:
    rng = random.Random(batch)
    vocab = llm._model.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # prefill (and prefix-cache) the prompts first
    before, steps0 = _C.tp_stats(), llm.stats()
    head0 = llm._model.lm_head_seconds
    start = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after, steps1 = _C.tp_stats(), llm.stats()
    head = llm._model.lm_head_seconds - head0
    steps = max(1, steps1["num_steps"] - steps0["num_steps"])
    comm = after["seconds"] - before["seconds"]
    forward = steps1["time_forward_s"] - steps0["time_forward_s"]
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": 1e3 * wall / steps,
        "forward_ms_per_step": 1e3 * forward / steps,
        "comm_ms_per_step": 1e3 * comm / steps,
        "compute_ms_per_step": 1e3 * (forward - comm) / steps,
        # rank 0's vocab slice of the lm_head (V/N rows) and the gather of every rank's slice
        "lm_head_ms_per_step": 1e3 * head / steps,
        "gather_kib_per_step": (after.get("gather_bytes", 0) - before.get("gather_bytes", 0)) / steps / 1024,
        "all_reduces_per_step": (after["all_reduce_calls"] - before["all_reduce_calls"]) / steps,
        "all_reduce_kib_per_step": (after["all_reduce_bytes"] - before["all_reduce_bytes"]) / steps / 1024,
        "tokens_per_s": batch * out_len / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="threads per rank (default: cores / ranks)")
    args = ap.parse_args()
    start = time.perf_counter()
    llm = LLM(args.model, tensor_parallel_size=args.tp, kv_cache_memory="256M", max_num_seqs=64,
              threads=args.threads)
    startup = time.perf_counter() - start
    info = {"tp": args.tp, "startup_s": round(startup, 2), "threads_per_rank": llm._model.num_threads,
            "weight_mib_per_rank": round(llm._model.weight_bytes() / 2**20, 2),
            "lm_head_mib_per_rank": round(llm._model.lm_head_bytes() / 2**20, 2),
            "kv_mib_per_rank": round(llm.engine.kv_cache_bytes / 2**20, 2),
            "kv_blocks": llm.engine.num_blocks, "heads_per_rank": llm._model.config.num_heads,
            "kv_heads_per_rank": llm._model.config.num_kv_heads}
    print(json.dumps(info))
    for b in (int(x) for x in args.batches.split(",")):
        fig = decode_figures(llm, b, args.prompt_len, args.out_len)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in fig.items()}))


if __name__ == "__main__":
    main()
