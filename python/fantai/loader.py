"""Model loading: a Hugging Face directory (read by the C++ core) or a GGUF file (dequantized here)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from fantai import _C
from fantai.model_files import is_gguf_file, resolve_model
from fantai.tokenizer import Tokenizer

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")


def parse_bytes(value: float | str | None) -> int | None:
    """Accepts 1073741824, "1G", "512M", "1.5GiB": binary multiples (K = 1024)."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot read {value!r} as a size in bytes (examples: 2G, 512M, 1073741824)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


@dataclass(slots=True)
class LoadedModel:
    model: _C.Model
    tokenizer: Tokenizer
    path: str
    load_seconds: float


def load_model(
    model: str | None, dtype: str = "auto", threads: int | None = None, backend: str = "cpu"
) -> LoadedModel:
    """Loads weights into the core and the tokenizer beside them; no network, no second copy."""
    start = time.perf_counter()
    path = resolve_model(model)
    if is_gguf_file(path):
        core = _load_gguf(path, dtype, threads or 0, backend)
    else:
        core = _C.Model.from_pretrained(path, dtype, backend, threads or 0)
    tokenizer = Tokenizer.from_model_path(path)
    return LoadedModel(core, tokenizer, path, time.perf_counter() - start)


def _load_gguf(path: str, dtype: str, threads: int, backend: str) -> _C.Model:
    from fantai.weights.gguf_loader import load_gguf

    gguf = load_gguf(path)
    if dtype == "auto" and gguf.is_quantized():
        # Quantized weights are dequantized at load: bf16 keeps decode bandwidth near the
        # quantized file's and is what the CPU kernels convert in registers.
        dtype = "bfloat16"
    core = _C.Model.create(json.dumps(gguf.config), dtype, backend, threads)
    for name, array in gguf.tensors():  # one dequantized tensor alive at a time
        core.set_tensor(name, array)
    core.finalize()
    del gguf
    _return_freed_heap()
    return core


def _return_freed_heap() -> None:
    """Dequantization churned through large temporaries; hand glibc's freed heap back to the OS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
