"""Server room tests: a real `fantai serve` on a scripted tiny model, driven by the openai and
anthropic SDKs (completions, chat, tools, Anthropic events, errors, concurrency, disconnects).

Over 400 lines: every case drives the same real server process through the SDKs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_fixtures import (
    CYCLE,
    TEXT_CHAIN,
    ServerProcess,
    build_scripted_model,
    cycle_text,
    iter_sse,
    metric_values,
    start_server,
)

KEY = "test-key-123"
TEXT_REPLY = "".join(TEXT_CHAIN)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="session")
def server(scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    proc = start_server([str(scripted_dir), "--served-model-name", "tiny", "tiny-alias",
                         "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN),
                         "--kv-cache-memory", "64M", "--max-request-body-size", "1M",
                         "--threads", "1", "--tool-call-parser", "hermes",
                         "--disable-log-requests"], log)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def hf_tok(scripted_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(scripted_dir))


def chat_prompt_len(hf_tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> int:
    """Prompt tokens by transformers' own template rendering (list-of-parts content joined)."""
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in messages]
    text = hf_tok.apply_chat_template(flat, tools=tools, add_generation_prompt=True,
                                      tokenize=False)
    return len(hf_tok(text, add_special_tokens=False)["input_ids"])


def metrics(server: ServerProcess) -> dict[str, float]:
    return metric_values(httpx.get(f"{server.base_url}/metrics", timeout=10).text)


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["fantai_num_requests_running"] == 0 and m["fantai_num_requests_waiting"] == 0
                and m["fantai_kv_cache_blocks_used"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ------------------------------------------------------------------ info routes

def test_open_routes_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    assert "fantai_kv_cache_blocks_total" in httpx.get(f"{server.base_url}/metrics").text
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    log = server.log()
    assert "KV pool" in log and "blocks" in log and "bytes" in log and "ready in" in log


def test_tokenize_detokenize(server: ServerProcess, hf_tok: Any) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hello alpha"}, headers=h).json()
    assert r["tokens"] == hf_tok("hello alpha")["input_ids"] and r["count"] == 3
    assert r["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"][1:]}, headers=h)
    assert d.json()["prompt"] == "hello alpha"
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": msgs}, headers=h).json()
    assert r["count"] == chat_prompt_len(hf_tok, msgs)


def test_metrics_count_requests_and_tokens(server: ServerProcess, client: openai.OpenAI) -> None:
    before = wait_idle(server)
    r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=5, temperature=0,
                                  n=2)
    after = metrics(server)
    assert after["fantai_generation_tokens_total"] - before["fantai_generation_tokens_total"] == 10
    assert (after["fantai_prompt_tokens_total"] - before["fantai_prompt_tokens_total"]
            == r.usage.prompt_tokens)
    length = 'fantai_request_success_total{finished_reason="length"}'
    assert after[length] - before[length] == 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "time_per_output_token_seconds"):
        assert after[f"fantai_{hist}_count"] == before[f"fantai_{hist}_count"] + 1
        assert after[f'fantai_{hist}_bucket{{le="+Inf"}}'] == after[f"fantai_{hist}_count"]
    assert after["fantai_kv_cache_blocks_total"] > 0 and after["fantai_kv_cache_blocks_used"] == 0
    assert 0.0 <= after["fantai_kv_cache_utilization"] <= 1.0
    assert "fantai_num_preemptions_total" in after


# ------------------------------------------------------------------ completions

