"""Bench room: offline throughput through `LLM` and single-request latency (prefill vs decode)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from fantai.bench.workloads import synthetic


def _vocab_size(llm: Any) -> int:
    return int(llm._model.config.vocab_size)


def _random_ids(llm: Any, length: int, seed: int) -> list[int]:
    prompt = synthetic(1, length, 1, 0.0, seed, _vocab_size(llm))[0].prompt
    assert isinstance(prompt, list)  # token ids: a vocab size was given
    return prompt


def throughput(llm: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
               seed: int, progress: bool = True) -> dict[str, Any]:
    """All prompts (seeded random token ids) submitted at once; EOS ignored, greedy."""
    from fantai import SamplingParams

    reqs = synthetic(num_prompts, input_len, output_len, range_ratio, seed, _vocab_size(llm))
    prompts = [r.prompt for r in reqs if isinstance(r.prompt, list)]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"num_prompts": num_prompts, "elapsed_s": elapsed, "total_input_tokens": n_in,
            "total_output_tokens": n_out, "request_throughput": num_prompts / elapsed,
            "output_throughput": n_out / elapsed, "total_token_throughput": (n_in + n_out) / elapsed}


def _timed_request(llm: Any, prompt: list[int], output_len: int) -> list[float]:
    """Runs one request through the engine's step loop; seconds from submit to each token."""
    from fantai import SamplingParams
    from fantai.requests import RequestState

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    state = RequestState.create("latency", None, prompt, params, llm.tokenizer)
    core = state.core_requests(llm.max_model_len)
    stamps: list[float] = []
    start = time.perf_counter()
    llm.engine.add_request(core[0][0], prompt, core[0][1])
    while llm.engine.has_unfinished():
        outs = llm.engine.step()
        now = time.perf_counter()
        stamps += [now - start for o in outs for _ in o.token_ids]
    return stamps


def latency(llm: Any, input_len: int, output_len: int, repeats: int, seed: int) -> dict[str, Any]:
    """One request at a time: prefill = submit to first token; decode = the rest per token.
    Prefix caching would make repeats 2.. free prefills, so every repeat gets a new prompt."""
    prefill, decode, total = [], [], []
    _timed_request(llm, _random_ids(llm, input_len, seed - 1), 2)  # warm-up, not counted
    for i in range(repeats):
        stamps = _timed_request(llm, _random_ids(llm, input_len, seed + i), output_len)
        prefill.append(stamps[0])
        total.append(stamps[-1])
        if len(stamps) > 1:
            decode.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    p, d = statistics.median(prefill), statistics.median(decode) if decode else float("nan")
    return {"input_len": input_len, "output_len": output_len, "repeats": repeats,
            "prefill_ms": p * 1e3, "prefill_tokens_per_s": input_len / p,
            "decode_ms_per_token": d * 1e3, "decode_tokens_per_s": 1.0 / d if d else float("nan"),
            "e2e_ms": statistics.median(total) * 1e3,
            "prefill_ms_all": [x * 1e3 for x in prefill],
            "decode_ms_per_token_all": [x * 1e3 for x in decode]}
