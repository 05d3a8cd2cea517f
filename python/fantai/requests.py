"""Python-side request state shared by LLM and AsyncEngine: n/best_of children, detokenizing,
stop strings and logprobs, turned into vLLM-shaped RequestOutputs."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from fantai import _C
from fantai.detokenizer import IncrementalDetokenizer
from fantai.outputs import CompletionOutput, Logprob, RequestOutput
from fantai.sampling_params import SamplingParams
from fantai.tokenizer import Tokenizer

_ids = itertools.count(1)


def next_core_id() -> int:
    return next(_ids)


def to_core_params(p: SamplingParams, index: int, max_tokens: int) -> _C.SamplingParams:
    c = _C.SamplingParams()
    c.temperature = p.temperature
    c.top_p = p.top_p
    c.top_k = p.top_k if p.top_k and p.top_k > 0 else 0
    c.min_p = p.min_p
    c.repetition_penalty = p.repetition_penalty
    c.presence_penalty = p.presence_penalty
    c.frequency_penalty = p.frequency_penalty
    # Children of one request must differ yet stay reproducible: seed + index.
    c.seed = -1 if p.seed is None else int(p.seed) + index
    c.max_tokens = max_tokens
    c.min_tokens = p.min_tokens
    c.ignore_eos = p.ignore_eos
    c.stop_token_ids = list(p.stop_token_ids)
    c.logprobs = -1 if p.logprobs is None else int(p.logprobs)
    c.logit_bias = [(int(k), float(v)) for k, v in (p.logit_bias or {}).items()]
    c.constrained = p.structured_outputs is not None
    return c


@dataclass(slots=True)
class _Child:
    core_id: int
    output: CompletionOutput
    detok: IncrementalDetokenizer


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    tokenizer: Tokenizer
    result: RequestOutput
    children: list[_Child] = field(default_factory=list)
    timed_out: bool = False  # the server's request timeout aborted it (AsyncEngine._expire)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.result.prompt_token_ids

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_ids: list[int],
               params: SamplingParams, tokenizer: Tokenizer) -> RequestState:
        children = []
        for i in range(params.best_of or params.n):
            out = CompletionOutput(i, "", [], 0.0, [] if params.logprobs is not None else None)
            detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            children.append(_Child(next_core_id(), out, detok))
        result = RequestOutput(request_id, prompt, prompt_ids, [c.output for c in children][: params.n])
        result.metrics.update(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt_ids))
        return cls(request_id, params, tokenizer, result, children)

    def core_requests(self, max_model_len: int) -> list[tuple[int, _C.SamplingParams]]:
        budget = max_model_len - len(self.prompt_token_ids)
        max_tokens = self.params.max_tokens if self.params.max_tokens is not None else budget
        return [(c.core_id, to_core_params(self.params, i, max_tokens)) for i, c in enumerate(self.children)]

    def apply(self, child_index: int, step: _C.StepOutput) -> bool:
        """Folds one core output into the child; returns True when a stop string ended it (the
        caller must then abort the core request)."""
        child = self.children[child_index]
        out = child.output
        if step.token_ids and "first_token_time" not in self.result.metrics:
            self.result.metrics["first_token_time"] = time.monotonic()
        if step.queue_seconds >= 0 and "first_scheduled_time" not in self.result.metrics:
            self.result.metrics["queue_time"] = step.queue_seconds
            self.result.metrics["first_scheduled_time"] = self.result.metrics["arrival_time"] + step.queue_seconds
        for tok, lp in zip(step.token_ids, step.logprobs):
            out.token_ids.append(tok)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob
            if out.logprobs is not None:
                out.logprobs.append(self._logprob_entry(tok, lp))
        stopped_by_string = False
        if step.token_ids and out.finish_reason is None:
            out.text += child.detok.add(list(step.token_ids))
            if child.detok.stop_reason is not None:
                out.finish_reason, out.stop_reason = "stop", child.detok.stop_reason
                stopped_by_string = not step.finished
        if step.finished and out.finish_reason is None:
            out.text += child.detok.flush()
            out.finish_reason = step.finish_reason
            if step.stop_token_id >= 0 and step.stop_token_id in self.params.stop_token_ids:
                out.stop_reason = step.stop_token_id
        self._maybe_finish()
        return stopped_by_string

    def abort(self) -> None:
        for c in self.children:
            if c.output.finish_reason is None:
                c.output.finish_reason = "abort"
        self._maybe_finish()

    def _logprob_entry(self, tok: int, lp: _C.TokenLogprob) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        ranks = {t: r + 1 for r, (t, _) in enumerate(lp.top)}
        entry[tok] = Logprob(lp.logprob, ranks.get(tok), self.tokenizer.decode([tok], False))
        for t, v in lp.top:
            if t not in entry:
                entry[t] = Logprob(v, ranks[t], self.tokenizer.decode([t], False))
        return entry

    def _maybe_finish(self) -> None:
        if any(c.output.finish_reason is None for c in self.children):
            return
        if self.params.best_of and self.params.best_of > self.params.n:
            ranked = sorted((c.output for c in self.children),
                            key=lambda o: -(o.cumulative_logprob or 0.0))[: self.params.n]
            for i, o in enumerate(ranked):
                o.index = i
            self.result.outputs = ranked
        self.result.finished = True
        self.result.metrics["finished_time"] = time.monotonic()
