"""Server room: tool-call parsers (hermes, llama3_json, mistral), on whole and streamed text.

Over 400 lines: each parser reads, streams and (for forced calls) writes the grammar of one
syntax, and they share the helpers above them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fantai.structured import json_lark, lark_string

_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)
    raw_arguments: str | None = None  # the model's own arguments text, when laid out name-first

    def input_dict(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


def _call_from_obj(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _decode_spans(text: str, seps: str = " \t\r\n;,") -> tuple[list[tuple[Any, str]], str]:
    """Consecutive JSON values in `text` (separated by `seps`) with their source text, and the
    undecodable rest."""
    values: list[tuple[Any, str]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in seps:
            pos += 1
        if pos >= len(text):
            return values, ""
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append((value, text[pos:end]))
        pos = end


def _decode_objects(text: str, seps: str = " \t\r\n;,") -> tuple[list[Any], str]:
    spans, rest = _decode_spans(text, seps)
    return [v for v, _ in spans], rest


# A call object that names its function first: what streaming needs to send arguments early.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                   r'\s*"(?:arguments|parameters)"\s*:\s*')


def _split_head(text: str) -> tuple[str, str] | None:
    """(function name, the text after `"arguments":`) of a name-first call object."""
    m = _HEAD.match(text)
    if m is None or not text[m.end():].startswith("{"):  # arguments as an object only
        return None
    try:
        return json.loads(m.group(1)), text[m.end():]
    except json.JSONDecodeError:
        return None


def _with_raw(call: ParsedToolCall | None, source: str) -> ParsedToolCall | None:
    """`call` plus the exact arguments text from its complete object `source`."""
    head = _split_head(source)
    if call is None or head is None:
        return call
    try:
        _, end = _DECODER.raw_decode(head[1])
    except json.JSONDecodeError:
        return call
    call.raw_arguments = head[1][:end]
    return call


def _settled(args_text: str, closer: str = "") -> str:
    """The part of a growing arguments text that cannot be the call's own closing tail."""
    for size in range(min(len(args_text), len(closer)), 0, -1):
        if closer.startswith(args_text[-size:]):
            args_text = args_text[:-size]
            break
    return args_text.rstrip(" \t\r\n}")


def _call_object_rules(tools: list[dict[str, Any]], name: str | None, args_key: str,
                       strict_only: bool = False) -> list[str]:
    """Lark rules `obj` (one call object, name first, as the parsers read it) and one `argsN`
    per function, its arguments as the function's JSON schema (strict_only: only functions that
    ask for `strict`; the others' arguments are any JSON object)."""
    alts: list[str] = []
    rules: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        if name is not None and fn.get("name") != name:
            continue
        schema = fn.get("parameters") or {"type": "object"}
        if strict_only and not fn.get("strict"):
            schema = {"type": "object"}
        head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + f', "{args_key}": '
        rules.append(f"fn{i}: {lark_string(head)} args{i} \"}}\"")
        rules.append(f"args{i}: {json_lark(schema)}")
        alts.append(f"fn{i}")
    if not alts:
        raise ValueError(f"no tool named {name!r}")
    return [f"obj: {' | '.join(alts)}", *rules, "WS: /[ \\t\\r\\n]+/"]


