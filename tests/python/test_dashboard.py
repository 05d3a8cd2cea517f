"""Dashboard room tests: the SSE snapshot stream, and the /dashboard page in a real headless
chromium (no console errors, the right number of blocks, a grid that changes while requests run)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import server_fixtures  # noqa: F401  (first: this checkout's fantai goes on sys.path)
from fantai.server.dashboard import decode_runs, encode_runs, histogram_percentiles
from fantai.server.metrics import Histogram
from server_fixtures import REPO, ServerProcess, iter_sse, metric_values, start_server
from tiny_models import build_tiny_model

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# A random llama just big enough that a step takes milliseconds (a burst spans many snapshots):
# 4 layers x 2 KV heads x head_dim 64 x 16 tokens x (K, V) x 4 bytes = 64 KiB a block.
MODEL_SHAPE = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "inter": 512}
KV_BYTES = "16M"  # 256 blocks: small enough that a burst fills the pool and preempts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = build_tiny_model(tmp_path_factory.mktemp("tiny_dash"), **MODEL_SHAPE)
    log = tmp_path_factory.mktemp("logs") / "dashboard_server.log"
    proc = start_server([str(model), "--served-model-name", "tiny", "--kv-cache-memory", KV_BYTES,
                         "--max-model-len", "1024", "--threads", "1", "--max-num-seqs", "4",
                         "--disable-log-requests",
                         "--log-level", "warning", "--api-key", "k"], log)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def total_blocks(server: ServerProcess) -> int:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return int(metric_values(text)["fantai_kv_cache_blocks_total"])


def burst(server: ServerProcess, count: int = 10, max_tokens: int = 500) -> threading.Thread:
    """Streams `count` requests with a shared 48-token prefix (prefix-cache sharing) at once."""
    prefix = " ".join(f"w{10 + i}" for i in range(48))

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"{prefix} " + " ".join(f"w{100 + i + k}" for k in range(40)),
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer k"}) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    def run_all() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    thread = threading.Thread(target=run_all, daemon=True)
    thread.start()
    return thread


# ---- units ----------------------------------------------------------------------------------
def test_runs_round_trip() -> None:
    states = bytes([0, 0, 2, 2, 2, 1, 0, 0, 0, 2])
    runs = encode_runs(states)
    assert runs == {"starts": [0, 2, 5, 6, 9], "values": [0, 2, 1, 0, 2]}
    assert decode_runs(runs, len(states)) == states
    assert encode_runs(b"") == {"starts": [], "values": []}


def test_histogram_percentiles_window() -> None:
    h = Histogram("x", "x", buckets=(0.01, 0.02, 0.04))
    for v in (0.005, 0.015, 0.015, 0.03):
        h.observe(v)
    base = list(h.counts)
    assert histogram_percentiles(h, base)["p50"] is None  # nothing new in the window
    for v in (0.011, 0.012, 0.013, 0.014):
        h.observe(v)
    est = histogram_percentiles(h, base)
    assert est["count"] == 4 and 0.01 <= est["p50"] <= 0.02 and 0.01 <= est["p99"] <= 0.02


def test_engine_snapshot_matches_tables(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Engine.snapshot() against the stats and the block tables it reports: states add up, every
    running table is in use, and ref counts equal the tables that hold each block."""
    from collections import Counter

    from fantai import _C, LLM

    llm = LLM(str(build_tiny_model(tmp_path_factory.mktemp("tiny_snap"))), num_kv_blocks=40,
              block_size=16, threads=1, max_num_seqs=3)
    prefix = list(range(10, 58))  # 3 full blocks shared through the prefix cache
    for i in range(5):
        params = _C.SamplingParams()
        params.max_tokens, params.ignore_eos, params.temperature = 40, True, 0.0
        llm.engine.add_request(100 + i, prefix + [60 + i] * (5 + 7 * i), params)
    ever_shared = False
    for step in range(100):
        llm.engine.step()
        snap, stats = llm.engine.snapshot(), llm.engine.stats()
        states = Counter(snap["block_states"])
        assert len(snap["block_states"]) == stats["num_total_blocks"] == 40
        assert states[2] == stats["num_used_blocks"] and states[1] == stats["num_cached_blocks"]
        holders = Counter(b for r in snap["requests"] for b in r["block_table"])
        assert dict(snap["shared"]) == {b: n for b, n in holders.items() if n > 1}, step
        running = [r for r in snap["requests"] if r["status"] == "running"]
        assert len(running) == stats["num_running"] <= 3
        for r in running:
            assert all(snap["block_states"][b] == 2 for b in r["block_table"])
            assert len(r["block_table"]) == -(-r["num_computed_tokens"] // 16) or \
                len(r["block_table"]) == -(-r["num_tokens"] // 16)
        ever_shared = ever_shared or bool(snap["shared"])
    # the second wave takes the first wave's cached prefix blocks: one block, several owners
    assert ever_shared


def test_stream_ends_when_server_drains(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m")
    proc = start_server([str(model), "--kv-cache-memory", "2M", "--threads", "1",
                         "--shutdown-timeout", "30", "--log-level", "warning"],
                        tmp_path / "drain.log")
    ended = threading.Event()

    def read() -> None:
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "GET", f"{proc.base_url}/dashboard/stream", timeout=60) as r:
            for _ in r.iter_lines():
                pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    time.sleep(1.0)
    start = time.monotonic()
    assert proc.stop() == 0
    # An open dashboard does not hold the shutdown for its grace period (30 s here).
    assert time.monotonic() - start < 10 and ended.wait(5)


# ---- the stream -------------------------------------------------------------------------------
def read_events(server: ServerProcess, count: int, timeout: float = 20.0) -> list[tuple[str | None, Any]]:
    events: list[tuple[str | None, Any]] = []
    with httpx.stream("GET", f"{server.base_url}/dashboard/stream", timeout=timeout) as r:
        assert r.status_code == 200  # no API key needed, like /metrics
        assert r.headers["content-type"].startswith("text/event-stream")
        for event, data in iter_sse(r.iter_lines()):
            events.append((event, json.loads(data)))
            if len(events) >= count:
                break
    return events


def test_stream_snapshots(server: ServerProcess) -> None:
    total = total_blocks(server)
    events = read_events(server, 3)
    assert events[0][0] == "hello" and events[0][1]["num_blocks"] == total
    msg = events[-1][1]
    assert msg["stats"]["num_total_blocks"] == total
    assert len(decode_runs(msg["blocks"], total)) == total
    assert {"ttft", "tpot"} <= set(msg["latency"]) and "steps" in msg and "requests" in msg
    page = httpx.get(f"{server.base_url}/dashboard", timeout=10)
    assert page.status_code == 200 and "dashboard.js" in page.text
    for name in ("dashboard.js", "dashboard.css"):
        assert httpx.get(f"{server.base_url}/dashboard/static/{name}", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/dashboard/static/nope.js", timeout=10).status_code != 200


def test_stream_sees_requests_and_steps(server: ServerProcess) -> None:
    total = total_blocks(server)
    seen_used, seen_steps, shared = 0, 0, 0
    with httpx.stream("GET", f"{server.base_url}/dashboard/stream", timeout=60) as r:
        thread = None
        for event, data in iter_sse(r.iter_lines()):
            if event == "hello":
                continue
            thread = thread or burst(server, count=8, max_tokens=400)
            msg = json.loads(data)
            states = decode_runs(msg["blocks"], total)
            used = states.count(2)
            seen_used = max(seen_used, used)
            seen_steps += len(msg["steps"])
            shared = max(shared, len(msg["shared"]))
            for req in msg["requests"]:  # a running request's table covers its tokens
                if req["status"] == "running":
                    assert len(req["block_table"]) * 16 >= req["num_computed_tokens"]
                    assert all(states[b] == 2 for b in req["block_table"])
            if not thread.is_alive() and msg["stats"]["num_running"] == 0:
                break
    assert seen_used > 0 and seen_steps > 0
    assert shared > 0  # the 48-token shared prefix is 3 full blocks held by several requests


# ---- the browser ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium "
                    "chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fantai-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1500"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {script}")


def test_dashboard_in_browser(server: ServerProcess, browser: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    total = total_blocks(server)
    browser.get(f"{server.base_url}/dashboard")
    wait_for(browser, "return window.fantaiDash && window.fantaiDash.messages >= 2")
    assert browser.execute_script("return window.fantaiDash.drawnBlocks") == total
    assert browser.find_element(By.ID, "grid").get_attribute("data-blocks") == str(total)
    assert browser.find_element(By.ID, "kv-summary").text.startswith(f"{total} blocks")

    before = browser.execute_script("return window.fantaiDash.signatures.size")
    # 10 waves of --max-num-seqs 4: long enough to hover a running request on a fast machine too.
    thread = burst(server, count=40, max_tokens=900)
    wait_for(browser, "return window.fantaiDash.requests.some(r => r.status === 'running')")
    time.sleep(0.8)  # let the charts fill a little
    hovered = None
    deadline = time.monotonic() + 20
    while hovered is None and time.monotonic() < deadline:  # a row can leave under the pointer
        row = wait_for(browser, "return document.querySelector('#requests tbody tr')")
        try:
            ActionChains(browser).move_to_element(row).perform()  # hover: highlight its block table
        except Exception:  # the row was redrawn between finding and hovering it
            continue
        time.sleep(0.3)
        hovered = browser.execute_script("return window.fantaiDash.hoverId")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    mapping = browser.find_element(By.ID, "mapping").text
    thread.join(timeout=120)
    wait_for(browser, "return window.fantaiDash.requests.length === 0", timeout=30)
    after = browser.execute_script("return window.fantaiDash.signatures.size")
    assert after - before >= 3, "the grid did not change while requests ran"
    assert hovered is not None and "logical → physical" in mapping and "→" in mapping
    steps = browser.execute_script("return window.fantaiDash.steps.length")
    assert steps > 0
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe
