"""Every sampling parameter changes what comes out (through LLM.generate), and seeds reproduce."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fantai import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_logits, hf_model, random_prompts

PROMPT = [11, 12, 13, 14, 15, 16]
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampling"), layers=2, seed=7)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=256, seed=1234)


def run(llm: LLM, **kw: object) -> list[int]:
    kw.setdefault("max_tokens", 12)
    return llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids


def greedy(llm: LLM, **kw: object) -> list[int]:
    return run(llm, temperature=0.0, ignore_eos=True, **kw)


def test_seed_reproducible_across_runs_and_batch_composition(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(5, 320, [4, 30], seed=9)
    mixed = llm.generate(others[:2] + [PROMPT] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=25)] * 2 + [params]
                         + [SamplingParams(temperature=0.7, max_tokens=7)] * 3, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    assert run(llm, temperature=1.0, seed=42, max_tokens=20, ignore_eos=True) == alone
    assert run(llm, temperature=1.0, seed=43, max_tokens=20, ignore_eos=True) != alone


def test_temperature_changes_output(llm: LLM) -> None:
    base = greedy(llm)
    sampled = [run(llm, temperature=5.0, seed=s, ignore_eos=True) for s in range(4)]
    assert any(s != base for s in sampled)


def test_top_k_top_p_min_p_restrict_to_the_best_token(llm: LLM) -> None:
    base = greedy(llm)
    hot = dict(temperature=10.0, seed=5, ignore_eos=True)
    assert run(llm, top_k=1, **hot) == base
    assert run(llm, top_p=1e-6, **hot) == base
    assert run(llm, min_p=1.0, **hot) == base
    assert run(llm, **hot) != base


def test_top_k_two_only_yields_the_two_best(llm: LLM, model_dir: Path) -> None:
    logits = hf_logits(hf_model(model_dir), PROMPT)[-1]
    best2 = set(torch.topk(logits, 2).indices.tolist())
    firsts = {run(llm, temperature=50.0, top_k=2, seed=s, max_tokens=1)[0] for s in range(30)}
    assert firsts <= best2 and len(firsts) == 2


def test_penalties_reduce_repetition(llm: LLM) -> None:
    base = greedy(llm, max_tokens=24)
    def repeats(t: list[int]) -> int:
        return len(t) - len(set(t))
    assert repeats(base) > 0, "the tiny model should repeat itself greedily"
    for kw in ({"repetition_penalty": 5.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert repeats(greedy(llm, max_tokens=24, **kw)) < repeats(base), kw


def test_logit_bias_stop_ids_min_tokens_and_ignore_eos(llm: LLM) -> None:
    assert greedy(llm, logit_bias={77: 100.0}) == [77] * 12
    base = greedy(llm)
    stop_id = base[3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, stop_token_ids=[stop_id], max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    eos_bias = {EOS: 100.0}
    assert run(llm, temperature=0, logit_bias=eos_bias) == [EOS]
    forced = run(llm, temperature=0, logit_bias=eos_bias, min_tokens=5)
    assert len(forced) == 6 and EOS not in forced[:5] and forced[5] == EOS
    assert run(llm, temperature=0, logit_bias=eos_bias, ignore_eos=True) == [EOS] * 12
    length = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert length[0].outputs[0].finish_reason == "length" and len(length[0].outputs[0].token_ids) == 3


def test_logprobs_match_transformers(llm: LLM, model_dir: Path) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(hf_logits(hf_model(model_dir), PROMPT)[-1], dim=-1)
    top = torch.topk(ref, 3)
    entry = out.logprobs[0]
    assert set(entry) == set(top.indices.tolist())
    for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert math.isclose(entry[tid].logprob, value, abs_tol=1e-4) and entry[tid].rank == rank
    assert out.cumulative_logprob == pytest.approx(entry[out.token_ids[0]].logprob)


def test_n_and_best_of(llm: LLM) -> None:
    res = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(res.outputs) == 3 and len({tuple(o.token_ids) for o in res.outputs}) > 1
    again = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in res.outputs]
    best = llm.generate([PROMPT], SamplingParams(n=1, best_of=4, temperature=1.0, seed=3, max_tokens=10,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert len(best.outputs) == 1
    assert best.outputs[0].cumulative_logprob >= max(o.cumulative_logprob for o in res.outputs[:3]) - 1e-6


def test_stop_string_spanning_tokens(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    words = text.split(" ")
    stop = words[2][-1:] + " " + words[3][:2]  # ends one token, starts the next
    cut = text.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
