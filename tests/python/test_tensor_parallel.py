"""Tensor parallelism over MPI on one host: TP = 2 gives TP = 1's greedy tokens and (within a
stated bound) its logprobs, runs the same twice, serves the openai SDK, and a rank killed
mid-request fails the request and ends the server."""

from __future__ import annotations

import json
import os
import re
import shutil
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


# TP = 3: 6 heads (hidden 96), MLP and expert widths divisible by 3.
VARIANTS_TP3 = {
    # the one KV head replicated on all three ranks
    "llama_kv1": dict(arch="llama", hidden=96, heads=6, kv_heads=1, inter=96),
    # 3 KV heads, one per rank; q/k/v biases
    "qwen2_bias": dict(arch="qwen2", hidden=96, heads=6, kv_heads=3, inter=96, use_sliding_window=False),
    "qwen3_qk_norm": dict(arch="qwen3", hidden=96, heads=6, kv_heads=3, head_dim=32, inter=96,
                          use_sliding_window=False),
    "mixtral_moe": dict(arch="mixtral", hidden=96, heads=6, kv_heads=3, num_local_experts=4,
                        num_experts_per_tok=2, inter=96),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.fixture(scope="module", params=sorted(VARIANTS_TP3))
def model_dir_tp3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param + "_tp3"), **VARIANTS_TP3[request.param])


def test_tp2_matches_tp1_and_repeats(model_dir: Path) -> None:
    """Greedy tokens equal TP = 1's through chunked prefill, preemption and prefix caching;
    logprobs within LOGPROB_ATOL; the second TP = 2 run gives the same bits; no KV leaks."""
    _check_matches_tp1(model_dir, 2)


def test_tp3_matches_tp1_and_repeats(model_dir_tp3: Path) -> None:
    _check_matches_tp1(model_dir_tp3, 3)


