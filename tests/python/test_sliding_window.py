"""Sliding-window attention in the paged cache, against Hugging Face transformers (f32): the config's
windows, logits and greedy tokens across block and window boundaries (chunked prefill on and off,
prefix caching), and the KV blocks a window has passed given back while the request runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fantai import _C, LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy, hf_logits, hf_model, random_prompts
from transformers import AutoConfig

LOGIT_ATOL = 2e-4  # as test_model_parity: f32 with another summation order
BLOCK = 16
MISTRAL_WINDOW = 24
QWEN_WINDOW = 40

GEMMA_WINDOW = 24
GEMMA_SOFTCAP = 2.0  # small enough that tanh bends the tiny model's scores (see the cap test)

# Mistral slides every layer; the Qwen2 slides layers >= max_window_layers (1 and 2 of 3), so it
# has a full-attention pool and a window pool; Gemma 2 alternates sliding / full layers and caps
# every attention score (and the final logits).
MODELS = {
    "mistral": dict(arch="mistral", heads=4, kv_heads=2, sliding_window=MISTRAL_WINDOW, max_pos=4096),
    "qwen2_mixed": dict(arch="qwen2", layers=3, heads=4, kv_heads=2, use_sliding_window=True,
                        sliding_window=QWEN_WINDOW, max_window_layers=1, max_pos=4096),
    "gemma2": dict(arch="gemma2", heads=4, kv_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=GEMMA_WINDOW, attn_logit_softcapping=GEMMA_SOFTCAP,
                   final_logit_softcapping=3.0, max_pos=4096),
}
WINDOW = {"mistral": MISTRAL_WINDOW, "qwen2_mixed": QWEN_WINDOW, "gemma2": GEMMA_WINDOW}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Any:
    """The references decode token by token: a tiny model's ops are cheaper on one thread than
    split over contended cores (several times, for the 2,000-token run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), **MODELS[request.param])
    return request.param, path, hf_model(path)


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def kinds(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k["kind"]: k for k in stats["kv_kinds"]}


# ---- config ------------------------------------------------------------------------------------

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SLIDES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
QWEN_ON = dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)
CONFIGS = [  # (model type, config kwargs); the loadable architectures also go through from_json
    ("mistral", dict(sliding_window=24)),
    ("mistral", dict(sliding_window=None)),
    ("mistral", {}),  # the class default, 4096
    ("qwen2", dict(use_sliding_window=False, sliding_window=32)),
    ("qwen2", QWEN_ON),
    ("qwen2", dict(QWEN_ON, layer_types=SLIDES)),
    ("llama", dict(sliding_window=16)),  # Llama ignores it
    ("mixtral", dict(sliding_window=8)),
    ("mixtral", {}),
    ("phi3", dict(sliding_window=12)),
    ("qwen3", QWEN_ON),
    ("qwen2_moe", QWEN_ON),
    ("qwen3_moe", QWEN_ON),
    ("qwen3_moe", dict(sliding_window=16)),
    ("gemma2", {}),
    ("gemma2", dict(sliding_window=10, layer_types=SLIDES)),
    ("gemma3_text", dict(sliding_window=10)),
    ("gemma3_text", dict(sliding_window=None)),
]
ARCHS = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_layer_windows(cfg: Any) -> list[int]:
    """What transformers' modeling code masks each layer with (0: full attention)."""
    n = cfg.num_hidden_layers
    if cfg.model_type == "llama":
        return [0] * n
    if cfg.model_type in ("mistral", "mixtral", "phi3", "qwen3_moe"):  # every layer, config.sliding_window
        return [cfg.sliding_window or 0] * n
    return [cfg.sliding_window if t == "sliding_attention" and cfg.sliding_window else 0 for t in cfg.layer_types]


@pytest.mark.parametrize("model_type,extra", CONFIGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CONFIGS)])
@pytest.mark.parametrize("saved", [True, False], ids=["saved", "raw"])
def test_layer_windows_as_transformers_decides(model_type: str, extra: dict[str, Any], saved: bool) -> None:
    """The windows from a config.json as transformers saves it (layer_types written out) and from the
    raw keys alone (older Hub configs), equal to what transformers' own config and modeling give."""
    cfg = AutoConfig.for_model(model_type, **BASE, **extra)
    text = cfg.to_json_string() if saved else json.dumps({"model_type": model_type, **BASE, **extra})
    want = hf_layer_windows(cfg)
    assert _C.ModelConfig.attention_pattern_from_json(text).layer_window == want
    if model_type in ARCHS:
        raw = json.loads(text)
        raw["architectures"] = [ARCHS[model_type]]
        ours = _C.ModelConfig.from_json(json.dumps(raw))
        assert ours.layer_window == want
        assert ours.attn_logit_softcap == 0.0


