"""Server room: OpenAI routes /v1/completions and /v1/chat/completions (plain and streamed)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fantai.outputs import CompletionOutput, RequestOutput
from fantai.server.chat import (
    ToolPlan,
    apply_tool_grammar,
    encode_chat,
    plan_tools,
    render_prompt,
    template_messages,
)
from fantai.server.errors import APIError
from fantai.server.params import (
    build_sampling_params,
    check_max_tokens,
    check_token_ids,
    constraint_param,
)
from fantai.server.protocol import ChatCompletionRequest, CompletionRequest, PromptT
from fantai.server.serving import (
    EngineCall,
    check_constraint,
    collect,
    generate,
    new_id,
    primed,
    sse,
    sse_response,
    token_text,
    top_entries,
    until_disconnect,
    usage,
)
from fantai.server.reasoning import StreamingReasoning
from fantai.server.state import ServerContext
from fantai.server.tool_parsers import ParsedToolCall, StreamingToolParser, ToolCallDelta

router = APIRouter()


@dataclass(slots=True)
class _Reply:
    """What one response needs besides the outputs: ids, names, echo text and formatting."""

    id: str
    model: str
    created: int
    calls: list[EngineCall]
    n: int
    logprobs: int | None
    include_usage: bool = False
    echo: list[str] = field(default_factory=list)

    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_ids) for c in self.calls)


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# ---------------------------------------------------------------- /v1/completions

def _prompts(ctx: ServerContext, prompt: PromptT) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError("'prompt' is empty.", param="prompt")
    out: list[tuple[str | None, list[int]]] = []
    for item in items:
        if isinstance(item, str):
            out.append((item, ctx.tokenizer.encode(item, add_special_tokens=True)))
        else:
            check_token_ids(list(item), ctx.vocab_size, "prompt")
            out.append((None, list(item)))
        if not out[-1][1]:
            raise APIError("'prompt' encodes to zero tokens.", param="prompt")
    return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    model = ctx.model_name(body.model)
    if body.suffix is not None:
        raise APIError("'suffix' is not supported: this server does no fill-in-the-middle.",
                       param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError("'echo' together with 'logprobs' is not supported (no prompt logprobs).",
                       param="echo")
    rid = new_id("cmpl-")
    calls: list[EngineCall] = []
    for i, (text, ids) in enumerate(_prompts(ctx, body.prompt)):
        max_tokens = check_max_tokens(body.max_tokens, len(ids), ctx.max_model_len)
        params = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                       defaults=ctx.defaults, vocab_size=ctx.vocab_size)
        calls.append(EngineCall(f"{rid}-{i}", ids, params, text))
    await check_constraint(ctx, calls[0].params, constraint_param(body))
    echo = [c.prompt_text if c.prompt_text is not None else ctx.tokenizer.decode(c.prompt_ids)
            for c in calls] if body.echo else []
    reply = _Reply(rid, model, int(time.time()), calls, body.n, body.logprobs,
                   bool(body.stream_options and body.stream_options.include_usage), echo)
    if body.stream:
        return sse_response(await primed(request, _completion_chunks(ctx, reply)))
    finals = await until_disconnect(request, collect(ctx, calls))
    return JSONResponse(_completion_body(ctx, reply, finals))


def _completion_logprobs(ctx: ServerContext, comp: CompletionOutput, start: int, k: int,
                         offset: int) -> dict[str, list[Any]]:
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for pos in range(start, len(comp.logprobs or [])):
        entry = comp.logprobs[pos]  # type: ignore[index]
        tid = comp.token_ids[pos]
        lp = entry.get(tid)
        text = token_text(ctx, tid, lp)
        tokens.append(text)
        values.append(lp.logprob if lp is not None else None)
        tops.append(dict(top_entries(ctx, entry, k)) if k else {text: values[-1] or 0.0})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def _completion_body(ctx: ServerContext, reply: _Reply, finals: list[RequestOutput]
                     ) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    generated = 0
    for i, out in enumerate(finals):
        for comp in out.outputs:
            generated += len(comp.token_ids)
            prefix = reply.echo[i] if reply.echo else ""
            lps = (_completion_logprobs(ctx, comp, 0, reply.logprobs, len(prefix))
                   if reply.logprobs is not None else None)
            choices.append({"index": i * reply.n + comp.index, "text": prefix + comp.text,
                            "logprobs": lps, "finish_reason": comp.finish_reason,
                            "stop_reason": comp.stop_reason})
    choices.sort(key=lambda c: int(c["index"]))
    return {"id": reply.id, "object": "text_completion", "created": reply.created,
            "model": reply.model, "choices": choices,
            "usage": usage(reply.prompt_tokens(), generated)}


async def _completion_chunks(ctx: ServerContext, reply: _Reply) -> AsyncGenerator[str, None]:
    sent_text: dict[int, int] = {}
    sent_tok: dict[int, int] = {}
    done: set[int] = set()
    generated = 0
    head = {"id": reply.id, "object": "text_completion", "created": reply.created,
            "model": reply.model}
    async with aclosing(generate(ctx, reply.calls)) as outs:
        async for i, out in outs:
            for comp in out.outputs:
                idx = i * reply.n + comp.index
                if idx in done:
                    continue
                start, tok_start = sent_text.get(idx, 0), sent_tok.get(idx, 0)
                delta = comp.text[start:]
                if start == 0 and tok_start == 0 and reply.echo:
                    delta = reply.echo[i] + delta
                new_tokens = len(comp.token_ids) > tok_start
                if not delta and not comp.finish_reason and not (reply.logprobs is not None
                                                                 and new_tokens):
                    continue
                lps = (_completion_logprobs(ctx, comp, tok_start, reply.logprobs, start)
                       if reply.logprobs is not None else None)
                sent_text[idx], sent_tok[idx] = len(comp.text), len(comp.token_ids)
                if comp.finish_reason:
                    done.add(idx)
                    generated += len(comp.token_ids)
                choice = {"index": idx, "text": delta, "logprobs": lps,
                          "finish_reason": comp.finish_reason}
                yield sse({**head, "choices": [choice]})
    if reply.include_usage:
        yield sse({**head, "choices": [], "usage": usage(reply.prompt_tokens(), generated)})
    yield sse("[DONE]")


# ---------------------------------------------------------------- /v1/chat/completions

def _check_chat_fields(body: ChatCompletionRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    model = ctx.model_name(body.model)
    _check_chat_fields(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    plan = plan_tools(ctx, tools, body.tool_choice, body.parallel_tool_calls)
    text = render_prompt(ctx, template_messages(body.messages), plan,
                         body.add_generation_prompt, body.chat_template_kwargs)
    ids = encode_chat(ctx, text)
    asked = body.max_completion_tokens
    if asked is None:
        asked = body.max_tokens
    max_tokens = check_max_tokens(asked, len(ids), ctx.max_model_len, ctx.defaults.max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=logprobs,
                                   defaults=ctx.defaults, vocab_size=ctx.vocab_size)
    if plan.parse and ctx.tool_parser is not None and ctx.tool_parser.name == "mistral":
        params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
    apply_tool_grammar(ctx, plan, params)
    await check_constraint(ctx, params, "tools" if plan.grammar else constraint_param(body))
    rid = new_id("chatcmpl-")
    reply = _Reply(rid, model, int(time.time()), [EngineCall(rid, ids, params, text)], body.n,
                   logprobs, bool(body.stream_options and body.stream_options.include_usage))
    if body.stream:
        return sse_response(await primed(request, _chat_chunks(ctx, reply, plan)))
    finals = await until_disconnect(request, collect(ctx, reply.calls))
    return JSONResponse(_chat_body(ctx, reply, plan, finals[0]))


def tool_call_json(call: ParsedToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(piece: ToolCallDelta) -> dict[str, Any]:
    """A streamed tool-call piece: id, type and name only on the call's first piece."""
    out: dict[str, Any] = {"index": piece.index}
    function: dict[str, str] = {"arguments": piece.arguments}
    if piece.id is not None:
        out.update(id=piece.id, type="function")
        function["name"] = piece.name or ""
    out["function"] = function
    return out


