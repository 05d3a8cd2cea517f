"""Bench room tests: `fantai bench serve | throughput | latency | plot` against a real `fantai serve`
on a tiny random model (exact counts with ignore_eos, every JSON field, the comparison plot)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import REPO, ServerProcess, python_env, start_server
from tiny_models import build_tiny_model

VOCAB = 320
RUN_FIELDS = {"num_prompts", "completed", "failed", "duration_s", "total_input_tokens",
              "total_output_tokens", "total_chunks", "total_tokens_received",
              "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms",
              "tpot_ms", "itl_ms", "e2el_ms", "errors", "request_rate", "max_concurrency"}
STATS = {"mean", "median", "p90", "p99", "std"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bench"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "bench_server.log"
    proc = start_server([str(model_dir), "--served-model-name", "tiny", "--kv-cache-memory", "8M",
                         "--max-model-len", "512", "--threads", "1", "--api-key", "sk-bench",
                         "--disable-log-requests", "--log-level", "warning"], log)
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


def fantai(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fantai.cli", *args]
    return subprocess.run(cmd, check=False, env=python_env(), cwd=str(REPO), capture_output=True,
                          text=True, timeout=timeout)


def bench_serve(server: ServerProcess, out: Path, *extra: str) -> dict[str, Any]:
    res = fantai("bench", "serve", "--base-url", server.base_url, "--api-key", "sk-bench",
                 "--json", str(out), "--no-progress", *extra)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Output token throughput (tok/s)" in res.stdout and "P99 TTFT (ms)" in res.stdout
    return json.loads(out.read_text())


def check_run(run: dict[str, Any], num: int) -> None:
    assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
    assert run["completed"] == num and run["failed"] == 0 and not run["errors"]
    # ITL needs two text chunks in a request: a fast engine may pack a short reply into one.
    gaps = run["total_chunks"] > run["completed"]
    for key in ("ttft_ms", "tpot_ms", "e2el_ms") + (("itl_ms",) if gaps else ()):
        assert set(run[key]) == STATS
        assert 0 < run[key]["median"] <= run[key]["p99"] + 1e-9, (key, run[key])
    assert run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
    assert run["request_throughput"] == pytest.approx(num / run["duration_s"])
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
    assert 0 < run["total_chunks"] <= run["total_output_tokens"]


def test_serve_synthetic_sweep_exact_counts(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    data = bench_serve(server, out, "--num-prompts", "8", "--input-len", "32", "--output-len",
                       "16", "--vocab-size", str(VOCAB), "--max-concurrency", "2", "4",
                       "--count-tokens", "--label", "tiny-sweep", "--plot", str(tmp_path / "s.svg"))
    assert data["label"] == "tiny-sweep" and data["model"] == "tiny"
    assert [r["max_concurrency"] for r in data["runs"]] == [2, 4]
    for run in data["runs"]:
        check_run(run, 8)
        # token-id prompts of exact length; ignore_eos: exactly max_tokens each
        assert run["total_input_tokens"] == 8 * 32
        assert run["total_output_tokens"] == 8 * 16
        # every streamed token (counted by its logprob entry) is one the usage reports
        assert run["total_tokens_received"] == run["total_output_tokens"]
    svg = (tmp_path / "s.svg").read_text()
    assert svg.startswith("<svg") and 'data-series="tiny-sweep:output_throughput"' in svg


def test_serve_poisson_jsonl_and_shared_prefix(server: ServerProcess, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"w{10 + i} w{20 + i} w{30 + i}", "max_tokens": 5 + i} for i in range(6)]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    data = bench_serve(server, tmp_path / "j.json", "--dataset", "jsonl", "--dataset-path",
                       str(prompts), "--num-prompts", "6", "--request-rate", "40", "--seed", "3")
    run = data["runs"][0]
    check_run(run, 6)
    assert run["request_rate"] == 40.0 and run["max_concurrency"] is None
    assert run["total_output_tokens"] == sum(x["max_tokens"] for x in lines)
    data = bench_serve(server, tmp_path / "p.json", "--dataset", "shared-prefix", "--prefix-len",
                       "48", "--num-prefixes", "2", "--input-len", "8", "--output-len", "4",
                       "--num-prompts", "6", "--vocab-size", str(VOCAB), "--max-concurrency", "3")
    run = data["runs"][0]
    check_run(run, 6)
    assert run["total_input_tokens"] == 6 * (48 + 8) and run["total_output_tokens"] == 6 * 4


def fake_result(tmp_path: Path, label: str, scale: float) -> Path:
    """A `bench serve` JSON with a concurrency sweep 1, 4, 16."""
    runs = []
    for conc in (1, 4, 16):
        dist = {"mean": scale * conc, "median": scale * conc, "p90": 1.5 * scale * conc,
                "p99": 2 * scale * conc, "std": 0.0}
        runs.append({"max_concurrency": conc, "request_rate": "inf", "num_prompts": 32,
                     "output_throughput": 100.0 * conc / scale, "ttft_ms": dist,
                     "tpot_ms": dist})
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps({"label": label, "runs": runs}))
    return path


def test_plot_svg_compares_runs(tmp_path: Path) -> None:
    a, b = fake_result(tmp_path, "fantai", 1.0), fake_result(tmp_path, "other", 2.0)
    res = fantai("bench", "plot", str(a), str(b), "-o", str(tmp_path / "cmp.svg"))
    assert res.returncode == 0, res.stderr
    svg = (tmp_path / "cmp.svg").read_text()
    for label in ("fantai", "other"):
        for series in ("output_throughput", "ttft_ms:median", "ttft_ms:p99", "tpot_ms:median",
                       "tpot_ms:p99"):
            assert f'data-series="{label}:{series}"' in svg
    assert svg.count("<polyline") == 10 and svg.count("<circle") == 30


def test_plot_png_compares_runs(tmp_path: Path) -> None:
    import matplotlib.image  # requirements-dev.txt: the PNG path is always tested
    import numpy as np
    from fantai.bench.plot import PALETTE

    a, b = fake_result(tmp_path, "fantai", 1.0), fake_result(tmp_path, "other", 2.0)
    res = fantai("bench", "plot", str(a), str(b), "-o", str(tmp_path / "cmp.png"))
    assert res.returncode == 0, res.stderr
    png = tmp_path / "cmp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = (matplotlib.image.imread(str(png))[..., :3] * 255).round()
    for color in PALETTE[:2]:  # each run's series is drawn in its colour
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(axis=-1) <= 8).sum() > 200, color


def test_offline_throughput_and_latency(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    res = fantai("bench", "throughput", str(model_dir), "--num-prompts", "6", "--input-len", "24",
                 "--output-len", "8", "--threads", "1", "--kv-cache-memory", "8M", "--json",
                 str(out), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    t = json.loads(out.read_text())
    assert t["total_input_tokens"] == 6 * 24 and t["total_output_tokens"] == 6 * 8
    assert t["output_throughput"] > 0 and "Throughput:" in res.stdout
    out = tmp_path / "l.json"
    res = fantai("bench", "latency", str(model_dir), "--input-len", "32", "--output-len", "8",
                 "--repeats", "2", "--threads", "1", "--kv-cache-memory", "8M", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    lat = json.loads(out.read_text())
    assert len(lat["prefill_ms_all"]) == 2 and len(lat["decode_ms_per_token_all"]) == 2
    assert lat["prefill_ms"] > 0 and lat["decode_ms_per_token"] > 0
    assert lat["e2e_ms"] >= lat["prefill_ms"] and not math.isnan(lat["decode_tokens_per_s"])
