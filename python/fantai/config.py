"""Engine options shared by LLM, AsyncEngine and the CLI, mapped onto the core's EngineConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fantai import _C
from fantai.loader import load_model, parse_bytes


@dataclass(slots=True)
class EngineOptions:
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_memory: int | str | None = None  # bytes, or "2G"
    memory_utilization: float | None = None    # fraction of MemAvailable for the KV pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    seed: int = 0
    threads: int | None = None
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None  # fixes the pool in blocks (tests, experiments)
    enable_prefix_caching: bool = True
    quantization: str = "none"  # online RTN of dense linear weights: "none" | "int8" | "int4"
    dequantize: bool = False  # load a GGUF's quantized tensors as dense `dtype` weights (references)

    def core_config(self, eos_token_ids: list[int]) -> _C.EngineConfig:
        c = _C.EngineConfig()
        c.block_size = self.block_size
        c.max_num_seqs = self.max_num_seqs
        c.max_num_batched_tokens = self.max_num_batched_tokens or 0
        c.max_model_len = self.max_model_len or 0
        c.enable_chunked_prefill = self.enable_chunked_prefill
        c.seed = self.seed
        c.eos_token_ids = list(eos_token_ids)
        c.num_blocks = self.num_kv_blocks or 0
        c.kv_cache_bytes = self.kv_bytes()
        c.enable_prefix_caching = self.enable_prefix_caching
        return c

    def kv_bytes(self) -> int:
        explicit = parse_bytes(self.kv_cache_memory)
        if explicit is not None:
            if explicit <= 0:
                raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
            return explicit
        if self.memory_utilization is not None:
            if not 0.0 < self.memory_utilization <= 0.95:
                raise ValueError(f"memory_utilization must be in (0, 0.95], got {self.memory_utilization}")
            return int(_available_bytes() * self.memory_utilization)
        return 0  # the core's default share of available RAM


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CoreHolder:
    """A loaded model and the core engine over it: what LLM and AsyncEngine share."""

    def __init__(self, model: str | None, options: EngineOptions, chat_template: str | None) -> None:
        loaded = load_model(model, options.dtype, options.threads, quantization=options.quantization,
                            dequantize=options.dequantize)
        self.options = options
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        self.chat_template = chat_template
        self._model = loaded.model
        self.engine = _C.Engine(loaded.model, options.core_config(self.tokenizer.eos_token_ids))
        self.max_model_len: int = self.engine.max_model_len
        self.vocab_size: int = loaded.model.config.vocab_size
