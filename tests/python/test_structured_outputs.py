"""Structured outputs: grammars (JSON schema, regex, choice, Lark / EBNF) enforced by the engine's
token masks, offline through LLM and against a real `fantai serve` on the default model with the
openai SDK (parse with pydantic models, guided fields, forced tool calls, errors, concurrency).

Over 400 lines: every case drives the same real server process or offline engine.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from enum import Enum
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field, ValidationError, create_model
from server_fixtures import ServerProcess, metric_values, start_server

pytest.importorskip("llguidance")


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Pet(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Color
    address: Address
    pets: list[Pet] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=16)


PROMPT = [{"role": "user", "content": "Describe a person who lives in Paris, as JSON."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}


class WeatherArgs(BaseModel):
    model_config = {"extra": "forbid"}
    city: str = Field(max_length=24)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class TimeArgs(BaseModel):
    model_config = {"extra": "forbid"}
    tz: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("structured") / "server.log"
    srv = start_server(["--max-model-len", "1024", "--kv-cache-memory", "96M", "--threads", "2",
                        "--tool-call-parser", "hermes", "--disable-log-requests"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                              timeout=300)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _gather(coros: list[Any]) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.gather(*coros)

    return asyncio.run(run())


# ---------------------------------------------------------------- chat.completions.parse

def test_parse_pydantic_greedy(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(model=_model(client), messages=PROMPT,
                                         response_format=Person, temperature=0, max_tokens=300)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    Person.model_validate_json(choice.message.content or "")
    # the same through the beta path older agent frameworks call
    beta = client.beta.chat.completions.parse(model=_model(client), messages=PROMPT,
                                              response_format=Person, temperature=0,
                                              max_tokens=300)
    assert beta.choices[0].message.parsed == choice.message.parsed


def test_parse_pydantic_sampled_every_seed_validates(server: ServerProcess) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                                 max_retries=0, timeout=300)
    model = "SmolLM2-135M-Instruct"

    async def one(seed: int) -> Any:
        return await aclient.chat.completions.parse(
            model=model, messages=PROMPT, response_format=Person, temperature=1.0, seed=seed,
            max_tokens=300)

    outs = _gather([one(seed) for seed in range(20)])
    texts = set()
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
        texts.add(choice.message.content)
    assert len(texts) > 1  # sampled, not one greedy answer 20 times


def test_json_object_and_schema_on_completions(client: openai.OpenAI) -> None:
    model = _model(client)
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=200, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object: {\"ok\": true}"}])
    text = out.choices[0].message.content or ""
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":  # no schema bounds its strings: it may run long
        assert isinstance(json.loads(text), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    comp = client.completions.create(model=model, prompt="The answer to everything is",
                                     max_tokens=40, temperature=0.8, seed=3, n=4,
                                     extra_body={"structured_outputs": {"json": schema}})
    for c in comp.choices:
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.text)["answer"], int)


# ---------------------------------------------------------------- regex, choice, grammar

def test_regex_holds_on_every_sample(client: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    out = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Give a product code."}],
        temperature=1.0, seed=7, n=12, max_tokens=30, extra_body={"guided_regex": pattern})
    for c in out.choices:
        assert re.fullmatch(pattern, c.message.content or ""), c.message.content
        assert c.finish_reason == "stop"


def test_choice_holds_on_every_sample(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral", "mixed feelings"]
    out = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Sentiment of: I love it"}],
        temperature=1.5, seed=1, n=16, max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}})
    got = [c.message.content for c in out.choices]
    assert all(g in choices for g in got), got
    old = client.completions.create(model=_model(client), prompt="The sky is", max_tokens=5,
                                    temperature=1.0, n=8, seed=2,
                                    extra_body={"guided_choice": ["blue", "grey"]})
    assert {c.text for c in old.choices} <= {"blue", "grey"}


def test_lark_and_ebnf_grammars_hold(client: openai.OpenAI) -> None:
    lark = ('start: item (", " item)*\n'
            'item: NUMBER " " FRUIT\n'
            'NUMBER: /[1-9]/\n'
            'FRUIT: "apples" | "pears" | "plums"\n')
    ebnf = 'root ::= "call " name "(" digit+ ")"\nname ::= [a-z]+\ndigit ::= [0-9]\n'
    want = {"lark": re.compile(r"[1-9] (apples|pears|plums)(, [1-9] (apples|pears|plums))*"),
            "ebnf": re.compile(r"call [a-z]+\([0-9]+\)")}
    for name, grammar in (("lark", lark), ("ebnf", ebnf)):
        out = client.chat.completions.create(
            model=_model(client), messages=[{"role": "user", "content": "List some fruit."}],
            temperature=1.0, seed=5, n=8, max_tokens=40,
            extra_body={"structured_outputs": {"grammar": grammar}})
        for c in out.choices:
            text = c.message.content or ""
            if c.finish_reason == "stop":
                assert want[name].fullmatch(text), (name, text)
            else:  # cut by max_tokens: still a prefix the grammar allows
                assert c.finish_reason == "length"


def test_max_tokens_cut_says_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=_model(client), messages=PROMPT, temperature=0, max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": Person.model_json_schema()}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


# ---------------------------------------------------------------- tools

def test_tool_choice_required_always_calls_with_valid_arguments(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=1.0, seed=11,
        n=8, max_tokens=120)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c.message.content
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            model = {"get_weather": WeatherArgs, "get_time": TimeArgs}[call.function.name]
            model.model_validate_json(call.function.arguments)
    one = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=12, n=4, max_tokens=120)
    assert all(len(c.message.tool_calls or []) == 1 for c in one.choices)


def test_named_tool_choice_forces_that_function(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model=_model(client), messages=[{"role": "user", "content": "What time is it?"}],
            tools=[WEATHER_TOOL, TIME_TOOL], temperature=0.7, seed=4, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if not stream:
            msg = client.chat.completions.create(**kwargs).choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        else:
            parts: dict[int, list[str]] = {}
            names: dict[int, str] = {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    if d.function and d.function.name:
                        names[d.index] = d.function.name
                    parts.setdefault(d.index, []).append((d.function and d.function.arguments) or "")
            calls = [(names[i], "".join(parts[i])) for i in sorted(parts)]
        assert calls and all(name == "get_weather" for name, _ in calls)
        for _, args in calls:
            WeatherArgs.model_validate_json(args)


def test_strict_tools_under_auto_choice(client: openai.OpenAI) -> None:
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    shot = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>')
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": shot},
            {"role": "user", "content": "Weather in Rome?"}]
    out = client.chat.completions.create(model=_model(client), messages=msgs, tools=[strict],
                                         tool_choice="auto", temperature=0.8, seed=3, n=8,
                                         max_tokens=80)
    called = 0
    for c in out.choices:
        if c.message.tool_calls:  # the model chose to call: the strict schema held
            called += 1
            for call in c.message.tool_calls:
                WeatherArgs.model_validate_json(call.function.arguments)
        else:  # or it answered in text, which never opens a call
            assert "<tool_call>" not in (c.message.content or "")
    assert called > 0


def test_anthropic_tool_choice_any_and_tool(server: ServerProcess) -> None:
    import anthropic

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0,
                                 timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER_TOOL, TIME_TOOL)]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        msg = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=120, tools=tools, tool_choice=choice,
                                     messages=[{"role": "user", "content": "Hello"}])
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses
        for use in uses:
            if choice["type"] == "tool":
                assert use.name == "get_time"
            model = {"get_weather": WeatherArgs, "get_time": TimeArgs}[use.name]
            model.model_validate(use.input)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
])
def test_bad_constraint_is_400(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    import httpx

    for stream in (False, True):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": stream,
            **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert err["message"]


# ---------------------------------------------------------------- concurrency

def test_64_concurrent_schemas_all_validate_and_free_their_blocks(
        server: ServerProcess, aclient: openai.AsyncOpenAI) -> None:
    import httpx

    models = []
    for i in range(64):
        fields: dict[str, Any] = {f"field_{i}": (int, Field(ge=0, le=999)),
                                  f"tag_{i % 7}": (str, Field(max_length=8))}
        if i % 3 == 0:
            fields["ok"] = (bool, ...)
        models.append(create_model(f"Record{i}", **fields))

    async def one(i: int) -> Any:
        return await aclient.chat.completions.parse(
            model="SmolLM2-135M-Instruct", response_format=models[i], temperature=0.8, seed=i,
            max_tokens=80, messages=[{"role": "user", "content": f"Record number {i}."}])

    outs = _gather([one(i) for i in range(64)])
    for i, out in enumerate(outs):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        assert isinstance(choice.message.parsed, models[i])
        with pytest.raises(ValidationError):  # each answer follows its own schema only
            models[(i + 1) % 64].model_validate_json(choice.message.content or "")
    metrics = metric_values(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
    running = [v for k, v in metrics.items() if k.endswith("num_requests_running")]
    used = [v for k, v in metrics.items() if k.endswith("kv_cache_blocks_used")]
    assert running == [0] and used == [0], metrics


# ---------------------------------------------------------------- offline (LLM.generate)

@pytest.fixture(scope="module")
def llm() -> Any:
    from fantai import LLM

    return LLM(None, max_model_len=512, threads=2, kv_cache_memory="32M")


def test_llm_generate_structured_outputs(llm: Any) -> None:
    from fantai import SamplingParams
    from fantai.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    plain = llm.generate("Hello", SamplingParams(temperature=0.8, seed=1, max_tokens=8),
                         use_tqdm=False)
    assert len(plain[0].outputs[0].token_ids) == 8
    assert llm.grammars.fills == 0  # no constrained row: the core never called the provider
    # No extra properties: pydantic's schema allows them, and a sampled extra property (an object
    # of unbounded numbers) can outrun any token budget, so whether the row stops would depend on
    # the machine's numerics. Without them the object is at most ~35 characters.
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    prompts = ["A pet as JSON:", "Another pet, as JSON:"]
    params = [SamplingParams(temperature=0.9, seed=s, n=3, max_tokens=60, logprobs=2,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for s in (1, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 3
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text
            Pet.model_validate_json(comp.text)
            assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    assert llm.grammars.fills > 0
    compiles = llm.grammars.compiler.compiles
    again = llm.generate(prompts, params, use_tqdm=False)  # seeded: the same again
    assert llm.grammars.compiler.compiles == compiles  # cached by its text: no second compile
    assert [[c.text for c in o.outputs] for o in again] == [[c.text for c in o.outputs]
                                                            for o in outs]
    old = llm.generate("Pick:", SamplingParams(
        temperature=1.0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
        use_tqdm=False)
    assert old[0].outputs[0].text in ("yes", "no")
    # min_tokens bans EOS, but a finished grammar allows nothing else: the grammar wins.
    short = llm.generate("Pick:", SamplingParams(
        temperature=1.0, max_tokens=8, min_tokens=6,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)
    assert short[0].outputs[0].text in ("yes", "no")
    assert short[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
                     use_tqdm=False)
    assert llm.grammars.live() == 0
    assert llm.stats()["num_running"] == 0


def test_llm_structured_outputs_survive_preemption(tmp_path: Any) -> None:
    from fantai import LLM, SamplingParams
    from fantai.sampling_params import StructuredOutputsParams

    # 8 blocks of 16 tokens for 6 sequences that each need 3 or 4: preemption by recompute.
    small = LLM(None, max_model_len=256, threads=2, num_kv_blocks=8)
    schema = {"type": "object", "properties": {"words": {"type": "array", "maxItems": 12,
                                                         "items": {"type": "string",
                                                                   "maxLength": 10}}},
              "required": ["words"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outs = small.generate([f"List {i} words:" for i in range(6)], params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    for out in outs:
        comp = out.outputs[0]
        if comp.finish_reason == "stop":
            assert isinstance(json.loads(comp.text)["words"], list)
        else:
            assert comp.finish_reason == "length"
    assert small.grammars.live() == 0


# ---------------------------------------------------------------- /v1/responses text.format

def test_responses_json_schema_output(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=_model(client), input=PROMPT[0]["content"],
                                    text_format=Person, temperature=0, max_output_tokens=300)
    assert isinstance(parsed.output_parsed, Person)
    with client.responses.stream(model=_model(client), input=PROMPT[0]["content"],
                                 text_format=Person, temperature=0.9,
                                 max_output_tokens=300) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)


# ---------------------------------------------------------------- units: the grammars themselves

@pytest.fixture(scope="module")
def compiler() -> Any:
    from fantai.model_files import default_model_path
    from fantai.structured import GrammarCompiler
    from fantai.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(default_model_path())
    return tok, GrammarCompiler(tok, 49152)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral"])
def test_tool_grammar_writes_what_its_parser_reads(compiler: Any, parser_name: str) -> None:
    from fantai.server.tool_parsers import get_parser
    from fantai.structured import GrammarSpec

    tok, comp = compiler
    parser = get_parser(parser_name)
    tools = [WEATHER_TOOL, TIME_TOOL]
    grammar = parser.call_grammar(tools, None, True, tok.token_to_id)
    args = [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"tz": "UTC"})]
    objs = [json.dumps({"name": n, ("parameters" if parser_name == "llama3_json" else
                                    "arguments"): a}) for n, a in args]
    text = {"hermes": "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs),
            "llama3_json": "; ".join(objs),
            "mistral": "[TOOL_CALLS][" + ", ".join(objs) + "]"}[parser_name]
    matcher = comp.matcher(GrammarSpec("lark", grammar))
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting()
    _, calls = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == args
    wrong = comp.matcher(GrammarSpec("lark", grammar))  # arguments off the schema are refused
    bad = text.replace('"celsius"', '"kelvin"')
    assert not wrong.consume_tokens(tok.encode(bad, add_special_tokens=False))


def test_request_fields_map_to_one_constraint() -> None:
    from fantai.server.errors import APIError
    from fantai.server.params import structured_from_request
    from fantai.server.protocol import ChatCompletionRequest

    def so(**extra: Any) -> Any:
        return structured_from_request(ChatCompletionRequest(
            messages=[{"role": "user", "content": "x"}], **extra))

    assert so() is None and so(response_format={"type": "text"}) is None
    assert so(response_format={"type": "json_object"}).spec().kind == "json"
    schema = {"type": "object"}
    fmt = so(response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                     "schema": schema}})
    assert json.loads(fmt.spec().text) == schema
    assert so(guided_regex="a+").spec() == so(structured_outputs={"regex": "a+"}).spec()
    assert so(guided_choice=["a"]).spec().kind == "lark"
    assert so(structured_outputs={"grammar": "root ::= \"a\"", "backend": "x"}).spec().kind == \
        "lark"
    for bad in ({"structured_outputs": {"frob": 1}}, {"guided_json": schema, "guided_regex": "a"},
                {"structured_outputs": {"json": schema, "regex": "a"}}):
        with pytest.raises(APIError):
            so(**bad)


def test_provider_never_fails_a_step_for_one_row(compiler: Any) -> None:
    import ctypes

    from fantai.structured import GrammarSpec, MaskProvider

    tok, _ = compiler
    provider = MaskProvider(tok, 49152, [2])
    provider.register([7, 8], GrammarSpec("regex", "ab+"))
    words = 49152 // 32
    masks = (ctypes.c_uint32 * (3 * words))()
    bad = tok.encode("zzz", add_special_tokens=False)
    # row 7: fine; row 8: fed a token its grammar refuses; row 9: unknown to the provider
    provider.fill([7, 8, 9], [0, 0, 0], [[], bad, []], ctypes.addressof(masks), words)

    def allowed(row: int) -> list[int]:
        return [t for t in range(49152) if (masks[row * words + t // 32] >> (t % 32)) & 1]

    assert len(allowed(0)) > 1 and 2 not in allowed(0)  # "a...": EOS not yet
    assert allowed(1) == [2] and allowed(2) == [2]  # may only end
    provider.release([7, 8])
    assert provider.live() == 0


@pytest.fixture(scope="module")
def mistral_compiler() -> Any:
    """The default model's vocabulary plus [TOOL_CALLS] as a special token, as Mistral's has."""
    import tokenizers
    from fantai.model_files import default_model_path
    from fantai.structured import GrammarCompiler
    from fantai.tokenizer import Tokenizer

    base = Tokenizer.from_model_path(default_model_path())
    hf = tokenizers.Tokenizer.from_str(base.hf.to_str())
    hf.add_special_tokens([tokenizers.AddedToken("[TOOL_CALLS]", special=True)])
    tok = Tokenizer(hf, base.spec)
    assert tok.token_to_id("[TOOL_CALLS]") == 49152
    return tok, GrammarCompiler(tok, 49153)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "mistral_special"])
def test_strict_auto_grammar_allows_text_or_schema_calls(compiler: Any, mistral_compiler: Any,
                                                         parser_name: str) -> None:
    from fantai.server.tool_parsers import get_parser
    from fantai.structured import GrammarSpec

    special = parser_name == "mistral_special"
    tok, comp = mistral_compiler if special else compiler
    parser = get_parser("mistral" if special else parser_name)
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    grammar = parser.auto_grammar([strict, TIME_TOOL], True, tok.token_to_id)
    key = "parameters" if parser_name == "llama3_json" else "arguments"

    def call(name: str, args: dict[str, Any]) -> str:
        obj = json.dumps({"name": name, key: args})
        if parser_name == "hermes":
            return f"Let me check.<tool_call>\n{obj}\n</tool_call>"
        return f"Let me check.[TOOL_CALLS][{obj}]" if parser_name.startswith("mistral") else obj

    def accepts(text: str) -> bool:
        m = comp.matcher(GrammarSpec("lark", grammar))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    if parser_name.startswith("mistral"):
        # what the grammar lets through, the parser reads back as the call
        _, calls = parser.extract(call("get_time", {"tz": "UTC"}))
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
        assert accepts("[TOOL_CALLS][" + ", ".join(
            json.dumps({"name": "get_time", "arguments": {"tz": z}}) for z in ("UTC", "CET")) + "]")
        assert not accepts("Let me check.[TOOL_CALLS]not a call list")
    assert accepts("It is sunny in Oslo.")
    assert accepts(call("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not accepts(call("get_weather", {"city": "Oslo", "unit": "kelvin"}))  # strict
    assert accepts(call("get_time", {"anything": 1}))  # not strict: any object