def _check_matches_tp1(path: Path, n: int) -> None:
    r = _run(path, n)
    full = json.loads((path / "config.json").read_text())["num_attention_heads"]
    assert r["heads_per_rank"] == full // n  # rank 0 really holds its share of the heads
    ref, tp, again = r["tp1"], r["tp"], r["tp_again"]
    assert ref["preemptions"] > 0  # the small pool really preempts
    assert tp["tokens"] == ref["tokens"]
    for a, b in zip(tp["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    # Run to run the same bits: the all-reduce sums in rank order, never in arrival order.
    assert again["tokens"] == tp["tokens"] and again["logprobs"] == tp["logprobs"]
    for run in (ref, tp, again):
        assert run["free_blocks"] == run["total_blocks"]
    assert r["comm"]["world_size"] == n and r["comm"]["all_reduce_calls"] > 0


@pytest.mark.parametrize("variant", ["llama_kv1", "gemma2_windows"])
def test_tp2_swap_preemption_matches_tp1(variant: str, tmp_path: Path) -> None:
    """Swapped-out sequences come back on every rank (the copies ride the step wire, and a
    step that only swaps sends them alone): TP = 2 swapping equals TP = 1 recomputing."""
    path = build_tiny_model(tmp_path, **VARIANTS[variant])
    r = _run(path, 2, "swap")
    ref, tp = r["tp1"], r["tp"]
    assert ref["preemptions"] > 0 and ref["swap_outs"] == 0
    assert tp["swap_outs"] > 0 and tp["swap_ins"] == tp["swap_outs"], tp
    assert tp["tokens"] == ref["tokens"]
    for a, b in zip(tp["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    assert tp["free_blocks"] == tp["total_blocks"] and tp["free_swap_slots"] == tp["swap_slots"] > 0


def test_tp2_cpu_bind_matches_tp1(tmp_path: Path) -> None:
    """--cpu-bind compact under TP = 2: each rank binds its slice of the host's cores (rank 1
    from place 1 on) and the tokens stay TP = 1's."""
    path = build_tiny_model(tmp_path, **VARIANTS["llama_kv1"])
    r = _run(path, 2, "bind")
    assert r["tp"]["tokens"] == r["tp1"]["tokens"]


# The vocab-parallel lm_head: rank r keeps rows [r V/N, (r+1) V/N), so a vocabulary that N does not
# divide gives slices a row apart (323 = 161 + 162 at TP = 2, 107 + 108 + 108 at TP = 3). Rank 0's
# lm_head must shrink to about its share: a replicated head would keep all V rows. The bound allows
# the packed layouts' padding (whole panels of up to 32 rows).
ODD_VOCAB = 323


def _tied_q8_gguf(path: Path) -> Path:
    """A tiny Llama GGUF whose only lm_head is its Q8_0 embedding (no output.weight), as the
    default model ships; the layers are f32, so only the tied head's slice is under test."""
    import gguf
    from tiny_gguf import gguf_writer, write_gguf

    rng = np.random.default_rng(7)
    hidden, inter, heads, kv = 64, 128, 4, 2
    w = gguf_writer(path, hidden, inter, 2, ODD_VOCAB, heads, kv)
    r = lambda *s: (rng.standard_normal(s) * 0.15).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(r(ODD_VOCAB, hidden), gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", 1 + r(hidden))
    for i in range(2):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden // heads * kv, hidden)),
                            ("attn_v", (hidden // heads * kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                            ("ffn_down", (hidden, inter))):
            w.add_tensor(f"blk.{i}.{name}.weight", r(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + r(hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + r(hidden))
    write_gguf(w)
    return path


@pytest.mark.parametrize("case", ["untied_tp2", "tied_tp3", "tied_q8_0_gguf_tp2"])
def test_vocab_parallel_lm_head_matches_tp1_on_an_odd_vocab(tmp_path: Path, case: str) -> None:
    tp = 3 if case.endswith("tp3") else 2
    if case.startswith("tied_q8_0"):
        path = _tied_q8_gguf(tmp_path / "tied.gguf")
    else:  # 6 heads split 2 or 3 ways (the one KV head replicated)
        path = build_tiny_model(tmp_path / case, vocab_size=ODD_VOCAB, tie=case.startswith("tied"),
                                hidden=96, heads=6, kv_heads=1, inter=192)
    r = _run(path, tp)
    assert r["vocab"] == ODD_VOCAB
    ref, out, again = r["tp1"], r["tp"], r["tp_again"]
    assert out["tokens"] == ref["tokens"]
    for a, b in zip(out["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    assert again["tokens"] == out["tokens"] and again["logprobs"] == out["logprobs"]
    assert r["comm"]["gather_calls"] > 0
    rows0 = ODD_VOCAB // tp  # rank 0's slice: the smallest one
    # What TP = 1 keeps for its head: its own matrix, a packed copy of a tied dense embedding, or
    # (a tied quantized one read in place) the embedding, of which TP = N packs rank 0's rows.
    whole = r["lm_head_bytes"]["tp1"] or r["quant_bytes"].get("model.embed_tokens.weight", 0)
    if whole == 0:  # a tied dense head read from the embedding in place, at any TP size
        assert r["lm_head_bytes"]["tp"] == 0
    else:
        assert 0 < r["lm_head_bytes"]["tp"] <= whole * (rows0 + 32) / ODD_VOCAB


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
        # A client that walks away mid-stream: its blocks come back. Every rank's block tables are
        # rank 0's (sent with each step), so rank 0's count is every rank's.
        gone = client.completions.create(model="tiny", prompt="w10 w11", max_tokens=2000, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
        it = iter(gone)
        next(it), next(it)
        assert metric_values(httpx.get(f"{server.base_url}/metrics", timeout=10).text)[
            "fantai_kv_cache_blocks_used"] > 0
        gone.close()
        deadline, used = time.monotonic() + 10, -1
        while time.monotonic() < deadline:
            used = metric_values(httpx.get(f"{server.base_url}/metrics", timeout=10).text)[
                "fantai_kv_cache_blocks_used"]
            if used == 0:
                break
            time.sleep(0.1)
        assert used == 0
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


# ---- two hosts: one rank in each of two network namespaces, over Open MPI's TCP transport ----
# The namespaces are joined by a veth pair whose addresses exist only inside them; mpirun runs in
# the first and starts the second rank's daemon through a launch agent that enters the second
# (`ip netns exec`), as ssh would on another host. Nothing but TCP over the veth joins the ranks.
NETNS_ADDRS = ("10.213.0.1", "10.213.0.2")
TWO_HOSTS_TIMEOUT_S = 240


def _netns_unavailable(probe: str) -> str:
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for tool in ("ip", "mpirun"):
        if not shutil.which(tool):
            return f"no {tool!r} on PATH"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _sh(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr}"


def _two_host_mpirun(tmp_path: Path, ns: tuple[str, str], args: list[str], timeout: float
                     ) -> subprocess.CompletedProcess:
    agent = tmp_path / "netns_agent.sh"
    agent.write_text("#!/bin/sh\n# mpirun's remote launch agent: 'AGENT [options] HOST COMMAND...'\n"
                     'while [ "${1#-}" != "$1" ]; do shift; done\n'
                     'host=$1; shift\ncase "$host" in\n'
                     + "".join(f"  {a}) ns={n};;\n" for a, n in zip(NETNS_ADDRS, ns))
                     + '  *) echo "netns agent: unknown host $host" >&2; exit 1;;\nesac\n'
                     'exec ip netns exec "$ns" sh -c "$*"\n')
    agent.chmod(0o755)
    subnet = "10.213.0.0/24"
    cmd = ["ip", "netns", "exec", ns[0], "mpirun", "-np", "2", "--host", ",".join(f"{a}:1" for a in NETNS_ADDRS),
           "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self",
           "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
           "--bind-to", "none", sys.executable, *args]
    env = python_env() | {"PYTHONPATH": os.pathsep.join([str(HERE), python_env().get("PYTHONPATH", "")]),
                          "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    # Its own session: on a timeout the whole job (mpirun, its daemon, both ranks) is killed.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the two-host run did not finish within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_two_hosts_in_network_namespaces_match_tp1(tmp_path: Path) -> None:
    """One rank in each of two network namespaces (a veth pair, addresses only inside them),
    joined by mpirun over TCP: the same greedy tokens as TP = 1, logprobs within LOGPROB_ATOL,
    and after the clean stop every rank finalizes MPI, so mpirun exits 0."""
    tag = f"fta{os.getpid() % 100000}"
    ns = (f"{tag}a", f"{tag}b")
    reason = _netns_unavailable(f"{tag}p")
    if reason:
        pytest.skip(f"two-host test needs two network namespaces: {reason}")
    path = build_tiny_model(tmp_path / "m", arch="llama", heads=4, kv_heads=2)
    ref = _run(path, 1, "ref")["tp1"]
    made: list[str] = []
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
            made.append(n)
        # Deleting a namespace deletes the veth end inside it, and so the pair.
        _sh("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for side, (n, addr) in zip("ab", zip(ns, NETNS_ADDRS)):
            _sh("ip", "link", "set", f"{tag}v{side}", "netns", n)
            _sh("ip", "-n", n, "addr", "add", f"{addr}/24", "dev", f"{tag}v{side}")
            _sh("ip", "-n", n, "link", "set", f"{tag}v{side}", "up")
            _sh("ip", "-n", n, "link", "set", "lo", "up")
        res = _two_host_mpirun(tmp_path, ns, [str(HERE / "tp_run.py"), str(path), "2", "mpirun"],
                               TWO_HOSTS_TIMEOUT_S)
        assert res.returncode == 0, f"mpirun exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == 1, res.stdout[-2000:]  # rank 0 alone reports
        r = json.loads(lines[0])
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
    assert r["heads_per_rank"] == 2 and r["comm"]["world_size"] == 2
    assert r["tp"]["tokens"] == ref["tokens"] and r["tp_again"]["tokens"] == ref["tokens"]
    for a, b in zip(r["tp"]["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    assert r["tp_again"]["logprobs"] == r["tp"]["logprobs"]
    assert r["tp"]["free_blocks"] == r["tp"]["total_blocks"]
    print(f"two namespaces: start-up {r['startup_s']:.2f} s, per step {r['per_step_ms']}")


# ---- GPTQ / AWQ checkpoints: split along their quantization groups --------------------------
# (format, bits, group, sym): grouped 4-bit GPTQ, per-channel 8-bit GPTQ (one scale per output
# row, which every column shard keeps), and 4-bit AWQ. Hidden 64, 4 heads, MLP 128: the
# row-parallel o (64 input columns) and down (128) split into whole groups of 32 per rank.
QUANT_CHECKPOINTS = [("gptq", 4, 32, False), ("gptq", 8, -1, True), ("awq", 4, 32, False)]


def _quantized_checkpoint(tmp_path: Path, fmt: str, bits: int, group: int, sym: bool, inter: int = 128,
                          act_order: bool = False) -> Path:
    from test_quant_formats import _write_quantized_twin

    src = build_tiny_model(tmp_path / "src", arch="llama", heads=4, kv_heads=2, inter=inter)
    _write_quantized_twin(src, tmp_path / "q", tmp_path / "dense", fmt, bits, group, sym, act_order)
    return tmp_path / "q"


@pytest.mark.parametrize(("fmt", "bits", "group", "sym"), QUANT_CHECKPOINTS)
def test_gptq_awq_tp2_matches_tp1(tmp_path: Path, fmt: str, bits: int, group: int, sym: bool) -> None:
    """A GPTQ / AWQ checkpoint at TP = 2 gives TP = 1's greedy tokens of the same checkpoint and
    its logprobs within LOGPROB_ATOL (the default int8-activation kernels: their activation
    blocks of 32 never straddle a group, so a rank's blocks are TP = 1's)."""
    r = _run(_quantized_checkpoint(tmp_path, fmt, bits, group, sym), 2)
    ref, tp, again = r["tp1"], r["tp"], r["tp_again"]
    assert r["heads_per_rank"] == 2
    assert tp["tokens"] == ref["tokens"]
    for a, b in zip(tp["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    assert again["tokens"] == tp["tokens"] and again["logprobs"] == tp["logprobs"]
    assert tp["free_blocks"] == tp["total_blocks"]


def test_act_order_gptq_tp2_keeps_o_and_down_whole_and_matches_tp1(tmp_path: Path) -> None:
    """Act-order scatters each group of 32 over the input columns, so no column split of o or
    down keeps groups whole: each rank holds them whole and gathers their input. Those two
    products are then TP = 1's, the column-parallel ones are too, and so are the logits."""
    r = _run(_quantized_checkpoint(tmp_path, "gptq", 4, 32, False, act_order=True), 2)
    ref, tp, again = r["tp1"], r["tp"], r["tp_again"]
    assert r["heads_per_rank"] == 2
    assert tp["tokens"] == ref["tokens"] and tp["logprobs"] == ref["logprobs"]
    assert again["tokens"] == tp["tokens"] and again["logprobs"] == tp["logprobs"]
    assert tp["free_blocks"] == tp["total_blocks"]


def test_gptq_split_that_cuts_a_group_is_refused(tmp_path: Path) -> None:
    # MLP 160: down's 160 input columns give each of 2 ranks 80, not whole groups of 32.
    err = _run(_quantized_checkpoint(tmp_path, "gptq", 4, 32, False, inter=160), 2, "refuse")["error"]
    assert re.search(r"tensor model\.layers\.\d\.mlp\.down_proj\.weight \(int4g32\) cannot be split 2 ways: each "
                     r"rank would take 80 of its 160 input columns, cutting quantization groups of 32; "
                     r"valid sizes: 1$", err), err


# ---- mpirun on one host: a clean stop finalizes MPI, a dead rank still ends the job fast -----
def _mpirun(*args: str) -> list[str]:
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun on PATH")
    return ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, str(HERE / "tp_run.py"), *args]


def _mpirun_env() -> dict[str, str]:
    return python_env() | {"PYTHONPATH": os.pathsep.join([str(HERE), python_env().get("PYTHONPATH", "")]),
                           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                           "FANTAI_TP_TIMEOUT_S": "2", "FANTAI_TP_EXIT_GRACE_S": "1"}


def test_mpirun_job_exits_zero_after_a_clean_stop(tmp_path: Path) -> None:
    """Every rank finalizes MPI after rank 0 stops the group: mpirun's status is 0."""
    path = build_tiny_model(tmp_path / "m", arch="llama", heads=4, kv_heads=2)
    out = subprocess.run(_mpirun(str(path), "2", "mpirun"), env=_mpirun_env(), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert r["comm"]["world_size"] == 2 and r["tp"]["tokens"] == r["tp_again"]["tokens"]


def test_mpirun_job_with_a_killed_rank_exits_nonzero_fast(tmp_path: Path) -> None:
    """The fault path skips MPI_Finalize: a rank killed mid-decode ends the job with a non-zero
    status within 10 s."""
    path = build_tiny_model(tmp_path / "m", arch="llama", heads=4, kv_heads=2, max_pos=4096)
    proc = subprocess.Popen(_mpirun(str(path), "2", "mpirun-long"), env=_mpirun_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("{") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-4000:]
        rank0 = json.loads(line)["ready"]
        time.sleep(0.5)  # decoding
        ranks = [p for p in _descendants(proc.pid) if p != rank0 and b"tp_run.py" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=10)
        assert time.monotonic() - killed_at < 10
        assert code != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_release_memory_returns_kv_pages_on_every_rank(tmp_path: Path) -> None:
    """llm.release_memory() (and --idle-release-seconds) gives back the same blocks' pages on the
    worker as on rank 0: an op on the step wire. Each rank holds half the KV heads, so the
    worker's RSS falls by about what rank 0's resident KV bytes fall."""
    # 8 KV heads of 64 over 4 layers: 8 KiB of KV per token per rank, 3200 tokens ~ 26 MiB each.
    path = build_tiny_model(tmp_path / "m", arch="llama", hidden=512, heads=8, kv_heads=8, layers=4, inter=256)
    r = _run(path, 2, "release")
    assert len(r["worker"]) == 1 and r["released_blocks"] > 0
    rank0_drop = r["rank0_before"] - r["rank0_after"]
    assert rank0_drop > 16 << 20, r
    worker_drop = r["worker_rss_before"][0] - r["worker_rss_after"][0]
    assert worker_drop > rank0_drop // 2, r
