"""Server room: engine calls for HTTP requests (merged prompts, abort on disconnect, SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from fantai.exceptions import EngineDeadError, RequestTimeoutError
from fantai.outputs import CompletionOutput, Logprob, RequestOutput
from fantai.sampling_params import SamplingParams
from fantai.server.chat import ToolPlan
from fantai.server.errors import APIError, stream_error
from fantai.server.reasoning import StreamingReasoning
from fantai.server.state import ServerContext
from fantai.server.tool_parsers import StreamingToolParser, ToolCallDelta

T = TypeVar("T")


@dataclass(slots=True)
class EngineCall:
    """One engine request: a tokenized prompt and its sampling parameters."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None


async def check_constraint(ctx: ServerContext, params: SamplingParams, param: str) -> None:
    """Compile the request's grammar now (off the event loop), so a bad one is a 400 before any
    stream starts; a cached grammar costs nothing here."""
    prepare = getattr(ctx.engine, "prepare_structured", None)
    if prepare is None or params.structured_outputs is None:
        return
    try:
        await prepare(params)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class ClientGone(Exception):
    """The HTTP client went away before its answer was ready."""


async def _guarded(ctx: ServerContext, call: EngineCall) -> AsyncGenerator[RequestOutput, None]:
    """engine.generate, with metrics on finish and an explicit abort if left early."""
    final_seen = False
    last: RequestOutput | None = None
    ctx.log_request(call.request_id, len(call.prompt_ids), call.params)
    ctx.active.add(call.request_id)
    try:
        async for out in ctx.engine.generate(call.prompt_ids, call.params, call.request_id):
            last = out
            if out.finished:
                final_seen = True
                ctx.metrics.record(out)
            yield out
        # The engine yields one live object and may stop right after a read that still looked
        # unfinished (it finished while we framed it): hand the finished state on once more.
        if last is not None and last.finished and not final_seen:
            final_seen = True
            ctx.metrics.record(last)
            yield last
    except ValueError as exc:
        final_seen = True  # refused before it started: nothing to abort
        raise APIError(str(exc)) from None
    except RequestTimeoutError as exc:  # already aborted in the engine (its KV blocks freed)
        final_seen = True
        ctx.metrics.finished["timeout"] = ctx.metrics.finished.get("timeout", 0) + call.params.n
        raise APIError(f"Request timed out: {exc}.", status=504, code="request_timeout") from None
    except EngineDeadError as exc:  # every request fails; the server exits to be restarted
        final_seen = True
        if not exc.in_flight:
            raise APIError(f"The engine has failed ({exc}) and this server is restarting; retry "
                           "shortly.", status=503, code="engine_failed") from None
        ctx.metrics.finished["engine_failed"] = ctx.metrics.finished.get("engine_failed", 0) + call.params.n
        raise APIError(f"The engine failed while serving this request ({exc}); this server is "
                       "restarting.", status=500, code="engine_failed") from None
    except RuntimeError as exc:  # e.g. the engine is shutting down
        final_seen = True
        raise APIError(f"The engine cannot take this request: {exc}", status=503) from None
    finally:
        ctx.active.discard(call.request_id)
        if not final_seen:
            _abort(ctx, call)


def _abort(ctx: ServerContext, call: EngineCall) -> None:
    with contextlib.suppress(KeyError, ValueError, RuntimeError):  # already gone: nothing to free
        ctx.engine.abort(call.request_id)
    ctx.metrics.finished["abort"] = ctx.metrics.finished.get("abort", 0) + call.params.n


async def _merged(ctx: ServerContext, calls: list[EngineCall]
                  ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, call: EngineCall) -> None:
        try:
            async with aclosing(_guarded(ctx, call)) as outs:
                async for out in outs:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001  (re-raised by the consumer)
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(calls)]
    try:
        remaining = len(calls)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate(ctx: ServerContext, calls: list[EngineCall]
                   ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(call index, cumulative RequestOutput) as each engine step lands, for all calls at once."""
    if len(calls) == 1:
        async with aclosing(_guarded(ctx, calls[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    async with aclosing(_merged(ctx, calls)) as merged:
        async for item in merged:
            yield item


@dataclass(slots=True)
class StreamEnd:
    """What a stream_deltas run leaves behind: the final output and whether a tool was called."""

    comp: CompletionOutput | None = None
    called: bool = False


async def stream_deltas(ctx: ServerContext, call: EngineCall, plan: ToolPlan, end: StreamEnd
                        ) -> AsyncGenerator[tuple[str, Any], None]:
    """One chat stream as deltas, for the APIs that frame them their own way (/v1/messages,
    /v1/responses): ("reasoning", text) with a reasoning parser, ("text", piece) of the answer,
    ("tool", ToolCallDelta) with a tool parser. `end` holds the final output once it returns."""
    parser = ctx.tool_parser if plan.parse else None
    tools = StreamingToolParser(parser, plan.prefix) if parser else None
    thinking = StreamingReasoning(ctx.reasoning_parser) if ctx.reasoning_parser else None
    sent = 0
    async with aclosing(generate(ctx, [call])) as outs:
        async for _, out in outs:
            comp = end.comp = out.outputs[0]
            text = comp.text
            if thinking is not None:
                rd = thinking.feed(comp.text, final=bool(comp.finish_reason))
                if rd.reasoning:
                    yield "reasoning", rd.reasoning
                text = rd.content
            if tools is None:
                piece, calls = text[sent:], list[ToolCallDelta]()
                sent = len(text)
            else:
                step = tools.finish(text) if comp.finish_reason else tools.feed(text)
                piece, calls = step.content, step.calls
            if piece:
                yield "text", piece
            for c in calls:
                yield "tool", c
    end.called = tools is not None and tools.called


async def collect(ctx: ServerContext, calls: list[EngineCall]) -> list[RequestOutput]:
    """The final output of every call."""
    finals: list[RequestOutput | None] = [None] * len(calls)
    async with aclosing(generate(ctx, calls)) as outs:
        async for i, out in outs:
            finals[i] = out
    return [f for f in finals if f is not None]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (aborting its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def primed(request: Request, stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pull the first item now, so errors become a JSON 4xx before any SSE header is sent; an
    error after that (a request timeout, an engine failure) ends the stream with the API's error
    event (errors.stream_error)."""
    try:
        first = await until_disconnect(request, stream.__anext__())
    except StopAsyncIteration:
        return _empty()
    return _chain(first, stream, request.url.path)


async def _empty() -> AsyncIterator[Any]:
    return
    yield


async def _chain(first: str, rest: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    try:
        yield first
        try:
            async for item in rest:
                yield item
        except APIError as exc:
            yield stream_error(path, exc)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"event: {event}\ndata: {body}\n\n" if event else f"data: {body}\n\n"


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def token_text(ctx: ServerContext, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return ctx.tokenizer.decode([token_id], skip_special_tokens=False)


def top_entries(ctx: ServerContext, entry: dict[int, Logprob], k: int
                ) -> list[tuple[str, float]]:
    """The k most likely (token text, logprob) pairs of one position."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    return [(token_text(ctx, tid, lp), lp.logprob) for tid, lp in ranked]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
