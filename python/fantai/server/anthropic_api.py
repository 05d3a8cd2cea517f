"""Server room: the Anthropic Messages route /v1/messages (plain and streamed event sequence)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fantai.outputs import CompletionOutput
from fantai.sampling_params import SamplingParams
from fantai.server.chat import (
    ToolPlan,
    apply_tool_grammar,
    content_text,
    encode_chat,
    plan_tools,
    render_prompt,
)
from fantai.server.errors import APIError
from fantai.server.params import _pick, check_max_tokens, stop_list
from fantai.server.protocol import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
    NamedFunction,
    NamedToolChoice,
)
from fantai.server.serving import (
    EngineCall,
    StreamEnd,
    check_constraint,
    collect,
    new_id,
    primed,
    sse,
    sse_response,
    stream_deltas,
    until_disconnect,
)
from fantai.server.state import ServerContext
from fantai.server.tool_parsers import ParsedToolCall, ToolCallDelta

router = APIRouter()


def _blocks_to_chat(msg: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> chat-template messages (tool results become role 'tool')."""
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in msg.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and msg.role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": block.get("input") or {}}})
        elif kind == "tool_result" and msg.role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": content_text(block.get("content"), where)})
        else:
            raise APIError(f"{where}: content block type {kind!r} is not supported for role "
                           f"'{msg.role}'.")
    out = list(results)
    if texts or calls:
        item: dict[str, Any] = {"role": msg.role, "content": "\n".join(texts)}
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    return out


def _chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.system:
        msgs.append({"role": "system", "content": content_text(body.system, "system")})
    for i, msg in enumerate(body.messages):
        msgs += _blocks_to_chat(msg, f"messages.{i}")
    return msgs


def _tool_plan(ctx: ServerContext, body: MessagesRequest) -> ToolPlan:
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}}
             for t in body.tools or []]
    choice: Any = None
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            if not body.tool_choice.name:
                raise APIError("tool_choice.name is required when tool_choice.type is 'tool'.")
            choice = NamedToolChoice(function=NamedFunction(name=body.tool_choice.name))
    parallel = None
    if body.tool_choice is not None and getattr(body.tool_choice, "disable_parallel_tool_use", None):
        parallel = False
    return plan_tools(ctx, tools or None, choice, parallel)


def _params(ctx: ServerContext, body: MessagesRequest, max_tokens: int) -> SamplingParams:
    d = ctx.defaults
    try:
        return SamplingParams(
            temperature=_pick(body.temperature, d.temperature, 1.0),
            top_p=_pick(body.top_p, d.top_p, 1.0), top_k=max(int(_pick(body.top_k, d.top_k, 0)), 0),
            min_p=_pick(None, d.min_p, 0.0),
            repetition_penalty=_pick(None, d.repetition_penalty, 1.0),
            max_tokens=max_tokens, stop=stop_list(body.stop_sequences))
    except ValueError as exc:
        raise APIError(str(exc)) from None


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    model = ctx.model_name(body.model)
    plan = _tool_plan(ctx, body)
    text = render_prompt(ctx, _chat_messages(body), plan)
    ids = encode_chat(ctx, text)
    params = _params(ctx, body, check_max_tokens(body.max_tokens, len(ids), ctx.max_model_len))
    if plan.parse and ctx.tool_parser is not None and ctx.tool_parser.name == "mistral":
        params.skip_special_tokens = False
    apply_tool_grammar(ctx, plan, params)
    await check_constraint(ctx, params, "tools")
    call = EngineCall(new_id("msg_"), ids, params, text)
    if body.stream:
        return sse_response(await primed(request, _events(ctx, call, model, plan)))
    final = (await until_disconnect(request, collect(ctx, [call])))[0]
    return JSONResponse(_message_body(ctx, call, model, plan, final.outputs[0]))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """Anthropic's token counter: the prompt tokens a /v1/messages body would use."""
    ctx: ServerContext = request.app.state.ctx
    ctx.model_name(body.model)
    text = render_prompt(ctx, _chat_messages(body), _tool_plan(ctx, body))
    return JSONResponse({"input_tokens": len(encode_chat(ctx, text))})


