"""Reasoning parsers: a scripted tiny model that thinks (<think>…</think>, the tags split over two
tokens or whole as the first token) served with --reasoning-parser, read through the openai and
anthropic SDKs: reasoning_content on chat (plain and streamed), thinking blocks on /v1/messages,
reasoning items on /v1/responses, tool calls after a reasoning block, enable_thinking off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from server_fixtures import (
    TEXT_CHAIN,
    TOOL_CHAIN,
    ServerProcess,
    build_scripted_model,
    start_server,
)

from fantai.server.reasoning import StreamingReasoning, get_reasoning_parser

# The opening tag split "<th" + "ink>", the closing one "</" + "think>".
THINK_CHAIN = ["<th", "ink>", "Plan", " step", " one", "</", "think>", "\n\n", "Answer",
               " forty", " two"]
# The opening tag as one whole first token, then a tool call after the block.
TOOL_THINK = ["<think>", "Need", " tool", "</think>"]
TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content or '' }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if tools -%}<|assistant_tools|>"
    "{%- elif enable_thinking is defined and not enable_thinking -%}<|assistant|>"
    "{%- else -%}<|assistant_think|>{%- endif -%}{%- endif -%}")
REASONING = "Plan step one"
ANSWER = "Answer forty two"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = build_scripted_model(
        tmp_path_factory.mktemp("thinker"), extra_specials=["<|assistant_think|>"],
        extra_tokens=list(dict.fromkeys(THINK_CHAIN + TOOL_THINK)), template=TEMPLATE,
        chains=[("<|assistant|>", TEXT_CHAIN, "</s>"),
                ("<|assistant_think|>", THINK_CHAIN, "</s>"),
                ("<|assistant_tools|>", TOOL_THINK + TOOL_CHAIN, "</s>")])
    log = tmp_path_factory.mktemp("thinker_logs") / "server.log"
    srv = start_server([str(path), "--served-model-name", "thinker", "--threads", "1",
                        "--max-model-len", "512", "--kv-cache-memory", "16M",
                        "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                        "--disable-log-requests"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


MSGS = [{"role": "user", "content": "What is the answer?"}]


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_chat_splits_reasoning(client: openai.OpenAI) -> None:
    msg = client.chat.completions.create(model="thinker", messages=MSGS, temperature=0,
                                         max_tokens=40).choices[0].message
    assert msg.content == ANSWER
    assert _extra(msg, "reasoning_content") == REASONING
    assert _extra(msg, "reasoning") == REASONING


def test_chat_stream_splits_reasoning_across_split_tags(client: openai.OpenAI) -> None:
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model="thinker", messages=MSGS, temperature=0,
                                                max_tokens=40, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if _extra(delta, "reasoning_content"):
            reasoning.append(_extra(delta, "reasoning_content"))
        if delta.content:
            content.append(delta.content)
    assert "".join(reasoning) == REASONING
    assert "".join(content) == ANSWER
    assert not any("<" in piece or ">" in piece for piece in reasoning + content)


def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI) -> None:
    msg = client.chat.completions.create(
        model="thinker", messages=MSGS, temperature=0, max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert msg.content == "".join(TEXT_CHAIN)
    assert _extra(msg, "reasoning_content") is None


def test_tool_call_after_reasoning_block(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model="thinker", messages=MSGS, tools=TOOLS,
                                            temperature=0, max_tokens=40).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _extra(choice.message, "reasoning_content") == "Need tool"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, names = [], []
    for chunk in client.chat.completions.create(model="thinker", messages=MSGS, tools=TOOLS,
                                                temperature=0, max_tokens=40, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning.append(_extra(d, "reasoning_content") or "")
            names += [t.function.name for t in d.tool_calls or [] if t.function.name]
            assert not (d.content or "").strip()
    assert "".join(reasoning) == "Need tool" and names == ["get_weather"]


def test_messages_thinking_blocks(server: ServerProcess) -> None:
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    msg = claude.messages.create(model="thinker", max_tokens=40, messages=MSGS,
                                 extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == REASONING and msg.content[1].text == ANSWER
    with claude.messages.stream(model="thinker", max_tokens=40, messages=MSGS,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == ANSWER


def test_responses_reasoning_items(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="thinker", input="What is the answer?", temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == REASONING
    assert resp.output_text == ANSWER
    with client.responses.stream(model="thinker", input="What is the answer?",
                                 extra_body={"temperature": 0}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == REASONING and final.output_text == ANSWER


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_every_split_of_the_stream_gives_the_same_parts(name: str) -> None:
    parser = get_reasoning_parser(name)
    text = "<think>a <b> c</think>\n\nThe end </thin"
    want = parser.split(text)
    for cut in range(1, len(text)):
        for cut2 in range(cut, len(text), 3):
            s = StreamingReasoning(parser)
            pieces = [text[:cut], text[:cut2], text]
            reasoning = "".join(s.feed(p, final=i == 2).reasoning for i, p in enumerate(pieces))
            assert reasoning == want[0]
            assert s.feed(text, final=True).content == want[1]
    r1 = get_reasoning_parser("deepseek_r1")
    assert r1.split("thinking</think>answer")[:2] == ("thinking", "answer")  # template opened it
    assert get_reasoning_parser("qwen3").split("no think tags")[:2] == (None, "no think tags")


def test_constraint_applies_after_the_reasoning_block(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(model="thinker", messages=MSGS, temperature=0,
                                      max_tokens=40,
                                      extra_body={"guided_choice": ["Answer two", "No answer"]})
        if not stream:
            msg = client.chat.completions.create(**kwargs).choices[0].message
            reasoning, content = _extra(msg, "reasoning_content"), msg.content
        else:
            parts: dict[str, list[str]] = {"r": [], "c": []}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    d = chunk.choices[0].delta
                    parts["r"].append(_extra(d, "reasoning_content") or "")
                    parts["c"].append(d.content or "")
            reasoning, content = "".join(parts["r"]), "".join(parts["c"])
        assert reasoning == REASONING  # thought freely, then the grammar took over
        assert content == "Answer two"
