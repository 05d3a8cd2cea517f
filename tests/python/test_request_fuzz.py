"""Hostile requests: a seeded fuzzer over the OpenAI, Anthropic and tokenize routes of a real server.

Each case starts from a valid body and replaces, removes or adds fields with edge values (numbers
past every integer width, NaN, wrong types, huge lists, deep nesting, control characters), or
sends bytes that are not JSON or not UTF-8. Every answer must be a 4xx in the route's error shape
or a success, never a 5xx or a hang, and the server must still serve, with no KV block leaked.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import build_scripted_model, metric_values, start_server

KEY = "fuzz-key"
SECONDS = 30.0

BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hello alpha"}],
                             "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
                             "stop": ["zz"], "logprobs": True, "top_logprobs": 2, "n": 1,
                             "logit_bias": {"5": 1.0}, "stream": False,
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                 "type": "object", "properties": {"a": {"type": "string"}}}}}]},
    "/v1/completions": {"model": "tiny", "prompt": "hello alpha", "max_tokens": 3, "temperature": 0,
                        "logprobs": 2, "echo": False, "stop": "zz", "n": 1, "best_of": 1,
                        "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1},
    "/v1/messages": {"model": "tiny", "max_tokens": 3, "system": "be brief",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hello alpha"}]}],
                     "temperature": 0.5, "top_k": 3, "stop_sequences": ["zz"], "stream": False},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]},
    "/tokenize": {"model": "tiny", "prompt": "hello alpha", "add_special_tokens": True},
    "/detokenize": {"model": "tiny", "tokens": [5, 6, 7]},
}

EDGES: list[Any] = [None, True, -1, 0, 1, 2**31, 2**63, 2**64, 10**400, -(10**30), 1e308, -0.0, "NaN", "",
                    "x" * 5000, "\u0000\u001b[2J\ud7ff", [], {}, [None], [[[[[[[[[[[]]]]]]]]]]],
                    {"a": {"b": {"c": {}}}}, ["zz"] * 3000, {str(i): 1.0 for i in range(3000)}, 0.5]


def _mutate(body: Any, rng: random.Random) -> Any:
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append((node, k))
                walk(v)
        elif isinstance(node, list):
            for i, v in enumerate(node[:4]):
                paths.append((node, i))
                walk(v)

    walk(body)
    for _ in range(rng.randint(1, 3)):
        parent, key = rng.choice(paths)
        r = rng.random()
        if r < 0.1 and isinstance(parent, dict) and key in parent:
            del parent[key]
        elif r < 0.2 and isinstance(parent, dict):
            parent[rng.choice(["stream", "n", "max_tokens", "response_format", "tool_choice", "unknown"])] = \
                rng.choice(EDGES)
        elif isinstance(parent, dict) and key in parent or isinstance(parent, list) and key < len(parent):
            parent[key] = rng.choice(EDGES)
    return body


def _raw_case(rng: random.Random) -> bytes:
    return rng.choice([b"", b"{", b"[]", b"null", b"\xff\xfe{}", b'{"model": "tiny", "prompt": "\xc3\x28"}',
                       b'{"a":' * 2000 + b"1" + b"}" * 2000, json.dumps({"prompt": "x" * 10}).encode() * 3,
                       b'{"model": "tiny", "prompt": "x", "max_tokens": NaN}'])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    model = build_scripted_model(tmp_path_factory.mktemp("fuzz_model"))
    log = tmp_path_factory.mktemp("fuzz_logs") / "server.log"
    proc = start_server([str(model), "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", "256",
                         "--kv-cache-memory", "16M", "--max-request-body-size", "1M", "--threads", "1",
                         "--disable-log-requests"], log)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def test_fuzzed_requests_never_get_a_5xx(fuzz_server) -> None:
    rng = random.Random(2026)
    base = fuzz_server.base_url
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "Content-Type": "application/json"}
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    deadline = time.monotonic() + SECONDS
    n = 0
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < deadline:
            n += 1
            route = rng.choice(sorted(BASES))
            if rng.random() < 0.1:
                content = _raw_case(rng)
            else:
                body = _mutate(json.loads(json.dumps(BASES[route])), rng)
                content = json.dumps(body, allow_nan=True).encode()
            try:
                r = http.post(f"{base}{route}", content=content, headers=headers)
            except httpx.TimeoutException:
                failures.append(f"hang: {route} {content[:300]!r}")
                continue
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                failures.append(f"{r.status_code} {route} {content[:300]!r} -> {r.text[:300]}")
            elif r.status_code >= 400:
                err = r.json()
                shape_ok = ("error" in err and "message" in err["error"]) if not route.startswith("/v1/messages") \
                    else err.get("type") == "error" and "message" in err.get("error", {})
                if not shape_ok:
                    failures.append(f"error shape {route}: {r.text[:300]}")
        healthy = http.get(f"{base}/health").status_code
        good = http.post(f"{base}/v1/completions", headers=headers,
                         json={"model": "tiny", "prompt": "hello alpha", "max_tokens": 2, "temperature": 0})
        metrics = metric_values(http.get(f"{base}/metrics", headers=headers).text)
    print(f"{n} fuzzed requests: {dict(sorted(statuses.items()))}")
    assert n >= 200, n
    assert not failures, "\n".join(failures[:10])
    assert healthy == 200 and good.status_code == 200
    used = [v for k, v in metrics.items() if "blocks" in k and "used" in k]
    assert used and all(v == 0 for v in used), metrics
