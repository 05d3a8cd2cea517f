"""Structured outputs: request constraints (JSON schema, regex, choice, Lark / EBNF grammar) compiled
by llguidance, and the token-mask provider that the core's grammar hook calls once per step.

The provider runs on the hook's worker thread (it takes the GIL there) while the forward pass runs;
llguidance computes the masks with the GIL released, writing straight into the core's buffer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("fantai")

# Compiled grammars kept (LRU by their text): a cached one costs a matcher copy, not a compile.
GRAMMAR_CACHE_SIZE = 256
# JSON is written compact, with OpenAI's separators: bounded output, and no whitespace runs for a
# sampled model to wander into. Tool-call grammars embed schemas with the same options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names; exactly one of them is set)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or EBNF / GBNF (rules written with '::=')
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar "
                             f"or json_object; got {given or 'none'}")
        if self.choice is not None and (not self.choice or
                                        not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs 'choice' must be a non-empty list of strings")

    def spec(self) -> GrammarSpec:
        if self.json_object:
            return GrammarSpec("json", '{"type": "object"}')
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return GrammarSpec("json", text)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("lark", choice_lark(self.choice))
        assert self.grammar is not None
        return GrammarSpec("lark", self.grammar)


# vLLM's older name for the same record.
GuidedDecodingParams = StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # "json" (a JSON schema's text), "regex" or "lark" (Lark or EBNF)
    text: str


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def json_lark(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON by `schema`, written with JSON_OPTIONS."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {"x-guidance": JSON_OPTIONS, **schema}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def choice_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(lark_string(c) for c in choices) + "\n"


def _is_ebnf(text: str) -> bool:
    return "::=" in text


class _TokenTable:
    """What llguidance asks of a tokenizer: each token's bytes, the specials, and encode()."""

    def __init__(self, tokenizer: Any, eos: list[int]) -> None:
        self._tok = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = list(tokenizer.all_special_ids)
        unk = tokenizer.token_to_id("<unk>")
        self._unk = unk if unk is not None and unk not in eos else None
        self._by_bytes: dict[bytes, int] | None = None

    def __call__(self, text: bytes | str) -> list[int]:
        raw = text if isinstance(text, bytes) else text.encode()
        ids = list(self._tok.encode(raw.decode("utf-8", errors="replace"),
                                    add_special_tokens=False))
        # llguidance spells the bytes a grammar forces through this. A vocabulary without byte
        # fallback answers an unknown word with <unk>, which spells nothing: spell the bytes
        # from the vocabulary itself instead, longest token first.
        if self._unk is not None and self._unk in ids and b"<unk>" not in raw:
            return self._longest_first(raw)
        return ids

    def _longest_first(self, raw: bytes) -> list[int]:
        if self._by_bytes is None:
            specials = set(self.special_token_ids)
            self._by_bytes = {}
            for i, piece in enumerate(self.tokens):
                if piece and i not in specials:
                    self._by_bytes.setdefault(piece, i)
        longest = max(map(len, self._by_bytes), default=1)
        out: list[int] = []
        pos = 0
        while pos < len(raw):
            for size in range(min(longest, len(raw) - pos), 0, -1):
                tid = self._by_bytes.get(raw[pos:pos + size])
                if tid is not None:
                    out.append(tid)
                    pos += size
                    break
            else:
                break  # a byte no token spells: the spelled prefix is all there is
        return out


