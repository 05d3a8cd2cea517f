"""Bench room: per-request records and the summary figures `fantai bench serve` reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds from the moment it was sent."""

    ok: bool
    prompt_tokens: int = 0      # usage.prompt_tokens (the server's count)
    output_tokens: int = 0      # usage.completion_tokens
    chunks: int = 0             # streamed chunks that carried text (a server may pack tokens)
    tokens_received: int = 0    # tokens counted from streamed logprobs (with count_tokens)
    ttft: float = 0.0           # to the first chunk with text
    e2el: float = 0.0           # to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (server tokens, not chunks)."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 / std in milliseconds (NaN when empty)."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "std")}
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return {"mean": mean, "median": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "std": std}


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """The figures of one run (what `vllm bench serve` reports, plus chunk counts)."""
    ok = [r for r in records if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    return {
        "num_prompts": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration, "total_input_tokens": inp, "total_output_tokens": out,
        "total_chunks": sum(r.chunks for r in ok),
        "total_tokens_received": sum(r.tokens_received for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([t for t in (r.tpot for r in ok) if t is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2el_ms": distribution_ms([r.e2el for r in ok]),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        # Per-request extremes, so a caller can tell every request got exactly what it asked for
        # (equal totals could hide one short and one long reply).
        "min_output_tokens": min((r.output_tokens for r in ok), default=0),
        "max_output_tokens": max((r.output_tokens for r in ok), default=0),
    }


def format_table(run: dict[str, Any], title: str) -> str:
    """A fixed-width report of one run."""
    lines = [f"{'=' * 20} {title} {'=' * 20}"]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<40}{text:>14}")

    for key, name in (("completed", "Successful requests"), ("failed", "Failed requests"),
                      ("duration_s", "Benchmark duration (s)"),
                      ("total_input_tokens", "Total input tokens"),
                      ("total_output_tokens", "Total generated tokens"),
                      ("total_chunks", "Total streamed chunks"),
                      ("total_tokens_received", "Tokens received (streamed logprobs)"),
                      ("request_throughput", "Request throughput (req/s)"),
                      ("output_throughput", "Output token throughput (tok/s)"),
                      ("total_token_throughput", "Total token throughput (tok/s)")):
        row(name, run[key])
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 12} {name} {'-' * 12}")
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {key[:-3].upper()} (ms)",
                run[key][stat])
    for err in run["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)
