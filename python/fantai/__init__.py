"""fantai: an LLM inference and serving engine (paged KV cache, continuous batching, C++ core)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fantai.outputs import CompletionOutput, Logprob, RequestOutput
from fantai.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngineArgs", "EngineArgs", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from fantai.engine_args import AsyncEngineArgs, EngineArgs
    from fantai.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in the compiled core; importing it lazily keeps `import fantai` cheap and lets
    # pure-Python pieces (tokenizer, protocol) be used without the extension.
    if name == "LLM":
        from fantai.llm import LLM

        return LLM
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from fantai import engine_args

        return getattr(engine_args, name)
    if name == "cmake_prefix_path":
        import os

        return os.path.join(os.path.dirname(__file__), "lib", "cmake")
    raise AttributeError(f"module 'fantai' has no attribute {name!r}")
