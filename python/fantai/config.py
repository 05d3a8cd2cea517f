"""Engine options shared by LLM, AsyncEngine and the CLI, mapped onto the core's EngineConfig."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fantai import _C
from fantai.loader import load_model, parse_bytes


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
MATMUL_PRECISIONS = ("float32", "bfloat16")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV pool's element type for a model whose weights are in ``model_dtype``.

    "auto" follows the model's activation precision, as vLLM's "auto" follows the model dtype:
    float32 KV for float32 weights, bfloat16 KV for bfloat16/float16 or quantized weights (so the
    parity tests, which load float32 models, keep a float32 cache). "int8" stores int8 values with
    one float32 scale per token and KV head.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float32" if model_dtype == "float32" else "bfloat16"


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
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | int8; see resolve_kv_cache_dtype
    device: str = "cpu"  # backend: "cpu", "cuda" or "cuda:N"
    quantization: str = "none"  # online RTN of dense linear weights: "none" | "int8" | "int4"
    dequantize: bool = False  # load a GGUF's quantized tensors as dense `dtype` weights (references)
    # Activations meeting bf16 weights or a bf16 KV cache: "float32" keeps them f32-grade;
    # "bfloat16" lets a bf16 matrix unit (CPU AMX) round them to bf16 first, as torch's bf16
    # matmul, llama.cpp and vLLM do: faster prefill, tokens no longer exact against an f32 reference.
    matmul_precision: str = "float32"

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype, "float32")  # a bad name fails before the model loads
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}; "
                             f"got {self.matmul_precision!r}")

    def core_config(self, eos_token_ids: list[int], model_dtype: str = "float32",
                    device_free_bytes: int = -1) -> _C.EngineConfig:
        c = _C.EngineConfig()
        c.block_size = self.block_size
        c.max_num_seqs = self.max_num_seqs
        c.max_num_batched_tokens = self.max_num_batched_tokens or 0
        c.max_model_len = self.max_model_len or 0
        c.enable_chunked_prefill = self.enable_chunked_prefill
        c.seed = self.seed
        c.eos_token_ids = list(eos_token_ids)
        c.num_blocks = self.num_kv_blocks or 0
        c.kv_cache_bytes = self.kv_bytes(device_free_bytes)
        c.enable_prefix_caching = self.enable_prefix_caching
        c.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype)
        return c

    def kv_bytes(self, device_free_bytes: int = -1) -> int:
        """KV pool bytes; memory_utilization is a share of the device's free memory on a device
        backend (device_free_bytes >= 0, weights already loaded) and of MemAvailable on cpu."""
        explicit = parse_bytes(self.kv_cache_memory)
        if explicit is not None:
            if explicit <= 0:
                raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
            return explicit
        if self.memory_utilization is not None:
            if not 0.0 < self.memory_utilization <= 0.95:
                raise ValueError(f"memory_utilization must be in (0, 0.95], got {self.memory_utilization}")
            free = device_free_bytes if device_free_bytes >= 0 else _available_bytes()
            return int(free * self.memory_utilization)
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
        loaded = load_model(model, options.dtype, options.threads, options.device,
                            quantization=options.quantization, dequantize=options.dequantize)
        self.options = options
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        self.chat_template = chat_template
        self._model = loaded.model
        # What the backend does, not what was asked: "bfloat16" only where it has a unit for it.
        rounds = loaded.model.set_matmul_precision(options.matmul_precision)
        self.matmul_precision: str = "bfloat16" if rounds else "float32"
        if options.matmul_precision != self.matmul_precision:
            logging.getLogger("fantai").warning(
                "matmul_precision=%r has no effect on this %s backend (no bf16 matrix unit such as "
                "AMX): activations stay float32", options.matmul_precision, loaded.model.backend)
        config = options.core_config(self.tokenizer.eos_token_ids, loaded.model.dtype,
                                     loaded.model.device_free_memory)
        self.kv_cache_dtype: str = config.kv_cache_dtype  # resolved: never "auto"
        self.engine = _C.Engine(loaded.model, config)
        self.max_model_len: int = self.engine.max_model_len
        self.vocab_size: int = loaded.model.config.vocab_size
