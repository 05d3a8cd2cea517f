"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers (CPU, float32): logits and
greedy tokens, batch invariance when the other rows choose other experts, the same models as GGUF
(expert stacks, float and Q8_0), online int8 experts, bf16 experts, and transformers' fused 3-D
expert tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fantai import LLM, SamplingParams
from test_model_parity import LOGIT_ATOL
from tiny_models import build_tiny_model, hf_greedy, hf_logits, hf_model, random_prompts

VOCAB = 320
VARIANTS: dict[str, dict[str, Any]] = {
    "mixtral_top2": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2, inter=96),
    "mixtral_top3_tied_mha": dict(arch="mixtral", num_local_experts=6, num_experts_per_tok=3, inter=64,
                                  tie=True, heads=4, kv_heads=4, layers=3),
    # Qwen3-MoE: q/k norms, head_dim apart from hidden / heads, a dense MLP on mlp_only_layers.
    "qwen3_moe_top3_dense_layer": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=3, inter=96,
                                       moe_intermediate_size=32, head_dim=24, layers=3, mlp_only_layers=[1],
                                       norm_topk_prob=False, use_sliding_window=False),
    # Sparse every second layer (decoder_sparse_step 2), renormalised top-4 of 12.
    "qwen3_moe_step2_norm_topk": dict(arch="qwen3_moe", num_experts=12, num_experts_per_tok=4, inter=80,
                                      moe_intermediate_size=48, head_dim=16, layers=4, decoder_sparse_step=2,
                                      norm_topk_prob=True, use_sliding_window=False),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return path, hf_model(path)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = build_tiny_model(tmp_path_factory.mktemp("mixtral"), **VARIANTS["mixtral_top2"])
    return path, hf_model(path)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = build_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), **VARIANTS["qwen3_moe_top3_dense_layer"])
    return path, hf_model(path)


@pytest.fixture(params=["mixtral", "qwen3_moe"])
def moe_model(request: pytest.FixtureRequest) -> tuple[Path, Any]:
    return request.getfixturevalue(request.param)


def assert_quantized_close(got: np.ndarray, want: np.ndarray) -> None:
    """int8 weights and int8 activations (the panel kernels) on a random tiny model: the dense
    Llama of the same size is off by ~2% of the logit range per token; a token whose router
    input moves across a near-tie picks another expert and may be off by more."""
    spread = want.max() - want.min()
    err = np.abs(got - want)
    assert 0 < err.mean() < 0.01 * spread, (err.mean(), spread)
    assert err.max() < 0.15 * spread, (err.max(), spread)


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_logits_match_transformers(variant: tuple[Path, Any]) -> None:
    path, ref = variant
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    for prompt in random_prompts(3, VOCAB, [1, 9, 40], seed=1):  # 40 tokens: three KV blocks
        want = hf_logits(ref, prompt).numpy()
        np.testing.assert_allclose(llm._model.score(prompt), want, atol=LOGIT_ATOL, rtol=1e-4)


def test_greedy_tokens_match_transformers(variant: tuple[Path, Any]) -> None:
    path, ref = variant
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompts = random_prompts(3, VOCAB, [3, 17, 40], seed=2)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 24)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def _first_token_experts(ref: Any, prompts: list[list[int]]) -> set[frozenset[int]]:
    """transformers' layer-0 top-k experts of each prompt's first token."""
    picks = set()
    k = ref.config.num_experts_per_tok
    with torch.no_grad():
        for p in prompts:
            logits = ref(torch.tensor([p]), output_router_logits=True).router_logits[0]
            picks.add(frozenset(torch.topk(logits[0], k).indices.tolist()))
    return picks


