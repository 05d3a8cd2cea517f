"""Tokenizer room tests: GGUF tokenizer ids vs llama.cpp, HF-dir tokenizer, chat templates."""

from __future__ import annotations

import json
import os

import pytest
from fantai.chat import ChatTemplateError, render_chat_template
from fantai.model_files import default_model_path
from fantai.tokenizer import Tokenizer, UnsupportedTokenizerError, build_gguf_bpe
from fantai.weights.gguf_loader import load_gguf

GGUF = default_model_path()

TEXTS = [
    "Hello world",
    "12345 and 3.14",
    " 1 22 333 4444 -7e10 0x1F",
    "def f(x):\n    return x**2  # square\n\n\tprint(f(3))",
    "café naïve résumé é",
    "中文分词测试，你好！",
    "emoji 🎉🚀 👩‍👩‍👧 done",
    "multiple   spaces\n\n\nand\r\nnewlines  \n ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>",
    "I'm sure they've 'quoted' it's DON'T",
    "   leading and trailing   ",
    "",
    "ÿ\x00\x01 control \x7f chars",
    "https://example.com/path?q=1&b=22#frag",
]


@pytest.fixture(scope="module")
def gguf_model():
    return load_gguf(GGUF)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_path(GGUF)


# --- an independent reference: llama.cpp's algorithm for `smollm` written out by hand ----------
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def reference_ids(meta: dict, text: str) -> list[int]:
    """Special tokens first, then each digit alone, then the GPT-2 regex, then rank-ordered BPE."""
    regex = pytest.importorskip("regex")  # \p{L} classes; ships with transformers
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = [t for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"]) if ty in (3, 4)]
    b2u = _bytes_to_unicode()
    special_re = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
    ids: list[int] = []
    for chunk in special_re.split(text):
        if chunk in vocab and chunk in specials:
            ids.append(vocab[chunk])
            continue
        for piece in regex.split(r"(\p{N})", chunk):
            for word in regex.findall(_GPT2_PATTERN, piece):
                mapped = "".join(b2u[b] for b in word.encode("utf-8"))
                ids.extend(vocab[p] for p in _bpe(mapped, ranks))
    return ids


# Golden ids from llama.cpp itself (llama-cpp-python 0.3.36, built from source in a throwaway
# venv outside the repo): Llama(model_path=GGUF, vocab_only=True).tokenize(text.encode("utf-8"),
# add_bos=False, special=True) for each of TEXTS. The same route agreed with this tokenizer on
# 2,950 random strings (letters, digits, CJK, emoji/ZWJ, whitespace runs, specials mixed in).
LLAMA_CPP_GOLDEN: dict[str, list[int]] = {
    'Hello world':
        [19556, 905],
    '12345 and 3.14':
        [33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36],
    ' 1 22 333 4444 -7e10 0x1F':
        [216, 33, 216, 34, 34, 216, 35, 35, 35, 216, 36, 36, 36, 36, 731, 39, 85, 33, 32, 216,
         32, 104, 33, 54],
    'def f(x):\n    return x**2  # square\n\n\tprint(f(3))':
        [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 1116, 197, 3272, 24,
         86, 24, 35, 1292],
    'café naïve résumé é':
        [83, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 26411],
    '中文分词测试，你好！':
        [28589, 29184, 37349, 16313, 231, 43222, 229, 16313, 239, 12831, 18645, 250, 48392, 138,
         8083, 219],
    'emoji 🎉🚀 👩\u200d👩\u200d👧 done':
        [391, 33777, 15107, 232, 227, 10813, 244, 218, 15107, 235, 119, 321, 231, 10813, 235,
         119, 321, 231, 10813, 235, 117, 2294],
    'multiple   spaces\n\n\nand\r\nnewlines  \n ':
        [30404, 256, 5600, 1116, 198, 397, 201, 198, 2241, 5110, 256, 3805],
    '<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n':
        [1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198],
    'text<|im_end|>glued<|endoftext|>':
        [2692, 2, 87, 1374, 277, 0],
    "I'm sure they've 'quoted' it's DON'T":
        [57, 5248, 2090, 502, 3543, 637, 385, 5036, 23, 357, 506, 422, 2154, 23, 68],
    '   leading and trailing   ':
        [256, 2899, 284, 35079, 333],
    '':
        [],
    'ÿ\x00\x01 control \x7f chars':
        [142, 140, 190, 191, 1533, 216, 217, 42040],
    'https://example.com/path?q=1&b=22#frag':
        [4687, 1742, 7434, 30, 824, 31, 1537, 47, 97, 45, 33, 22, 82, 45, 34, 34, 19, 28082],
}


def test_gguf_metadata_basics(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids[0] == 2  # <|im_end|>, then <|endoftext|> as another end token
    assert 0 in tok.eos_token_ids
    assert set(range(17)) <= set(tok.all_special_ids)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token False


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_reference(tok, gguf_model, text):
    assert tok.encode(text) == reference_ids(gguf_model.tokenizer_metadata, text)


def test_golden_covers_texts():
    assert list(LLAMA_CPP_GOLDEN) == TEXTS


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_llama_cpp(tok, text):
    assert tok.encode(text) == LLAMA_CPP_GOLDEN[text]


def test_digits_split_one_by_one(tok):
    ids = tok.encode("12345 and 3.14")
    expected = ["1", "2", "3", "4", "5", "Ġand", "Ġ", "3", ".", "1", "4"]
    assert tok.convert_ids_to_tokens(ids) == expected


def test_special_tokens_in_text(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.decode(ids) == "user\nHi"


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert b"".join(tok.id_to_piece(i) for i in tok.encode(text)) == text.encode()


def test_matches_transformers_gguf_tokenizer(tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF)
    )
    for text in TEXTS:
        assert tok.encode(text) == ref(text, add_special_tokens=True)["input_ids"], text


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        build_gguf_bpe({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(UnsupportedTokenizerError, match="no-such-pre"):
        build_gguf_bpe(meta)


# --- chat templates ---------------------------------------------------------------------------
def test_smollm2_chat_template_exact(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert tok.apply_chat_template(convo, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_template_helpers():
    tpl = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m.content | tojson }}{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}"
        "{{ bos_token }}{{ strftime_now('%Y') | length }}"
    )
    msgs = [{"role": "u", "content": "é"}, {"role": "skip", "content": "x"},
            {"role": "u", "content": "b"}, {"role": "u", "content": "c"}]
    assert render_chat_template(tpl, msgs, bos_token="<s>") == '"é""b"<s>4'
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat_template("{{ raise_exception('nope') }}", [])
    with pytest.raises(ChatTemplateError):  # sandboxed: no attribute escapes
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


# --- HF directory -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gguf_model):
    d = tmp_path_factory.mktemp("hf_tok")
    build_gguf_bpe(gguf_model.tokenizer_metadata).save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": gguf_model.chat_template,
        "model_max_length": 8192,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (d / "config.json").write_text(json.dumps(gguf_model.config))
    return str(d)


def test_hf_dir_tokenizer(hf_dir, tok):
    hf_tok = Tokenizer.from_model_path(hf_dir)
    assert hf_tok.eos_token_ids == [2, 0]
    assert hf_tok.bos_token_id == 1
    assert hf_tok.chat_template == tok.chat_template
    for text in TEXTS:
        assert hf_tok.encode(text) == tok.encode(text), text


def test_hf_dir_matches_transformers(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = Tokenizer.from_model_path(hf_dir)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token == ref.eos_token


def test_hf_dir_add_bos(tmp_path, hf_dir):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True,
           "chat_template": [{"name": "default", "template": "{{ bos_token }}x"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_model_path(str(tmp_path))
    assert t.encode("hi") == [1, *t.encode("hi", add_special_tokens=False)]
    assert t.encode("<|im_start|>hi")[:2] == [1, t.encode("hi", add_special_tokens=False)[0]]
    assert t.apply_chat_template([]) == "<|im_start|>x"


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("smollm", ["Hello", "Ġ", "1", "2", "3", "4", "5", "ĠĠĠ", "Ġx", "'s"]),
        ("gpt2", ["Hello", "Ġ12345", "ĠĠĠ", "Ġx", "'s"]),
        ("llama-bpe", ["Hello", "Ġ", "123", "45", "ĠĠĠ", "Ġx", "'s"]),
        ("qwen2", ["Hello", "Ġ", "1", "2", "3", "4", "5", "ĠĠĠ", "Ġx", "'s"]),
    ],
)
def test_pre_tokenizer_kinds(pre, expected):
    from fantai.tokenizer import _pre_tokenizer

    pieces = _pre_tokenizer(pre).pre_tokenize_str("Hello 12345    x's")
    assert [p for p, _ in pieces] == expected


# --- SentencePiece (`llama` tokenizer model) GGUF ------------------------------------------------
# data/spm_tiny.gguf: a 600-piece SentencePiece BPE (byte_fallback, split_digits, user-defined
# <|im_start|>/<|im_end|>) trained with the `sentencepiece` package on a few licence texts and
# written with gguf.GGUFWriter (tokenizer.ggml.model "llama", scores, token types, add_bos,
# add_space_prefix). Golden ids: llama.cpp (llama-cpp-python 0.3.36, throwaway venv outside the
# repo), Llama(vocab_only=True).tokenize(text.encode(), add_bos=True, special=True); the same
# route also agreed on 1,934 random strings.
SPM_GGUF = os.path.join(os.path.dirname(__file__), "data", "spm_tiny.gguf")
SPM_LLAMA_CPP_GOLDEN: dict[str, list[int]] = {
    'Hello world':
        [1, 513, 557, 514, 525, 525, 516, 277, 269, 525, 524],
    'The license is free software.':
        [1, 498, 417, 331, 285, 410, 461, 536],
    ' leading space':
        [1, 513, 303, 514, 519, 443, 283, 529, 519, 316],
    'multiple   spaces\n\nnewline':
        [1, 287, 526, 525, 515, 517, 529, 318, 513, 513, 283, 529, 519, 523, 290, 15, 15, 520,
         514, 533, 525, 267, 514],
    '12345 and 3.14':
        [1, 513, 560, 568, 575, 581, 579, 313, 513, 575, 536, 560, 581],
    'café naïve 中文 日本語 🎉 zß':
        [1, 270, 519, 527, 589, 304, 519, 593, 317, 513, 595, 596, 513, 597, 598, 599, 513, 245,
         164, 147, 142, 513, 578, 200, 164],
    '<|im_start|>user\nhi<|im_end|>\n':
        [1, 3, 310, 502, 15, 522, 517, 4, 513, 15],
    'x<|im_end|>y':
        [1, 513, 556, 4, 513, 528],
    '':
        [1],
    '  ':
        [1, 513, 513, 513],
    '\t tab':
        [1, 513, 14, 261, 379],
    'Copyright (C) 2007 Free Software Foundation, Inc. <https://fsf.org/>':
        [1, 383, 516, 529, 528, 377, 366, 549, 553, 513, 568, 570, 570, 580, 392, 410, 364, 516,
         422, 392, 281, 520, 524, 356, 534, 362, 520, 523, 536, 513, 576, 359, 515, 529, 521,
         572, 566, 566, 527, 521, 527, 536, 269, 532, 566, 577],
}


@pytest.fixture(scope="module")
def spm_tok():
    return Tokenizer.from_model_path(SPM_GGUF)


@pytest.mark.parametrize("text", list(SPM_LLAMA_CPP_GOLDEN))
def test_spm_gguf_matches_llama_cpp(spm_tok, text):
    assert spm_tok.encode(text) == SPM_LLAMA_CPP_GOLDEN[text]
    if "<|" not in text:
        assert spm_tok.decode(spm_tok.encode(text)) == text


def test_spm_gguf_basics(spm_tok):
    assert spm_tok.bos_token_id == 1 and spm_tok.eos_token_ids == [2, 4]  # <|im_end|> too
    assert spm_tok.encode("hi", add_special_tokens=False)[0] != 1
    byte_ids = spm_tok.encode("🎉", add_special_tokens=False)[1:]
    assert [spm_tok.convert_ids_to_tokens([i])[0] for i in byte_ids] == [
        "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert b"".join(spm_tok.id_to_piece(i) for i in byte_ids) == "🎉".encode()
