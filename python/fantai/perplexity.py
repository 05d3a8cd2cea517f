"""Perplexity over non-overlapping windows through the core's scoring path (Model.score).

Every window of `context` tokens (the last one may be shorter, if it has two tokens or more) is
scored from scratch; each token but a window's first is predicted from the ones before it in the
window. The result is the mean negative log-likelihood over all predicted tokens and exp of it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

DEFAULT_TEXT = os.path.join("bench", "data", "python_execmodel_import.txt")


def windows(ids: Sequence[int], context: int) -> list[list[int]]:
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    out = [list(ids[i:i + context]) for i in range(0, len(ids), context)]
    return [w for w in out if len(w) >= 2]


def window_nll(logits: np.ndarray, window: Sequence[int]) -> tuple[float, int]:
    """Summed NLL of window[1:] given logits [len, vocab] (row j predicts token j + 1)."""
    x = np.asarray(logits[:-1], dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(axis=1)))
    target = np.asarray(window[1:], dtype=np.int64)
    picked = x[np.arange(len(target)), target]
    return float((lse - picked).sum()), len(target)


def perplexity(score: Callable[[list[int]], np.ndarray], ids: Sequence[int], context: int) -> dict[str, Any]:
    """score(window ids) -> logits [len, vocab]; returns nll, ppl, token counts and timing."""
    wins = windows(ids, context)
    if not wins:
        raise ValueError("text too short: need at least two tokens")
    total, count = 0.0, 0
    start = time.perf_counter()
    for w in wins:
        nll, n = window_nll(score(w), w)
        total += nll
        count += n
    mean = total / count
    return {"tokens": len(ids), "windows": len(wins), "context": context, "predicted_tokens": count,
            "nll": mean, "perplexity": math.exp(mean), "seconds": time.perf_counter() - start}


def default_text_path() -> str:
    """bench/data's text in a source checkout (the package does not ship it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(here))):
        candidate = os.path.join(root, DEFAULT_TEXT)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"no --text given and {DEFAULT_TEXT} not found from {os.getcwd()}")


def evaluate(model: str | None, text_file: str | None = None, context: int = 512, dtype: str = "auto",
             quantization: str = "none", dequantize: bool = False, threads: int | None = None) -> dict[str, Any]:
    from fantai.loader import load_model

    path = text_file or default_text_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    loaded = load_model(model, dtype, threads, quantization=quantization, dequantize=dequantize)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    result = perplexity(lambda w: loaded.model.score(w), ids, context)
    result.update({"model": loaded.path, "text": path, "dtype": loaded.model.dtype, "quantization": quantization,
                   "dequantize": dequantize, "weight_bytes": loaded.model.weight_bytes(),
                   "load_seconds": loaded.load_seconds})
    return result
