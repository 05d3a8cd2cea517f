"""Server room tests: start-up banner, SIGTERM/SIGINT drain (in-flight streams end, exit 0)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import (
    TOOL_CHAIN,
    build_scripted_model,
    cycle_text,
    metric_values,
    python_env,
    start_server,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scripted_model(tmp_path_factory.mktemp("scripted_lifecycle"))


def test_sigterm_drains_in_flight_stream_and_exits_zero(model_dir: Path, tmp_path: Path) -> None:
    env = {**python_env(), "FANTAI_API_KEY": "from-env"}
    template = tmp_path / "always_tools.jinja"  # --chat-template from a file
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}<|assistant_tools|>")
    gen_config = tmp_path / "gen.json"  # --generation-config: defaults for unset fields
    gen_config.write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    srv = start_server([str(model_dir), "--max-model-len", "4096", "--kv-cache-memory", "16M",
                        "--threads", "1", "--shutdown-timeout", "3", "--chat-template",
                        str(template), "--generation-config", str(gen_config)],
                       tmp_path / "log.txt", env=env)
    auth = {"Authorization": "Bearer from-env"}
    assert httpx.get(f"{srv.base_url}/v1/models").status_code == 401
    models = httpx.get(f"{srv.base_url}/v1/models", headers=auth).json()
    assert models["data"][0]["id"] == str(model_dir)
    chat = httpx.post(f"{srv.base_url}/v1/chat/completions", headers=auth, json={
        "model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["choices"][0]["message"]["content"] == "".join(TOOL_CHAIN[:3])
    assert chat["choices"][0]["finish_reason"] == "length"
    log = srv.log()
    assert re.search(r"KV pool \d+ blocks x \d+ tokens = \d+ tokens, \d+ bytes", log), log
    assert re.search(r"ready in [0-9.]+ s", log) and "listening on http://127.0.0.1:" in log
    got: list[str] = []
    started = threading.Event()

    def reader() -> None:
        body = {"model": str(model_dir), "prompt": "hello alpha", "max_tokens": 40,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=30,
                          headers=auth) as r:
            for line in r.iter_lines():
                got.append(line)
                started.set()
                time.sleep(0.02)  # a slow reader keeps the request in flight at SIGTERM

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(30)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0, srv.log()[-3000:]
    assert time.monotonic() - t0 < 15
    thread.join(timeout=30)
    text = "".join(json.loads(line[6:])["choices"][0]["text"]
                   for line in got if line.startswith("data: {"))
    assert text == cycle_text(" alpha", 40)  # finished within the grace period
    assert got[-1] == "data: [DONE]" or got[-1] == ""
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{srv.base_url}/health", timeout=2)


def test_sigint_aborts_past_grace_and_exits_zero(model_dir: Path, tmp_path: Path) -> None:
    # One sequence at a time and 12 long requests: far more work than the 1 s grace allows.
    srv = start_server([str(model_dir), "--max-model-len", "4096", "--kv-cache-memory", "16M",
                        "--threads", "1", "--shutdown-timeout", "1", "--max-num-seqs", "1",
                        "--disable-log-requests"], tmp_path / "log.txt")
    done: list[bool] = []
    first = threading.Event()

    def reader() -> None:
        body = {"model": str(model_dir), "prompt": "hello alpha", "max_tokens": 4000,
                "temperature": 0, "stream": True, "ignore_eos": True}
        lines: list[str] = []
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    first.set()
        except httpx.HTTPError:
            pass
        reasons = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines
                   if x.startswith("data: {")]
        done.append(f"{reasons[-1] if reasons else None} {lines[-1] if lines else None}")

    threads = [threading.Thread(target=reader) for _ in range(12)]
    for t in threads:
        t.start()
    assert first.wait(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # all 12 admitted (1 running, 11 waiting)
        m = metric_values(httpx.get(f"{srv.base_url}/metrics").text)
        if m["fantai_num_requests_running"] + m["fantai_num_requests_waiting"] == 12:
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(timeout=60) == 0, srv.log()[-3000:]
    assert time.monotonic() - t0 < 20
    for t in threads:
        t.join(timeout=30)
    # Every stream ends cleanly; those still running after the grace period were aborted.
    assert len(done) == 12 and set(done) <= {"length data: [DONE]", "abort data: [DONE]"}, done
    assert "abort data: [DONE]" in done
    assert "Traceback" not in srv.log()


def test_cli_generate_and_chat_one_shot(model_dir: Path) -> None:
    import subprocess
    import sys

    from server_fixtures import REPO, TEXT_CHAIN

    def run(*args: str) -> str:
        cmd = [sys.executable, "-m", "fantai.cli", *args, str(model_dir), "--kv-cache-memory",
               "16M", "--threads", "1"]
        done = subprocess.run(cmd, env=python_env(), cwd=str(REPO), capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.splitlines()[-1]

    generated = run("generate", "--prompt", "hello alpha", "--max-tokens", "3")
    assert generated == cycle_text(" alpha", 3)
    assert run("chat", "--message", "Hi") == "".join(TEXT_CHAIN)


def test_served_swap_preemption_keeps_every_reply(model_dir: Path, tmp_path: Path) -> None:
    """A KV pool too small for the clients: preempted requests are swapped to host memory and
    resume; every reply equals the same request served alone, and the swap space drains. n = 4
    per request makes the sequences grow in step, so the 12-block pool must preempt."""
    srv = start_server([str(model_dir), "--num-kv-blocks", "12", "--swap-space", "4M", "--preemption-mode",
                        "swap", "--threads", "1", "--max-model-len", "512"], tmp_path / "log.txt")
    try:
        def complete(prompt: str, n: int) -> list[str]:
            body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 80, "temperature": 0,
                    "ignore_eos": True, "n": n}
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        prompts = ["hello alpha", "hello beta gamma"]
        alone = {p: complete(p, 1)[0] for p in prompts}
        got: dict[str, list[str]] = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, complete(p, 4))) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == {p: [alone[p]] * 4 for p in prompts}
        m = metric_values(httpx.get(f"{srv.base_url}/metrics").text)
        assert m["fantai_num_swap_outs_total"] > 0, {k: v for k, v in m.items() if "swap" in k or "preempt" in k}
        assert m["fantai_num_requests_swapped"] == 0 and m["fantai_cpu_cache_usage_perc"] == 0
        assert m["fantai_kv_cache_blocks_used"] == 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
