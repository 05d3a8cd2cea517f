"""Server room unit tests: tool parsers (whole and streamed), CLI, metrics text, error shapes."""

from __future__ import annotations

import json

import pytest
import server_fixtures
from fantai.cli import build_parser, parse_size
from fantai.outputs import CompletionOutput, RequestOutput
from fantai.server.errors import APIError, error_body
from fantai.server.metrics import ServerMetrics
from fantai.server.params import GenerationDefaults, check_max_tokens, parse_logit_bias
from fantai.server.tool_parsers import StreamingToolParser, get_parser

CASES = {
    "hermes": (('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Paris"}}\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}'
                '</tool_call>'),
               "Let me check. "),
    "llama3_json": (('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                     '{"name": "get_time", "parameters": {}}'), ""),
    "mistral": (('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {}}]'), ""),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parser_extracts_calls(name: str) -> None:
    text, content = CASES[name]
    got_content, calls = get_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_parser_matches_full_parse(name: str) -> None:
    text, content = CASES[name]
    stream = StreamingToolParser(get_parser(name))
    pieces, deltas = [], []
    for end in range(1, len(text) + 1):  # one character per step: the worst split
        step = stream.feed(text[:end])
        pieces.append(step.content)
        deltas += step.calls
    last = stream.finish()
    pieces.append(last.content)
    deltas += last.calls
    assert "".join(pieces) == content
    calls: dict[int, list[str]] = {}
    for d in deltas:  # the first piece of a call carries id and name; arguments add up
        assert (d.id is not None) == (d.index not in calls)
        slot = calls.setdefault(d.index, [d.name or "", ""])
        slot[1] += d.arguments
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert sum(d.done for d in deltas) == 2
    if name != "mistral":  # name-first objects stream their arguments in several pieces
        assert len(deltas) > 4


def test_mistral_named_format_and_plain_text() -> None:
    _, calls = get_parser("mistral").extract('[TOOL_CALLS]get_weather{"city": "Paris"}')
    assert [(c.name, c.input_dict()) for c in calls] == [("get_weather", {"city": "Paris"})]
    for name in CASES:
        assert get_parser(name).extract("just words, no {call}") == ("just words, no {call}", [])


def test_streaming_plain_text_is_not_held() -> None:
    stream = StreamingToolParser(get_parser("hermes"))
    assert stream.feed("Hello <to").content == "Hello "  # '<to' might open <tool_call>
    assert stream.feed("Hello <tom>").content == "<tom>"
    assert stream.finish().content == ""


def test_forced_prefix_parses() -> None:
    for name in CASES:
        parser = get_parser(name)
        prefix = parser.forced_prefix("get_weather")
        tail = '{"city": "Paris"}}' + ("</tool_call>" if name == "hermes" else "")
        tail += "]" if name == "mistral" else ""
        _, calls = parser.extract(prefix + tail)
        assert [(c.name, c.input_dict()) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_broken_call_falls_back_to_content() -> None:
    text = '<tool_call>{"name": "get_weather", "argu'
    stream = StreamingToolParser(get_parser("hermes"))
    assert stream.feed(text).content == ""
    assert stream.finish().content == text


def test_parse_size_and_cli_help() -> None:
    assert parse_size("4G") == 4 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size("1000") == 1000
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b",
                                      "--kv-cache-memory", "2G"])
    assert args.served_model_name == ["a", "b"] and args.kv_cache_memory == 2 << 30
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore
    text = serve.format_help()
    for option in ("--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                   "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
                   "--memory-utilization", "--dtype", "--seed", "--threads", "--api-key",
                   "--chat-template", "--generation-config", "--log-level",
                   "--disable-log-requests", "--tool-call-parser"):
        assert option in text


def test_max_tokens_checks_name_both_numbers() -> None:
    with pytest.raises(APIError) as err:
        check_max_tokens(100, 30, 64)
    assert "64" in err.value.message and "100" in err.value.message and "30" in err.value.message
    assert check_max_tokens(None, 30, 64) == 34
    with pytest.raises(APIError):
        check_max_tokens(0, 3, 64)
    with pytest.raises(APIError):
        parse_logit_bias({"99": 1.0}, vocab_size=10)
    assert parse_logit_bias({"3": -100}, vocab_size=10) == {3: -100.0}


def test_generation_defaults(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 77, "bos_token_id": 1}))
    d = GenerationDefaults.load("auto", str(tmp_path))
    assert (d.temperature, d.top_p, d.max_tokens) == (0.6, 0.9, 77)
    assert GenerationDefaults.load("none", str(tmp_path)).temperature is None


def test_metrics_text() -> None:
    m = ServerMetrics()
    comp = CompletionOutput(0, "x", [5, 6], finish_reason="length")
    out = RequestOutput("r", None, [1, 2, 3], [comp],
                        finished=True, metrics={"arrival_time": 1.0, "first_token_time": 1.5,
                                                "finished_time": 2.0})
    m.record(out)
    kinds = [{"kind": "full", "num_used_blocks": 3, "num_total_blocks": 6},
             {"kind": "sliding_window_24", "num_used_blocks": 1, "num_total_blocks": 4}]
    text = m.render({"num_running": 2, "num_waiting": 1, "num_free_blocks": 6,
                     "num_total_blocks": 10, "kv_utilization": 0.5, "num_preemptions": 3, "kv_kinds": kinds,
                     "num_swap_outs": 2, "num_swapped": 1, "num_swap_slots": 8, "num_free_swap_slots": 6})
    values = server_fixtures.metric_values(text)
    assert values['fantai_kv_cache_kind_blocks_used{kind="full"}'] == 3
    assert values['fantai_kv_cache_kind_blocks_used{kind="sliding_window_24"}'] == 1
    assert values['fantai_kv_cache_kind_blocks_total{kind="sliding_window_24"}'] == 4
    assert values['fantai_request_success_total{finished_reason="length"}'] == 1
    assert values["fantai_prompt_tokens_total"] == 3
    assert values["fantai_generation_tokens_total"] == 2
    assert values["fantai_kv_cache_blocks_used"] == 4
    assert values["fantai_kv_cache_blocks_total"] == 10
    assert values["fantai_num_preemptions_total"] == 3
    assert values["fantai_num_swap_outs_total"] == 2 and values["fantai_num_requests_swapped"] == 1
    assert values["fantai_cpu_cache_usage_perc"] == pytest.approx(0.25)
    assert values["fantai_time_to_first_token_seconds_count"] == 1
    assert values["fantai_time_per_output_token_seconds_sum"] == pytest.approx(0.5)


def test_error_shapes() -> None:
    assert error_body("/v1/chat/completions", 404, "m", "model", "model_not_found") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}}
    assert error_body("/v1/messages", 401, "k") == {
        "type": "error", "error": {"type": "authentication_error", "message": "k"}}