def test_softcap_is_parsed() -> None:
    raw = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **BASE, attn_logit_softcapping=30.0)
    assert _C.ModelConfig.from_json(json.dumps(raw)).attn_logit_softcap == 30.0
    gemma2 = AutoConfig.for_model("gemma2", **BASE)  # transformers' default cap, saved or not
    for text in (gemma2.to_json_string(), json.dumps({"model_type": "gemma2", **BASE})):
        assert _C.ModelConfig.attention_pattern_from_json(text).attn_logit_softcap == gemma2.attn_logit_softcapping
    raw["layer_types"] = ["sliding_attention", "chunked_attention"] + ["full_attention"] * 3
    with pytest.raises(ValueError, match="chunked_attention"):
        _C.ModelConfig.from_json(json.dumps(raw))


# ---- numerics against transformers ---------------------------------------------------------------

def test_logits_match_transformers(model: tuple[str, Path, Any]) -> None:
    _, path, ref = model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    # Inside, at and past the window, and over several blocks past it.
    for prompt in random_prompts(6, 320, [1, 23, 24, 25, 41, 90], seed=1):
        ours = llm._model.score(prompt)
        np.testing.assert_allclose(ours, hf_logits(ref, prompt).numpy(), atol=LOGIT_ATOL, rtol=1e-4)


