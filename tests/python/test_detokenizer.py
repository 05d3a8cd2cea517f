"""Detokenizer room tests: UTF-8-safe streaming deltas, stop strings across tokens, bounded work."""

from __future__ import annotations

import pytest
import tokenizers
from fantai.detokenizer import IncrementalDetokenizer
from fantai.model_files import default_model_path
from fantai.tokenizer import Tokenizer, TokenizerSpec
from tokenizers import decoders, models


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_path(default_model_path())


def _byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (byte-level vocabularies hold all 256 single-byte tokens)."""
    ids = []
    for b in text.encode():
        ids.append(next(i for i in range(tok.vocab_size) if tok.id_to_piece(i) == bytes([b])))
    return ids


def _char_ids(tok: Tokenizer, text: str) -> list[int]:
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


def test_stream_equals_decode(tok):
    text = "Hello, world! 12345 café 中文 🎉 done.\n  next line"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    deltas = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == text == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.stop_reason is None and not detok.finished_by_stop


def test_multibyte_split_across_byte_tokens(tok):
    text = "a中é🎉"
    ids = _byte_token_ids(tok, text)
    assert len(ids) == 1 + 3 + 2 + 4
    detok = IncrementalDetokenizer(tok, [])
    deltas = _stream(detok, ids)
    assert deltas == ["a", "", "", "中", "", "é", "", "", "", "🎉"]
    assert detok.flush() == ""


def test_incomplete_bytes_flushed_at_end(tok):
    ids = _byte_token_ids(tok, "ok中")[:-1]  # generation stopped mid-character
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(detok, ids)) == "ok"
    assert detok.flush() == "\ufffd"


def test_stop_string_across_tokens(tok):
    ids = _char_ids(tok, "abc <stop> tail")
    detok = IncrementalDetokenizer(tok, [], stop=["<stop>"])
    deltas = _stream(detok, ids)
    assert "".join(deltas) == "abc "
    assert detok.stop_reason == "<stop>" and detok.finished_by_stop
    assert detok.text == "abc "
    assert detok.add(tok.encode("more")) == "" and detok.flush() == ""
    # "<" and "<s"... were held back, never emitted as a partial stop string
    assert all("<" not in d for d in deltas)


def test_stop_included(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["END"], include_stop_str_in_output=True)
    out = "".join(_stream(detok, _char_ids(tok, "x ENDING")))
    assert out == "x END" == detok.text and detok.stop_reason == "END"


def test_earliest_stop_wins_and_multichar_token(tok):
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, [], stop=["four", "two"])
    assert "".join(_stream(detok, ids)) == "one " and detok.stop_reason == "two"


def test_held_back_prefix_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["<stop>"])
    deltas = _stream(detok, _char_ids(tok, "a <st"))
    assert "".join(deltas) == "a "
    assert detok.text == "a <st"  # decoded, held back
    assert detok.add(_char_ids(tok, "ay")) == "<stay"  # no longer a stop prefix
    assert detok.add(_char_ids(tok, " <s")) == " "
    assert detok.flush() == "<s"
    assert detok.text == "a <stay <s" and detok.stop_reason is None


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi<|im_end|>")
    skip = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(skip, ids)) + skip.flush() == "hi"
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert "".join(_stream(keep, ids)) == "hi" and keep.stop_reason == "<|im_end|>"


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_per_token_work_is_bounded(tok):
    counting = CountingTokenizer(tok)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 中文 " * 80)
    assert len(ids) > 800
    detok = IncrementalDetokenizer(counting, tok.encode("a long prompt " * 100), stop=["zzz"])
    out = "".join(_stream(detok, ids)) + detok.flush()
    assert out == tok.decode(ids)
    assert counting.longest <= 8
    assert len(detok._ids) < 100 and len(detok._pending) < 3


# --- a SentencePiece-style vocabulary with <0xNN> byte-fallback tokens ---------------------------
@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
              "▁", "▁Hello", "▁world", "H", "e", "l", "o", "w", "r", "d"]
    vocab = {p: i for i, p in enumerate(pieces)}
    bpe = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    hf = tokenizers.Tokenizer(bpe)
    hf.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(hf, TokenizerSpec(bos_token_id=1, eos_token_ids=[2]))


def test_byte_fallback_tokens(sp_tok):
    hello, world = sp_tok.token_to_id("▁Hello"), sp_tok.token_to_id("▁world")
    bytes_ = [sp_tok.token_to_id(f"<0x{b:02X}>") for b in "中🎉".encode()]
    assert sp_tok.id_to_piece(bytes_[0]) == b"\xe4" and sp_tok.id_to_piece(world) == b" world"
    detok = IncrementalDetokenizer(sp_tok, [1, hello])
    # leading space of "▁world" survives thanks to the prompt context window
    assert detok.add([world]) == " world"
    deltas = _stream(detok, bytes_)
    assert deltas == ["", "", "中", "", "", "", "🎉"]
    assert detok.add([2]) == "" and detok.flush() == ""
    assert detok.text == " world中🎉"


def test_sentencepiece_gguf_stream():
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "spm_tiny.gguf")
    spm = Tokenizer.from_model_path(path)
    text = "free café 中文 🎉 software"
    ids = spm.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(spm, spm.encode("The license is"), stop=["soft"])
    deltas = _stream(detok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == " free café 中文 🎉 " and detok.stop_reason == "soft"
