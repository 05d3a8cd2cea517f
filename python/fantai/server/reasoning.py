"""Server room: reasoning parsers (the <think>…</think> family), on whole and streamed text.

deepseek_r1 (and qwq): the model thinks first; its chat template may already have written the
opening <think> into the prompt, so everything before </think> is reasoning, with or without an
opening tag, and output that never closes the block is all reasoning.
qwen3: reasoning only inside an explicit opening <think> (thinking can be switched off through
chat_template_kwargs {"enable_thinking": false}, and then the output is all content).
With a parser on, an output constraint (response_format, guided_*, tool grammars) applies to the
answer after the reasoning block, not to the reasoning (reasoning_grammar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fantai.structured import StructuredOutputsParams, json_lark, lark_string


class ReasoningParser:
    name = "base"
    start = "<think>"
    end = "</think>"
    implicit_start = False  # reasoning may begin without the opening tag (written by the template)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str, bool]:
        """(reasoning or None, content, reasoning closed?) of a (possibly partial) output.
        A partial output holds back a tail that may still grow into a tag."""
        body = text.lstrip()
        opened = body.startswith(self.start)
        if opened:
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):
            return "", "", False  # maybe the opening tag, still arriving
        elif not self.implicit_start:
            return None, text, True
        cut = body.find(self.end)
        if cut >= 0:  # the answer's leading blank lines belong to neither part
            return body[:cut], body[cut + len(self.end):].lstrip(), True
        if final:
            return body, "", False
        return body[:len(body) - _tag_tail(body, self.end)], "", False


def _tag_tail(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class QwQParser(DeepSeekR1Parser):
    name = "qwq"


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, QwQParser, Qwen3Parser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]()
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {choices}") from None


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""  # the content text so far, cumulative (what the tool parser is fed)


class StreamingReasoning:
    """Feeds cumulative output text; gives reasoning as new pieces and content cumulatively, so a
    tag split over two tokens (or one that is the first token) never leaks into either."""

    __slots__ = ("parser", "sent")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0  # reasoning characters handed out

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        reasoning, content, _ = self.parser.split(text, final)
        reasoning = reasoning or ""
        piece = reasoning[self.sent:] if len(reasoning) > self.sent else ""
        self.sent = max(self.sent, len(reasoning))
        return ReasoningDelta(piece, content)


def _answer_rules(so: StructuredOutputsParams) -> list[str] | None:
    """Lark rules defining `answer` as the constraint's language, or None (left unwrapped)."""
    if so.json_object:
        return [f"answer: {json_lark({'type': 'object'})}"]
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return [f"answer: {json_lark(schema)}"] if isinstance(schema, dict) else None
    if so.regex is not None:
        return ["answer: /" + so.regex.replace("/", "\\/") + "/"]
    if so.choice is not None:
        return ["answer: " + " | ".join(lark_string(c) for c in so.choice)]
    text = so.grammar or ""
    if "::=" in text:
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        except Exception:  # noqa: BLE001  (the compiler reports it on the unwrapped grammar)
            return None
    # Lark's entry rule renamed; only where `start` is not also used inside the grammar.
    if len(re.findall(r"\bstart\b", text)) != 1 or not re.search(r"^start\s*:", text, re.M):
        return None
    return [re.sub(r"^start(\s*):", r"answer\1:", text, count=1, flags=re.M)]


def reasoning_grammar(parser: ReasoningParser, so: StructuredOutputsParams
                      ) -> StructuredOutputsParams:
    """The constraint with a reasoning block allowed before it: the model thinks freely, then
    the answer follows the grammar. (A lazy lexeme that stops at the closing tag: a greedy one
    could not hand the tag back.)"""
    answer = _answer_rules(so)
    if answer is None:
        return so
    opener = lark_string(parser.start)
    think = f"({opener}? thought WS?)?" if parser.implicit_start else f"({opener} thought WS?)?"
    rules = [f"start: {think} answer",
             f"thought[stop={lark_string(parser.end)}]: /(?s:.*)/",
             "WS: /[ \\t\\r\\n]+/", *answer]
    if any(line.lstrip().startswith("WS:") for line in answer[-1].splitlines()):
        rules.remove("WS: /[ \\t\\r\\n]+/")
    return StructuredOutputsParams(grammar="\n".join(rules) + "\n")
