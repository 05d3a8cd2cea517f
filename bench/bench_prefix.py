"""Prefix-caching figures on the default model: TTFT with a cached 2,000-token prefix vs cold,
throughput of 64 requests sharing a 1,000-token system prompt with caching on and off, KV
utilization at peak, and resident memory of an engine before/after a burst and after release.
A benchmark, never a test: prints figures, asserts nothing about time."""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from fantai import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def shared_prompt_run(llm: LLM, system: list[int], suffixes: list[list[int]], out_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    engine = llm.engine
    from fantai.requests import to_core_params

    for i, s in enumerate(suffixes):
        engine.add_request(10_000 + i, system + s, to_core_params(params, 0, out_len))
    peak_util, start, generated = 0.0, time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(o.token_ids) for o in engine.step())
        peak_util = max(peak_util, engine.stats()["kv_utilization"])
    elapsed = time.perf_counter() - start
    total = sum(len(system) + len(s) for s in suffixes) + generated
    return {"seconds": elapsed, "output_tok_s": generated / elapsed, "total_tok_s": total / elapsed,
            "peak_kv_utilization": peak_util, "hit_rate": engine.stats()["prefix_cache_hit_rate"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = range(100, 40000)
    rss_start = rss_mib()
    results: dict[str, object] = {}
    for caching in (True, False):
        llm = LLM(dtype=args.dtype, threads=args.threads, kv_cache_memory="1G", enable_prefix_caching=caching)
        long_prefix = [rng.choice(vocab) for _ in range(2000)]
        ttft(llm, [rng.choice(vocab) for _ in range(8)])  # warm-up
        cold = ttft(llm, long_prefix + [7])
        warm = ttft(llm, long_prefix + [8])
        system = [rng.choice(vocab) for _ in range(args.system_len)]
        suffixes = [[rng.choice(vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.num_requests)]
        run = shared_prompt_run(llm, system, suffixes, args.output_len)
        rss_burst = rss_mib()
        llm.release_memory()
        rss_released = rss_mib()
        results["on" if caching else "off"] = {"ttft_cold_s": cold, "ttft_cached_prefix_s": warm, **run,
                                               "rss_after_burst_mib": rss_burst,
                                               "rss_after_release_mib": rss_released}
        del llm
    results["rss_before_mib"] = rss_start
    print(f"| prefix caching | TTFT 2000-token prefix cold | cached | 64x shared {args.system_len}-token prompt "
          "out tok/s | total tok/s | peak KV util | hit rate | RSS after burst | after release |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in ("on", "off"):
        r = results[key]
        assert isinstance(r, dict)
        print(f"| {key} | {r['ttft_cold_s']*1000:.0f} ms | {r['ttft_cached_prefix_s']*1000:.0f} ms | "
              f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.0f} | {r['peak_kv_utilization']:.3f} | "
              f"{r['hit_rate']:.2f} | {r['rss_after_burst_mib']:.0f} MiB | {r['rss_after_release_mib']:.0f} MiB |")
    print(f"RSS before loading: {rss_start:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
