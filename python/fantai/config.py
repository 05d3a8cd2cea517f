"""The loaded model and core engine that LLM and AsyncEngine share, built from one EngineArgs."""

from __future__ import annotations

import logging

from fantai import _C
from fantai.engine_args import (  # noqa: F401  re-exported: the names this module always had
    KV_CACHE_DTYPES,
    MATMUL_PRECISIONS,
    EngineArgs,
    resolve_kv_cache_dtype,
)
from fantai.loader import load_model
from fantai.structured import MaskProvider

# The name before EngineArgs; kept so code and tests written against it still run.
EngineOptions = EngineArgs


class CoreHolder:
    """A loaded model and the core engine over it: what LLM and AsyncEngine share."""

    def __init__(self, options: EngineArgs) -> None:
        from fantai.tp_launch import bind_threads, start_ranks

        # Under tensor parallelism the other ranks start here (or already run under mpirun) and
        # load their shares beside this one; rank 0 goes on as the only engine.
        threads = start_ranks(options)
        loaded = load_model(options.model, options.dtype, threads, options.device,
                            quantization=options.quantization, dequantize=options.dequantize)
        self.options = options
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.load_seconds = loaded.load_seconds
        self.chat_template = options.chat_template
        self._model = loaded.model
        bind_threads(loaded.model, options.cpu_bind)
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
        # Structured outputs: the core asks this for the masks of constrained rows only; the
        # llguidance tables are built on the first such request.
        self.grammars = MaskProvider(self.tokenizer, self.vocab_size,
                                     list(config.eos_token_ids) or self.tokenizer.eos_token_ids)
        self.engine.set_mask_provider(self.grammars.fill)
