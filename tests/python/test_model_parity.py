"""Exact greedy tokens and logits against Hugging Face transformers (CPU, float32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fantai import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy, hf_logits, hf_model, random_prompts

# Logits are compared relative to their spread; f32 with a different summation order.
LOGIT_ATOL = 2e-4

VARIANTS = {
    "llama_gqa": dict(arch="llama", heads=4, kv_heads=2),
    "llama_tied_llama3_rope": dict(arch="llama", tie=True, heads=4, kv_heads=1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear_rope_mha": dict(arch="llama", heads=4, kv_heads=4,
                                  rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(arch="mistral", heads=8, kv_heads=2, hidden=64, sliding_window=None),
    "qwen2_bias": dict(arch="qwen2", heads=4, kv_heads=2, use_sliding_window=False),
    # head_dim apart from hidden / heads (q is 128 wide on a 64 model), per-head q/k RMSNorm
    "qwen3_qk_norm": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=32, use_sliding_window=False),
    # (1 + w) norms on both sides of attention and MLP, GeGLU, sqrt(hidden)-scaled embeddings,
    # query_pre_attn_scalar, final logit soft-capping
    "gemma2": dict(arch="gemma2", heads=4, kv_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   final_logit_softcapping=3.0, attn_logit_softcapping=None, tie=True),
    # q/k norms too, and a sliding layer with its own rope base beside a linearly scaled global one
    "gemma3": dict(arch="gemma3", heads=4, kv_heads=1, head_dim=32, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "full_attention"], rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
    # fused qkv_proj / gate_up_proj in the checkpoint, 3/4 of each head rotated, longrope
    "phi3_longrope_partial": dict(arch="phi3", heads=4, kv_heads=2, max_pos=1024, pad_token_id=0,
        original_max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 256,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return path, hf_model(path)


def test_logits_match_transformers(variant: tuple[Path, object]) -> None:
    path, ref = variant
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    for prompt in random_prompts(3, 320, [1, 9, 70], seed=1):
        ours = llm._model.score(prompt)
        theirs = hf_logits(ref, prompt).numpy()
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=1e-4)


def test_greedy_tokens_match_transformers(variant: tuple[Path, object]) -> None:
    path, ref = variant
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompts = random_prompts(3, 320, [3, 17, 40], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 24)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_qkv_bias_is_loaded(tmp_path: Path) -> None:
    """Zeroing Qwen2's q/k/v biases must change the logits (the loader really uses them)."""
    path = build_tiny_model(tmp_path / "q", arch="qwen2", use_sliding_window=False)
    ref = hf_model(path)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_proj.bias.zero_()
    prompt = [7, 8, 9, 10, 11]
    ours = LLM(str(path), dtype="float32", num_kv_blocks=8)._model.score(prompt)
    assert np.abs(ours - hf_logits(ref, prompt).numpy()).max() > 1e-3


@pytest.mark.parametrize("tie", [False, True], ids=["own_lm_head", "tied_lm_head"])
def test_sharded_bf16_checkpoint(tmp_path: Path, tie: bool) -> None:
    """A bf16 checkpoint split into shards with an index loads, and runs in bf16 and f32 (the bf16
    run packs the layers and the lm_head, an own one or a copy of the tied embedding, for AMX
    where the CPU has it)."""
    path = build_tiny_model(tmp_path / "src", arch="llama", tie=tie)
    ref = hf_model(path)
    sharded = tmp_path / "sharded"
    ref.to(torch.bfloat16).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompt = [9, 10, 11, 12, 13, 14, 15]
    expected = hf_logits(hf_model(sharded).float(), prompt).numpy()  # bf16 weights, f32 math
    as_f32 = LLM(str(sharded), dtype="float32", num_kv_blocks=8)
    np.testing.assert_allclose(as_f32._model.score(prompt), expected, atol=LOGIT_ATOL, rtol=1e-4)
    auto = LLM(str(sharded), num_kv_blocks=8)
    assert auto._model.dtype == "bfloat16"
    # bf16 weights are exact in bf16, so keeping them bf16 gives the same logits as f32 math.
    np.testing.assert_allclose(auto._model.score(prompt), expected, atol=LOGIT_ATOL, rtol=1e-4)


def test_float16_weights_close_to_float32(variant: tuple[Path, object]) -> None:
    path, ref = variant
    prompt = [20, 21, 22, 23]
    half = LLM(str(path), dtype="float16", num_kv_blocks=8)._model.score(prompt)
    full = hf_logits(ref, prompt).numpy()
    assert np.abs(half - full).max() < 5e-2
    assert np.abs(half - full).max() > 0  # really rounded to f16
