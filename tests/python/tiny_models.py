"""Test helpers: tiny random-weight checkpoints of every family fantai runs, saved as HF directories."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
           "mixtral": MixtralConfig, "qwen3_moe": Qwen3MoeConfig}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def build_tiny_model(path: Path, arch: str = "llama", *, vocab_size: int = 320, hidden: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 160,
                     tie: bool = False, seed: int = 0, max_pos: int = 1024,
                     edit_config: Callable[[dict[str, Any]], None] | None = None, **extra: Any) -> Path:
    """Saves config.json + model.safetensors + a word-level tokenizer into `path`.

    edit_config changes the saved config.json in place (e.g. drops the layer_types transformers 5
    writes, as older Hub configs lack them); transformers reloads the edited file."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                                  initializer_range=0.15, rms_norm_eps=1e-5)
    kwargs.update(extra)
    config = CONFIGS[arch](**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their trivial init, so they are exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a MoE router: wider logits, clear top-k picks
                p.add_(torch.randn_like(p) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if edit_config is not None:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_word_tokenizer(path, vocab_size)
    return path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE}))


def hf_model(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers, EOS ignored (the reference for exact-token tests)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def random_prompts(count: int, vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab_size, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(count)]
