"""Slow readers: a client that stops reading its stream must not make the server buffer without
bound or hold the engine up; other requests keep being served, and when the reader goes away its
request is aborted and its KV blocks freed."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from server_fixtures import metric_values, rss_kib, scripted_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with scripted_server(tmp_path_factory, "slow", [
            "--served-model-name", "tiny", "--max-model-len", "1024", "--kv-cache-memory", "16M",
            "--threads", "1", "--disable-log-requests"]) as proc:
        yield proc


def test_stalled_stream_is_bounded_and_does_not_block_others(server) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    body = (b'{"model": "tiny", "prompt": "hello alpha", "max_tokens": 1000, "temperature": 0, '
            b'"ignore_eos": true, "stream": true}')
    start_rss = rss_kib(server.proc.pid)
    stalled = []
    for _ in range(4):  # four streams whose readers never read past the headers
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        stalled.append(s)
    time.sleep(3.0)  # long enough for the engine to have produced all 4 x 1,000 tokens
    with httpx.Client(timeout=30) as http:
        t = time.monotonic()
        r = http.post(f"{server.base_url}/v1/completions",
                      json={"model": "tiny", "prompt": "hello alpha", "max_tokens": 8, "temperature": 0})
        others_latency = time.monotonic() - t
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        grown = rss_kib(server.proc.pid) - start_rss
        for s in stalled:
            s.close()
        deadline = time.monotonic() + 10
        used = None
        while time.monotonic() < deadline:
            metrics = metric_values(http.get(f"{server.base_url}/metrics").text)
            used = [v for k, v in metrics.items() if "blocks" in k and "used" in k]
            if used and all(v == 0 for v in used):
                break
            time.sleep(0.2)
    print(f"4 stalled streams: another request took {others_latency * 1000:.0f} ms; RSS grew {grown} KiB")
    assert others_latency < 5.0
    assert grown < 64 * 1024  # KiB: 4,000 undelivered tokens cost little, and nothing grows past them
    assert used and all(v == 0 for v in used), used
