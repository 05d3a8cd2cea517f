"""Server room: chat messages and tools -> prompt text (template, tool choice, forced prefix)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fantai.sampling_params import SamplingParams
from fantai.server.errors import APIError
from fantai.server.protocol import ChatMessage, NamedToolChoice, ToolCall
from fantai.server.reasoning import reasoning_grammar
from fantai.server.state import ServerContext
from fantai.structured import StructuredOutputsParams


@dataclass(slots=True)
class ToolPlan:
    """How tools shape one chat request: what the template sees and how output is read."""

    tools: list[dict[str, Any]] | None  # OpenAI-shaped tool list for the template, or None
    parse: bool  # run the tool-call parser over the output
    prefix: str = ""  # text appended to the prompt, already part of the output to parse
    # tool_choice required / named: a Lark grammar that makes the output a call (or calls) in
    # the parser's syntax, arguments by the function's schema; the engine enforces it.
    grammar: str | None = None


def content_text(content: str | list[dict[str, Any]] | None, where: str = "content") -> str:
    """Text of a message content: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(f"Unsupported content part type {kind!r} in {where}: this server "
                           "takes text only.", param="messages")
    return "\n".join(texts)


def _tool_call_dict(call: ToolCall) -> dict[str, Any]:
    args: Any = call.function.arguments
    if isinstance(args, str):
        try:  # templates expect a mapping they can iterate or `tojson`
            args = json.loads(args) if args else {}
        except json.JSONDecodeError:
            pass
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = "system" if msg.role == "developer" else msg.role
        item: dict[str, Any] = {"role": role,
                                "content": content_text(msg.content, f"messages[{i}]")}
        if msg.name:
            item["name"] = msg.name
        if msg.tool_calls:
            item["tool_calls"] = [_tool_call_dict(c) for c in msg.tool_calls]
        if msg.tool_call_id:
            item["tool_call_id"] = msg.tool_call_id
        out.append(item)
    return out


def plan_tools(ctx: ServerContext, tools: list[dict[str, Any]] | None,
               choice: str | NamedToolChoice | None, parallel: bool | None = None) -> ToolPlan:
    """Resolve tool_choice (none / auto / required / a named function) against the parser."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs a non-empty 'tools' list.", param="tool_choice")
        return ToolPlan(None, False)
    if choice == "none":
        return ToolPlan(None, False)
    parser = ctx.tool_parser
    if parser is None:
        raise APIError("Tool calling is off: start the server with --tool-call-parser.",
                       param="tools")
    grammars = getattr(ctx.engine, "grammars", None)
    can_mask = grammars is not None and grammars.spells_every_byte()
    if choice in (None, "auto"):
        strict = can_mask and any(t.get("function", {}).get("strict") for t in tools)
        grammar = (parser.auto_grammar(tools, parallel is not False, ctx.tokenizer.token_to_id)
                   if strict else None)
        return ToolPlan(tools, True, "", grammar)
    name = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
    known = {t["function"]["name"] for t in tools}
    if name is not None and name not in known:
        raise APIError(f"tool_choice names function '{name}', which is not in 'tools'.",
                       param="tool_choice")
    if not can_mask:  # no grammar can be trusted here: open the call in the prompt instead
        return ToolPlan(tools, True, parser.forced_prefix(name))
    grammar = parser.call_grammar(tools, name, parallel is not False, ctx.tokenizer.token_to_id)
    return ToolPlan(tools, True, "", grammar)


def apply_tool_grammar(ctx: ServerContext, plan: ToolPlan, params: SamplingParams) -> None:
    """A tool grammar (forced calls, strict functions) replaces any other output constraint;
    under a reasoning parser the constraint starts after the reasoning block."""
    if plan.grammar is not None:
        params.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
    if ctx.reasoning_parser is not None and params.structured_outputs is not None:
        params.structured_outputs = reasoning_grammar(ctx.reasoning_parser,
                                                      params.structured_outputs)


def render_prompt(ctx: ServerContext, messages: list[dict[str, Any]], plan: ToolPlan,
                  add_generation_prompt: bool = True,
                  template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template applied to messages (+ tools), plus any forced tool-call prefix."""
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, tools=plan.tools, add_generation_prompt=add_generation_prompt,
            chat_template=getattr(ctx.engine, "chat_template", None), **(template_kwargs or {}))
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001  (template errors are the client's)
        raise APIError(f"Could not apply the chat template: {exc}", param="messages") from None
    return text + plan.prefix


def encode_chat(ctx: ServerContext, text: str) -> list[int]:
    # The template already wrote BOS and friends into the text.
    return ctx.tokenizer.encode(text, add_special_tokens=False)
