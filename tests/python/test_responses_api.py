"""/v1/responses against a real `fantai serve` on the scripted tiny model, through the openai SDK:
text, streamed events in their documented order, a function-calling round trip continued with
previous_response_id, retrieve and delete, 404s, and the bounded store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import TEXT_CHAIN, ServerProcess, build_scripted_model, start_server

TEXT = "".join(TEXT_CHAIN)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path: Path = build_scripted_model(tmp_path_factory.mktemp("responses"))
    log = tmp_path_factory.mktemp("responses_logs") / "server.log"
    srv = start_server([str(path), "--served-model-name", "tiny", "--threads", "1",
                        "--max-model-len", "1024", "--kv-cache-memory", "16M",
                        "--responses-store-size", "4", "--disable-log-requests"], log)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def test_text_response_and_usage(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", input="Hi", instructions="Be brief.",
                                   temperature=0, max_output_tokens=30)
    assert resp.object == "response" and resp.status == "completed"
    assert resp.output_text == TEXT
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage is not None and resp.usage.output_tokens == len(TEXT_CHAIN) + 1
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief."
    cut = client.responses.create(model="tiny", input="Hi", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_input_items_and_message_parts(client: openai.OpenAI) -> None:
    resp = client.responses.create(model="tiny", temperature=0, input=[
        {"role": "developer", "content": "You answer greetings."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert resp.output_text == TEXT


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input="Hi", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT
    assert final.output_text == TEXT and final.status == "completed"
    assert client.responses.retrieve(final.id).output_text == TEXT
    cut = list(client.responses.create(model="tiny", input="Hi", temperature=0,
                                       max_output_tokens=3, stream=True))
    assert cut[-1].type == "response.incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_function_call_round_trip_through_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL],
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    # the result goes back, continuing the stored conversation (no tools: the model answers)
    second = client.responses.create(model="tiny", previous_response_id=first.id, temperature=0,
                                     input=[{"type": "function_call_output",
                                             "call_id": calls[0].call_id, "output": "sunny"}])
    assert second.previous_response_id == first.id
    assert second.output_text == TEXT
    assert second.usage.input_tokens > first.usage.input_tokens
    # streamed function call: arguments deltas, then done, inside one output item
    with client.responses.stream(model="tiny", input="Weather?", tools=[TOOL],
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert [i.type for i in final.output] == ["function_call"]
    forced = client.responses.create(model="tiny", input="Hi", tools=[TOOL], temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"})
    assert [i.type for i in forced.output] == ["function_call"]


def test_retrieve_delete_and_404(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.responses.create(model="tiny", input="Hi", temperature=0)
    assert client.responses.retrieve(resp.id).id == resp.id
    client.responses.delete(resp.id)
    for call in (lambda: client.responses.retrieve(resp.id),
                 lambda: client.responses.delete(resp.id),
                 lambda: client.responses.create(model="tiny", input="x",
                                                 previous_response_id="resp_nope")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        err = info.value.body
        assert isinstance(err, dict) and "not found" in err["message"]
    r = httpx.get(f"{server.base_url}/v1/responses/resp_unknown", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    unstored = client.responses.create(model="tiny", input="Hi", temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_is_bounded_lru(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="tiny", input="Hi", temperature=0,
                                   max_output_tokens=2).id for _ in range(6)]
    client.responses.retrieve(ids[2])  # capacity 4: the oldest two are gone
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])


def test_bad_requests_are_400(server: ServerProcess) -> None:
    for body, needle in (({"input": "x", "tools": [{"type": "web_search"}]}, "function"),
                         ({"input": []}, "empty"),
                         ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
                         ({"input": "x", "frobnicate": 1}, "frobnicate")):
        r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
