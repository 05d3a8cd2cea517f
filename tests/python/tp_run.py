"""Runs in its own process for test_tensor_parallel.py (MPI and its signal handlers stay out of the
pytest process): TP = 1, then TP = 2 twice on one model directory; prints one JSON line.

    tp_run.py DIR N            TP = 1, then TP = N twice (ranks spawned on this host)
    tp_run.py DIR N refuse     the error of a split that cannot work
    tp_run.py DIR 1 ref        TP = 1 only
    mpirun -np N ... tp_run.py DIR N mpirun   every rank runs this; rank 0 prints TP = N twice,
                               its start-up time and its step time split into compute and
                               communication
    tp_run.py DIR N cuda       TP = 1, then TP = N twice, on GPUs (NCCL; one GPU per rank)
    tp_run.py DIR N release    KV pages released on rank 0 and (through the step wire) the worker
    tp_run.py DIR N swap       TP = 1 without swap space, then TP = N swapping every preempted
                               sequence to host memory (each rank its heads' share)
    mpirun ... tp_run.py DIR N mpirun-long   rank 0 prints its pid, then decodes for ever"""

from __future__ import annotations

import json
import os
import sys
import time

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
            "preemptions": stats.get("num_preemptions", -1), "swap_outs": stats.get("num_swap_outs", 0),
            "swap_ins": stats.get("num_swap_ins", 0), "swap_slots": stats.get("num_swap_slots", 0),
            "free_swap_slots": stats.get("num_free_swap_slots", 0)}


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat").rsplit(b")", 1)
    return int(stat[1].split()[1]) if len(stat) == 2 else -1


def _descendants(pid: int) -> list[int]:
    """The ranks MPI_Comm_spawn started hang below its runtime's daemon, not this process."""
    procs = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    parent = {p: _parent(p) for p in procs}
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        kids = [p for p, pp in parent.items() if pp == q]
        out += kids
        todo += kids
    return out


def _rss(pid: int) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(b"VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def main() -> None:
    path, tp = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "refuse":
        try:
            LLM(path, tensor_parallel_size=tp, dtype="float32", num_kv_blocks=8)
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
        return
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    if mode == "ref":
        print(json.dumps({"tp1": run(LLM(path, **ENGINE))}))
        return
    if mode == "mpirun":  # ranks > 0 turn into workers inside LLM() and never return
        t0 = time.perf_counter()
        llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
        out = {"startup_s": time.perf_counter() - t0, "heads_per_rank": llm._model.config.num_heads}
        s0, c0 = llm.stats(), _C.tp_stats()
        out["tp"] = run(llm)
        out["tp_again"] = run(llm)
        s1, c1 = llm.stats(), _C.tp_stats()
        steps = max(1, s1["num_steps"] - s0["num_steps"])
        comm = c1["seconds"] - c0["seconds"]
        forward = s1["time_forward_s"] - s0["time_forward_s"]
        out["comm"] = c1
        out["per_step_ms"] = {"steps": steps, "forward": 1e3 * forward / steps, "comm": 1e3 * comm / steps,
                              "compute": 1e3 * (forward - comm) / steps}
        print(json.dumps(out), flush=True)
        return
    if mode == "release":  # KV pages given back on every rank: rank 0's resident bytes, the worker's RSS
        llm = LLM(path, tensor_parallel_size=tp, dtype="float32", kv_cache_memory="64M",
                  enable_prefix_caching=False)
        worker = [p for p in _descendants(os.getpid()) if b"fantai.tp_launch" in _read(f"/proc/{p}/cmdline")]
        llm.generate(random_prompts(8, 320, [400] * 8, seed=3), SamplingParams(temperature=0.0, max_tokens=8,
                                                                              ignore_eos=True), use_tqdm=False)
        out = {"worker": worker, "rank0_before": llm.engine.kv_resident_bytes(),
               "worker_rss_before": [_rss(p) for p in worker]}
        out["released_blocks"] = llm.release_memory()
        out["rank0_after"] = llm.engine.kv_resident_bytes()
        # The worker applies the release when it reads the op, which a loaded machine may delay:
        # wait until its RSS has fallen by half rank 0's drop (the test's bound), or 10 s.
        want = (out["rank0_before"] - out["rank0_after"]) // 2
        deadline = time.monotonic() + 10
        while worker:
            out["worker_rss_after"] = [_rss(p) for p in worker]
            drop = out["worker_rss_before"][0] - out["worker_rss_after"][0]
            if drop > want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print(json.dumps(out))
        return
    if mode == "mpirun-long":  # rank 0 says it is ready, then decodes until a rank is killed
        llm = LLM(path, tensor_parallel_size=tp, dtype="float32", kv_cache_memory="16M", max_model_len=4096)
        print(json.dumps({"ready": os.getpid()}), flush=True)
        # Really for ever: one 4,000-token request takes well under a second on an idle machine.
        while True:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True),
                         use_tqdm=False)
    if mode == "bind":
        out = {"tp1": run(LLM(path, **ENGINE))}
        out["tp"] = run(LLM(path, tensor_parallel_size=tp, cpu_bind="compact", **ENGINE))
        print(json.dumps(out))
        return
    if mode == "swap":
        out = {"tp1": run(LLM(path, **ENGINE))}
        out["tp"] = run(LLM(path, tensor_parallel_size=tp, swap_space="4M", preemption_mode="swap", **ENGINE))
        print(json.dumps(out))
        return
    engine = ENGINE | {"device": "cuda"} if mode == "cuda" else ENGINE
    ref = LLM(path, **engine)
    out = {"tp1": run(ref), "vocab": ref._model.config.vocab_size,
           "lm_head_bytes": {"tp1": ref._model.lm_head_bytes()}, "quant_bytes": ref._model.quant_bytes()}
    del ref
    llm = LLM(path, tensor_parallel_size=tp, **engine)
    out["heads_per_rank"] = llm._model.config.num_heads
    out["lm_head_bytes"]["tp"] = llm._model.lm_head_bytes()  # rank 0's
    out["tp"] = run(llm)
    out["tp_again"] = run(llm)
    out["comm"] = _C.tp_stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
