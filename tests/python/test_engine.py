"""Continuous batching behaviour: batch invariance, chunked prefill, preemption, aborts, no leaks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fantai import _C, LLM, SamplingParams
from tiny_models import build_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine"), layers=3, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=512)


@pytest.fixture(autouse=True)
def no_leaked_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "llm" in request.fixturenames:
        stats = request.getfixturevalue("llm").stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_32_equals_each_alone(llm: LLM) -> None:
    prompts = random_prompts(32, 320, [1, 5, 16, 17, 33, 64, 90, 130], seed=3)
    batched = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 16 for t in batched)


@pytest.mark.parametrize("budget,chunked", [(16, True), (7, True), (512, False)])
def test_chunked_prefill_gives_same_tokens(model_dir: Path, llm: LLM, budget: int, chunked: bool) -> None:
    prompts = random_prompts(6, 320, [3, 40, 100], seed=4)
    reference = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=512, max_num_batched_tokens=budget,
                enable_chunked_prefill=chunked)
    assert tokens(small.generate(prompts, GREEDY, use_tqdm=False)) == reference
    prompt_tokens = sum(len(p) for p in prompts)
    assert small.stats()["prompt_tokens"] >= prompt_tokens
    if chunked:  # no step may take more than `budget` tokens, so prefill alone needs this many
        assert small.stats()["num_steps"] >= -(-prompt_tokens // budget)


def test_preemption_keeps_every_request_and_its_tokens(model_dir: Path, llm: LLM) -> None:
    prompts = random_prompts(8, 320, [30, 20, 41], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = tokens(llm.generate(prompts, params, use_tqdm=False))
    tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=10)  # 160 slots for ~560 tokens
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == ample
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(8)]


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_swap_preemption_resumes_without_recomputing(model_dir: Path, kv_cache_dtype: str) -> None:
    """Preempted sequences swapped to host memory come back with their KV: the same greedy and
    seeded tokens as a pool that never preempts, and no prompt token computed twice (a recompute
    run computes more). int8 KV swaps its per-token scales with the values."""
    prompts = random_prompts(8, 320, [30, 20, 41], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(str(model_dir), dtype="float32", num_kv_blocks=512, kv_cache_dtype=kv_cache_dtype)
    want = [tokens(ample.generate(prompts, p, use_tqdm=False)) for p in (greedy, SEEDED)]
    runs = {}
    for mode in ("swap", "recompute"):
        # Prefix caching off, so every prefilled token is counted (no hits to subtract).
        tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=10, kv_cache_dtype=kv_cache_dtype,
                    swap_space="4M", preemption_mode=mode, enable_prefix_caching=False)
        got = [tokens(tight.generate(prompts, p, use_tqdm=False)) for p in (greedy, SEEDED)]
        assert got == want, mode
        runs[mode] = tight.stats()
    swap, recompute = runs["swap"], runs["recompute"]
    assert swap["num_preemptions"] > 0 and swap["num_swap_outs"] == swap["num_preemptions"], swap
    assert swap["num_swap_ins"] == swap["num_swap_outs"]
    assert swap["prompt_tokens"] == 2 * sum(len(p) for p in prompts)  # once per prompt and run
    assert recompute["num_swap_outs"] == 0 and recompute["prompt_tokens"] > swap["prompt_tokens"]
    assert swap["num_free_swap_slots"] == swap["num_swap_slots"] > 0 and swap["num_swapped"] == 0
    assert swap["num_free_blocks"] == swap["num_total_blocks"]


def test_swap_space_too_small_falls_back_to_recompute(model_dir: Path) -> None:
    prompts = random_prompts(8, 320, [30, 20, 41], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(str(model_dir), dtype="float32", num_kv_blocks=512)
    per_block = ample.stats()["bytes_per_block"]
    tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space=f"{3 * per_block}B",
                preemption_mode="swap")
    assert tight.stats()["num_swap_slots"] == 3
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == tokens(
        ample.generate(prompts, params, use_tqdm=False))
    stats = tight.stats()
    # A victim of more than 3 blocks cannot be swapped: those preemptions recompute.
    assert 0 < stats["num_swap_outs"] < stats["num_preemptions"], stats
    assert stats["num_free_swap_slots"] == 3 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_auto_preemption_keeps_every_token(model_dir: Path) -> None:
    """auto picks swap or recompute per victim from measured costs; either way nothing is lost."""
    prompts = random_prompts(8, 320, [30, 20, 41], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(str(model_dir), dtype="float32", num_kv_blocks=512)
    tight = LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space=0.01)
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == tokens(
        ample.generate(prompts, params, use_tqdm=False))
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert stats["num_free_swap_slots"] == stats["num_swap_slots"] > 0


def test_aborting_a_swapped_request_frees_its_swap_slots(model_dir: Path) -> None:
    model = LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space="4M", preemption_mode="swap")
    engine = model.engine
    p = _C.SamplingParams()
    p.temperature, p.max_tokens, p.ignore_eos = 0.0, 60, True
    for i, prompt in enumerate(random_prompts(6, 320, [30, 20, 41], seed=7)):
        engine.add_request(i, prompt, p)
    swapped = []
    for _ in range(200):
        engine.step()
        swapped = [r["id"] for r in engine.snapshot()["requests"] if r["status"] == "swapped"]
        if swapped:
            break
    assert swapped, "no request was swapped out"
    held = engine.stats()["num_swap_slots"] - engine.stats()["num_free_swap_slots"]
    assert held > 0 and engine.stats()["num_swapped"] == len(swapped)
    assert engine.abort_request(swapped[0])
    assert engine.stats()["num_swap_slots"] - engine.stats()["num_free_swap_slots"] < held
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_free_swap_slots"] == stats["num_swap_slots"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # Used swap slots stay backed until release_memory() gives every free slot's pages back.
    assert engine.swap_resident_bytes() > 0
    engine.release_memory()
    assert engine.swap_resident_bytes() <= 2 * 4096, engine.swap_resident_bytes()


def test_swap_options_are_checked(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs swap space"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=10, preemption_mode="swap")
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space="100B")
    with pytest.raises(ValueError, match="host memory"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space=1 << 20)  # 1 PiB
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=10, swap_space=-1)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=10, preemption_mode="sometimes")


def test_sequence_larger_than_the_pool_finishes_with_length(model_dir: Path) -> None:
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=2, block_size=8)  # 16 slots
    out = small.generate([[7] * 10], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].outputs[0].token_ids) < 50
    assert small.stats()["num_free_blocks"] == 2


def test_abort_frees_blocks_at_any_stage(model_dir: Path) -> None:
    model = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    engine = model.engine
    p = _C.SamplingParams()
    p.temperature, p.max_tokens, p.ignore_eos = 0.0, 30, True
    engine.add_request(1, list(range(10, 50)), p)  # long prompt: mid-prefill after one step
    engine.add_request(2, [5, 6, 7], p)
    engine.add_request(3, [8, 9], p)
    engine.step()
    assert engine.stats()["num_used_blocks"] > 0
    assert engine.abort_request(1)  # mid-prefill
    for _ in range(6):
        engine.step()
    assert engine.abort_request(2)  # decoding
    assert not engine.abort_request(2) and not engine.abort_request(999)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["used_slots"] == 0


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 99999]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="1024"):
        llm.generate([[5] * 1030], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5, 6]], SamplingParams(temperature=-1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    assert len(tokens(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False))[0]) == 16


def test_kv_utilization_is_exact(model_dir: Path) -> None:
    model = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16)
    p = _C.SamplingParams()
    p.temperature, p.max_tokens, p.ignore_eos = 0.0, 5, True
    model.engine.add_request(1, list(range(10, 31)), p)  # 21 tokens -> 2 blocks
    model.engine.add_request(2, [5, 6, 7], p)            # 3 tokens -> 1 block
    model.engine.step()  # prefill both and sample one token each
    stats = model.engine.stats()
    assert stats["used_slots"] == 21 + 3 and stats["allocated_slots"] == 3 * 16
    assert stats["kv_utilization"] == pytest.approx(24 / 48)
    while model.engine.has_unfinished():
        model.engine.step()


def test_async_engine_fault_fails_every_request_and_refuses_new_ones(model_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The test hook makes step 21 an engine fault: every waiting generator raises EngineDeadError
    at once (none hangs), and so does any later request, before it reaches the engine.

    The loop thread steps while the event loop submits the next request, so on a slow or loaded
    machine r1 and r2 may reach the engine only after it has failed: then they are refused
    (in_flight False, no tokens). r0 is always in flight, since the fault needs its steps."""
    import asyncio

    from fantai.engine import AsyncEngine
    from fantai.exceptions import EngineDeadError

    monkeypatch.setenv("FANTAI_FAULT_AFTER_STEPS", "20")
    engine = AsyncEngine(str(model_dir), dtype="float32", num_kv_blocks=64)
    monkeypatch.delenv("FANTAI_FAULT_AFTER_STEPS")  # read once, when the loop starts
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def one(i: int) -> tuple[int, str, bool]:
        n = 0
        try:
            async for out in engine.generate([5, 6, 7 + i], params, f"r{i}"):
                n = len(out.outputs[0].token_ids)
        except EngineDeadError as exc:
            return n, str(exc), exc.in_flight
        return n, "finished", False

    async def run() -> tuple[list[tuple[int, str, bool]], EngineDeadError]:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 30)
        with pytest.raises(EngineDeadError) as late:
            async for _ in engine.generate([5, 6], params, "late"):
                pass
        return results, late.value

    try:
        results, late = asyncio.run(run())
    finally:
        engine.shutdown()
    assert all("injected engine fault" in why for _, why, _ in results), results
    assert all(n <= 20 if in_flight else n == 0 for n, _, in_flight in results), results
    assert results[0][2], results  # r0 ran the steps that led to the fault
    assert not late.in_flight and engine.fault is not None and "FANTAI_FAULT_AFTER_STEPS=20" in engine.fault


def test_async_engine_request_timeout_aborts_and_frees_blocks(model_dir: Path) -> None:
    import asyncio
    import time

    from fantai.engine import AsyncEngine
    from fantai.exceptions import RequestTimeoutError

    # 1,000 tokens take far longer than 5 ms here; the timer fires while the request decodes.
    engine = AsyncEngine(str(model_dir), dtype="float32", num_kv_blocks=64, request_timeout=0.005)

    async def run() -> int:
        n = 0
        with pytest.raises(RequestTimeoutError, match="0.005 s"):
            async for out in engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1000,
                                                                       ignore_eos=True), "slow"):
                n = len(out.outputs[0].token_ids)
        engine.request_timeout = 30.0  # read per request
        async for out in engine.generate([5, 6], SamplingParams(temperature=0.0, max_tokens=2), "quick"):
            pass
        assert out.finished and len(out.outputs[0].token_ids) == 2
        return n

    try:
        assert asyncio.run(run()) < 1000
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = engine.stats()
            if stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0:
                break
            time.sleep(0.01)
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0, stats
    finally:
        engine.shutdown()
