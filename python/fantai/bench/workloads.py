"""Bench room: seeded workloads (synthetic lengths, a JSONL file of prompts, shared prefixes)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

Prompt = str | list[int]
# Common words: about one token each for BPE vocabularies, so a word count tracks the token count.
WORDS = (  # noqa: SIM905
    "the of and to in is was for on that with as by at from his her they this which river "
    "mountain engine memory token cache batch signal garden window market story quickly slowly "
    "bright silent ancient modern simple careful").split()


@dataclass(slots=True)
class BenchRequest:
    prompt: Prompt       # text, or token ids (exact lengths; fantai and vLLM accept them)
    max_tokens: int


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


def _text_or_ids(rng: random.Random, length: int, vocab_size: int | None) -> Prompt:
    if vocab_size:  # skip the lowest ids: special and control tokens usually live there
        low = min(16, vocab_size // 4)
        return [rng.randrange(low, vocab_size) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


def synthetic(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
              vocab_size: int | None = None) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = _lengths(rng, input_len, range_ratio)
        n_out = _lengths(rng, output_len, range_ratio)
        out.append(BenchRequest(_text_or_ids(rng, n_in, vocab_size), n_out))
    return out


def shared_prefix(num: int, prefix_len: int, num_prefixes: int, input_len: int, output_len: int,
                  seed: int, vocab_size: int | None = None) -> list[BenchRequest]:
    """Each prompt: one of `num_prefixes` shared prefixes, then its own `input_len` suffix (the
    prefix cache's best case: system prompts, few-shot examples)."""
    rng = random.Random(seed)
    prefixes = [_text_or_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        prefix, suffix = prefixes[i % num_prefixes], _text_or_ids(rng, input_len, vocab_size)
        prompt: Prompt = (prefix + suffix if isinstance(prefix, list) and isinstance(suffix, list)
                          else f"{prefix} {suffix}")
        out.append(BenchRequest(prompt, output_len))
    rng.shuffle(out)
    return out


def from_jsonl(path: str | Path, num: int | None, output_len: int, seed: int) -> list[BenchRequest]:
    """Lines of {"prompt": text or token ids, "max_tokens"?: int}; `num` sampled with the seed
    (all, in file order, when num is None or covers the file)."""
    items = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            items.append(BenchRequest(obj["prompt"], int(obj.get("max_tokens", output_len))))
    if num is not None and num < len(items):
        items = random.Random(seed).sample(items, num)
    return items


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals at `rate` req/s (inf: all at once)."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]
