"""Server room: reasoning parsers (the <think>…</think> family), on whole and streamed text.

deepseek_r1 (and qwq): the model thinks first; its chat template may already have written the
opening <think> into the prompt, so everything before </think> is reasoning, with or without an
opening tag, and output that never closes the block is all reasoning.
qwen3: reasoning only inside an explicit opening <think> (thinking can be switched off through
chat_template_kwargs {"enable_thinking": false}, and then the output is all content).
"""

from __future__ import annotations

from dataclasses import dataclass


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
