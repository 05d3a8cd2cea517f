"""Bench room: `fantai bench serve` at each concurrency level, optionally against a server this
script launches, so the time from launching `fantai serve` to a healthy /health is measured too.

The client is the packaged one (python/fantai/bench): N requests of exactly --input-len prompt
tokens (seeded token ids below --vocab-size) and exactly --output-len output tokens (ignore_eos),
streamed over /v1/completions; it reports request / token throughput, TTFT, TPOT, ITL and E2E.

    python bench/bench_serve.py --launch --threads 2 --concurrency 1 16 64
    python bench/bench_serve.py --base-url http://127.0.0.1:8000 --model my-model
    python bench/bench_serve.py --short

--short (CI: make bench-smoke) launches the server itself and runs 4 requests of 32 prompt and 8
output tokens at concurrency 1 and 4, then checks every level's results: each request answered
200 and streamed to the end, with exactly --input-len prompt and --output-len output tokens (the
server's usage and the tokens counted from the stream's logprobs). Any miss exits 1; a slow run
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fantai.cli import main as fantai_main


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, float, Path]:
    """Start `fantai serve` on a free port; return it, its URL and seconds from launch to ready."""
    log = Path(tempfile.mkstemp(prefix="bench_serve_", suffix=".log")[1])
    model = [args.model_path] if args.model_path else []
    cmd = [sys.executable, "-m", "fantai.cli", "serve", *model,
           "--host", "127.0.0.1", "--port", "0", "--disable-log-requests",
           "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)),
           *(["--threads", str(args.threads)] if args.threads else []), *args.server_arg]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = None
    while time.perf_counter() - start < args.launch_timeout:
        if url is None:
            m = re.search(r"listening on (http://[0-9.]+:[0-9]+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
        if url is not None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url, time.perf_counter() - start, log
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"server did not become ready:\n{log.read_text(errors='replace')[-3000:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server to drive (without /v1); ignored with --launch")
    p.add_argument("--launch", action="store_true",
                   help="start `fantai serve` here (free port) and time launch to ready")
    p.add_argument("--model-path", default=None, help="MODEL for --launch (default model if unset)")
    p.add_argument("--threads", type=int, default=2, help="--threads for --launch")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `fantai serve` argument for --launch (repeatable)")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--model", default=None, help="model name to request (default: first served)")
    p.add_argument("--api-key", default=os.environ.get("FANTAI_API_KEY"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="prompt token ids are drawn below this (exact prompt lengths)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--short", action="store_true",
                   help="CI smoke run: launch, a handful of tiny requests, results checked")
    # --short changes the defaults only; explicit flags still win.
    if "--short" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(launch=True, concurrency=[1, 4], num_prompts=4, input_len=32, output_len=8)
    return p.parse_args(argv)


def check_runs(args: argparse.Namespace, runs: list[dict[str, object]]) -> list[str]:
    """What --short verifies per level: a failed request is one whose HTTP status was not 200 or
    whose stream broke (fantai bench serve records both as failed, with the error)."""
    problems = []
    for run in runs:
        n = int(run["num_prompts"])  # type: ignore[call-overload]
        level = run["max_concurrency"]
        want = {"completed": n, "failed": 0, "total_input_tokens": n * args.input_len,
                "total_output_tokens": n * args.output_len, "total_tokens_received": n * args.output_len,
                "min_output_tokens": args.output_len, "max_output_tokens": args.output_len}
        for key, value in want.items():
            if run.get(key) != value:
                problems.append(f"concurrency {level}: {key} = {run.get(key)}, expected {value}")
        if run.get("errors"):
            problems.append(f"concurrency {level}: errors {run['errors']}")
    return problems


def run_level(args: argparse.Namespace, base_url: str, level: int, out: Path) -> int:
    """One `fantai bench serve` run at a fixed concurrency; its JSON goes to `out`."""
    argv = ["bench", "serve", "--base-url", base_url, "--max-concurrency", str(level),
            "--num-prompts", str(args.num_prompts or max(8, 2 * level)),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--range-ratio", "0", "--vocab-size", str(args.vocab_size),
            "--seed", str(args.seed + level), "--ignore-eos", "--count-tokens", "--warmup", "1",
            "--no-progress", "--json", str(out)]
    argv += ["--model", args.model] if args.model else []
    argv += ["--api-key", args.api_key] if args.api_key else []
    return fantai_main(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, ready_s, base_url = None, None, args.base_url
    if args.launch:
        proc, base_url, ready_s, log = launch_server(args)
        print(f"launch to ready: {ready_s:.2f} s  ({base_url}, log {log})")
    status, runs = 0, []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for level in args.concurrency:
                out = Path(tmp) / f"c{level}.json"
                status |= run_level(args, base_url, level, out)
                runs += json.loads(out.read_text())["runs"]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    if args.json:
        Path(args.json).write_text(json.dumps({"launch_to_ready_s": ready_s, "input_len": args.input_len,
                                               "output_len": args.output_len, "runs": runs}, indent=1))
    if args.short:
        problems = check_runs(args, runs)
        for line in problems:
            print(f"FAIL {line}")
        if not problems:
            print(f"check ok: {sum(int(r['num_prompts']) for r in runs)} requests over "
                  f"{len(runs)} levels, all 200 with {args.input_len} prompt and {args.output_len} "
                  "output tokens each")
        status |= 1 if problems else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