def _stop_info(comp: CompletionOutput, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if comp.finish_reason == "length":
        return "max_tokens", None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return "end_turn", None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_block(call: ParsedToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
            "input": call.input_dict()}


def _message_body(ctx: ServerContext, call: EngineCall, model: str, plan: ToolPlan,
                  comp: CompletionOutput) -> dict[str, Any]:
    reasoning, text = None, comp.text
    if ctx.reasoning_parser is not None:
        reasoning, text, _ = ctx.reasoning_parser.split(comp.text, final=True)
    content, calls = text, list[ParsedToolCall]()
    if plan.parse and ctx.tool_parser is not None:
        content, calls = ctx.tool_parser.extract(plan.prefix + text)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content.strip() or not calls:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_block(c) for c in calls]
    reason, sequence = _stop_info(comp, bool(calls))
    return {"id": call.request_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(call.prompt_ids), "output_tokens": len(comp.token_ids)}}


class _EventWriter:
    """Anthropic's block bookkeeping: a thinking block first, then a text block that opens lazily
    and closes before tool blocks."""

    __slots__ = ("index", "text_open", "thinking_open")

    def __init__(self) -> None:
        self.index = 0
        self.text_open = False
        self.thinking_open = False

    def thinking(self, piece: str) -> list[str]:
        out = []
        if not self.thinking_open:
            out.append(sse({"type": "content_block_start", "index": self.index, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}}, "content_block_start"))
            self.thinking_open = True
        out.append(sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": piece}},
                       "content_block_delta"))
        return out

    def close_thinking(self) -> list[str]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        self.index += 1
        return [sse({"type": "content_block_delta", "index": self.index - 1,
                     "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta"),
                sse({"type": "content_block_stop", "index": self.index - 1}, "content_block_stop")]

    def text(self, piece: str) -> list[str]:
        out = self.close_thinking()
        if not self.text_open:
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "text", "text": ""}}, "content_block_start"))
            self.text_open = True
        if piece:
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "text_delta", "text": piece}}, "content_block_delta"))
        return out

    def close_text(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [sse({"type": "content_block_stop", "index": self.index - 1}, "content_block_stop")]

    def tool(self, piece: ToolCallDelta) -> list[str]:
        """A tool_use block opens with the call's first piece and closes with its last."""
        out: list[str] = []
        i = self.index
        if piece.id is not None:
            out += self.close_thinking()
            out += self.close_text()
            i = self.index
            block = {"type": "tool_use", "id": _tool_use_id(piece.id), "name": piece.name or "",
                     "input": {}}
            out.append(sse({"type": "content_block_start", "index": i, "content_block": block},
                           "content_block_start"))
        if piece.arguments:
            out.append(sse({"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": piece.arguments}},
                "content_block_delta"))
        if piece.done:
            out.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
            self.index += 1
        return out


async def _events(ctx: ServerContext, call: EngineCall, model: str, plan: ToolPlan
                  ) -> AsyncGenerator[str, None]:
    start: dict[str, Any] = {
        "id": call.request_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(call.prompt_ids), "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "ping"}, "ping")
    writer = _EventWriter()
    end = StreamEnd()
    async with aclosing(stream_deltas(ctx, call, plan, end)) as deltas:
        async for kind, value in deltas:
            frames = (writer.thinking(value) if kind == "reasoning" else
                      writer.text(value) if kind == "text" else writer.tool(value))
            for chunk in frames:
                yield chunk
    comp, called = end.comp, end.called
    assert comp is not None
    if (writer.index == 0 or writer.thinking_open) and not writer.text_open:
        for chunk in writer.text(""):
            yield chunk
    for chunk in writer.close_text():
        yield chunk
    reason, sequence = _stop_info(comp, called)
    yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": len(comp.token_ids)}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
