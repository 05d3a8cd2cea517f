"""Bench room: drive a `fantai serve` (or any OpenAI-compatible) server like `vllm bench serve`.

Fixed, seeded protocol: N requests of exactly --input-len prompt tokens (token-id prompts cut
from a seeded word stream, measured with the server's /tokenize) and exactly --output-len output
tokens (ignore_eos), streamed over /v1/completions, run at each --concurrency level. Reports
requests/s, output tokens/s, median and p99 TTFT and TPOT, and, with --launch, the time from
launching `fantai serve` to a healthy /health.

    python bench/bench_serve.py --launch --threads 2 --concurrency 1 16 64
    python bench/bench_serve.py --base-url http://127.0.0.1:8000 --model my-model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = (  # noqa: SIM905
    "the of and to in is was for on that with as by at from his her they this which "
    "river mountain engine memory token cache batch signal garden window market story "
    "quickly slowly bright silent ancient modern simple careful").split()


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from send to the first streamed token
    latency: float = 0.0  # seconds from send to the end of the stream
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class LevelReport:
    concurrency: int
    num_requests: int
    completed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def make_prompts(http: httpx.AsyncClient, model: str, count: int, input_len: int,
                       seed: int) -> list[list[int]]:
    """`count` token-id prompts of exactly `input_len` tokens, from a seeded word stream."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        r = await http.post("/tokenize", json={"model": model, "prompt": text})
        r.raise_for_status()
        tokens = r.json()["tokens"]
        if len(tokens) < input_len:
            raise RuntimeError("prompt text too short for --input-len")
        prompts.append(tokens[:input_len])
    return prompts


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = 0.0
    tokens = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                body_text = (await r.aread())[:200]
                return RequestResult(False, error=f"HTTP {r.status_code}: {body_text!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not ttft and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
    except httpx.HTTPError as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    return RequestResult(True, ttft, time.perf_counter() - start, tokens)


async def run_level(http: httpx.AsyncClient, model: str, prompts: list[list[int]],
                    output_len: int, concurrency: int) -> LevelReport:
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> RequestResult:
        async with gate:
            return await one_request(http, model, prompt, output_len)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [t * 1e3 for t in (r.tpot for r in ok) if t is not None]
    return LevelReport(
        concurrency=concurrency, num_requests=len(prompts), completed=len(ok),
        duration_s=duration, requests_per_s=len(ok) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft_median_ms=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p99_ms=percentile(ttfts, 0.99),
        tpot_median_ms=statistics.median(tpots) if tpots else float("nan"),
        tpot_p99_ms=percentile(tpots, 0.99),
        errors=sorted({r.error for r in results if not r.ok})[:5])


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


def print_table(reports: list[LevelReport]) -> None:
    head = (f"{'conc':>5} {'reqs':>5} {'ok':>4} {'dur s':>7} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12}")
    print(head)
    for r in reports:
        print(f"{r.concurrency:>5} {r.num_requests:>5} {r.completed:>4} {r.duration_s:>7.2f} "
              f"{r.requests_per_s:>7.3f} {r.output_tokens_per_s:>10.1f} {r.ttft_median_ms:>12.1f} "
              f"{r.ttft_p99_ms:>12.1f} {r.tpot_median_ms:>12.1f} {r.tpot_p99_ms:>12.1f}")
        for err in r.errors:
            print(f"      error: {err}")


async def bench(args: argparse.Namespace, base_url: str) -> list[LevelReport]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        await one_request(http, model, [1, 2, 3, 4], 4)  # warm-up, not counted
        reports = []
        for level in args.concurrency:
            count = args.num_prompts or max(8, 2 * level)
            prompts = await make_prompts(http, model, count, args.input_len, args.seed + level)
            reports.append(await run_level(http, model, prompts, args.output_len, level))
        return reports


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    ready_s = None
    base_url = args.base_url
    if args.launch:
        proc, base_url, ready_s, log = launch_server(args)
        print(f"launch to ready: {ready_s:.2f} s  ({base_url}, log {log})")
    try:
        reports = asyncio.run(bench(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"input {args.input_len} tokens, output {args.output_len} tokens, greedy, ignore_eos")
    print_table(reports)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"launch_to_ready_s": ready_s, "input_len": args.input_len,
             "output_len": args.output_len, "levels": [asdict(r) for r in reports]}, indent=1))
    return 0 if all(r.completed == r.num_requests for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
