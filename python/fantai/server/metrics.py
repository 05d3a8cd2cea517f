"""Server room: Prometheus text metrics (requests, tokens, latency histograms, KV blocks)."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Any

from fantai.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_PREFIX = "fantai_"


@dataclass(slots=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        name = _PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


def _metric(kind: str, name: str, help_text: str, samples: list[tuple[str, Any]]) -> list[str]:
    full = _PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{labels} {value}" for labels, value in samples]
    return lines


class ServerMetrics:
    """Counters and histograms fed once per finished request; gauges read from engine.stats()."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.")
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per request.")
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = Histogram("request_queue_time_seconds", "Arrival to first scheduling.")

    def record(self, out: RequestOutput) -> None:
        """Account one finished engine request (all of its n outputs)."""
        for comp in out.outputs:
            reason = comp.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.generation_tokens += len(comp.token_ids)
        self.prompt_tokens += len(out.prompt_token_ids)
        self._observe_times(out)

    def _observe_times(self, out: RequestOutput) -> None:
        m = out.metrics
        arrival, done = m.get("arrival_time"), m.get("finished_time")
        first = m.get("first_token_time")
        if arrival is None or done is None:
            return
        self.e2e.observe(max(done - arrival, 0.0))
        scheduled = m.get("first_scheduled_time")
        if scheduled is not None:
            self.queue.observe(max(scheduled - arrival, 0.0))
        if first is None:
            return
        self.ttft.observe(max(first - arrival, 0.0))
        generated = max((len(c.token_ids) for c in out.outputs), default=0)
        if generated > 1:
            self.tpot.observe(max(done - first, 0.0) / (generated - 1))

    def render(self, stats: dict[str, Any]) -> str:
        """The /metrics body; `stats` is engine.stats()."""
        lines: list[str] = []
        lines += _metric("gauge", "num_requests_running", "Requests in the running batch.",
                         [("", stats.get("num_running", 0))])
        lines += _metric("gauge", "num_requests_waiting", "Requests waiting to be scheduled.",
                         [("", stats.get("num_waiting", 0))])
        lines += _metric("counter", "request_success_total", "Finished sequences by reason.",
                         [(f'{{finished_reason="{k}"}}', v)
                          for k, v in sorted(self.finished.items())])
        lines += _metric("counter", "prompt_tokens_total", "Prefilled prompt tokens.",
                         [("", self.prompt_tokens)])
        lines += _metric("counter", "generation_tokens_total", "Generated tokens.",
                         [("", self.generation_tokens)])
        for hist in (self.ttft, self.tpot, self.e2e, self.queue):
            lines += hist.render()
        lines += self._kv_lines(stats)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _kv_lines(stats: dict[str, Any]) -> list[str]:
        total = int(stats.get("num_total_blocks", 0))
        used = int(stats.get("num_used_blocks", total - int(stats.get("num_free_blocks", total))))
        allocated = stats.get("allocated_slots", 0) or 0
        util = stats.get("kv_utilization")
        if util is None:
            util = (stats.get("used_slots", 0) / allocated) if allocated else 0.0
        lines = _metric("gauge", "kv_cache_blocks_used", "KV blocks allocated to requests.",
                        [("", used)])
        lines += _metric("gauge", "kv_cache_blocks_total", "KV blocks in the pool.", [("", total)])
        # One pool per attention kind (full, each sliding window): the totals above are their sums.
        kinds = stats.get("kv_kinds") or []
        lines += _metric("gauge", "kv_cache_kind_blocks_used", "KV blocks allocated, per attention kind.",
                         [(f'{{kind="{k["kind"]}"}}', k["num_used_blocks"]) for k in kinds])
        lines += _metric("gauge", "kv_cache_kind_blocks_total", "KV blocks in the pool, per attention kind.",
                         [(f'{{kind="{k["kind"]}"}}', k["num_total_blocks"]) for k in kinds])
        lines += _metric("gauge", "kv_cache_utilization", "Used / allocated KV slots.",
                         [("", float(util))])
        lines += _metric("counter", "num_preemptions_total", "Preempted requests.",
                         [("", stats.get("num_preemptions", 0))])
        # Of those, swapped to host memory (the rest recompute); vLLM's names for the gauges.
        lines += _metric("counter", "num_swap_outs_total", "Preempted requests whose KV was swapped out.",
                         [("", stats.get("num_swap_outs", 0))])
        lines += _metric("gauge", "num_requests_swapped", "Waiting requests whose KV is in swap space.",
                         [("", stats.get("num_swapped", 0))])
        slots = int(stats.get("num_swap_slots", 0))
        lines += _metric("gauge", "cpu_cache_usage_perc", "Share of the swap space in use.",
                         [("", (slots - int(stats.get("num_free_swap_slots", 0))) / slots if slots else 0.0)])
        lines += _metric("gauge", "kv_cache_blocks_cached", "Unowned blocks kept for prefix reuse.",
                         [("", stats.get("num_cached_blocks", 0))])
        lines += _metric("gauge", "kv_cache_blocks_free", "Free KV blocks (clean + cached).",
                         [("", stats.get("num_free_blocks", 0))])
        lines += _metric("counter", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                         [("", stats.get("prefix_cache_queries", 0))])
        lines += _metric("counter", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                         [("", stats.get("prefix_cache_hits", 0))])
        lines += _metric("gauge", "prefix_cache_hit_rate", "Hits / queries, in tokens.",
                         [("", float(stats.get("prefix_cache_hit_rate", 0.0)))])
        lines += _metric("counter", "kv_cache_evictions_total", "Cached blocks evicted for new content.",
                         [("", stats.get("evictions", 0))])
        lines += _metric("gauge", "kv_cache_resident_bytes", "KV pool bytes backed by memory now.",
                         [("", stats.get("kv_resident_bytes", 0))])
        lines += _metric("gauge", "process_resident_memory_bytes", "Resident memory of the server.",
                         [("", _resident_bytes())])
        return lines


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
