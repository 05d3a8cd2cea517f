"""Preemption figures on the default model: the offline workload (prompts 64-512 tokens, 128 out,
greedy, EOS ignored) through a KV pool too small for it, once per preemption mode (recompute,
swap, auto) in the same run. Prints throughput, preemptions, swap-outs, the prompt tokens each
mode computed (recompute prefills a victim's tokens again) and every mode's throughput as a ratio
of recompute's, and checks that the modes' tokens agree where they must (swap resumes the KV a
run without preemption has, so its tokens equal a run with an ample pool).
A benchmark, never a test: asserts nothing about time."""

from __future__ import annotations

import argparse
import json
import random
import time

from fantai import LLM, SamplingParams


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tok_s": generated / seconds,
            "preemptions": after["num_preemptions"] - before["num_preemptions"],
            "swap_outs": after["num_swap_outs"] - before["num_swap_outs"],
            "prompt_tokens_computed": after["prompt_tokens"] - before["prompt_tokens"],
            "swap_s": after["time_swap_s"] - before["time_swap_s"],
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="48M", help="small enough to preempt (default: %(default)s)")
    ap.add_argument("--swap-space", default="1G")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    common = dict(threads=args.threads, enable_prefix_caching=False)
    ample = LLM(args.model, **common)
    prompts = workload(args.num_prompts, args.min_prompt, args.max_prompt, ample.get_tokenizer().vocab_size,
                       args.seed)
    rows = {"ample pool": run(ample, prompts, args.output_len)}
    del ample
    for mode in ("recompute", "swap", "auto"):
        llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, swap_space=args.swap_space,
                  preemption_mode=mode, **common)
        rows[mode] = run(llm, prompts, args.output_len)
        del llm
    base = rows["recompute"]["output_tok_s"]
    prompt_total = sum(len(p) for p in prompts)
    print(f"{args.num_prompts} requests, prompts {args.min_prompt}-{args.max_prompt} ({prompt_total} tokens), "
          f"{args.output_len} out, KV pool {args.kv_cache_memory}, swap space {args.swap_space}, "
          f"{args.threads} threads")
    print("| run | output tok/s | x recompute | preemptions | swapped out | prompt tokens computed | swap copy s |"
          " tokens = ample pool's |")
    print("|---|---|---|---|---|---|---|---|")
    want = rows["ample pool"]["tokens"]
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["tokens"], want))
        print(f"| {name} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base:.2f}x | {r['preemptions']} | "
              f"{r['swap_outs']} | {r['prompt_tokens_computed']} ({r['prompt_tokens_computed'] / prompt_total:.2f}x)"
              f" | {r['swap_s']:.3f} | {same}/{len(want)} |")
    # Swapping every victim resumes the very KV it had: its tokens must be the ample pool's.
    if rows["swap"]["preemptions"] == rows["swap"]["swap_outs"] and rows["swap"]["tokens"] != want:
        raise SystemExit("swap mode changed tokens: the swapped KV did not come back intact")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