def test_completion_greedy_and_usage(client: openai.OpenAI, hf_tok: Any) -> None:
    r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=7, temperature=0)
    assert r.choices[0].text == cycle_text(" alpha", 7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(hf_tok("hello alpha")["input_ids"])
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    alias = client.completions.create(model="tiny-alias", prompt="hello alpha", max_tokens=7,
                                      temperature=0)
    assert alias.model == "tiny-alias" and alias.choices[0].text == r.choices[0].text


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="tiny", prompt="hello alpha", max_tokens=9,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == cycle_text(" alpha", 9)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_completion_prompt_forms_and_echo(client: openai.OpenAI, hf_tok: Any) -> None:
    ids = hf_tok("hello alpha")["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == cycle_text(" alpha", 4)
    many = client.completions.create(model="tiny", prompt=["hello alpha", "hello gamma"],
                                     max_tokens=3, temperature=0, n=2)
    texts = [c.text for c in sorted(many.choices, key=lambda c: c.index)]
    assert texts == [cycle_text(" alpha", 3)] * 2 + [cycle_text(" gamma", 3)] * 2
    assert many.usage.prompt_tokens == 2 * len(ids) and many.usage.completion_tokens == 12
    ids_list = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=2,
                                         temperature=0)
    assert [c.text for c in ids_list.choices] == [cycle_text(" alpha", 2)] * 2
    echo = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=2,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "hello alpha" + cycle_text(" alpha", 2)


@pytest.mark.parametrize("stop,expected", [("ta gam", " be"), (["zzz", "a gamma d"], " bet"),
                                           (" delta", " beta gamma")])
def test_stop_strings_across_tokens(client: openai.OpenAI, stop: Any, expected: str) -> None:
    r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=20,
                                  temperature=0, stop=stop)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=20,
                                  temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in s) == expected


def test_seed_reproducible_and_n(client: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=24,
                                      temperature=3.0, seed=seed, n=n)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    best = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=8,
                                     temperature=3.0, seed=3, n=2, best_of=4)
    assert sorted(c.index for c in best.choices) == [0, 1]
    four = sample(11, n=4)
    assert len(four) == 4 and len(set(four)) > 1
    assert sample(11, n=4) == four
    stream = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=24,
                                       temperature=3.0, seed=11, n=4, stream=True)
    parts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert [parts[i] for i in range(4)] == four and finished == {0, 1, 2, 3}


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [" beta", " gamma", " delta", " epsilon"]
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value)
        assert top[token] == pytest.approx(value)
    assert lp.text_offset == [0, 5, 11, 17]


def test_sampling_fields_reach_engine(client: openai.OpenAI, hf_tok: Any) -> None:
    mu, delta = hf_tok.convert_tokens_to_ids([" mu", " delta"])
    biased = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=3,
                                       temperature=0, logit_bias={str(mu): 100})
    assert biased.choices[0].text == " mu mu mu"
    stopped = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=20,
                                        temperature=0, extra_body={"stop_token_ids": [delta]})
    # As in vLLM, a stop token that is not a special token keeps its text.
    assert stopped.choices[0].text == " beta gamma delta"
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].stop_reason == delta
    msgs = [{"role": "user", "content": "Hi"}]
    longer = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                            max_tokens=30, extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    assert longer.choices[0].message.content.startswith(TEXT_REPLY)
    no_eos = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                            max_tokens=15, extra_body={"ignore_eos": True})
    assert no_eos.usage.completion_tokens == 15 and no_eos.choices[0].finish_reason == "length"
    knobs = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0.7, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5, user="u1",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1})
    assert knobs.usage.completion_tokens == 4


# ------------------------------------------------------------------ chat

def test_chat_greedy_usage_and_stream(client: openai.OpenAI, hf_tok: Any) -> None:
    msgs = [{"role": "system", "content": "Be nice."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0)
    assert r.choices[0].message.content == TEXT_REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == chat_prompt_len(hf_tok, msgs)
    assert r.usage.completion_tokens == len(TEXT_CHAIN) + 1  # the EOS token counts
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT_REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    capped = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                            max_completion_tokens=3)
    assert capped.choices[0].message.content == "".join(TEXT_CHAIN[:3])
    assert capped.choices[0].finish_reason == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, logprobs=True, top_logprobs=3, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == TEXT_CHAIN[:4]
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.bytes == list(c.token.encode())
    streamed = []
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
            logprobs=True, top_logprobs=3, max_tokens=4, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    tokens: list[str] = []
    for chunk in client.completions.create(model="tiny", prompt="hello alpha", max_tokens=4,
                                           temperature=0, logprobs=1, stream=True):
        tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert tokens == [" beta", " gamma", " delta", " epsilon"]


def test_tool_calls(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                           tool_choice=choice, temperature=0)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", choice
        assert m.content is None and len(m.tool_calls) == 1
        assert m.tool_calls[0].function.name == "get_weather"
        assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
        assert m.tool_calls[0].id.startswith("call_")
    none = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                          tool_choice="none", temperature=0)
    assert none.choices[0].message.content == TEXT_REPLY
    assert not none.choices[0].message.tool_calls


