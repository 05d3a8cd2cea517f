"""Tensor parallelism over MPI on one host: TP = 2 gives TP = 1's greedy tokens and (within a
stated bound) its logprobs, runs the same twice, serves the openai SDK, and a rank killed
mid-request fails the request and ends the server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fantai import _C
from server_fixtures import metric_values, python_env, start_server
from tiny_models import build_tiny_model

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(_C.mpi_unavailable_reason() != "",
                                reason=f"no MPI in this build: {_C.mpi_unavailable_reason()}")

# The row-parallel o and down projections are summed as 2 partials instead of one dot product:
# in f32 each all-reduced element moves by a few ulps of the partials' magnitude (|x| <= ~10 on
# these models, ulp ~1e-6), and logprobs after two layers, the final norm and the lm_head stay
# within ~1e-4; 1e-3 leaves room without hiding a wrong shard (those move logprobs by > 0.1).
LOGPROB_ATOL = 1e-3

VARIANTS = {
    # 4 heads over 2 ranks; one KV head, replicated on both ranks (KV heads < N)
    "llama_kv1": dict(arch="llama", heads=4, kv_heads=1),
    # q/k/v biases (the o bias is absent; an o bias would be added on rank 0 only)
    "qwen2_bias": dict(arch="qwen2", heads=4, kv_heads=2, use_sliding_window=False),
    # head_dim apart from hidden / heads, per-head q/k norms
    "qwen3_qk_norm": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=32, use_sliding_window=False),
    # mixture of experts: each expert split like the dense MLP, the router replicated
    "mixtral_moe": dict(arch="mixtral", heads=4, kv_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        inter=64),
    # a dense layer (mlp_only_layers) beside a sparse one
    "qwen3_moe": dict(arch="qwen3_moe", heads=4, kv_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      inter=64, moe_intermediate_size=32, mlp_only_layers=[1], use_sliding_window=False),
    # two attention kinds (a 16-token window beside full layers), each with its own pool, tables
    # and slots on the step wire; soft-capped scores
    "gemma2_windows": dict(arch="gemma2", heads=4, kv_heads=2, head_dim=16, sliding_window=16,
                           attn_logit_softcapping=2.0, max_pos=4096),
}



def _run(path: Path, tp: int, *extra: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "tp_run.py"), str(path), str(tp), *extra],
                         env=python_env() | {"PYTHONPATH": os.pathsep.join([str(HERE), python_env().get(
                             "PYTHONPATH", "")])}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def test_tp2_matches_tp1_and_repeats(model_dir: Path) -> None:
    """Greedy tokens equal TP = 1's through chunked prefill, preemption and prefix caching;
    logprobs within LOGPROB_ATOL; the second TP = 2 run gives the same bits; no KV leaks."""
    r = _run(model_dir, 2)
    assert r["heads_per_rank"] == 2  # rank 0 really holds half the heads
    ref, tp, again = r["tp1"], r["tp"], r["tp_again"]
    assert ref["preemptions"] > 0  # the small pool really preempts
    assert tp["tokens"] == ref["tokens"]
    for a, b in zip(tp["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    # Run to run the same bits: the all-reduce sums in rank order, never in arrival order.
    assert again["tokens"] == tp["tokens"] and again["logprobs"] == tp["logprobs"]
    for run in (ref, tp, again):
        assert run["free_blocks"] == run["total_blocks"]
    assert r["comm"]["world_size"] == 2 and r["comm"]["all_reduce_calls"] > 0


def test_split_that_cannot_work_names_valid_sizes(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", arch="llama", heads=4, kv_heads=2)
    err = _run(path, 3, "refuse")["error"]
    assert re.search(r"tensor_parallel_size 3 cannot split.*valid sizes: 1, 2, 4$", err), err


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid {pid} (gone)"


def _workers(server_pid: int) -> list[int]:
    return [p for p in _descendants(server_pid)
            if b"fantai.tp_launch" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_served_tp2_answers_and_a_killed_rank_ends_it(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", arch="llama", heads=4, kv_heads=2, max_pos=4096)
    env = python_env() | {"FANTAI_TP_TIMEOUT_S": "2", "FANTAI_TP_EXIT_GRACE_S": "1"}
    server = start_server([str(path), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                           "--kv-cache-memory", "16M", "--max-model-len", "4096",
                           "--disable-log-requests"], tmp_path / "server.log", env=env)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "w10 w11 w12"}]
        reply = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        streamed = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                  stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == reply.choices[0].message.content
        metrics = metric_values(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
        assert metrics["fantai_kv_cache_blocks_used"] == 0
        workers = _workers(server.proc.pid)
        assert len(workers) == 1, workers
        helpers = _descendants(server.proc.pid)
        # A long request is in flight when its rank dies: it gets an error, the server exits.
        stream = client.completions.create(model="tiny", prompt="w10", max_tokens=3000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices
        os.kill(workers[0], signal.SIGKILL)
        killed_at = time.monotonic()
        # The engine aborts the step's requests with the collective's error: the stream ends with
        # finish_reason "abort", or is cut when the process exits first.
        reasons = []
        try:
            for c in chunks:
                reasons += [ch.finish_reason for ch in c.choices if ch.finish_reason]
        except (openai.APIError, httpx.HTTPError):
            reasons.append("cut")
        assert reasons and reasons[-1] in ("abort", "cut"), reasons
        code = server.proc.wait(timeout=10)
        assert time.monotonic() - killed_at < 10
        assert code != 0
        assert "a rank died or hangs" in server.log()
        # The MPI runtime's helpers notice their parent's death on their own clock: give them a
        # few seconds on a loaded machine, then name any that stay.
        names = {p: _cmdline(p) for p in helpers}
        deadline = time.monotonic() + 5
        while [p for p in helpers if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [names[p] for p in helpers if _alive(p)]
        assert not left, f"processes of the server outlived it: {left}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
