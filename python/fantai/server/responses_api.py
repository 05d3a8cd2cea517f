"""Server room: OpenAI's Responses API — POST /v1/responses (plain and streamed events), GET and
DELETE /v1/responses/{id}, and the bounded in-memory store behind previous_response_id.

Over 400 lines: the request mapping, the output items and the streamed event writer describe one
object model and read best together.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fantai.outputs import CompletionOutput
from fantai.sampling_params import SamplingParams
from fantai.server.chat import ToolPlan, apply_tool_grammar, encode_chat, plan_tools, render_prompt
from fantai.server.errors import APIError
from fantai.server.params import _pick, check_max_tokens, format_constraint
from fantai.server.protocol import (
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    _Loose,
    _Strict,
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


class ResponsesTool(_Loose):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Loose):
    type: str
    name: str | None = None


class ResponsesText(_Loose):
    format: ResponseFormat | None = None
    verbosity: str | None = None


class ResponsesFormat(_Loose):
    """text.format: the json_schema variant carries name / schema / strict at its top level."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None
    # Accepted for compatibility; they change nothing here.
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]
    history: list[dict[str, Any]]  # chat messages up to and including this response's output


class ResponseStore:
    """Responses by id, least recently used dropped first past `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._items[rid] = item
            self._items.move_to_end(rid)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def _store(ctx: ServerContext) -> ResponseStore:
    if ctx.responses is None:
        ctx.responses = ResponseStore(ctx.config.responses_store_size)
    return ctx.responses


def _not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(f"Response with id '{rid}' not found.", status=404, param=param,
                    code="response_not_found")


# ---------------------------------------------------------------- request -> chat messages

def _part_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(f"Unsupported content part type {kind!r} in {where}: this server "
                           "takes text only.", param="input")
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat-template messages (tool calls and their outputs too)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}: unsupported role {role!r}.", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _part_text(item.get("content"), where)})
        elif kind == "function_call":
            args = item.get("arguments") or "{}"
            try:
                parsed: Any = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                parsed = args
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": parsed}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else _part_text(output, where)})
        elif kind == "reasoning":
            continue  # a model's own reasoning is not fed back to it
        else:
            raise APIError(f"{where}: input item type {kind!r} is not supported.", param="input")
    if not out:
        raise APIError("'input' is empty.", param="input")
    return out


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.type != "function" or not t.name:
            raise APIError(f"tools[{i}]: only function tools (with a name) are supported.",
                           param="tools")
        tools.append({"type": "function", "function": {
            "name": t.name, "description": t.description or "", "strict": bool(t.strict),
            "parameters": t.parameters or {"type": "object", "properties": {}}}})
    return tools or None


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type == "function" and choice.name:
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    if choice.type in ("auto", "none", "required"):
        return choice.type
    raise APIError(f"tool_choice type {choice.type!r} is not supported.", param="tool_choice")


def _text_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    try:
        parsed = ResponsesFormat.model_validate(fmt)
    except ValueError as exc:
        raise APIError(f"Invalid text.format: {exc}", param="text.format") from None
    raw: dict[str, Any] = {"type": parsed.type}
    if parsed.type == "json_schema":
        raw["json_schema"] = {"name": parsed.name, "schema": parsed.schema_,
                              "strict": parsed.strict}
    return ResponseFormat.model_validate(raw)


# ---------------------------------------------------------------- output items

@dataclass(slots=True)
class _Reply:
    id: str
    model: str
    created: int
    body: ResponsesRequest
    tools: list[dict[str, Any]] | None
    history: list[dict[str, Any]]
    call: EngineCall | None = None
    output: list[dict[str, Any]] = field(default_factory=list)


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str = "completed", item_id: str | None = None
                  ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg_"), "status": status,
            "role": "assistant", "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc_"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _output_items(ctx: ServerContext, plan: ToolPlan, comp: CompletionOutput
                  ) -> list[dict[str, Any]]:
    reasoning, text = None, comp.text
    if ctx.reasoning_parser is not None:
        reasoning, text, _ = ctx.reasoning_parser.split(comp.text, final=True)
    content, calls = text, list[ParsedToolCall]()
    if plan.parse and ctx.tool_parser is not None:
        content, calls = ctx.tool_parser.extract(plan.prefix + text)
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(_reasoning_item(reasoning))
    if content.strip() or not calls:
        items.append(_message_item(content))
    items += [_call_item(c.id, c.name, c.arguments) for c in calls]
    return items


def _history_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This response's output as the chat messages a follow-up request continues from."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": _loads(it["arguments"])}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _usage(prompt: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _response_body(reply: _Reply, status: str, comp: CompletionOutput | None = None
                   ) -> dict[str, Any]:
    body = reply.body
    choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump(exclude_none=True)
    text_cfg = body.text or {"format": {"type": "text"}}
    out: dict[str, Any] = {
        "id": reply.id, "object": "response", "created_at": reply.created, "status": status,
        "model": reply.model, "output": reply.output if status != "in_progress" else [],
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": text_cfg, "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "store": body.store, "error": None, "incomplete_details": None, "usage": None,
        "reasoning": body.reasoning, "truncation": body.truncation or "disabled",
    }
    if comp is not None:
        assert reply.call is not None
        out["usage"] = _usage(len(reply.call.prompt_ids), len(comp.token_ids))
        if comp.finish_reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["completed_at"] = int(time.time())
    return out


# ---------------------------------------------------------------- routes

def _prepare(ctx: ServerContext, body: ResponsesRequest) -> tuple[_Reply, ToolPlan]:
    model = ctx.model_name(body.model)
    if body.background:
        raise APIError("background responses are not supported.", param="background")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = _store(ctx).get(body.previous_response_id)
        if prev is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = [dict(m) for m in prev.history]
    history += input_messages(body.input)
    tools = _tools(body)
    reply = _Reply(new_id("resp_"), model, int(time.time()), body, tools, history)
    return reply, plan_tools(ctx, tools, _tool_choice(body), body.parallel_tool_calls)


def _params(ctx: ServerContext, body: ResponsesRequest, max_tokens: int) -> SamplingParams:
    d = ctx.defaults
    try:
        return SamplingParams(
            temperature=_pick(body.temperature, d.temperature, 1.0),
            top_p=_pick(body.top_p, d.top_p, 1.0), top_k=max(int(_pick(None, d.top_k, 0)), 0),
            min_p=_pick(None, d.min_p, 0.0),
            repetition_penalty=_pick(None, d.repetition_penalty, 1.0), seed=body.seed,
            max_tokens=max_tokens,
            structured_outputs=format_constraint(_text_format(body), "text.format"))
    except ValueError as exc:
        raise APIError(str(exc)) from None


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    reply, plan = _prepare(ctx, body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    text = render_prompt(ctx, system + reply.history, plan)
    ids = encode_chat(ctx, text)
    max_tokens = check_max_tokens(body.max_output_tokens, len(ids), ctx.max_model_len,
                                  ctx.defaults.max_tokens)
    params = _params(ctx, body, max_tokens)
    if plan.parse and ctx.tool_parser is not None and ctx.tool_parser.name == "mistral":
        params.skip_special_tokens = False
    apply_tool_grammar(ctx, plan, params)
    await check_constraint(ctx, params, "tools" if plan.grammar else "text.format")
    reply.call = EngineCall(reply.id, ids, params, text)
    if body.stream:
        return sse_response(await primed(request, _events(ctx, reply, plan)))
    final = (await until_disconnect(request, collect(ctx, [reply.call])))[0]
    comp = final.outputs[0]
    reply.output = _output_items(ctx, plan, comp)
    out = _response_body(reply, "completed", comp)
    _remember(ctx, reply, out)
    return JSONResponse(out)


def _remember(ctx: ServerContext, reply: _Reply, out: dict[str, Any]) -> None:
    if reply.body.store:
        _store(ctx).put(reply.id, StoredResponse(out, reply.history + _history_of(reply.output)))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    item = _store(ctx).get(response_id)
    if item is None:
        raise _not_found(response_id)
    return JSONResponse(item.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    if not _store(ctx).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# ---------------------------------------------------------------- streamed events

class _EventWriter:
    """The documented event sequence: each output item is added, filled by deltas, and done."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.items.append(item)
        self.open = item
        added = {**item}
        if item["type"] == "message":
            added["content"] = []
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=added)]

    def reasoning(self, piece: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            out += self._add(_reasoning_item("", "in_progress"))
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=piece))
        return out

    def text(self, piece: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            out += self._add(_message_item("", "in_progress"))
            assert self.open is not None
            out.append(self.event("response.content_part.added", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  part=_text_part("")))
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        if piece:
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.items) - 1, content_index=0,
                                  delta=piece, logprobs=[]))
        return out

    def tool(self, piece: ToolCallDelta) -> list[str]:
        out: list[str] = []
        if piece.id is not None:
            out += self.close()
            out += self._add(_call_item(piece.id, piece.name or "", "", "in_progress"))
        item = self.open
        if item is None or item["type"] != "function_call":
            return out
        if piece.arguments:
            item["arguments"] += piece.arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(self.items) - 1, delta=piece.arguments))
        if piece.done:
            out += self.close()
        return out

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.items) - 1
        out: list[str] = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _events(ctx: ServerContext, reply: _Reply, plan: ToolPlan
                  ) -> AsyncGenerator[str, None]:
    assert reply.call is not None
    w = _EventWriter()
    start = _response_body(reply, "in_progress")
    yield w.event("response.created", response=start)
    yield w.event("response.in_progress", response=start)
    end = StreamEnd()
    async with aclosing(stream_deltas(ctx, reply.call, plan, end)) as deltas:
        async for kind, value in deltas:
            frames = (w.reasoning(value) if kind == "reasoning" else
                      w.text(value) if kind == "text" else w.tool(value))
            for chunk in frames:
                yield chunk
    comp = end.comp
    assert comp is not None
    if not any(it["type"] in ("message", "function_call") for it in w.items):
        for chunk in w.text(""):
            yield chunk
    for chunk in w.close():
        yield chunk
    reply.output = w.items
    final = _response_body(reply, "completed", comp)
    _remember(ctx, reply, final)
    # Cut by max_output_tokens: OpenAI ends such a stream with response.incomplete.
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield w.event(kind, response=final)