def test_tool_calls_streamed_and_follow_up(client: openai.OpenAI) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert reasons[-1] == "tool_calls"
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                 {"id": calls[0]["id"], "type": "function",
                  "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
             {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS,
                                       tool_choice="none", temperature=0)
    assert r.choices[0].message.content == TEXT_REPLY


# ------------------------------------------------------------------ anthropic

def test_anthropic_messages(claude: anthropic.Anthropic, hf_tok: Any) -> None:
    m = claude.messages.create(model="tiny", max_tokens=50, system="Be nice.",
                               messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"temperature": 0})
    assert m.content[0].type == "text" and m.content[0].text == TEXT_REPLY
    assert m.stop_reason == "end_turn" and m.role == "assistant"
    msgs = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}]
    assert m.usage.input_tokens == chat_prompt_len(hf_tok, msgs)
    assert m.usage.output_tokens == len(TEXT_CHAIN) + 1
    s = claude.messages.create(model="tiny", max_tokens=50, stop_sequences=["friend"],
                               messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"temperature": 0})
    assert s.content[0].text == "Hello there my " and s.stop_reason == "stop_sequence"
    assert s.stop_sequence == "friend"
    counted = claude.messages.count_tokens(model="tiny", system="Be nice.",
                                           messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens == m.usage.input_tokens
    short = claude.messages.create(model="tiny", max_tokens=2, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Hi"}])
    assert short.stop_reason == "max_tokens" and short.content[0].text == "Hello there"


def test_anthropic_tools(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model="tiny", max_tokens=50, tools=tools, messages=q,
                               extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with claude.messages.stream(model="tiny", max_tokens=50, tools=tools, messages=q,
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    follow = q + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id,
                                                     "name": use.name, "input": use.input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny and warm"}]}]
    r = claude.messages.create(model="tiny", max_tokens=50, tools=tools, messages=follow,
                               tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert r.content[0].text == TEXT_REPLY


def _events(server: ServerProcess, body: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        return [(ev, json.loads(data)) for ev, data in iter_sse(r.iter_lines())]


def test_anthropic_event_sequence(server: ServerProcess) -> None:
    events = _events(server, {"model": "tiny", "max_tokens": 50, "stream": True, "temperature": 0,
                              "messages": [{"role": "user", "content": "Hi"}]})
    names = [ev for ev, _ in events]
    assert all(ev == data["type"] for ev, data in events)
    deltas = names.count("content_block_delta")  # steps may coalesce, never split a token
    assert 1 <= deltas <= len(TEXT_CHAIN)
    assert names == (["message_start", "ping", "content_block_start"]
                     + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert events[0][1]["message"]["usage"]["output_tokens"] == 0
    text = "".join(d["delta"]["text"] for ev, d in events if ev == "content_block_delta")
    assert text == TEXT_REPLY
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert events[-2][1]["usage"]["output_tokens"] == len(TEXT_CHAIN) + 1
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    events = _events(server, {"model": "tiny", "max_tokens": 50, "stream": True, "tools": tools,
                              "temperature": 0,
                              "messages": [{"role": "user", "content": "Weather?"}]})
    names = [ev for ev, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1 and names == (["message_start", "ping", "content_block_start"]
                                     + ["content_block_delta"] * deltas
                                     + ["content_block_stop", "message_delta", "message_stop"])
    assert events[2][1]["content_block"]["type"] == "tool_use"
    assert events[2][1]["content_block"]["name"] == "get_weather"
    args = "".join(d["delta"]["partial_json"] for ev, d in events if ev == "content_block_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# ------------------------------------------------------------------ parity with LLM.generate

def test_greedy_matches_llm_generate(client: openai.OpenAI, scripted_dir: Path) -> None:
    from fantai import LLM, SamplingParams

    llm = LLM(str(scripted_dir), max_model_len=MAX_MODEL_LEN, threads=1)
    prompts = ["Once upon a time", "hello alpha", "Tell me a story ."]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(prompts, expected):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == out.outputs[0].text
        assert r.usage.completion_tokens == len(out.outputs[0].token_ids)


# ------------------------------------------------------------------ load and disconnects

def test_200_concurrent_streams(server: ServerProcess) -> None:
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str, str, int]:
        word, count = CYCLE[i % len(CYCLE)], 1 + (i * 7) % 48
        stream = await aclient.completions.create(
            model="tiny", prompt="hello" + word, max_tokens=count, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, reason, used = "", "", 0
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, cycle_text(word, count), reason, used - count

    async def run() -> list[tuple[str, str, str, int]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY,
                                         http_client=http, max_retries=0)
            return await asyncio.gather(*(one(aclient, i) for i in range(200)))

    results = asyncio.run(run())
    bad = [(i, r) for i, r in enumerate(results) if r[0] != r[1]]
    assert not bad, bad[:3]
    assert all(reason == "length" and extra == 0 for _, _, reason, extra in results)


def test_50_stream_disconnects_and_5_timeouts_free_kv(server: ServerProcess,
                                                      client: openai.OpenAI) -> None:
    """Clients that leave mid-request (a stream closed after a few events, a non-streamed call
    given up on) each end exactly once in the engine, and every KV block comes back.

    Whether one departed request ends as an abort or as 'length' is a race the engine may win:
    the scripted model decodes 1000 tokens in tens of milliseconds, and a stream's first events
    can carry most of them, so its end may come before the server sees the socket close. What
    holds on any machine: every one of the 55 ends once, none as 'stop', and departures are
    aborted (the 50 streams share the engine's steps for seconds, so not all of them can have
    ended first). The non-streamed calls are given up on only once the server reports them in the
    engine: a wall-clock client timeout can fire before a loaded server has read the request,
    which then never reaches the engine at all (CI once counted 54 of 55 that way)."""
    before = metrics(server)
    long_body = {"model": "tiny", "prompt": "hello alpha", "max_tokens": MAX_MODEL_LEN - 8,
                 "ignore_eos": True, "temperature": 0}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": "hello alpha", "max_tokens": 900, "stream": True,
                "temperature": 0}
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        if i % 2:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hello alpha"}],
                    "max_tokens": 900, "stream": True, "ignore_eos": True}
        async with http.stream("POST", path, json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream

    async def in_engine(http: httpx.AsyncClient, n: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metric_values((await http.get("/metrics")).text)
            if m["fantai_num_requests_running"] + m["fantai_num_requests_waiting"] >= n:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{n} requests never reached the engine")

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            plain = [asyncio.create_task(http.post("/v1/completions", json=long_body))
                     for _ in range(5)]
            await in_engine(http, len(plain))
            streams = asyncio.gather(*(one(http, i) for i in range(50)))
            # Give up on the non-streamed calls while the streams run, as a client timeout does:
            # httpx closes each connection mid-request.
            for t in plain:
                t.cancel()
            await streams
            return [(await t).status_code for t in plain if not t.cancelled()]

    finished = asyncio.run(run())  # the calls that ended before they were given up on
    assert all(code == 200 for code in finished)
    after = wait_idle(server)
    assert after["fantai_kv_cache_blocks_used"] == 0
    assert after["fantai_num_requests_running"] == 0
    ended = {r: after[f'fantai_request_success_total{{finished_reason="{r}"}}']
             - before[f'fantai_request_success_total{{finished_reason="{r}"}}']
             for r in ("abort", "length", "stop")}
    assert ended["abort"] + ended["length"] == 55 and ended["stop"] == 0, ended
    assert ended["abort"] >= 1, ended
    r = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=3, temperature=0)
    assert r.choices[0].text == cycle_text(" alpha", 3)


# ------------------------------------------------------------------ bad input

def _openai_shape(body: dict[str, Any]) -> str:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err["message"]


def _anthropic_shape(body: dict[str, Any], kind: str) -> str:
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]["message"]


LONG_PROMPT = "hello" + " alpha" * 600
BAD_CASES: list[tuple[str, str, Any, dict[str, str], int, str]] = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, "JSON"),
    ("wrong type", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"},
     {}, 400, "max_tokens"),
    ("unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, {}, 404, "nope"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, {}, 400, "messages"),
    ("max_tokens zero", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0},
     {}, 400, "max_tokens"),
    ("max_tokens too large", "/v1/completions",
     {"model": "tiny", "prompt": "x", "max_tokens": 5000}, {}, 400, "5000"),
    ("prompt plus max_tokens", "/v1/completions",
     {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 500}, {}, 400, "1024"),
    ("n too large", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 1000}, {}, 400, "n"),
    ("logit_bias key", "/v1/completions",
     {"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, {}, 400, "logit_bias"),
    ("logit_bias range", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
      "logit_bias": {"999999": 1}}, {}, 400, "logit_bias"),
    ("unsupported field", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "functions": []},
     {}, 400, "functions"),
    ("suffix", "/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, {}, 400,
     "suffix"),
    ("bad json schema", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {
          "name": "x", "schema": {"type": "nonsense"}}}}, {}, 400, "JSON schema"),
    ("image part", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, {}, 400, "image_url"),
    ("unknown tool", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, {}, 400, "nope"),
    ("stream_options without stream", "/v1/completions",
     {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options"),
    ("best_of streamed", "/v1/completions",
     {"model": "tiny", "prompt": "x", "n": 1, "best_of": 2, "stream": True}, {}, 400, "best_of"),
    ("wrong key", "/v1/completions", {"model": "tiny", "prompt": "x"},
     {"Authorization": "Bearer wrong"}, 401, "API key"),
    ("missing key", "/v1/models", None, {"Authorization": ""}, 401, "API key"),
    ("oversized body", "/v1/completions", {"model": "tiny", "prompt": "x" * (2 << 20)}, {},
     413, "limit"),
    ("unknown route", "/v1/nothing", {}, {}, 404, "/v1/nothing"),
    # integers past the core's fixed widths (the request fuzzer's one 500, a TypeError at the binding)
    ("top_k past int64", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 9223372036854775808}, {}, 400,
     "top_k"),
    ("seed past int64", "/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**64}, {}, 400, "seed"),
    ("n past int32", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 2**40}, {}, 400, "Invalid value for 'n'"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_then_good(server: ServerProcess, client: openai.OpenAI,
                             case: tuple[str, str, Any, dict[str, str], int, str]) -> None:
    _, path, body, headers, status, needle = case
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
    url = f"{server.base_url}{path}"
    if body is None:
        r = httpx.get(url, headers=h)
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url, content=content, headers=h, timeout=30)
    assert r.status_code == status, r.text
    assert needle in _openai_shape(r.json())
    if case[0] == "prompt plus max_tokens":
        assert "500" in r.json()["error"]["message"]
    good = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=2,
                                     temperature=0)
    assert good.choices[0].text == cycle_text(" alpha", 2)


ANTHROPIC_BAD = [
    ("missing max_tokens", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
     {}, 400, "invalid_request_error"),
    ("unknown model", {"model": "nope", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "x"}]}, {}, 404, "not_found_error"),
    ("wrong key",
     {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
     {"x-api-key": "wrong"}, 401, "authentication_error"),
    ("too long", {"model": "tiny", "max_tokens": 5000,
                  "messages": [{"role": "user", "content": "x"}]}, {}, 400,
     "invalid_request_error"),
]


@pytest.mark.parametrize("case", ANTHROPIC_BAD, ids=[c[0] for c in ANTHROPIC_BAD])
def test_anthropic_errors(server: ServerProcess, claude: anthropic.Anthropic,
                          case: tuple[str, dict[str, Any], dict[str, str], int, str]) -> None:
    _, body, headers, status, kind = case
    h = {"x-api-key": KEY, **headers}
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers=h, timeout=30)
    assert r.status_code == status, r.text
    assert _anthropic_shape(r.json(), kind)
    ok = claude.messages.create(model="tiny", max_tokens=2, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Hi"}])
    assert ok.content[0].text == "Hello there"


def test_chunked_oversized_body_is_413(server: ServerProcess, client: openai.OpenAI) -> None:
    def body() -> Any:  # no Content-Length: the limit is counted while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(f"{server.base_url}/v1/completions", content=body(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in _openai_shape(r.json())
    r = httpx.post(f"{server.base_url}/v1/messages", content=body(), timeout=30,
                   headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == 413 and _anthropic_shape(r.json(), "request_too_large")
    good = client.completions.create(model="tiny", prompt="hello alpha", max_tokens=2,
                                     temperature=0)
    assert good.choices[0].text == cycle_text(" alpha", 2)


def test_sdk_errors_and_no_leaks(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    m = wait_idle(server)
    assert m["fantai_kv_cache_blocks_used"] == 0 and m["fantai_num_requests_running"] == 0