def _chat_logprobs(ctx: ServerContext, comp: CompletionOutput, start: int, k: int
                   ) -> dict[str, list[dict[str, Any]]]:
    content = []
    for pos in range(start, len(comp.logprobs or [])):
        entry = comp.logprobs[pos]  # type: ignore[index]
        tid = comp.token_ids[pos]
        lp = entry.get(tid)
        text = token_text(ctx, tid, lp)
        tops = [{"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, v in top_entries(ctx, entry, k)]
        content.append({"token": text, "logprob": lp.logprob if lp else -9999.0,
                        "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}


def _chat_body(ctx: ServerContext, reply: _Reply, plan: ToolPlan, out: RequestOutput
               ) -> dict[str, Any]:
    choices = []
    for comp in out.outputs:
        reasoning, text = split_reasoning(ctx, comp.text)
        content, calls = text, list[ParsedToolCall]()
        if plan.parse and ctx.tool_parser is not None:
            content, calls = ctx.tool_parser.extract(plan.prefix + text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if calls and not content.strip() else content}
        if reasoning is not None:  # vLLM's two names for it
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
        lps = (_chat_logprobs(ctx, comp, 0, reply.logprobs) if reply.logprobs is not None
               else None)
        choices.append({"index": comp.index, "message": message, "logprobs": lps,
                        "finish_reason": "tool_calls" if calls else comp.finish_reason,
                        "stop_reason": comp.stop_reason})
    generated = sum(len(c.token_ids) for c in out.outputs)
    return {"id": reply.id, "object": "chat.completion", "created": reply.created,
            "model": reply.model, "choices": choices,
            "usage": usage(reply.prompt_tokens(), generated)}


def split_reasoning(ctx: ServerContext, text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a finished output under the server's reasoning parser."""
    if ctx.reasoning_parser is None:
        return None, text
    reasoning, content, _ = ctx.reasoning_parser.split(text, final=True)
    return reasoning, content


@dataclass(slots=True)
class _ChoiceState:
    text: int = 0
    tokens: int = 0
    done: bool = False
    tools: StreamingToolParser | None = None
    reasoning: StreamingReasoning | None = None


def _chat_deltas(ctx: ServerContext, reply: _Reply, comp: CompletionOutput, st: _ChoiceState
                 ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Deltas for one choice's new output (content and/or tool calls), and its logprobs."""
    deltas: list[dict[str, Any]] = []
    text = comp.text
    if st.reasoning is not None:
        rd = st.reasoning.feed(comp.text, final=bool(comp.finish_reason))
        if rd.reasoning:
            deltas.append({"reasoning_content": rd.reasoning, "reasoning": rd.reasoning})
        text = rd.content
    if st.tools is not None:
        step = st.tools.finish(text) if comp.finish_reason else st.tools.feed(text)
        if step.content:
            deltas.append({"content": step.content})
        deltas += [{"tool_calls": [tool_call_delta_json(piece)]} for piece in step.calls
                   if piece.id is not None or piece.arguments]
    elif len(text) > st.text:
        deltas.append({"content": text[st.text:]})
    lps = None
    if reply.logprobs is not None and len(comp.token_ids) > st.tokens:
        lps = _chat_logprobs(ctx, comp, st.tokens, reply.logprobs)
    st.text, st.tokens = len(text), len(comp.token_ids)
    return deltas, lps


async def _chat_chunks(ctx: ServerContext, reply: _Reply, plan: ToolPlan
                       ) -> AsyncGenerator[str, None]:
    head = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
            "model": reply.model}

    def chunk(idx: int, delta: dict[str, Any], lps: Any = None, finish: str | None = None) -> str:
        choice = {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    parser = ctx.tool_parser if plan.parse else None
    thinking = ctx.reasoning_parser
    states = [_ChoiceState(tools=StreamingToolParser(parser, plan.prefix) if parser else None,
                           reasoning=StreamingReasoning(thinking) if thinking else None)
              for _ in range(reply.n)]
    for idx in range(reply.n):
        yield chunk(idx, {"role": "assistant", "content": ""})
    generated = 0
    async with aclosing(generate(ctx, reply.calls)) as outs:
        async for _, out in outs:
            for comp in out.outputs:
                st = states[comp.index]
                if st.done:
                    continue
                deltas, lps = _chat_deltas(ctx, reply, comp, st)
                for j, delta in enumerate(deltas):
                    yield chunk(comp.index, delta, lps if j == 0 else None)
                if not deltas and lps is not None:
                    yield chunk(comp.index, {}, lps)
                if comp.finish_reason:
                    st.done = True
                    generated += len(comp.token_ids)
                    called = st.tools is not None and st.tools.called
                    reason = "tool_calls" if called else comp.finish_reason
                    yield chunk(comp.index, {}, None, reason)
    if reply.include_usage:
        yield sse({**head, "choices": [], "usage": usage(reply.prompt_tokens(), generated)})
    yield sse("[DONE]")
