"""Sliding-window attention: each layer's window read from config.json as transformers decides it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fantai import _C
from transformers import AutoConfig


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
