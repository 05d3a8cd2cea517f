"""Crashes, restarts and timeouts against real `fantai serve` processes.

- An engine fault (injected with the test hook FANTAI_FAULT_AFTER_STEPS) fails every in-flight
  request with an error (JSON or a stream's error event, never a hang), turns /health to 503,
  refuses new requests with 503, and the process exits with status 70 so a supervisor restarts it.
- A request that can never sample (bad input that would fail a step) is a 400 and the server
  keeps serving.
- SIGKILL in the middle of a burst, then a restart on the same port: correct answers at once.
- --request-timeout aborts a request in the engine (its KV blocks freed) with a 504 / an error
  event.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import (
    CYCLE,
    build_scripted_model,
    cycle_text,
    free_port,
    metric_values,
    python_env,
    start_server,
    vocab,
)

EXIT_ENGINE_FAULT = 70
FAULT_AFTER_STEPS = 3000  # every client below is in flight by then, none has finished (4000 tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every chat reply runs the endless cycle (" alpha beta gamma ..."): long requests on every API.
    return build_scripted_model(tmp_path_factory.mktemp("scripted_faults"),
                                chains=[("<|assistant|>", [" alpha"], " beta")])


def _args(model_dir: Path, *extra: str) -> list[str]:
    return [str(model_dir), "--served-model-name", "tiny", "--max-model-len", "4096",
            "--kv-cache-memory", "16M", "--threads", "1", "--disable-log-requests", *extra]


LONG = {"model": "tiny", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def _stream(url: str, body: dict[str, Any], out: dict[str, Any], first: threading.Event) -> None:
    """POST a streamed request; record its status, data lines and events until the stream ends."""
    lines: list[str] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()
    except httpx.HTTPError as exc:
        out["exc"] = repr(exc)
    out["lines"] = lines
    first.set()


def _post(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        r = httpx.post(url, json=body, timeout=60)
        out["status"], out["json"] = r.status_code, r.json()
    except httpx.HTTPError as exc:
        out["exc"] = repr(exc)


def test_engine_fault_fails_in_flight_requests_and_exits_nonzero(model_dir: Path, tmp_path: Path) -> None:
    env = {**python_env(), "FANTAI_FAULT_AFTER_STEPS": str(FAULT_AFTER_STEPS)}
    srv = start_server(_args(model_dir), tmp_path / "log.txt", env=env)
    base = srv.base_url
    # Served normally until the fault.
    ok = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hello alpha",
                                                    "max_tokens": 3, "temperature": 0}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == cycle_text(" alpha", 3)
    chat = {**LONG, "messages": [{"role": "user", "content": "Hi alpha"}]}
    anthropic = {"model": "tiny", "max_tokens": 4000, "temperature": 0,
                 "messages": [{"role": "user", "content": "Tell me alpha"}]}
    streams = {
        "completions": (f"{base}/v1/completions", {**LONG, "prompt": "hello alpha", "stream": True}),
        "chat": (f"{base}/v1/chat/completions", {**chat, "stream": True}),
        "messages": (f"{base}/v1/messages", {**anthropic, "stream": True}),
    }
    plain = {
        "completions": (f"{base}/v1/completions", {**LONG, "prompt": "hello beta"}),
        "messages": (f"{base}/v1/messages", anthropic),
    }
    got: dict[str, dict[str, Any]] = {}
    threads = []
    firsts = []
    for name, (url, body) in streams.items():
        got["stream " + name], first = {}, threading.Event()
        firsts.append(first)
        threads.append(threading.Thread(target=_stream, args=(url, body, got["stream " + name], first)))
    for name, (url, body) in plain.items():
        got[name] = {}
        threads.append(threading.Thread(target=_post, args=(url, body, got[name])))
    for t in threads:
        t.start()
    for first in firsts:
        assert first.wait(60)
    # Every client gets its error (the fault comes a few hundred steps in), none hangs.
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a client hung after the engine fault"
    t_errors = time.monotonic()
    health = httpx.get(f"{base}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "failed", health.text
    assert "injected engine fault" in health.json()["error"]
    refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hello alpha",
                                                         "max_tokens": 3}, timeout=5)
    assert refused.status_code == 503 and refused.headers.get("retry-after") == "1"
    assert refused.json()["error"]["code"] == "engine_failed"
    status = srv.proc.wait(timeout=30)
    exit_seconds = time.monotonic() - t_errors
    print(f"engine fault: every client answered, then exit status {status} "
          f"{exit_seconds:.2f} s after the errors")
    assert status == EXIT_ENGINE_FAULT, srv.log()[-3000:]
    assert exit_seconds < 10

    # The streams: some tokens, then the API's error event; the plain requests: a 500 error JSON.
    for name in ("stream completions", "stream chat"):
        lines = got[name]["lines"]
        assert got[name]["status"] == 200 and lines[-1] == "data: [DONE]", got[name]
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "engine_failed" and error["type"] == "server_error", error
        assert any('"choices"' in x for x in lines[:-2])  # it was streaming before the fault
    lines = got["stream messages"]["lines"]
    assert lines[-2] == "event: error", lines[-4:]
    event = json.loads(lines[-1][6:])
    assert event["type"] == "error" and event["error"]["type"] == "api_error", event
    assert "injected engine fault" in event["error"]["message"]
    assert "content_block_delta" in "".join(lines)
    assert got["completions"]["status"] == 500, got["completions"]
    assert got["completions"]["json"]["error"]["code"] == "engine_failed"
    assert got["messages"]["status"] == 500, got["messages"]
    assert got["messages"]["json"]["error"]["type"] == "api_error"
    log = srv.log()
    assert "engine fault" in log and "exiting with status 70" in log, log[-3000:]


def test_request_that_cannot_sample_is_a_400_and_the_server_keeps_serving(model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """min_tokens bans EOS and the stop tokens; banning the whole vocabulary would fail the step
    (an input error, not an engine fault): refused up front instead."""
    srv = start_server(_args(model_dir), tmp_path / "log.txt")
    try:
        every_token_but_eos = [i for i in range(len(vocab())) if i != 2]
        r = httpx.post(f"{srv.base_url}/v1/completions", json={
            "model": "tiny", "prompt": "hello alpha", "max_tokens": 5, "min_tokens": 2,
            "stop_token_ids": every_token_but_eos}, timeout=30)
        assert r.status_code == 400 and "bans every token" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{srv.base_url}/v1/completions", json={
            "model": "tiny", "prompt": "hello alpha", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == cycle_text(" alpha", 3)
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_sigkill_mid_burst_then_restart_serves_at_once(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = _args(model_dir, "--port", str(port))
    srv = start_server(args, tmp_path / "log1.txt")
    results: list[int | str] = []
    started = threading.Event()

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": "hello alpha", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": i % 2 == 0}
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
                results.append(r.status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)
            started.set()

    burst = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in burst:
        t.start()
    assert started.wait(60)
    time.sleep(0.3)  # the burst is in full swing
    srv.proc.send_signal(signal.SIGKILL)
    assert srv.proc.wait(timeout=30) == -signal.SIGKILL
    for t in burst:
        t.join(timeout=60)
    assert len(results) == 16 and any(isinstance(r, str) for r in results), results  # cut off

    t0 = time.monotonic()
    again = start_server(args, tmp_path / "log2.txt")
    try:
        first = httpx.post(f"{again.base_url}/v1/completions", json={
            "model": "tiny", "prompt": "hello alpha", "max_tokens": 12, "temperature": 0}, timeout=30)
        restart_seconds = time.monotonic() - t0
        print(f"restart after SIGKILL: first correct answer {restart_seconds:.2f} s after the "
              f"relaunch (ready in {again.ready_seconds:.2f} s)")
        assert again.base_url == f"http://127.0.0.1:{port}"
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == cycle_text(" alpha", 12)
        answers: list[str] = []

        def check(word: str) -> None:
            r = httpx.post(f"{again.base_url}/v1/completions", json={
                "model": "tiny", "prompt": f"hello{word}", "max_tokens": 20, "temperature": 0}, timeout=60)
            answers.append(r.json()["choices"][0]["text"] == cycle_text(word, 20))

        threads = [threading.Thread(target=check, args=(w,)) for w in CYCLE[:8]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert answers == [True] * 8
    finally:
        assert again.stop() == 0, again.log()[-3000:]


def test_request_timeout_aborts_in_the_engine(model_dir: Path, tmp_path: Path) -> None:
    # 4,000 tokens take about 2 s here (0.5 ms a token), far longer than 0.25 s; 3 tokens far less.
    srv = start_server(_args(model_dir, "--request-timeout", "0.25"), tmp_path / "log.txt")
    slow = LONG
    base = srv.base_url
    try:
        short = httpx.post(f"{base}/v1/completions", json={
            "model": "tiny", "prompt": "hello alpha", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert short.status_code == 200 and short.json()["choices"][0]["text"] == cycle_text(" alpha", 3)
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={**slow, "prompt": "hello alpha"}, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "request_timeout" and error["type"] == "timeout_error", error
        assert "0.25 s" in error["message"] and took < 5
        r = httpx.post(f"{base}/v1/messages", json={
            "model": "tiny", "max_tokens": 4000, "messages": [{"role": "user", "content": "Hi alpha"}],
            "temperature": 0}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
        # A stream that already started ends with the error event instead.
        with httpx.stream("POST", f"{base}/v1/completions", timeout=30,
                          json={**slow, "prompt": "hello alpha", "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
        assert len(lines) > 3  # tokens came before the timeout
        with httpx.stream("POST", f"{base}/v1/responses", timeout=30, json={
                "model": "tiny", "input": "Hi alpha", "max_output_tokens": 4000, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        assert lines[-2] == "event: error" and json.loads(lines[-1][6:])["code"] == "request_timeout"
        # Aborted in the engine: no KV block stays in use, and the metrics count the timeouts.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = metric_values(httpx.get(f"{base}/metrics").text)
            used = [v for k, v in metrics.items() if "blocks" in k and "used" in k]
            if used and all(v == 0 for v in used) and metrics["fantai_num_requests_running"] == 0:
                break
            time.sleep(0.1)
        assert used and all(v == 0 for v in used), metrics
        assert metrics['fantai_request_success_total{finished_reason="timeout"}'] == 4
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
