"""Request sampling parameters (names and defaults follow vLLM's SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fantai.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A grammar the output must follow (vLLM's structured_outputs; guided_decoding is its older
    # name and lands here).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # The core holds these in fixed-width integers: a value outside them is an error here, in
        # the request's terms, not an overflow at the binding.
        int32 = (-(2**31), 2**31 - 1)
        for name in ("n", "best_of", "top_k", "max_tokens", "min_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not int32[0] <= value <= int32[1]):
                raise ValueError(f"{name} must be an integer in [{int32[0]}, {int32[1]}], got {value!r}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for t in self.stop_token_ids:
            if not int32[0] <= t <= int32[1]:
                raise ValueError(f"stop_token_ids entry {t} is not a token id")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5
