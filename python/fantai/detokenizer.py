"""Detokenizer room: incremental UTF-8-safe text deltas, stop strings held back across tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context (leading-space handling)
_MAX_PENDING_TOKENS = 6  # a UTF-8 char is <= 4 bytes; past this, a U+FFFD is real, emit it
_COMPACT_AT = 64  # drop consumed ids once this many pile up (keeps the window small)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas safe to stream.

    `.text` is all text decoded so far (held-back tail included; cut at a matched stop string),
    `.stop_reason` the stop string that matched (then no more text), `.finished_by_stop` whether
    one did. Per-token work is bounded by the decode window and the longest stop string.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop = [s for s in stops if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0  # ids[_prefix:_read] is context already turned into text
        self._read = len(self._ids)
        self._emitted: list[str] = []  # text already handed out
        self._pending = ""  # decoded text not handed out yet (a possible stop-string prefix)

    @property
    def finished_by_stop(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._emitted) + self._pending

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Feed new token ids; return the text delta that is now safe to emit."""
        out: list[str] = []
        for token_id in new_token_ids:
            if self.finished_by_stop:
                break
            self._ids.append(int(token_id))
            out.append(self._consume(self._decode_step(force=False)))
        return "".join(out)

    def flush(self) -> str:
        """At the end of generation: emit everything still held back (incomplete bytes too)."""
        if self.finished_by_stop:
            return ""
        delta = self._consume(self._decode_step(force=True))
        if self.finished_by_stop:
            return delta
        rest, self._pending = self._pending, ""
        self._emitted.append(rest)
        return delta + rest

    # decoding window ---------------------------------------------------------------------
    def _decode_step(self, force: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        window = self._ids[self._prefix:]
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(window)
        unread = len(self._ids) - self._read
        if full_text.endswith(_REPLACEMENT) and not force and unread < _MAX_PENDING_TOKENS:
            return ""  # a multi-byte char is split across tokens: wait for the rest
        delta = full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self._compact()
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _compact(self) -> None:
        if self._prefix >= _COMPACT_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    # stop strings ------------------------------------------------------------------------
    def _consume(self, delta: str) -> str:
        """Append decoded text to the pending tail, check stops, return what may be emitted."""
        if not delta:
            return ""
        if not self.stop:
            self._emitted.append(delta)
            return delta
        self._pending += delta
        match = self._find_stop()
        if match is not None:
            return self._finish_at(*match)
        keep = self._held_back_len()
        ready = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(ready):]
        if ready:
            self._emitted.append(ready)
        return ready

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _finish_at(self, index: int, stop: str) -> str:
        end = index + len(stop) if self.include_stop_str_in_output else index
        ready = self._pending[:end]
        self._pending = ""
        self._emitted.append(ready)
        self.stop_reason = stop
        return ready

    def _held_back_len(self) -> int:
        """Length of the longest tail of pending text that starts some stop string."""
        tail_max = min(self._max_stop - 1, len(self._pending))
        for k in range(tail_max, 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