def test_gemma2_softcap_bends_the_scores(model: tuple[str, Path, Any]) -> None:
    """Gemma 2's attention soft-cap is applied, not merely parsed: transformers with the cap taken
    out of its layers departs from our logits by far more than the parity tolerance, and the
    parity above holds with it in."""
    name, path, ref = model
    if name != "gemma2":
        pytest.skip("Gemma 2 only")
    prompt = random_prompts(1, 320, [60], seed=8)[0]
    ours = LLM(str(path), dtype="float32", num_kv_blocks=64)._model.score(prompt)
    layers = ref.model.layers
    saved = [layer.self_attn.attn_logit_softcapping for layer in layers]
    assert saved == [GEMMA_SOFTCAP] * len(layers)
    try:
        for layer in layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf_logits(ref, prompt).numpy()
    finally:
        for layer, cap in zip(layers, saved):
            layer.self_attn.attn_logit_softcapping = cap
    assert np.abs(ours - uncapped).max() > 50 * LOGIT_ATOL
    np.testing.assert_allclose(ours, hf_logits(ref, prompt).numpy(), atol=LOGIT_ATOL, rtol=1e-4)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_greedy_tokens_match_transformers(model: tuple[str, Path, Any], chunked: bool) -> None:
    """Prompts shorter and longer than the window, generation past it; chunks of 16 tokens make the
    prompts' later chunks attend over a cached prefix through the window."""
    _, path, ref = model
    extra = dict(max_num_batched_tokens=16) if chunked else dict(enable_chunked_prefill=False)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, **extra)
    prompts = random_prompts(3, 320, [5, 30, 70], seed=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert tokens(outs) == [hf_greedy(ref, p, 40) for p in prompts]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_prefix_caching_stays_exact(model: tuple[str, Path, Any]) -> None:
    """Prompts that share a 60-token prefix, twice: the second pass hits the cache (in every kind)
    and still gives transformers' tokens; so does a pool too small to keep it all."""
    _, path, ref = model
    system = random_prompts(1, 320, [60], seed=3)[0]
    prompts = [system + p for p in random_prompts(4, 320, [3, 17], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [hf_greedy(ref, p, 20) for p in prompts]
    for blocks in (128, 14):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=blocks, max_num_batched_tokens=32)
        for _ in range(2):
            assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        stats = llm.stats()
        if blocks == 128:
            assert stats["prefix_cache_hits"] >= 3 * (60 // BLOCK) * BLOCK
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_never_loses_a_request(model: tuple[str, Path, Any], swap: bool) -> None:
    """Swapped: each kind's live blocks (a window kind's last ones only) go to host memory and
    come back around fresh blocks, the dropped ones staying dropped."""
    _, path, ref = model
    prompts = random_prompts(6, 320, [30, 55], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    extra = dict(swap_space="8M", preemption_mode="swap") if swap else {}
    tight = LLM(str(path), dtype="float32", num_kv_blocks=12, enable_prefix_caching=False, **extra)
    assert tokens(tight.generate(prompts, params, use_tqdm=False)) == [hf_greedy(ref, p, 30) for p in prompts]
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_swap_outs"] == (stats["num_preemptions"] if swap else 0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_swap_slots"] == stats["num_swap_slots"]


# ---- blocks given back while a request runs -------------------------------------------------------

def run_and_sample_blocks(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], dict[str, int]]:
    """Steps the engine by hand; returns the tokens and the most blocks each kind held at a step."""
    core = llm.engine
    p = _C.SamplingParams()
    p.temperature, p.max_tokens, p.ignore_eos = 0.0, max_tokens, True
    core.add_request(7, prompt, p, [])
    out: list[int] = []
    peak: dict[str, int] = {}
    while core.has_unfinished():
        for o in core.step():
            out += o.token_ids
        for name, k in kinds(core.stats()).items():
            peak[name] = max(peak.get(name, 0), k["num_used_blocks"])
    return out, peak


def test_window_only_model_holds_the_window_through_2000_tokens(model: tuple[str, Path, Any]) -> None:
    """Mistral: 2,000 generated tokens in a pool of 8 blocks (128 token slots), never more than
    ceil(W / block_size) + 1 blocks held, transformers' tokens. The mixed Qwen2's and Gemma 2's
    window pools stay as small while their full pools hold the whole sequence."""
    name, path, ref = model
    window = WINDOW[name]
    n = 2000 if name == "mistral" else 300
    prompt = random_prompts(1, 320, [10], seed=6)[0]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8 if name == "mistral" else 32)
    got, peak = run_and_sample_blocks(llm, prompt, n)
    assert got == hf_greedy(ref, prompt, n)
    bound = math.ceil(window / BLOCK) + 1
    assert peak[f"sliding_window_{window}"] <= bound
    if name != "mistral":  # a full-attention pool beside the window's
        assert peak["full"] == math.ceil((len(prompt) + n - 1) / BLOCK)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    for k in stats["kv_kinds"]:
        assert k["num_free_blocks"] == k["num_total_blocks"]


def test_kinds_in_stats_and_long_prompts_in_a_small_window_pool(tmp_path: Path) -> None:
    """The stats name each kind's pool and its layers; a window-only pool of 8 blocks prefills a
    500-token prompt chunk by chunk (each chunk and the window before it fit), as transformers."""
    path = build_tiny_model(tmp_path / "m", **MODELS["mistral"])
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=32)
    assert [(k["kind"], k["num_layers"], k["num_total_blocks"]) for k in llm.stats()["kv_kinds"]] == [
        (f"sliding_window_{MISTRAL_WINDOW}", 2, 8)]
    prompt = random_prompts(1, 320, [500], seed=7)[0]
    got, peak = run_and_sample_blocks(llm, prompt, 20)
    assert got == hf_greedy(hf_model(path), prompt, 20)
    assert peak[f"sliding_window_{MISTRAL_WINDOW}"] <= math.ceil((MISTRAL_WINDOW + 32 - 1) / BLOCK) + 1
    # Whole-prompt prefill needs every block of the prompt at once: the pool is too small.
    whole = LLM(str(path), dtype="float32", num_kv_blocks=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="KV pool"):
        whole.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    # An older Hub config (no layer_types): the kinds come from max_window_layers.
    mixed = build_tiny_model(tmp_path / "q", **MODELS["qwen2_mixed"], edit_config=lambda c: c.pop("layer_types"))
    assert "layer_types" not in json.loads((mixed / "config.json").read_text())
    llm = LLM(str(mixed), dtype="float32", num_kv_blocks=8)
    assert [(k["kind"], k["num_layers"]) for k in llm.stats()["kv_kinds"]] == [
        ("full", 1), (f"sliding_window_{QWEN_WINDOW}", 2)]
    np.testing.assert_allclose(llm._model.score(prompt[:60]), hf_logits(hf_model(mixed), prompt[:60]).numpy(),
                               atol=LOGIT_ATOL, rtol=1e-4)