def _steps(out: Any) -> list[tuple[int, float]]:
    o = out.outputs[0]
    return [(tok, lp[tok].logprob) for tok, lp in zip(o.token_ids, o.logprobs)]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_batch_invariant_when_other_rows_pick_other_experts(moe_model: tuple[Path, Any],
                                                            quantization: str) -> None:
    """A prompt alone and batched with prompts whose tokens choose other experts: the same tokens
    and bit-identical logprobs (greedy: the logits row's own log-softmax), prefill and decode."""
    path, ref = moe_model
    prompts = random_prompts(8, VOCAB, [5, 17, 33, 60], seed=3)
    assert len(_first_token_experts(ref, prompts)) > 2  # the batch really routes apart
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    batched = [_steps(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [_steps(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    assert batched == alone
    chunked = LLM(str(path), dtype="float32", num_kv_blocks=256, quantization=quantization,
                  max_num_batched_tokens=16)
    assert [_steps(o) for o in chunked.generate(prompts, params, use_tqdm=False)] == batched


def test_online_int8_experts(mixtral: tuple[Path, Any]) -> None:
    path, ref = mixtral
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, quantization="int8")
    formats = llm._model.weight_formats()
    assert formats["model.layers.1.block_sparse_moe.experts.7.w2.weight"] == "int8"
    assert formats["model.layers.0.block_sparse_moe.gate.weight"] == "f32"  # the router stays f32
    dense = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert llm._model.weight_bytes() < 0.4 * dense._model.weight_bytes()
    prompt = random_prompts(1, VOCAB, [40], seed=4)[0]
    assert_quantized_close(llm._model.score(prompt), hf_logits(ref, prompt).numpy())


def test_bf16_checkpoint_runs_in_bf16(mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    """A bf16 checkpoint kept in bf16: the experts go into the backend's packed layout with their
    layer (AMX tiles where the CPU has them); bf16 weights are exact in f32, so the logits are
    transformers' f32 math on those weights."""
    path, ref = mixtral
    bf16 = tmp_path / "bf16"
    hf_model(path).to(torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, bf16 / name)
    llm = LLM(str(bf16), num_kv_blocks=64)
    assert llm._model.dtype == "bfloat16"
    prompt = random_prompts(1, VOCAB, [40], seed=5)[0]
    want = hf_logits(hf_model(bf16).float(), prompt).numpy()
    np.testing.assert_allclose(llm._model.score(prompt), want, atol=LOGIT_ATOL, rtol=1e-4)


def test_fused_3d_expert_tensors_load(mixtral: tuple[Path, Any], tmp_path: Path) -> None:
    """transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I],
    mlp.gate) saved as is loads to the same bits as the per-expert checkpoint."""
    from safetensors.torch import save_file

    path, ref = mixtral
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, str(fused / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, fused / name)
    prompt = random_prompts(1, VOCAB, [20], seed=6)[0]
    a = LLM(str(fused), dtype="float32", num_kv_blocks=8)._model.score(prompt)
    b = LLM(str(path), dtype="float32", num_kv_blocks=8)._model.score(prompt)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# --- GGUF: llama.cpp's layout (arch llama + expert_count, 3-D ffn_*_exps stacks) -----------------
def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows per head from rotate-half to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(src: Path, dst: Path, *, dtype: str = "f32",
                   legacy_experts: bool = False) -> Path:
    """The HF checkpoint at `src` as a GGUF file the way llama.cpp's converter writes it (Mixtral:
    arch llama with q/k rows permuted; Qwen3-MoE: arch qwen3moe): dtype f32 / f16 (dense) or q8_0
    (matrices quantized, norms and the router f32). legacy_experts: one tensor per expert
    (blk.N.ffn_gate.E.weight), as early Mixtral files have, instead of the stacks."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    st = load_file(str(src / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layers = cfg["num_hidden_layers"]
    experts = cfg["num_local_experts"]
    qwen = cfg["model_type"] == "qwen3_moe"
    w = gguf.GGUFWriter(str(dst), "qwen3moe" if qwen else "llama")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if qwen:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q8_0": 7}[dtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_token_merges([])

    def put(name: str, a: np.ndarray, matrix: bool = True) -> None:
        if not matrix or a.ndim == 1:
            w.add_tensor(name, a.astype(np.float32))
        elif dtype == "q8_0":
            w.add_tensor(name, quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a.astype(np.float16 if dtype == "f16" else np.float32))

    put("token_embd.weight", st["model.embed_tokens.weight"])
    put("output_norm.weight", st["model.norm.weight"])
    if "lm_head.weight" in st and not cfg.get("tie_word_embeddings"):
        put("output.weight", st["lm_head.weight"])
    def permute(a: np.ndarray, n: int) -> np.ndarray:
        return a if qwen else _llama_permute(a, n)

    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", st[p + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", st[p + "post_attention_layernorm.weight"])
        put(b + "attn_q.weight", permute(st[p + "self_attn.q_proj.weight"], heads))
        put(b + "attn_k.weight", permute(st[p + "self_attn.k_proj.weight"], kv))
        put(b + "attn_v.weight", st[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", st[p + "self_attn.o_proj.weight"])
        if qwen:
            put(b + "attn_q_norm.weight", st[p + "self_attn.q_norm.weight"])
            put(b + "attn_k_norm.weight", st[p + "self_attn.k_norm.weight"])
        moe = "block_sparse_moe" if not qwen else "mlp"
        if p + f"{moe}.gate.weight" not in st:  # a dense layer
            for part in ("gate", "up", "down"):
                put(f"{b}ffn_{part}.weight", st[f"{p}mlp.{part}_proj.weight"])
            continue
        put(b + "ffn_gate_inp.weight", st[p + f"{moe}.gate.weight"], matrix=False)
        names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        for part, hf in zip(("gate", "up", "down"), names):
            mats = [st[f"{p}{moe}.experts.{e}.{hf}.weight"] for e in range(experts)]
            if legacy_experts:
                for e, m in enumerate(mats):
                    put(f"{b}ffn_{part}.{e}.weight", m)
            else:
                put(f"{b}ffn_{part}_exps.weight", np.stack(mats))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_gguf_config_and_names(mixtral: tuple[Path, Any], qwen3_moe: tuple[Path, Any],
                               tmp_path: Path) -> None:
    from fantai.weights.gguf_loader import hf_tensor_name, load_gguf

    assert hf_tensor_name("blk.3.ffn_gate_inp.weight") == "model.layers.3.mlp.gate.weight"
    stack = "model.layers.3.mlp.experts.*.down_proj.weight"
    assert hf_tensor_name("blk.3.ffn_down_exps.weight") == stack
    assert hf_tensor_name("blk.3.ffn_up.5.weight") == "model.layers.3.mlp.experts.5.up_proj.weight"
    path, _ = mixtral
    g = load_gguf(str(write_moe_gguf(path, tmp_path / "m.gguf")))
    cfg = g.config
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    sizes = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    assert sizes == (8, 2, 96)
    assert cfg["mlp_only_layers"] == [] and cfg["norm_topk_prob"] is True
    raw = [t for t in g.raw_tensors() if ".experts." in t.hf_name]
    assert len(raw) == 2 * 8 * 3 and all(t.ndim == 2 for t in raw)
    down7 = next(t for t in raw if t.hf_name == "model.layers.1.mlp.experts.7.down_proj.weight")
    assert (down7.rows, down7.cols) == (64, 96)
    g.close()
    g = load_gguf(str(write_moe_gguf(qwen3_moe[0], tmp_path / "q.gguf")))
    cfg = g.config
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["head_dim"] == 24
    sizes = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    assert sizes == (8, 3, 32) and cfg["intermediate_size"] == 96
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is False  # layer 1 has no router
    g.close()


@pytest.mark.parametrize("dtype,legacy", [("f32", False), ("f16", False), ("f32", True)],
                         ids=["f32_stacks", "f16_stacks", "f32_per_expert_tensors"])
def test_gguf_float_gives_the_same_bits(moe_model: tuple[Path, Any], tmp_path: Path, dtype: str,
                                        legacy: bool) -> None:
    path, _ = moe_model
    gguf_path = write_moe_gguf(path, tmp_path / "m.gguf", dtype=dtype, legacy_experts=legacy)
    torch_dtype = "float16" if dtype == "f16" else "float32"
    from_gguf = LLM(str(gguf_path), num_kv_blocks=64)
    assert from_gguf._model.dtype == torch_dtype
    from_hf = LLM(str(path), dtype=torch_dtype, num_kv_blocks=64)
    prompts = random_prompts(3, VOCAB, [3, 17, 40], seed=7)
    for p in prompts:
        a, b = from_gguf._model.score(p), from_hf._model.score(p)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # test_greedy_tokens_match_transformers holds the checkpoint's tokens to transformers'.
    assert tokens(from_gguf.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
        from_hf.generate(prompts, GREEDY, use_tqdm=False))


def test_gguf_q8_0_experts_stay_quantized(moe_model: tuple[Path, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 experts run on the quantized kernels: with exact activations (FANTAI_QUANT_KERNEL=f32)
    they give the bits of the same file dequantized to dense f32; with the default int8-activation
    kernels they stay close, and decoding stays batch invariant."""
    path, _ = moe_model
    gguf_path = str(write_moe_gguf(path, tmp_path / "q.gguf", dtype="q8_0"))
    llm = LLM(gguf_path, dtype="float32", num_kv_blocks=64)
    formats = llm._model.weight_formats()
    assert formats["model.layers.0.mlp.experts.3.gate_proj.weight"] == "q8_0"
    assert formats["model.layers.0.mlp.experts.0.down_proj.weight"] == "q8_0"
    assert formats["model.layers.0.mlp.gate.weight"] == "f32"
    dense = LLM(gguf_path, dtype="float32", num_kv_blocks=64, dequantize=True)
    assert dense._model.weight_formats()["model.layers.0.mlp.experts.3.gate_proj.weight"] == "f32"
    prompt = random_prompts(1, VOCAB, [40], seed=8)[0]
    want = dense._model.score(prompt)
    assert_quantized_close(llm._model.score(prompt), want)
    prompts = random_prompts(4, VOCAB, [5, 40], seed=9)
    batched = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert batched == [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "f32")  # read when the backend is made
    exact = LLM(gguf_path, dtype="float32", num_kv_blocks=64)._model.score(prompt)
    assert np.array_equal(exact.view(np.uint32), want.view(np.uint32))
