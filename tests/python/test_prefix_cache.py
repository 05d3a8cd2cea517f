"""Automatic prefix caching, n > 1 sharing with copy-on-write, and a KV pool that gives memory back."""

from __future__ import annotations

from pathlib import Path

import pytest
from fantai import _C, LLM, SamplingParams
from tiny_models import build_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("prefix"), layers=2, max_pos=2048)


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_shared_1000_token_prefix_prefills_only_the_suffix(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=512)
    prefix = random_prompts(1, 320, [1000], seed=11)[0]
    first, second = prefix + [21, 22, 23], prefix + [31, 32, 33, 34, 35]
    out1 = llm.generate([first], GREEDY, use_tqdm=False)
    before = llm.stats()["prompt_tokens"]
    out2 = llm.generate([second], GREEDY, use_tqdm=False)
    stats = llm.stats()
    cached = (len(prefix) // 16) * 16  # whole blocks only
    assert stats["prompt_tokens"] - before == len(second) - cached
    assert stats["prefix_cache_hits"] == cached
    no_cache = LLM(str(model_dir), dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    assert tokens(no_cache.generate([first, second], GREEDY, use_tqdm=False)) == tokens(out1) + tokens(out2)
    assert no_cache.stats()["prefix_cache_hits"] == 0


def test_caching_never_changes_outputs(model_dir: Path) -> None:
    system = random_prompts(1, 320, [70], seed=12)[0]
    prompts = [system + p for p in random_prompts(12, 320, [1, 9, 30], seed=13)] + random_prompts(4, 320, [40], seed=14)
    on = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)
    off = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    # Twice: the second pass is served from the cache.
    for _ in range(2):
        assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    assert on.stats()["prefix_cache_hits"] > 0
    assert on.stats()["num_free_blocks"] == on.stats()["num_total_blocks"]


def test_lru_prefers_recent_prefixes_and_reset_drops_them(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=12)  # 192 slots
    a, b = random_prompts(2, 320, [64], seed=15)
    llm.generate([a], GREEDY, use_tqdm=False)
    llm.generate([b], GREEDY, use_tqdm=False)
    llm.generate([a], GREEDY, use_tqdm=False)  # a is now the most recent
    filler = random_prompts(1, 320, [80], seed=16)[0]  # needs more than the clean blocks
    llm.generate([filler], GREEDY, use_tqdm=False)
    assert llm.stats()["evictions"] > 0
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate([a], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] - hits == 48  # a survived (3 of its 4 blocks usable)
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate([b], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] - hits < 48  # b was evicted first
    assert llm.reset_prefix_cache() > 0 and llm.stats()["num_cached_blocks"] == 0
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate([a], GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == hits


@pytest.mark.parametrize("prompt_len,copies", [(21, 3), (32, 0)])
def test_n4_shares_the_prompt_and_copies_on_write_exactly_once_per_diverging_child(
        model_dir: Path, prompt_len: int, copies: int) -> None:
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    prompt = random_prompts(1, 320, [prompt_len], seed=17)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    core = llm.engine
    ps = [_C.SamplingParams() for _ in range(4)]
    for i, p in enumerate(ps):
        p.temperature, p.seed, p.max_tokens, p.ignore_eos = 1.0, 5 + i, 10, True
    core.add_request(1, prompt, ps[0], [(2 + i, p) for i, p in enumerate(ps[1:])])
    core.step()  # prefill + the first token of all four children
    stats = core.stats()
    assert stats["used_slots"] == prompt_len  # the shared prompt is counted once
    assert stats["num_used_blocks"] == (prompt_len + 15) // 16
    while core.has_unfinished():
        core.step()
    assert core.stats()["copy_on_writes"] == copies
    assert core.stats()["num_free_blocks"] == core.stats()["num_total_blocks"]
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    # Each child equals the same seed run alone (sharing changes nothing).
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=6, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0]
    assert first.outputs[1].token_ids == alone.outputs[0].token_ids


def test_preempted_requests_find_their_blocks_again(model_dir: Path) -> None:
    prompts = random_prompts(6, 320, [40, 60], seed=18)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ample = LLM(str(model_dir), dtype="float32", num_kv_blocks=256)
    tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=14)
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == tokens(ample.generate(prompts, params, use_tqdm=False))
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def resident_bytes() -> int:
    # smaps_rollup walks the page tables: exact, unlike statm's per-thread cached counters, which
    # lag behind pages faulted in by the kernel's worker threads.
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Rss line in smaps_rollup")


def test_pool_memory_grows_on_demand_and_is_given_back(tmp_path: Path) -> None:
    # Wide KV (8 heads x 64 dims x 4 layers, f32): 256 KiB per block, so the pool's pages dominate.
    path = build_tiny_model(tmp_path / "wide", layers=4, hidden=512, heads=8, kv_heads=8, inter=256,
                            max_pos=2048)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=1024, enable_prefix_caching=False)  # 256 MiB
    block = llm.stats()["bytes_per_block"]
    assert block == 4 * 2 * 8 * 16 * 64 * 4
    # The pool's own pages (mincore), so other allocations of this test process can't blur it.
    assert llm.engine.kv_resident_bytes() < 8 * block  # reserved, not committed
    prompts = random_prompts(16, 320, [300], seed=19)
    burst = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    touched = llm.engine.kv_resident_bytes()
    assert touched >= 16 * 19 * block  # 16 sequences of 312 tokens: 20 blocks each, all written
    rss_burst = resident_bytes()
    assert llm.release_memory() == 1024
    assert llm.engine.kv_resident_bytes() < 8 * block
    assert rss_burst - resident_bytes() > touched - 8 * block  # the process really gave it back
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == burst  # grows again, same output
    assert llm.engine.kv_resident_bytes() >= 16 * 19 * block
