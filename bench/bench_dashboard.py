#!/usr/bin/env python3
"""Bench room: what a connected /dashboard costs the server. Runs the same seeded `bench serve`
workload against one `fantai serve`, alternating rounds with no dashboard client and with N SSE
clients reading /dashboard/stream, and prints output tokens/s and TPOT for both.

    python bench/bench_dashboard.py --threads 2 --rounds 3
    python bench/bench_dashboard.py --model-path /path/to/model --clients 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import launch_server
from fantai.bench.serve import ServeTarget, bench_serve
from fantai.bench.workloads import synthetic


class DashboardClients:
    """N threads reading the SSE stream, as many browsers would (counts messages and bytes)."""

    def __init__(self, base_url: str, count: int) -> None:
        self.base_url, self.count = base_url, count
        self.stop = threading.Event()
        self.messages = 0
        self.bytes = 0
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(count)]

    def _read(self) -> None:
        with httpx.stream("GET", f"{self.base_url}/dashboard/stream", timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.messages += 1
                    self.bytes += len(line)
                if self.stop.is_set():
                    return

    def __enter__(self) -> DashboardClients:  # noqa: PYI034
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (less sensitive to a busy machine than wall)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cost(url: str, pid: int, clients: int, seconds: float) -> float:
    """Server CPU seconds per wall second while idle, with `clients` dashboards connected."""
    with DashboardClients(url, clients) if clients else contextlib.nullcontext():
        time.sleep(1.0)  # connected and the first snapshot published
        start = cpu_seconds(pid)
        time.sleep(seconds)
        return (cpu_seconds(pid) - start) / seconds


def one_round(url: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    # Same prompts every run, each against a cold prefix cache: runs differ only in the clients.
    httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
    reqs = synthetic(args.num_prompts, args.input_len, args.output_len, 0.0, args.seed, vocab)
    target = ServeTarget(url)
    result = asyncio.run(bench_serve(target, reqs, [float("inf")], [args.concurrency], args.seed,
                                     warmup=1, progress=False))
    run = result["runs"][0]
    return {"output_tok_s": run["output_throughput"], "tpot_ms": run["tpot_ms"]["median"],
            "ttft_ms": run["ttft_ms"]["median"]}


def timed_round(url: str, args: argparse.Namespace, pid: int) -> dict[str, float]:
    start = cpu_seconds(pid)
    out = one_round(url, args, args.vocab_size)
    tokens = args.num_prompts * args.output_len
    out["server_cpu_ms_per_token"] = (cpu_seconds(pid) - start) / tokens * 1e3
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--vocab-size", type=int, default=49152, help="token-id prompts below this")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--clients", type=int, default=1, help="dashboard SSE clients in 'on' rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=10.0, help="idle CPU measurement")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    launch = argparse.Namespace(model_path=args.model_path, concurrency=[args.concurrency],
                                threads=args.threads, server_arg=args.server_arg,
                                launch_timeout=args.launch_timeout)
    proc, url, _, _ = launch_server(launch)
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        idle = {n: idle_cost(url, proc.pid, n, args.idle_seconds) for n in (0, args.clients)}
        print(f"idle server CPU: {idle[0] * 100:.2f}% of a core without a dashboard, "
              f"{idle[args.clients] * 100:.2f}% with {args.clients} client(s)", flush=True)
        for i in range(args.rounds):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                if mode == "on":
                    with DashboardClients(url, args.clients) as dash:
                        results[mode].append(timed_round(url, args, proc.pid))
                    print(f"round {i} on : {results[mode][-1]} ({dash.messages} messages, "
                          f"{dash.bytes / max(dash.messages, 1):.0f} B each)", flush=True)
                else:
                    results[mode].append(timed_round(url, args, proc.pid))
                    print(f"round {i} off: {results[mode][-1]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    off = statistics.median(r["output_tok_s"] for r in results["off"])
    on = statistics.median(r["output_tok_s"] for r in results["on"])
    tpot_off = statistics.median(r["tpot_ms"] for r in results["off"])
    tpot_on = statistics.median(r["tpot_ms"] for r in results["on"])
    cpu_off = statistics.median(r["server_cpu_ms_per_token"] for r in results["off"])
    cpu_on = statistics.median(r["server_cpu_ms_per_token"] for r in results["on"])
    print(f"median server CPU per output token: off {cpu_off:.2f} ms, on {cpu_on:.2f} ms "
          f"({(cpu_on / cpu_off - 1) * 100:+.1f}%)")
    # Rounds run back to back, so a paired ratio cancels most of the drift of a shared machine.
    ratios = [b["output_tok_s"] / a["output_tok_s"] for a, b in zip(results["off"], results["on"])]
    print(f"median output tok/s: off {off:.1f}, on {on:.1f} ({(on / off - 1) * 100:+.1f}%); "
          f"median TPOT ms: off {tpot_off:.2f}, on {tpot_on:.2f}; median paired on/off "
          f"{statistics.median(ratios):.3f} (per round: {', '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