class ToolParser:
    """Base: `marker_index` finds where tool-call text starts; `calls` parses from there."""

    name = "base"
    markers: tuple[str, ...] = ()

    def marker_index(self, text: str) -> int:
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits) if hits else -1

    def hold_back(self, text: str) -> int:
        """How many trailing characters might still grow into a marker (not yet content)."""
        for size in range(min(len(text), max(map(len, self.markers))), 0, -1):
            tail = text[-size:]
            if any(m.startswith(tail) for m in self.markers):
                return size
        return 0

    def calls(self, tool_text: str, final: bool) -> list[ParsedToolCall] | None:
        """Complete calls in `tool_text`; at `final`, None means 'not a tool call after all'."""
        raise NotImplementedError

    def partial(self, tool_text: str) -> tuple[str, str] | None:
        """The call being written after the complete ones: (name, settled arguments text)."""
        return None

    def forced_prefix(self, function_name: str | None) -> str:
        """Prompt text that opens a call (tool_choice required / named) where no grammar can
        force one (a vocabulary that cannot spell every byte: see MaskProvider)."""
        raise NotImplementedError

    def call_grammar(self, tools: list[dict[str, Any]], name: str | None, parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str:
        """A Lark grammar whose every sentence is one call (or several, `parallel`) in this
        parser's syntax, of `name` or of any tool, its arguments following the tool's schema."""
        raise NotImplementedError

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str | None:
        """tool_choice auto with `strict` functions: free text, or text then calls whose
        arguments follow the strict schemas. None: this syntax cannot say so (not enforced)."""
        return None

    def extract(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        start = self.marker_index(text)
        if start < 0:
            return text, []
        found = self.calls(text[start:], final=True)
        if not found:
            return text, []
        return text[:start], found


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def calls(self, tool_text: str, final: bool) -> list[ParsedToolCall] | None:
        found: list[ParsedToolCall] = []
        for m in self._block.finditer(tool_text):
            closed = bool(m.group(2))
            if not closed and not final:
                break
            spans, _ = _decode_spans(m.group(1).strip())
            for value, source in spans:
                call = _with_raw(_call_from_obj(value), source)
                if call is not None:
                    found.append(call)
        return found

    def partial(self, tool_text: str) -> tuple[str, str] | None:
        last = None
        for last in self._block.finditer(tool_text):
            pass
        if last is None or last.group(2):
            return None
        head = _split_head(last.group(1))
        return None if head is None else (head[0], _settled(head[1], "</tool_call>"))

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            return "<tool_call>"
        return '<tool_call>{"name": ' + json.dumps(function_name) + ', "arguments": '

    def call_grammar(self, tools: list[dict[str, Any]], name: str | None, parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str:
        start = "start: call (WS? call)*" if parallel else "start: call"
        call = 'call: "<tool_call>" WS? obj WS? "</tool_call>"'
        return "\n".join([start, call, *_call_object_rules(tools, name, "arguments")]) + "\n"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str | None:
        # Text that never opens a call, or text up to the first <tool_call> (a lazy lexeme that
        # stops there), then calls. A greedy text lexeme could not give the marker back.
        more = ' (WS? "<tool_call>" call)*' if parallel else ""
        return "\n".join([
            f"start: TEXT | pre call{more}",
            "TEXT: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
            'pre[stop="<tool_call>"]: /(?s:.*)/',
            'call: WS? obj WS? "</tool_call>"',
            *_call_object_rules(tools, None, "arguments", strict_only=True)]) + "\n"


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the reply is `{"name": ..., "parameters": {...}}`, `;`-separated, maybe tagged."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def marker_index(self, text: str) -> int:
        tag = text.find("<|python_tag|>")
        if tag >= 0:
            return tag
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:stripped + 1] == "{" else -1

    def hold_back(self, text: str) -> int:
        if not text.strip():
            return len(text)  # leading whitespace may precede a JSON call
        return super().hold_back(text) if "<" in text[-14:] else 0

    def calls(self, tool_text: str, final: bool) -> list[ParsedToolCall] | None:
        tool_text = tool_text.replace("<|python_tag|>", "")
        spans, rest = _decode_spans(tool_text)
        found = [c for c in (_with_raw(_call_from_obj(v), s) for v, s in spans) if c is not None]
        if final and (rest.strip() or len(found) != len(spans)):
            return None
        return found

    def partial(self, tool_text: str) -> tuple[str, str] | None:
        _, rest = _decode_spans(tool_text.replace("<|python_tag|>", ""))
        head = _split_head(rest)
        return None if head is None else (head[0], _settled(head[1]))

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(function_name) + ', "parameters": '

    def call_grammar(self, tools: list[dict[str, Any]], name: str | None, parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str:
        start = 'start: obj ("; " obj)*' if parallel else "start: obj"
        return "\n".join([start, *_call_object_rules(tools, name, "parameters")]) + "\n"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str | None:
        # A reply is a call when it starts with "{": text is anything that does not.
        calls = 'obj ("; " obj)*' if parallel else "obj"
        return "\n".join([f"start: TEXT | {calls}",
                          "TEXT: /[^{ \\t\\r\\n](?s:.*)/ & ~/(?s:.*)<\\|python_tag\\|>(?s:.*)/",
                          *_call_object_rules(tools, None, "parameters", strict_only=True)]) + "\n"


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name{...}`."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    _named = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?=\{)")

    def calls(self, tool_text: str, final: bool) -> list[ParsedToolCall] | None:
        body = tool_text.replace("[TOOL_CALLS]", " ").strip()
        if body.startswith("["):
            values, _ = _decode_objects(body)
            if not values or not isinstance(values[0], list):
                return [] if not final else None
            found = [_call_from_obj(v) for v in values[0]]
            return [c for c in found if c is not None]
        return self._named_calls(body)

    def _named_calls(self, body: str) -> list[ParsedToolCall]:
        found: list[ParsedToolCall] = []
        pos = 0
        while (m := self._named.match(body, pos)) is not None:
            try:
                args, pos = _DECODER.raw_decode(body, m.end())
            except json.JSONDecodeError:
                break
            call = _call_from_obj({"name": m.group(1), "arguments": args})
            if call is not None:
                found.append(call)
        return found

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            return '[TOOL_CALLS][{"name": "'
        return '[TOOL_CALLS][{"name": ' + json.dumps(function_name) + ', "arguments": '

    def call_grammar(self, tools: list[dict[str, Any]], name: str | None, parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str:
        # [TOOL_CALLS] is a special token: the grammar names it by id (llguidance's <[id]>).
        tid = token_id("[TOOL_CALLS]") if token_id is not None else None
        marker = f"<[{tid}]>" if tid is not None else lark_string("[TOOL_CALLS]")
        items = 'obj (", " obj)*' if parallel else "obj"
        start = f'start: {marker} "[" {items} "]"'
        return "\n".join([start, *_call_object_rules(tools, name, "arguments")]) + "\n"

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool = True,
                     token_id: Callable[[str], int | None] | None = None) -> str | None:
        items = 'obj (", " obj)*' if parallel else "obj"
        rules = _call_object_rules(tools, None, "arguments", strict_only=True)
        tid = token_id("[TOOL_CALLS]") if token_id is not None else None
        if tid is not None:
            # The marker is a special token, which no text lexeme can write: text is free, and
            # the token (named by id) opens the calls.
            return "\n".join([f'start: TEXT | TEXT? <[{tid}]> "[" {items} "]"', "TEXT: /(?s:.+)/",
                              *rules]) + "\n"
        # The marker spelled as text: text that never writes it, or one lexeme of text ending at
        # its first marker, then the calls. (A lazy lexeme stopping at the marker drops the rest
        # of the token that completes it, and "][" is one token in common vocabularies.)
        return "\n".join([
            f'start: TEXT | OPEN "[" {items} "]"',
            "TEXT: /(?s:.+)/ & ~/(?s:.*)\\[TOOL_CALLS\\](?s:.*)/",
            "OPEN: /(?s:.*)\\[TOOL_CALLS\\]/ & ~/(?s:.*)\\[TOOL_CALLS\\](?s:.+)/",
            *rules]) + "\n"


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {choices}") from None


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a streamed call: `id` and `name` open it, `arguments` grow, `done` ends it."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    done: bool = False


@dataclass(slots=True)
class ToolStreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class StreamingToolParser:
    """Feeds cumulative text; yields content that is surely not a call, then tool-call pieces:
    a call's name as soon as it is known, its arguments as they settle (name-first layouts),
    or the whole call at once when it is laid out otherwise."""

    __slots__ = ("calls_done", "content_sent", "open", "parser", "prefix", "start", "text")

    def __init__(self, parser: ToolParser, prefix: str = "") -> None:
        self.parser = parser
        self.prefix = prefix  # forced call opening (tool_choice), never sent as content
        self.text = prefix
        self.content_sent = 0
        self.calls_done = 0
        self.open: tuple[str, str] | None = None  # (id, arguments sent) of the call in progress
        self.start = parser.marker_index(prefix) if prefix else -1

    @property
    def called(self) -> bool:
        return self.calls_done > 0 or self.open is not None

    def feed(self, generated: str) -> ToolStreamDelta:
        """`generated`: the cumulative generated text so far."""
        self.text = self.prefix + generated
        if self.start < 0:
            self.start = self.parser.marker_index(self.text)
        if self.start < 0:
            end = len(self.text) - self.parser.hold_back(self.text)
            return self._content_until(end)
        delta = self._content_until(self.start)
        tool_text = self.text[self.start:]
        delta.calls = self._complete(self.parser.calls(tool_text, final=False) or [])
        delta.calls += self._progress(self.parser.partial(tool_text))
        return delta

    def finish(self, generated: str | None = None) -> ToolStreamDelta:
        """The rest, once the output is final (`generated`: its whole text, if it grew)."""
        if generated is not None:
            self.text = self.prefix + generated
        content, calls = self.parser.extract(self.text)
        if not calls and not self.called:
            return self._content_until(len(self.text))
        delta = self._content_until(len(content))
        delta.calls = self._complete(calls)
        if self.open is not None:  # a call that never closed: end it as it stands
            delta.calls.append(ToolCallDelta(self.calls_done, done=True))
            self.open = None
            self.calls_done += 1
        return delta

    def _complete(self, calls: list[ParsedToolCall]) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for call in calls[self.calls_done:]:
            index = self.calls_done
            if self.open is None:
                out.append(ToolCallDelta(index, call.arguments, call.id, call.name, done=True))
            else:
                sent = self.open[1]
                raw = call.raw_arguments or ""
                rest = raw[len(sent):] if raw.startswith(sent) else ""
                out.append(ToolCallDelta(index, rest, done=True))
                self.open = None
            self.calls_done += 1
        return out

    def _progress(self, partial: tuple[str, str] | None) -> list[ToolCallDelta]:
        if partial is None:
            return []
        name, settled = partial
        out: list[ToolCallDelta] = []
        if self.open is None:
            self.open = (new_call_id(), "")
            out.append(ToolCallDelta(self.calls_done, "", self.open[0], name))
        call_id, sent = self.open
        if len(settled) > len(sent) and settled.startswith(sent):
            out.append(ToolCallDelta(self.calls_done, settled[len(sent):]))
            self.open = (call_id, settled)
        return out

    def _content_until(self, end: int) -> ToolStreamDelta:
        if end <= self.content_sent:
            return ToolStreamDelta()
        piece = self.text[self.content_sent:end]
        self.content_sent = end
        return ToolStreamDelta(content=piece)
