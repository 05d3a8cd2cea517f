#!/usr/bin/env python3
"""Single-stream decode from DRAM: a model larger than the last-level cache, per weight format, as
a fraction of the read bandwidth measured around it.

Not a test: it prints figures, it asserts nothing about time.

The bundled SmolLM2-135M (98 MB Q4_1, 145 MB Q8_0, 269 MB bf16) sits in the L3 of some hosts
(300 MiB on the Emerald Rapids guests these figures came from), so its decode rate says nothing
about streaming weights from DRAM. This writes (once, into --cache-dir) a random-weight Llama of
--hidden / --inter / --layers in each of --formats with bench/make_kquant_gguf.py (2048 / 5632 /
24 by default: 785 MB Q4_1, 1.26 GB Q8_0, 2.37 GB bf16), then per format and round:

  probe     bench_kernels --only probe --threads T (at FANTAI_CPU_ISA when set): the 512 MB
            read bandwidth, just before the model loads and just after it is freed;
  decode    LLM(file) with dtype auto, a 1-token prompt: --repeats times, the wall time of a
            --tokens + 1 token generation minus that of a 1-token one, so tok/s counts decode
            steps only; median;
  GB/s      the file's tensor bytes (every weight is read once per token; the tied embedding is the
            lm_head) x tok/s, against the higher of the two probes (and their mean).

    .venv/bin/python bench/decode_dram.py                          # the three formats
    FANTAI_CPU_ISA=avx2 .venv/bin/python bench/decode_dram.py --rounds 3
    .venv/bin/python bench/decode_dram.py --short                  # a tiny model: runs end to end

The side by side against llama.cpp on the same files: compare_llamacpp.py --model FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_llamacpp import model_costs, run_probe  # noqa: E402  (the same probe and byte count)


def read_gbs(binary: str, threads: int) -> float:
    gbs = run_probe(binary, threads, os.environ.get("FANTAI_CPU_ISA")).get("read_gbs")
    if gbs is None:
        raise RuntimeError(f"no read bandwidth in {binary}'s probe output")
    return gbs


def model_file(args: argparse.Namespace, fmt: str) -> str:
    path = os.path.join(args.cache_dir, f"dram-{fmt}-{args.hidden}x{args.inter}x{args.layers}.gguf")
    if not os.path.exists(path):
        os.makedirs(args.cache_dir, exist_ok=True)
        subprocess.run([sys.executable, os.path.join(HERE, "make_kquant_gguf.py"), "--type", fmt,
                        "--hidden", str(args.hidden), "--inter", str(args.inter), "--layers", str(args.layers),
                        "--out", path], check=True)
    return path


def decode_rates(path: str, args: argparse.Namespace) -> list[float]:
    """Decode tok/s per repeat; the model is freed on return, before the probe after it."""
    from fantai import LLM, SamplingParams

    llm = LLM(path, threads=args.threads, seed=0, enable_prefix_caching=False)

    def wall(n: int) -> float:
        t = time.perf_counter()
        llm.generate([[100]], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    wall(4)
    return [args.tokens / (wall(args.tokens + 1) - wall(1)) for _ in range(args.repeats)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="q4_1,q8_0,bf16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fantai-bench"))
    p.add_argument("--probe", default=os.path.join(HERE, "..", "build", "wheel", "bench", "bench_kernels"))
    p.add_argument("--short", action="store_true", help="a 2-layer 256-wide model, 2 repeats of 8 tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.short:
        args.hidden, args.inter, args.layers, args.tokens, args.repeats = 256, 512, 2, 8, 2
    rows = []
    for rnd in range(args.rounds):
        for fmt in args.formats.split(","):
            path = model_file(args, fmt)
            nbytes = model_costs(path, 1)["bytes_per_token"]
            before = read_gbs(args.probe, args.threads)
            rates = decode_rates(path, args)
            after = read_gbs(args.probe, args.threads)
            gbs = median(rates) * nbytes / 1e9
            row = {"round": rnd + 1, "format": fmt, "bytes_per_token": nbytes, "tok_s": rates,
                   "gb_s": gbs, "probe_before": before, "probe_after": after,
                   "of_higher": gbs / max(before, after), "of_mean": gbs / ((before + after) / 2)}
            rows.append(row)
            print(f"[decode_dram] round {rnd + 1} {fmt}: {nbytes / 1e6:.0f} MB/token, tok/s "
                  f"{' '.join(f'{r:.1f}' for r in rates)}", file=sys.stderr, flush=True)
    isa = os.environ.get("FANTAI_CPU_ISA", "native")
    print(f"\nSingle-stream decode, {args.threads} threads, ISA {isa}, hidden {args.hidden} x inter "
          f"{args.inter} x {args.layers} layers, median of {args.repeats} x {args.tokens} tokens\n")
    print("| round | format | MB / token | decode tok/s | GB/s | read probe before / after | % of the higher | % of the mean |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['format']} | {r['bytes_per_token'] / 1e6:.0f} | {median(r['tok_s']):.1f} | "
              f"{r['gb_s']:.1f} | {r['probe_before']:.1f} / {r['probe_after']:.1f} | {r['of_higher'] * 100:.0f}% | "
              f"{r['of_mean'] * 100:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
