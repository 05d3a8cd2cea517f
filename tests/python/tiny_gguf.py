"""GGUF files for tests, written with gguf-py (no torch: the loader fuzzer imports this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def gguf_writer(path: Path, hidden: int, inter: int, layers: int, vocab: int, heads: int, kv_heads: int,
                arch: str = "llama", context: int = 256, rope_base: float = 10000.0,
                rms_eps: float = 1e-5) -> Any:
    """A GGUFWriter with the model keys every test file needs and a tiny byte-level vocabulary
    ("a".."z", "aa".. as tokens, no merges); the caller adds its own keys and the tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    return w


def write_gguf(w: Any) -> None:
    """Writes header, metadata and tensors, then closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
