#!/usr/bin/env python3
"""Offline throughput and single-stream latency: fantai vs Hugging Face transformers, side by side.

Not a test (pytest never collects it: it lives outside tests/python and is not named test_*.py);
it prints figures, it gates nothing.

Workload (issue 5's definition): --num-prompts requests (default 64) whose prompts are seeded
random token ids from the model's vocabulary (special/control tokens excluded), with lengths spread
evenly over [--min-prompt, --max-prompt] (symmetric, so 64 x 64..512 gives exactly 18,432 prompt
tokens) and shuffled with --seed; exactly --output-len new tokens each (EOS ignored), greedy.
Single stream: one --single-prompt-len token prompt (default 128), --output-len new tokens.

Each (system, dtype) runs in its own subprocess of this script, one after the other, so that
peak RSS (getrusage ru_maxrss) and load time belong to that system alone; every subprocess gets
the same prompts (written once by the parent) and the same thread count.

What is measured, per (system, dtype):
  load          fantai: LLM(...) constructor; HF: AutoModelForCausalLM.from_pretrained(gguf_file=...)
                (both read the same GGUF and dequantize it); imports not included (reported apart).
  TTFT          wall time of one request for 1 new token on the single-stream prompt, through the
                public API (LLM.generate / model.generate); median of --repeats.
  decode tok/s  single-stream decode with prefill excluded: one request for output_len+1 tokens,
                a timestamp at every generated token (fantai: after each engine step; HF: from a
                StoppingCriteria, called once per generated token); decode tok/s = output_len /
                (t[last token] - t[first token]); median of --repeats. A cross-check by difference,
                output_len / (T(output_len+1 tokens) - T(1 token)) on medians, is in the JSON.
  offline       the whole workload, wall time from submitting to the last output; output tok/s =
                output tokens / wall, total tok/s = (prompt + output tokens) / wall.
                fantai: all requests submitted at once to the continuous-batching engine.
                HF: static batches of --hf-batch in submission order, left padding + attention mask,
                min_new_tokens = max_new_tokens = output_len and no EOS.
  KV util       fantai only. The batch runs through llm.engine directly (the same loop as
                LLM.generate, detokenizing included) reading engine.stats() before every step:
                "end" is used/allocated slots just before the step in which the last request
                finished (afterwards everything is freed, so stats after generate() say nothing);
                "mean" is the mean over all steps that held any KV.
  peak RSS      ru_maxrss of the subprocess at its end (load + single stream + batch).

--short (CI: make bench-smoke): 4 prompts of 16-64 tokens, 8 new tokens, one dtype (float32), 2
single-stream repeats; same figures and table. The fantai worker also checks its results: every
request's greedy tokens equal to that prompt generated alone, and the single-stream repeats
equal to each other; a mismatch (or any worker crash) exits 1. Timings never fail a run.

Usage:  python bench/bench_offline.py                 # full default workload, both systems
        python bench/bench_offline.py --num-prompts 8 --output-len 32 --json out.json
        python bench/bench_offline.py --short

Over 400 lines: fantai and transformers driven by one harness, so their figures compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# ----------------------------------------------------------------------------------------------
# Workload


def model_vocab(path: str) -> tuple[int, list[int]]:
    """(vocab size, ids of special tokens) from GGUF metadata or an HF folder's tokenizer, without
    loading the weights."""
    if os.path.isdir(path):
        from fantai.tokenizer import Tokenizer

        tok = Tokenizer.from_hf_dir(path)
        return tok.vocab_size, sorted(set(tok.all_special_ids))
    from fantai.weights.gguf_file import GGUFFile

    meta = GGUFFile(path).metadata
    types = meta.get("tokenizer.ggml.token_type") or []
    return len(meta["tokenizer.ggml.tokens"]), [i for i, t in enumerate(types) if t != 1]  # 1 = normal


def prompt_lengths(n: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """n lengths spread evenly over [lo, hi], mirrored so the mean is exactly (lo + hi) / 2."""
    if n == 1:
        return [(lo + hi) // 2]
    lengths = [0] * n
    for i in range((n + 1) // 2):
        a = lo + (hi - lo) * i // (n - 1)
        lengths[i], lengths[n - 1 - i] = a, lo + hi - a
    if n % 2:
        lengths[n // 2] = (lo + hi) // 2
    rng.shuffle(lengths)
    return lengths


def make_workload(args: argparse.Namespace) -> dict[str, Any]:
    vocab, special = model_vocab(args.model)
    banned = set(special)
    allowed = [t for t in range(vocab) if t not in banned]
    rng = random.Random(args.seed)
    lengths = prompt_lengths(args.num_prompts, args.min_prompt, args.max_prompt, rng)
    prompts = [[rng.choice(allowed) for _ in range(n)] for n in lengths]
    single = [rng.choice(allowed) for _ in range(args.single_prompt_len)]
    warmup = [rng.choice(allowed) for _ in range(16)]
    return {"prompts": prompts, "single": single, "warmup": warmup, "vocab_size": vocab,
            "num_special_excluded": len(banned)}


# ----------------------------------------------------------------------------------------------
# Helpers


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fantai_build() -> dict[str, Any]:
    """Which fantai build this process loaded (the shared venv may be reinstalled between runs)."""
    import hashlib

    from fantai import _C

    so = _C.__file__
    with open(so, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return {"so": so, "so_sha256": digest,
            "so_mtime_utc": time.strftime("%H:%M:%S", time.gmtime(os.path.getmtime(so)))}


def log(msg: str) -> None:
    print(f"[bench_offline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# fantai worker


def submit(llm: Any, prompts: list[list[int]], sp: Any) -> tuple[list[Any], dict[int, tuple[Any, int]]]:
    """LLM.generate's submission: a RequestState per prompt, its core requests added to the engine;
    returns the states and core request id -> (state, output index)."""
    states = [llm._make_state(str(i), p, sp) for i, p in enumerate(prompts)]
    owner: dict[int, tuple[Any, int]] = {}
    for st in states:
        for i, (core_id, cp) in enumerate(st.core_requests(llm.max_model_len)):
            llm.engine.add_request(core_id, st.prompt_token_ids, cp)
            owner[core_id] = (st, i)
    return states, owner


def fantai_run(llm: Any, prompts: list[list[int]], sp: Any, stamps: list[float] | None = None
               ) -> dict[str, Any]:
    """LLM.generate's loop (llm.py: _make_state / core_requests / engine.step / RequestState.apply),
    with engine.stats() read before every step, and optionally a timestamp per step that produced
    tokens. Returns the outputs and the KV figures."""
    engine = llm.engine
    before = engine.stats()
    t0 = time.perf_counter()
    states, owner = submit(llm, prompts, sp)
    utils: list[float] = []
    used_blocks_peak = 0
    last_pre: dict[str, Any] | None = None
    unfinished = len(states)
    end_util = float("nan")
    end_snapshot: dict[str, Any] | None = None
    try:
        while engine.has_unfinished():
            pre = engine.stats()
            if pre["allocated_slots"] > 0:
                utils.append(pre["kv_utilization"])
                used_blocks_peak = max(used_blocks_peak, pre["num_used_blocks"])
            last_pre = pre
            outs = engine.step()
            produced = False
            for out in outs:
                st, i = owner[out.request_id]
                was_done = st.result.finished
                if out.token_ids:
                    produced = True
                if st.apply(i, out):
                    engine.abort_request(out.request_id)
                if st.result.finished and not was_done:
                    unfinished -= 1
                    if unfinished == 0:  # the last request finished in this step
                        end_snapshot = last_pre
            if produced and stamps is not None:
                stamps.append(time.perf_counter())
    except BaseException:
        for core_id in owner:
            engine.abort_request(core_id)
        raise
    wall = time.perf_counter() - t0
    after = engine.stats()
    if end_snapshot is not None:
        end_util = end_snapshot["kv_utilization"]
    results = [st.result for st in states]
    return {
        "wall_s": wall,
        "results": results,
        "kv_util_end": end_util,
        "kv_end_used_slots": end_snapshot["used_slots"] if end_snapshot else None,
        "kv_end_allocated_slots": end_snapshot["allocated_slots"] if end_snapshot else None,
        "kv_end_running": end_snapshot["num_running"] if end_snapshot else None,
        "kv_util_mean": sum(utils) / len(utils) if utils else float("nan"),
        "kv_util_min": min(utils) if utils else float("nan"),
        "kv_peak_used_blocks": used_blocks_peak,
        "kv_total_blocks": after["num_total_blocks"],
        "num_steps": after["num_steps"] - before["num_steps"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "kv_free_after": after["num_free_blocks"] == after["num_total_blocks"],
    }


def worker_fantai(dtype: str, args: argparse.Namespace, wl: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    import fantai
    from fantai import LLM, SamplingParams
    import_s = time.perf_counter() - t
    build = fantai_build()  # read now, before anything can replace the file

    # Prefix caching is off by default (issue 5's workload): the single-stream repeats reuse one
    # prompt, and a cached prefix would turn TTFT into the time of a one-token prefill.
    kw: dict[str, Any] = {"kv_cache_dtype": args.kv_cache_dtype, "enable_prefix_caching": args.enable_prefix_caching}
    if args.kv_cache_memory:
        kw["kv_cache_memory"] = args.kv_cache_memory
    t = time.perf_counter()
    if args.quantization != "none":
        kw["quantization"] = args.quantization
    if args.dequantize:
        kw["dequantize"] = True
    llm = LLM(args.model, dtype=dtype, threads=args.threads, seed=args.seed, matmul_precision=args.matmul_precision,
              **kw)
    load_s = time.perf_counter() - t
    rss_load = current_rss_bytes()
    log(f"fantai {dtype}: loaded in {load_s:.2f} s ({llm.engine.num_blocks} KV blocks, {llm.kv_cache_dtype} KV)")

    def sp(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    out_len = args.output_len
    llm.generate([wl["warmup"]], sp(4), use_tqdm=False)

    ttft, t_full, decode = [], [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm.generate([wl["single"]], sp(1), use_tqdm=False)
        ttft.append(time.perf_counter() - t)
    single_tokens = []
    for _ in range(args.repeats):
        stamps: list[float] = []
        r = fantai_run(llm, [wl["single"]], sp(out_len + 1), stamps)
        n_tok = len(r["results"][0].outputs[0].token_ids)
        assert n_tok == out_len + 1 and len(stamps) == n_tok, (n_tok, len(stamps))
        t_full.append(r["wall_s"])
        decode.append(out_len / (stamps[-1] - stamps[0]))
        single_tokens.append(list(r["results"][0].outputs[0].token_ids))
    log(f"fantai {dtype}: TTFT {median(ttft) * 1e3:.0f} ms, decode {median(decode):.1f} tok/s")

    prompts = wl["prompts"]
    r = fantai_run(llm, prompts, sp(out_len))
    n_out = [len(x.outputs[0].token_ids) for x in r["results"]]
    assert all(n == out_len for n in n_out), f"output lengths {sorted(set(n_out))} != {out_len}"
    n_prompt = sum(len(p) for p in prompts)
    wall = r.pop("wall_s")
    results = r.pop("results")
    log(f"fantai {dtype}: offline {sum(n_out) / wall:.1f} output tok/s")
    if args.short:
        check_greedy(llm, prompts, [list(x.outputs[0].token_ids) for x in results], sp(out_len),
                     single_tokens, dtype)
    return {
        "system": "fantai", "version": getattr(fantai, "__version__", "?"), "build": build, "dtype": dtype,
        "kv_cache_dtype": llm.kv_cache_dtype, "matmul_precision": llm.matmul_precision,
        "import_s": import_s, "load_s": load_s, "rss_after_load": rss_load,
        "quantization": args.quantization, "dequantize": args.dequantize, "weight_bytes": llm._model.weight_bytes(),
        "ttft_s": median(ttft), "ttft_all_s": ttft,
        "decode_tok_s": median(decode), "decode_all_tok_s": decode,
        "decode_tok_s_diff": out_len / (median(t_full) - median(ttft)),
        "single_prefill_tok_s": len(wl["single"]) / median(ttft),
        "offline_wall_s": wall, "prompt_tokens": n_prompt, "output_tokens": sum(n_out),
        "offline_output_tok_s": sum(n_out) / wall,
        "offline_total_tok_s": (n_prompt + sum(n_out)) / wall,
        "peak_rss": peak_rss_bytes(), **r,
    }


def check_greedy(llm: Any, prompts: list[list[int]], batched: list[list[int]], sp: Any,
                 single_runs: list[list[int]], dtype: str) -> None:
    """--short's result check: greedy decoding is deterministic and each sequence's arithmetic
    does not depend on what shares its batch, so every request of the batch must give the tokens
    it gives alone, and the repeated single-stream runs the same tokens each time."""
    bad = []
    for i, (p, got) in enumerate(zip(prompts, batched)):
        alone = list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
        if alone != got:
            bad.append(f"request {i}: batched {got} != alone {alone}")
    if any(run != single_runs[0] for run in single_runs):
        bad.append(f"single-stream repeats differ: {single_runs}")
    if bad:
        raise AssertionError(f"fantai {dtype}: greedy outputs differ:\n" + "\n".join(bad))
    log(f"fantai {dtype}: check ok: {len(prompts)} batched requests equal to each alone, "
        f"{len(single_runs)} single-stream runs equal")


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers worker


def worker_hf(dtype: str, args: argparse.Namespace, wl: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
    import_s = time.perf_counter() - t
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.model),
                                                 gguf_file=os.path.basename(args.model),
                                                 dtype=torch_dtype)
    model.eval()
    load_s = time.perf_counter() - t
    rss_load = current_rss_bytes()
    log(f"hf {dtype}: loaded in {load_s:.2f} s")
    pad = 0
    # EOS ignored: no eos id at all (so nothing stops early) and min_new_tokens = max_new_tokens.
    model.generation_config.eos_token_id = None
    gen_kw = dict(do_sample=False, pad_token_id=pad, eos_token_id=None, temperature=None, top_p=None,
                  top_k=None)

    class Stamp(StoppingCriteria):
        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            self.t.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(prompts: list[list[int]], n: int, stamp: Stamp | None = None) -> Any:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        extra = {"stopping_criteria": StoppingCriteriaList([stamp])} if stamp is not None else {}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             **gen_kw, **extra)
        return out[:, width:]

    out_len = args.output_len
    with torch.inference_mode():
        generate([wl["warmup"]], 4)
        ttft, t_full, decode = [], [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            generate([wl["single"]], 1)
            ttft.append(time.perf_counter() - t)
        for _ in range(args.repeats):
            stamp = Stamp()
            t = time.perf_counter()
            new = generate([wl["single"]], out_len + 1, stamp)
            t_full.append(time.perf_counter() - t)
            assert new.shape[1] == out_len + 1 and len(stamp.t) == out_len + 1, (new.shape, len(stamp.t))
            decode.append(out_len / (stamp.t[-1] - stamp.t[0]))
        log(f"hf {dtype}: TTFT {median(ttft) * 1e3:.0f} ms, decode {median(decode):.1f} tok/s")

        prompts = wl["prompts"]
        n_out = 0
        t = time.perf_counter()
        for b in range(0, len(prompts), args.hf_batch):
            new = generate(prompts[b:b + args.hf_batch], out_len)
            assert new.shape[1] == out_len, new.shape
            n_out += new.shape[0] * new.shape[1]
        wall = time.perf_counter() - t
    n_prompt = sum(len(p) for p in prompts)
    log(f"hf {dtype}: offline {n_out / wall:.1f} output tok/s")
    return {
        "system": "hf", "version": transformers.__version__, "torch": torch.__version__,
        "dtype": dtype, "import_s": import_s, "load_s": load_s, "rss_after_load": rss_load,
        "ttft_s": median(ttft), "ttft_all_s": ttft,
        "decode_tok_s": median(decode), "decode_all_tok_s": decode,
        "decode_tok_s_diff": out_len / (median(t_full) - median(ttft)),
        "single_prefill_tok_s": len(wl["single"]) / median(ttft),
        "offline_wall_s": wall, "prompt_tokens": n_prompt, "output_tokens": n_out,
        "offline_output_tok_s": n_out / wall, "offline_total_tok_s": (n_prompt + n_out) / wall,
        "hf_batch": args.hf_batch, "peak_rss": peak_rss_bytes(),
    }


# ----------------------------------------------------------------------------------------------
# Parent: run the workers, print the table


def fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    return format(x, spec)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = ("| system | weights | offline output tok/s | offline total tok/s | single-stream decode tok/s "
            "| TTFT | load | peak RSS | KV util end / mean | preemptions | loadavg start→end |")
    lines = [head, "|" + "---|" * 11]
    names = {"fantai": "fantai (continuous batching)",
             "hf": f"HF transformers (static batches of {args.hf_batch})"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {names[r['system']]} | {r['dtype']} | failed: {r['error'][:80]} |"
                         + " |" * 8)
            continue
        build = f" (_C {r['build']['so_sha256'][:7]})" if "build" in r else ""
        kv = (f"{fmt(r['kv_util_end'], '.3f')} / {fmt(r['kv_util_mean'], '.3f')}"
              if r["system"] == "fantai" else "–")
        mm = " (bf16 matmuls)" if r.get("matmul_precision") == "bfloat16" else ""
        lines.append(
            f"| {names[r['system']]} {r.get('version', '')}{build}{mm} | {r['dtype']} "
            f"| {fmt(r['offline_output_tok_s'], '.1f')} | {fmt(r['offline_total_tok_s'], '.0f')} "
            f"| {fmt(r['decode_tok_s'], '.1f')} | {fmt(r['ttft_s'] * 1e3, '.0f')} ms "
            f"| {fmt(r['load_s'], '.2f')} s | {r['peak_rss'] / 1e9:.2f} GB | {kv} "
            f"| {r.get('num_preemptions', '–')} "
            f"| {fmt(r.get('loadavg_start'), '.1f')}→{fmt(r.get('loadavg_end'), '.1f')} |")
    ok = [r for r in rows if "error" not in r]
    for dtype in args.dtype:
        f = next((r for r in ok if r["system"] == "fantai" and r["dtype"] == dtype), None)
        h = next((r for r in ok if r["system"] == "hf" and r["dtype"] == dtype), None)
        if f and h:
            lines.append(
                f"| **fantai / HF** | {dtype} "
                f"| {f['offline_output_tok_s'] / h['offline_output_tok_s']:.2f}x "
                f"| {f['offline_total_tok_s'] / h['offline_total_tok_s']:.2f}x "
                f"| {f['decode_tok_s'] / h['decode_tok_s']:.2f}x | {f['ttft_s'] / h['ttft_s']:.2f}x "
                f"| {f['load_s'] / h['load_s']:.2f}x | {f['peak_rss'] / h['peak_rss']:.2f}x | | | |")
    return "\n".join(lines)


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]], n_prompt: int) -> None:
    meta = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    meta.update(prompt_tokens=n_prompt, cpu_count=os.cpu_count(),
                time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    with open(args.json, "w") as f:
        json.dump({"config": meta, "results": rows}, f, indent=2)


def run_json_worker(cmd: list[str], threads: int, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs `cmd --_out F` with the math libraries held to `threads`; returns the JSON the worker
    wrote to F plus its wall time, spawn time and the load averages around it, or {"error": ...}.
    Shared by this script's and compare_llamacpp.py's workers."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        out_path = out.name
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.update(env_extra or {})
    load_start = os.getloadavg()[0]
    t = time.perf_counter()
    spawn_unix = time.time()
    proc = subprocess.run([*cmd, "--_out", out_path], env=env, stdout=sys.stderr)
    try:
        if proc.returncode != 0:
            return {"error": f"worker exited {proc.returncode}"}
        with open(out_path) as f:
            res = json.load(f)
        res["worker_wall_s"] = time.perf_counter() - t
        res["spawn_unix"] = spawn_unix
        res["loadavg_start"], res["loadavg_end"] = load_start, os.getloadavg()[0]
        return res
    finally:
        os.unlink(out_path)


def run_worker(spec: str, args: argparse.Namespace, workload_path: str) -> dict[str, Any]:
    system, dtype = spec.split(":")
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--_worker", spec,
           "--_workload", workload_path]
    log(f"running {spec}")
    # No tokenizer threads, no transformers' GGUF de-quantizing progress bar.
    res = run_json_worker(cmd, args.threads, {"TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"})
    if "error" in res:
        res.update(system=system, dtype=dtype)
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--single-prompt-len", type=int, default=128)
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated weight dtypes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-fantai", action="store_true")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="single-stream repetitions (median)")
    p.add_argument("--kv-cache-memory", default=None, help="fantai KV pool size, e.g. 2G (default: engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="fantai KV cache element type (default: auto, follows the weights)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="fantai prefix caching (default off)")
    p.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16"],
                   help="fantai's matmul_precision (bfloat16: activations rounded to bf16 on AMX)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="fantai: online quantization of dense linear weights")
    p.add_argument("--dequantize", action="store_true",
                   help="fantai: load the GGUF's quantized tensors dense (the unquantized reference)")
    p.add_argument("--json", default=None, help="write all figures to this JSON file")
    p.add_argument("--short", action="store_true",
                   help="CI smoke run: a handful of tiny requests, results checked (see above)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    # --short changes the defaults only, so `--short --dtype bfloat16` still means what it says.
    if "--short" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(num_prompts=4, output_len=8, min_prompt=16, max_prompt=64, single_prompt_len=16,
                       repeats=2, dtype="float32")
    args = p.parse_args(argv)
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error("need 1 <= --min-prompt <= --max-prompt")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        with open(args._workload) as f:
            wl = json.load(f)
        system, dtype = args._worker.split(":")
        res = (worker_fantai if system == "fantai" else worker_hf)(dtype, args, wl)
        with open(args._out, "w") as f:
            json.dump(res, f)
        return 0

    wl = make_workload(args)
    n_prompt = sum(len(p) for p in wl["prompts"])
    log(f"workload: {args.num_prompts} prompts, {n_prompt} prompt tokens "
        f"({args.min_prompt}-{args.max_prompt}), {args.output_len} output tokens each, "
        f"threads {args.threads}, model {args.model}")
    systems = [s for s in ("fantai", "hf")
               if not ((s == "hf" and args.skip_hf) or (s == "fantai" and args.skip_fantai))]
    # dtype by dtype, so that a run cut short still has complete side-by-side pairs
    specs = [f"{s}:{d}" for d in args.dtype for s in systems]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(wl, f)
        wl_path = f.name
    rows: list[dict[str, Any]] = []
    try:
        for s in specs:
            rows.append(run_worker(s, args, wl_path))
            if args.json:  # after every worker, so a long run that is cut short keeps its figures
                write_json(args, rows, n_prompt)
            print(table(rows, args), file=sys.stderr, flush=True)
    finally:
        os.unlink(wl_path)

    print(f"\nSmolLM2-135M-Instruct ({os.path.basename(args.model)}), {args.threads} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}: {args.num_prompts} requests, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens ({n_prompt} in all), {args.output_len} "
          f"output tokens each, EOS ignored, greedy; single stream: {args.single_prompt_len}-token "
          f"prompt, {args.output_len} new tokens (median of {args.repeats})\n")
    print(table(rows, args))
    if args.json:
        write_json(args, rows, n_prompt)
        log(f"wrote {args.json}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
