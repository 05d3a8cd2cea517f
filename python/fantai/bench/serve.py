"""Bench room: drive any OpenAI-compatible server (fantai, vLLM, llama-server, TGI) with a
workload at a Poisson rate or a fixed concurrency, streaming, and measure what a client sees."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from fantai.bench.stats import RequestRecord, summarize
from fantai.bench.workloads import BenchRequest, arrival_gaps


@dataclass(slots=True)
class ServeTarget:
    base_url: str                 # without /v1
    model: str | None = None      # None: the first of GET /v1/models
    api_key: str | None = None
    endpoint: str = "/v1/completions"
    ignore_eos: bool = True       # sent as `ignore_eos` (fantai, vLLM, llama-server accept it)
    timeout: float = 1800.0
    # Ask for sampled-token logprobs (completions: logprobs=0, chat: logprobs=true) so every
    # received token is counted even when the server packs several into one chunk.
    count_tokens: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def _body(target: ServeTarget, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if target.endpoint.endswith("/chat/completions"):
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.count_tokens:
        chat = "messages" in body
        body["logprobs"] = True if chat else 0
    body.update(target.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            return str(text)
    return ""


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens a chunk carries, by its logprobs (completions: tokens[], chat: content[])."""
    n = 0
    for choice in chunk.get("choices") or []:
        lp = choice.get("logprobs") or {}
        n += len(lp.get("tokens") or lp.get("content") or [])
    return n


async def send(http: httpx.AsyncClient, target: ServeTarget, model: str,
               req: BenchRequest) -> RequestRecord:
    """One streamed request; usage (include_usage) gives the server's token counts."""
    rec = RequestRecord(ok=False)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", target.endpoint, json=_body(target, model, req)) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                rec.tokens_received += _chunk_tokens(chunk)
                if _chunk_text(chunk):
                    if rec.chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    rec.chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    rec.output_tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.e2el = time.perf_counter() - start
    rec.ok = True
    if rec.output_tokens == 0:  # a server without usage in streams: count chunks instead
        rec.output_tokens = rec.chunks
    return rec


async def resolve_model(http: httpx.AsyncClient, target: ServeTarget) -> str:
    if target.model:
        return target.model
    r = await http.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def run_load(http: httpx.AsyncClient, target: ServeTarget, model: str,
                   requests: list[BenchRequest], rate: float, concurrency: int | None,
                   seed: int, progress: bool = True) -> dict[str, Any]:
    """Sends `requests` with Poisson gaps at `rate` (inf: at once), at most `concurrency` in
    flight (None: unbounded); returns the run's summary."""
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    bar = _progress_bar(len(requests), progress)

    async def one(req: BenchRequest) -> RequestRecord:
        if gate is None:
            rec = await send(http, target, model, req)
        else:
            async with gate:
                rec = await send(http, target, model, req)
        if bar is not None:
            bar.update(1)
        return rec

    tasks = []
    start = time.perf_counter()
    for req, gap in zip(requests, arrival_gaps(len(requests), rate, seed)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    run = summarize(list(records), duration)
    # JSON has no infinity: "inf" means all requests at once.
    run.update({"request_rate": rate if math.isfinite(rate) else "inf",
                "max_concurrency": concurrency})
    return run


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True, leave=False)


async def bench_serve(target: ServeTarget, requests: list[BenchRequest], rates: list[float],
                      concurrencies: list[int | None], seed: int, warmup: int = 1,
                      progress: bool = True) -> dict[str, Any]:
    """Every (rate, concurrency) pair as one run over the same requests."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    top = max([c or len(requests) for c in concurrencies] + [1])
    limits = httpx.Limits(max_connections=top + 8, max_keepalive_connections=top + 8)
    async with httpx.AsyncClient(base_url=target.base_url.rstrip("/"), headers=headers,
                                 limits=limits, timeout=target.timeout) as http:
        model = await resolve_model(http, target)
        for req in requests[:warmup]:  # connection set-up and first-call costs stay out
            await send(http, target, model, BenchRequest(req.prompt, min(req.max_tokens, 4)))
        runs = []
        for rate in rates:
            for conc in concurrencies:
                runs.append(await run_load(http, target, model, requests, rate, conc, seed,
                                           progress))
    return {"model": model, "runs": runs}
