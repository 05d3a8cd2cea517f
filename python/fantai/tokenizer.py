"""Tokenizer room: one Tokenizer over HF `tokenizers`, from an HF model dir or GGUF metadata."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from fantai.chat import render_chat_template

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> how the text is split before BPE.
_GPT2_PRE = {"default", "gpt2", "olmo", "jais", "poro-chat", "viking", "gpt-2"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERN_PRE = {
    "llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "dbrx": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN, "deepseek-r1-qwen": _QWEN2_PATTERN,
}
_IGNORE_MERGES_PRE = {"llama-bpe", "llama3", "dbrx", "smaug-bpe"}

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4
_SPM_SPACE = "\u2581"


class UnsupportedTokenizerError(ValueError):
    """The model's tokenizer type cannot be built here."""


@dataclass(slots=True)
class TokenizerSpec:
    """Everything besides the `tokenizers` object that a Tokenizer needs."""

    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class Tokenizer:
    """Text <-> token ids, special tokens, and chat-template rendering for one model."""

    def __init__(self, hf: tokenizers.Tokenizer, spec: TokenizerSpec) -> None:
        self.hf = hf
        self.spec = spec
        self._byte_level = _is_byte_level(hf)
        added = hf.get_added_tokens_decoder()
        self._special_ids = sorted(
            {i for i, t in added.items() if t.special}
            | set(spec.eos_token_ids)
            | ({spec.bos_token_id} if spec.bos_token_id is not None else set())
        )

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """Build from a .gguf file or from a Hugging Face model directory."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        from fantai.weights.gguf_loader import load_gguf

        model = load_gguf(path)
        return cls.from_gguf_metadata(model.tokenizer_metadata, model.eos_token_ids)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ generation_config.json, chat_template.jinja)"""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise UnsupportedTokenizerError(f"{path}: no tokenizer.json (only fast tokenizers)")
        hf = tokenizers.Tokenizer.from_file(tok_file)
        return cls(hf, _hf_dir_spec(path, hf))

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], eos_token_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """Build the tokenizer described by `tokenizer.ggml.*` GGUF metadata."""
        hf = build_gguf_bpe(meta)
        spm = meta.get("tokenizer.ggml.model") == "llama"
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = list(eos_token_ids)
        if not eos and meta.get("tokenizer.ggml.eos_token_id") is not None:
            eos = [int(meta["tokenizer.ggml.eos_token_id"])]
        spec = TokenizerSpec(
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            # llama.cpp's default when the key is absent: BOS for SentencePiece vocabularies only
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )
        return cls(hf, spec)

    # properties ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.spec.eos_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.spec.eos_token_ids[0] if self.spec.eos_token_ids else None

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._special_ids)

    @property
    def bos_token(self) -> str:
        return self._token_text(self.spec.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_id)

    @property
    def chat_template(self) -> str | None:
        return self.spec.chat_template

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.hf.id_to_token(token_id) or ""

    # encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts inside it become their ids."""
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos = self.spec.bos_token_id
        if self.spec.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        eos = self.eos_token_id
        if self.spec.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.hf.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_piece(self, token_id: int) -> bytes:
        """Raw bytes a token stands for (byte-level and SentencePiece-style vocabularies)."""
        piece = self.hf.id_to_token(token_id) or ""
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    # chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's (or the given) chat template to a prompt string."""
        template = chat_template or self.spec.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=")
        return render_chat_template(
            template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, **kwargs,
        )


# GGUF -> tokenizers ----------------------------------------------------------------------------
def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PATTERN_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_PATTERN_PRE[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise UnsupportedTokenizerError(f"unsupported GGUF pre-tokenizer {pre!r}")


def build_gguf_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A `tokenizers` object equal to llama.cpp's tokenizer for this GGUF metadata.

    Supports `gpt2` (byte-level BPE with merges) and `llama` (SentencePiece, score-ranked).
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if kind == "gpt2":
        hf = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        hf = _sentencepiece_bpe(meta, tokens, types)
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE and "
            "'llama' SentencePiece); use the model's Hugging Face directory instead"
        )
    hf.add_tokens(_added_tokens(tokens, types))
    return hf


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    hf = tokenizers.Tokenizer(bpe)
    hf.pre_tokenizer = _pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    return hf


def _score_ranked_merges(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """Every split (a, b) of a normal token with both halves in the vocabulary, best score first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose joined piece has
    the highest score (leftmost on ties); BPE with merges ranked that way does the same.
    """
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for tid, (tok, ttype) in enumerate(zip(tokens, types)):
        if ttype != _TOKEN_NORMAL:
            continue
        for cut in range(1, len(tok)):
            a, b = tok[:cut], tok[cut:]
            if a in ids and b in ids:
                ranked.append((-scores[tid], tid, ids[a], (a, b)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def _sentencepiece_bpe(
    meta: dict[str, Any], tokens: list[str], types: list[int]
) -> tokenizers.Tokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=_score_ranked_merges(tokens, types, scores),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    hf = tokenizers.Tokenizer(bpe)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPM_SPACE)] if space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    dec = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence([*dec, decoders.Strip(" ", 1, 0)] if space_prefix else dec)
    return hf


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    # Control tokens are special (skipped when decoding); user-defined ones are matched verbatim.
    return [
        AddedToken(tok, special=(t == _TOKEN_CONTROL), normalized=False)
        for tok, t in zip(tokens, types)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]


def _is_byte_level(hf: tokenizers.Tokenizer) -> bool:
    decoder = hf.decoder
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


# HF directory --------------------------------------------------------------------------------
def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_template(path: str, cfg: dict[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _hf_dir_spec(path: str, hf: tokenizers.Tokenizer) -> TokenizerSpec:
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen = _read_json(os.path.join(path, "generation_config.json"))
    bos_text, eos_text = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    bos = hf.token_to_id(bos_text) if bos_text else None
    eos: list[int] = []
    declared = hf.token_to_id(eos_text) if eos_text else None
    for tid in [declared, *_as_id_list(gen.get("eos_token_id"))]:
        if tid is not None and tid not in eos:
            eos.append(tid)
    if bos is None and gen.get("bos_token_id") is not None:
        bos = int(gen["bos_token_id"])
    return TokenizerSpec(
        bos_token_id=bos,
        eos_token_ids=eos,
        add_bos=bool(cfg.get("add_bos_token", False)),
        add_eos=bool(cfg.get("add_eos_token", False)),
        chat_template=_hf_chat_template(path, cfg),
    )
