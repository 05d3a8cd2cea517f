#!/usr/bin/env python3
"""Engine overhead per step: where a step's wall time goes, at issue 5's batch-64 workload.

Not a test: it prints a breakdown, it gates nothing.

How it is measured. The engine times each phase of Engine::step() with a steady clock and sums it
in engine.stats() (time_schedule_s, time_prepare_s, time_forward_s, time_sample_s,
time_postprocess_s, time_step_s). This script drives LLM.generate's own loop (the
bench_offline.fantai_run copy of it: engine.step(), then RequestState.apply per output =
detokenizing and output records) and reads those sums before and after every step, outside the
timed intervals, so each step has:
  schedule / prepare / forward / sample / postprocess   C++ phases (prepare = token ids, positions,
                                                        slot mapping, block tables)
  binding     engine.step() wall as seen from Python minus the C++ step: the pybind11 call and the
              conversion of the StepOutputs to Python objects
  python      RequestState.apply for every output (detokenize, stop strings, output records)
Overhead = everything but forward; the target is < 5% of the step at batch 64. Figures are given
for all steps of the workload and for the steady decode steps that ran exactly --num-prompts
sequences and no prefill (the "batch 64" steps).

    .venv/bin/python bench/bench_overhead.py                  # 64 prompts 64..512, 128 tokens, bf16
    .venv/bin/python bench/bench_overhead.py --output-len 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


def run(llm: Any, prompts: list[list[int]], out_len: int) -> list[dict[str, float]]:
    from fantai import SamplingParams

    from bench_offline import submit  # main() put bench/ on the path

    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    engine = llm.engine
    states, owner = submit(llm, prompts, sp)
    steps: list[dict[str, float]] = []
    before = engine.stats()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        for out in outs:
            st, i = owner[out.request_id]
            if st.apply(i, out):
                engine.abort_request(out.request_id)
        t2 = time.perf_counter()
        after = engine.stats()
        rec = {p: after[f"time_{p}_s"] - before[f"time_{p}_s"] for p in PHASES}
        cpp = after["time_step_s"] - before["time_step_s"]
        rec.update(binding=(t1 - t0) - cpp, python=t2 - t1, total=t2 - t0,
                   decode=after["last_batch_decode_tokens"], prefill=after["last_batch_prefill_tokens"],
                   outputs=len(outs))
        steps.append(rec)
        before = after
    assert all(len(st.result.outputs[0].token_ids) == out_len for st in states)
    return steps


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    n = len(steps)
    if n == 0:
        return {"steps": 0}
    s = {k: sum(x[k] for x in steps) / n for k in (*PHASES, "binding", "python", "total")}
    s["steps"] = n
    s["overhead"] = s["total"] - s["forward"]
    return s


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    keys = (*PHASES, "binding", "python", "overhead", "total")
    lines = ["| steps | n | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for name, s in rows:
        if not s.get("steps"):
            lines.append(f"| {name} | 0 |" + " |" * len(keys))
            continue
        cells = [f"{s[k] * 1e3:.2f} ms ({100 * s[k] / s['total']:.1f}%)" for k in keys]
        lines.append(f"| {name} | {s['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-prompt-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from bench_offline import make_workload

    from fantai import LLM, SamplingParams

    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    wl = make_workload(args)
    llm = LLM(args.model, dtype=args.dtype, threads=args.threads, seed=args.seed, enable_prefix_caching=False)
    llm.generate([wl["warmup"]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    steps = run(llm, wl["prompts"], args.output_len)
    wall = time.perf_counter() - t
    load1 = os.getloadavg()[0]
    full = [x for x in steps if x["decode"] == args.num_prompts and x["prefill"] == 0]
    rows = [("all", summarize(steps)), (f"decode-only, batch {args.num_prompts}", summarize(full))]
    n_out = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts {args.min_prompt}-{args.max_prompt} tokens, {args.output_len} output tokens "
          f"each, {args.dtype}, {args.threads} threads: {wall:.1f} s, {n_out / wall:.1f} output tok/s; "
          f"load average {load0:.2f}→{load1:.2f}; mean per step (share of the step):\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "wall_s": wall, "loadavg": [load0, load1],
                       "summary": dict(rows), "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
