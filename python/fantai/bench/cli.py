"""Bench room: the `fantai bench` subcommands (argument parsing, tables, JSON and plot files)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fantai.bench.stats import format_table


def _rates(text: str) -> float:
    return float("inf") if text.lower() in ("inf", "infinity") else float(text)


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=["synthetic", "jsonl", "shared-prefix"],
                   default="synthetic", help="workload kind (default: %(default)s)")
    p.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl: lines "
                   'of {"prompt": text or token ids, "max_tokens": optional}')
    p.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt length (tokens)")
    p.add_argument("--output-len", type=int, default=128, help="mean output length (tokens)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in mean x [1 - r, 1 + r] (default: exact)")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="send prompts as random token ids below this (exact lengths; fantai "
                        "and vLLM accept them); default: text of common words")
    p.add_argument("--seed", type=int, default=0)


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server",
                       description="Stream a workload to any OpenAI-compatible server and report "
                       "request / token throughput, TTFT, TPOT, ITL and E2E latency.")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--request-rate", type=_rates, nargs="+", default=[float("inf")],
                   help="Poisson arrival rate(s) in req/s; inf sends all at once (default)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="requests in flight at most; several values = a sweep")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (servers that know ignore_eos)")
    p.add_argument("--count-tokens", action="store_true",
                   help="request sampled-token logprobs to count every streamed token exactly "
                        "(servers may pack several tokens into one chunk)")
    p.add_argument("--warmup", type=int, default=1, help="short requests first, not counted")
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    p.add_argument("--label", default=None, help="name of this run in plots (default: model)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="also draw them (.svg, or .png with matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_workload_options(p)
    p.set_defaults(func=serve_command)


def _workload(args: argparse.Namespace) -> list[Any]:
    from fantai.bench import workloads as w

    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise SystemExit("--dataset jsonl needs --dataset-path")
        return w.from_jsonl(args.dataset_path, args.num_prompts, args.output_len, args.seed)
    if args.dataset == "shared-prefix":
        return w.shared_prefix(args.num_prompts, args.prefix_len, args.num_prefixes,
                               args.input_len, args.output_len, args.seed, args.vocab_size)
    return w.synthetic(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                       args.seed, args.vocab_size)


def serve_command(args: argparse.Namespace) -> int:
    from fantai.bench.serve import ServeTarget, bench_serve

    target = ServeTarget(args.base_url, args.model, args.api_key, args.endpoint, args.ignore_eos,
                         args.timeout, args.count_tokens)
    requests = _workload(args)
    result = asyncio.run(bench_serve(target, requests, args.request_rate, args.max_concurrency,
                                     args.seed, args.warmup, not args.no_progress))
    result = {"schema": "fantai-bench-serve/1", "label": args.label or result["model"],
              "base_url": args.base_url, "endpoint": args.endpoint,
              "workload": {k: getattr(args, k) for k in (
                  "dataset", "dataset_path", "num_prompts", "input_len", "output_len",
                  "range_ratio", "prefix_len", "num_prefixes", "vocab_size", "seed",
                  "ignore_eos")}, **result}
    for run in result["runs"]:
        print(format_table(run, f"rate {run['request_rate']}, concurrency "
                                f"{run['max_concurrency'] or 'unbounded'}"))
    _write_outputs(result, args.json, args.plot)
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


def _write_outputs(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {json_path}")
    if plot_path:
        from fantai.bench.plot import plot

        if json_path is None:
            json_path = str(Path(plot_path).with_suffix(".json"))
            Path(json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {plot([json_path], plot_path)}")


def _add_offline(sub: Any, add_engine_options: Callable[[argparse.ArgumentParser], None]) -> None:
    t = sub.add_parser("throughput", help="offline throughput through LLM.generate")
    add_engine_options(t)
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=256)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--range-ratio", type=float, default=0.0)
    t.add_argument("--json", default=None)
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=throughput_command)
    lat = sub.add_parser("latency", help="one request at a time: prefill vs decode")
    add_engine_options(lat)
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=64)
    lat.add_argument("--repeats", type=int, default=3, help="runs (median reported)")
    lat.add_argument("--json", default=None)
    lat.set_defaults(func=latency_command)


_ENGINE_KWARGS: Callable[[argparse.Namespace], dict[str, Any]] | None = None


def _llm(args: argparse.Namespace) -> Any:
    from fantai import LLM

    assert _ENGINE_KWARGS is not None
    kwargs = _ENGINE_KWARGS(args)
    kwargs.pop("chat_template", None)
    return LLM(args.model, **kwargs)


def throughput_command(args: argparse.Namespace) -> int:
    from fantai.bench.offline import throughput

    res = throughput(_llm(args), args.num_prompts, args.input_len, args.output_len,
                     args.range_ratio, args.seed, not args.no_progress)
    print(f"Throughput: {res['request_throughput']:.2f} requests/s, "
          f"{res['total_token_throughput']:.1f} total tokens/s, "
          f"{res['output_throughput']:.1f} output tokens/s "
          f"({res['num_prompts']} prompts, {res['elapsed_s']:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def latency_command(args: argparse.Namespace) -> int:
    from fantai.bench.offline import latency

    res = latency(_llm(args), args.input_len, args.output_len, args.repeats, args.seed)
    print(f"Latency ({args.input_len} prompt + {args.output_len} output tokens, median of "
          f"{args.repeats}): prefill {res['prefill_ms']:.2f} ms "
          f"({res['prefill_tokens_per_s']:.0f} tok/s), decode {res['decode_ms_per_token']:.2f} "
          f"ms/token ({res['decode_tokens_per_s']:.1f} tok/s), end to end {res['e2e_ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from fantai.bench.plot import plot

    print(f"wrote {plot(args.files, args.output)}")
    return 0


def add_bench_parser(sub: Any, add_engine_options: Callable[[argparse.ArgumentParser], None],
                     engine_kwargs: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """Adds `bench` with its subcommands to the `fantai` parser's subparsers."""
    global _ENGINE_KWARGS
    _ENGINE_KWARGS = engine_kwargs
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, plot")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    _add_offline(bsub, add_engine_options)
    _add_serve(bsub)
    p = bsub.add_parser("plot", help="compare `bench serve` JSON files in one chart")
    p.add_argument("files", nargs="+", help="JSON files written by `fantai bench serve --json`")
    p.add_argument("-o", "--output", required=True, help="output .svg (or .png with matplotlib)")
    p.set_defaults(func=plot_command)