class GrammarCompiler:
    """Grammar text -> a ready llguidance matcher; compiled grammars cached by their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None = None,
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        try:
            import llguidance
        except ImportError:
            raise ValueError("structured outputs need the llguidance package "
                             "(pip install llguidance)") from None
        self._llg = llguidance
        eos = list(eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids)
        table = _TokenTable(tokenizer, eos)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table),
                                                n_vocab=vocab_size, eos_token=eos or None)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and stats

    def grammar_text(self, spec: GrammarSpec) -> str:
        m = self._llg.LLMatcher
        if spec.kind == "json":
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            try:  # compact separators: bounded, and what OpenAI's strict mode writes
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise ValueError(f"invalid JSON schema: {exc}") from None
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.text)
        text = spec.text
        if _is_ebnf(text):
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001  (its parser raises plain exceptions)
                raise ValueError(f"invalid EBNF grammar: {exc}") from None
        return m.grammar_from_lark(text)

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh matcher at the grammar's start; ValueError with the compiler's message."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template.deep_copy()
        grammar = self.grammar_text(spec)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"invalid {_KIND_NAMES[spec.kind]}: {error}")
        template = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {_KIND_NAMES[spec.kind]}: {template.get_error()}")
        with self._lock:
            self.compiles += 1
            self._cache[spec] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "lark": "grammar"}


class _Row:
    __slots__ = ("fed", "matcher")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.fed = 0


class MaskProvider:
    """Matchers of the live constrained core requests, and the per-step fill the core calls."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._rows: dict[int, _Row] = {}
        self._lock = threading.Lock()
        self._executor: Any = None
        self._spells: bool | None = None
        self.fills = 0  # steps the core asked for masks (a step without grammar rows never does)

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
                if not self.spells_every_byte():
                    logger.warning("this vocabulary cannot spell every byte (no byte fallback): "
                                   "grammar masks may refuse text the grammar allows")
            return self._compiler

    def spells_every_byte(self) -> bool:
        """True when every printable ASCII byte is one token (byte-level BPE, byte fallback).
        llguidance's masks assume a vocabulary can spell whatever a grammar forces; a word-level
        vocabulary without byte fallback cannot, and its masks can then be wrong."""
        if self._spells is None:
            pieces = {self._tokenizer.id_to_piece(i) for i in range(self._tokenizer.vocab_size)}
            self._spells = all(bytes([b]) in pieces for b in range(0x20, 0x7F))
        return self._spells

    def ready(self, spec: GrammarSpec) -> bool:
        """True when a matcher for `spec` costs no compile (tables built, grammar cached)."""
        with self._lock:
            compiler = self._compiler
        return compiler is not None and compiler.cached(spec)

    def prepare(self, spec: GrammarSpec) -> None:
        """Compiles (or finds cached) the grammar; ValueError when it does not compile."""
        self.compiler.matcher(spec)

    def register(self, core_ids: list[int], spec: GrammarSpec) -> None:
        compiler = self.compiler
        rows = {cid: _Row(compiler.matcher(spec)) for cid in core_ids}
        with self._lock:
            self._rows.update(rows)

    def release(self, core_ids: list[int]) -> None:
        with self._lock:
            for cid in core_ids:
                self._rows.pop(cid, None)

    def live(self) -> int:
        with self._lock:
            return len(self._rows)

    def fill(self, ids: list[int], fed: list[int], tokens: list[list[int]], address: int,
             words: int) -> None:
        """Called by the core's grammar hook (its own thread): feed, then write one mask a row.
        Never raises for a row's sake: an error would fail the whole step (every request in
        it), so a row whose matcher cannot go on gets an EOS-only mask and a warning instead."""
        self.fills += 1
        nbytes = words * 4
        todo: list[tuple[Any, int]] = []
        with self._lock:
            rows = [self._rows.get(i) for i in ids]
        for k, (cid, row) in enumerate(zip(ids, rows)):
            if row is None:
                self._end_only(address + k * nbytes, words, cid, "has no matcher")
                continue
            m = row.matcher
            if row.fed != fed[k]:
                logger.warning("constrained request %d: matcher saw %d tokens, the core %d", cid,
                               row.fed, fed[k])
            if tokens[k]:
                m.consume_tokens(tokens[k])
                row.fed = fed[k] + len(tokens[k])
            if m.is_error():
                self._end_only(address + k * nbytes, words, cid, m.get_error())
                continue
            todo.append((m, k))
        if len(todo) == 1:
            todo[0][0].unsafe_compute_mask_ptr(address + todo[0][1] * nbytes, nbytes)
        elif todo:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(todo, address, nbytes, len(ids))
        for m, k in todo:  # a matcher that failed inside the mask computation wrote no bits
            if m.is_error() or not self._any_bit(address + k * nbytes, words):
                self._end_only(address + k * nbytes, words, ids[k],
                               m.get_error() or "allows no token")

    @staticmethod
    def _any_bit(address: int, words: int) -> bool:
        import ctypes

        return ctypes.string_at(address, words * 4).count(0) != words * 4  # C speed

    def _end_only(self, address: int, words: int, cid: int, why: str) -> None:
        import ctypes

        logger.warning("constrained request %d: %s; it may only end now", cid, why)
        buf = (ctypes.c_uint32 * words).from_address(address)
        ctypes.memset(address, 0, words * 4)
        for t in self._eos or [0]:
            buf[t // 32] |= 1 << (t % 32)


def structured_spec(params: Any) -> GrammarSpec | None:
    """The grammar of a fantai SamplingParams, or None when it is unconstrained."""
    so = getattr(params, "structured_outputs", None)
    return None if so is None else so.spec()
