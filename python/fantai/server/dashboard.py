"""Server room: the live dashboard (/dashboard page, its static files, and an SSE snapshot stream)."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import numpy as np
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fantai.server.metrics import Histogram
from fantai.server.state import ServerContext

STATIC_FILES = {"dashboard.html": "text/html; charset=utf-8",
                "dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8"}
# The page shows what /metrics shows plus request ids and block tables (no text, no prompts), so,
# like /metrics, it is reachable without an API key: a browser's EventSource can't send one.
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/stream"} |
                            {f"/dashboard/static/{name}" for name in STATIC_FILES})
DEFAULT_HZ = 5.0        # snapshots per second sent to every client (one poll of the engine each)
PERCENTILE_WINDOW = 10.0  # seconds of finished requests behind the TTFT / TPOT percentiles
MAX_STEPS_PER_MESSAGE = 512


def encode_runs(states: bytes) -> dict[str, Any]:
    """Block states as runs (start index, value): a pool is mostly long runs, and numpy keeps
    this O(num_blocks) pass off the Python interpreter's per-item cost."""
    a = np.frombuffer(states, dtype=np.uint8)
    if a.size == 0:
        return {"starts": [], "values": []}
    starts = np.concatenate(([0], np.flatnonzero(np.diff(a)) + 1))
    return {"starts": starts.tolist(), "values": a[starts].tolist()}


def histogram_percentiles(hist: Histogram, base: list[int] | None,
                          qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Percentiles (seconds) of the observations since `base` (an earlier copy of hist.counts),
    interpolated inside the histogram's buckets: an estimate as fine as /metrics' buckets."""
    counts = [c - (base[i] if base else 0) for i, c in enumerate(hist.counts)]
    total = sum(counts)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{round(q * 100)}"] = _bucket_quantile(hist.buckets, counts, total, q)
    out["count"] = float(total)
    return out


def _bucket_quantile(bounds: tuple[float, ...], counts: list[int], total: int,
                     q: float) -> float | None:
    if total == 0:
        return None
    cumulative = np.cumsum(counts).tolist()
    rank = q * total
    i = bisect.bisect_left(cumulative, rank)
    lo = bounds[i - 1] if i > 0 else 0.0
    hi = bounds[i] if i < len(bounds) else bounds[-1]  # +Inf bucket: report its lower bound
    below = cumulative[i - 1] if i > 0 else 0
    inside = counts[i] or 1
    return lo + (hi - lo) * min(max((rank - below) / inside, 0.0), 1.0)


class DashboardHub:
    """One poller for all clients: while anyone listens it reads the engine's latest snapshot at
    `hz` and fans one encoded message out; with no client it does nothing at all."""

    def __init__(self, ctx: ServerContext, hz: float = DEFAULT_HZ) -> None:
        self.ctx = ctx
        self.period = 1.0 / hz
        self.queues: set[asyncio.Queue[str]] = set()
        self.task: asyncio.Task[None] | None = None
        self.last_step = -1
        self.hist_history: deque[tuple[float, list[int], list[int]]] = deque()

    async def subscribe(self) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=2)
        self.queues.add(queue)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        try:
            while not self.ctx.draining:
                try:
                    yield await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"  # also notices a gone client sooner
        finally:
            self.queues.discard(queue)

    async def _run(self) -> None:
        await self._first_snapshot()
        while self.queues:
            message = f"data: {json.dumps(self.build_message(), separators=(',', ':'))}\n\n"
            for queue in list(self.queues):
                if queue.full():  # a slow client gets the newest state, never a backlog
                    queue.get_nowait()
                queue.put_nowait(message)
            await asyncio.sleep(self.period)

    async def _first_snapshot(self) -> None:
        """A new watch wakes the engine loop to publish; give it a moment (it is one copy)."""
        engine = self.ctx.engine
        for _ in range(20):
            if not hasattr(engine, "snapshot") or engine.snapshot() is not None:
                return
            await asyncio.sleep(0.01)

    def build_message(self) -> dict[str, Any]:
        engine = self.ctx.engine
        now = time.monotonic()
        snap = engine.snapshot() if hasattr(engine, "snapshot") else None
        stats = snap["stats"] if snap else engine.stats()
        msg: dict[str, Any] = {"time": now, "stats": stats, "latency": self._latency(now),
                               "steps": self._steps(engine), "hz": 1.0 / self.period}
        if snap is not None:
            msg["blocks"] = encode_runs(snap["block_states"])
            msg["shared"] = snap["shared"]
            msg["requests"] = snap["requests"]
        return msg

    def _steps(self, engine: Any) -> list[dict[str, Any]]:
        if not hasattr(engine, "steps_since"):
            return []
        steps = engine.steps_since(self.last_step)
        if steps:
            self.last_step = steps[-1]["step"]
        return steps[-MAX_STEPS_PER_MESSAGE:]

    def _latency(self, now: float) -> dict[str, Any]:
        """TTFT / TPOT percentiles over the last PERCENTILE_WINDOW seconds of finished requests."""
        m = self.ctx.metrics
        self.hist_history.append((now, list(m.ttft.counts), list(m.tpot.counts)))
        while len(self.hist_history) > 1 and now - self.hist_history[0][0] > PERCENTILE_WINDOW:
            self.hist_history.popleft()
        _, ttft_base, tpot_base = self.hist_history[0]
        return {"ttft": histogram_percentiles(m.ttft, ttft_base),
                "tpot": histogram_percentiles(m.tpot, tpot_base),
                "window_s": PERCENTILE_WINDOW}


def _static(name: str) -> bytes:
    return resources.files("fantai.server").joinpath("static").joinpath(name).read_bytes()


def install(app: FastAPI, ctx: ServerContext, hz: float = DEFAULT_HZ) -> DashboardHub:
    """Adds GET /dashboard, /dashboard/static/<file> and the SSE stream /dashboard/stream."""
    hub = DashboardHub(ctx, hz)
    pages = {name: _static(name) for name in STATIC_FILES}  # read once: the wheel is immutable

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(pages["dashboard.html"], media_type=STATIC_FILES["dashboard.html"],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in pages:
            return Response(status_code=404)
        return Response(pages[name], media_type=STATIC_FILES[name],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/stream", include_in_schema=False)
    async def dashboard_stream(request: Request) -> StreamingResponse:
        info = {"num_blocks": None, "block_size": None, "model": ctx.config.served_model_names[0]}
        if hasattr(ctx.engine, "kv_pool_info"):
            info.update(ctx.engine.kv_pool_info())
        hello = f"event: hello\ndata: {json.dumps(info)}\n\n"
        return StreamingResponse(_with_hello(hello, hub.subscribe()),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return hub


async def _with_hello(hello: str, messages: AsyncIterator[str]) -> AsyncIterator[str]:
    yield hello
    async for message in messages:
        yield message


def decode_runs(runs: dict[str, Any], num_blocks: int) -> bytes:
    """Inverse of encode_runs (tests and tools)."""
    out = bytearray(num_blocks)
    starts = runs["starts"] + [num_blocks]
    for i, value in enumerate(runs["values"]):
        out[starts[i]:starts[i + 1]] = bytes([value]) * (starts[i + 1] - starts[i])
    return bytes(out)


__all__ = ["DASHBOARD_PATHS", "DashboardHub", "decode_runs", "encode_runs", "install"]
