"""Model loading: a Hugging Face directory (read by the C++ core; GPTQ / AWQ ones unpacked here) or a
GGUF file whose tensors go to the core as raw bytes, quantized types staying quantized."""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from fantai import _C
from fantai.model_files import is_gguf_file, resolve_model
from fantai.tokenizer import Tokenizer

QUANTIZATION_CHOICES = ("none", "int8", "int4")
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
    model: str | None, dtype: str = "auto", threads: int | None = None, backend: str = "cpu",
    quantization: str = "none", dequantize: bool = False,
) -> LoadedModel:
    """Loads weights into the core and the tokenizer beside them; no network, no second copy.

    quantization: online round-to-nearest of the linear layers of dense weights ("int8": per
    channel, "int4": groups of 32); tensors a checkpoint already stores quantized stay as they are.
    dequantize: load a GGUF's quantized tensors as dense weights of `dtype` (reference runs).
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    start = time.perf_counter()
    path = resolve_model(model)
    threads = threads or 0
    # Building the tokenizer allocates ~100k small objects that all live on; the cyclic collector
    # would walk them again and again while they are made (~7% of start-up, measured).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        core, tokenizer = _load(path, dtype, threads, backend, quantization, dequantize)
    except ValueError as e:  # model files are untrusted input: every refusal names the file
        if path in str(e):
            raise
        raise ValueError(f"{path}: {e}") from e
    finally:
        if gc_was_enabled:
            gc.enable()
    return LoadedModel(core, tokenizer, path, time.perf_counter() - start)


def _load(path: str, dtype: str, threads: int, backend: str, quantization: str,
          dequantize: bool) -> tuple[_C.Model, Tokenizer]:
    if is_gguf_file(path):
        core, tokenizer = _load_gguf(path, dtype, threads, backend, quantization, dequantize)
    else:
        from fantai.weights.gptq_awq import load_quantized_checkpoint, read_quantization_config

        quant_config = read_quantization_config(path)
        if quant_config is not None:
            if quantization != "none":
                raise ValueError(f"{path} is already quantized ({quant_config.get('quant_method')}); "
                                 f"online quantization {quantization!r} does not apply")
            core = load_quantized_checkpoint(path, quant_config, dtype, backend, threads)
        else:
            core = _C.Model.from_pretrained(path, dtype, backend, threads, quantization)
        tokenizer = Tokenizer.from_model_path(path)
    return core, tokenizer


def _load_gguf(path: str, dtype: str, threads: int, backend: str, quantization: str,
               dequantize: bool) -> tuple[_C.Model, Tokenizer]:
    from fantai.weights.gguf_loader import load_gguf

    gguf = load_gguf(path)
    if dtype == "auto" and gguf.is_quantized():
        # Dense parts of a quantized file (norms, dequantized references) in bf16: what the CPU
        # kernels convert in registers, and half of f32's bandwidth.
        dtype = "bfloat16"
    try:
        core = _C.Model.create(json.dumps(gguf.config), dtype, backend, threads, quantization)
    except ValueError as e:  # the config the file's metadata gave: say which file
        raise ValueError(f"{path}: {e}") from e
    # The tensors convert in C++ with the GIL released while the tokenizer is built in Python, on
    # another thread: the two overlap instead of adding up (~85 ms of the default model's load).
    failed: list[BaseException] = []

    def send_tensors() -> None:
        try:
            _send_gguf_tensors(core, gguf, dequantize, quantization != "none")
            core.finalize()
        except BaseException as e:  # re-raised on the loading thread below
            failed.append(e)

    sender = threading.Thread(target=send_tensors, name="fantai-load-tensors")
    sender.start()
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gguf.tokenizer_metadata, gguf.eos_token_ids)
    except (ValueError, TypeError, KeyError, IndexError) as e:  # a hostile vocabulary
        raise ValueError(f"{path}: bad tokenizer metadata ({type(e).__name__}: {e})") from e
    finally:
        sender.join()
    if failed:
        e = failed[0]
        if isinstance(e, ValueError) and not str(e).startswith(path):
            raise ValueError(f"{path}: {e}") from e
        raise e
    gguf.close()
    _return_freed_heap()
    return core, tokenizer


def _send_gguf_tensors(core: _C.Model, gguf: Any, dequantize: bool, online_quantization: bool) -> None:
    """Raw bytes (views of the mapping) to the core; 1-D tensors and dequantized references dense,
    and F32/F16/BF16 matrices too when the core quantizes dense weights at load.

    The core decodes and packs each tensor with the GIL released and takes several tensors at
    once, so on a CPU backend one thread per core pulls tensors from one queue, largest first
    (the default model's packing took ~180 ms on one thread)."""
    from fantai.weights.gguf_loader import DENSE_TYPES, dequantize_raw

    def send(t: Any) -> None:
        if t.ndim == 1:
            dense = dequantize_raw(t.data, t.ggml_type, (t.cols,))
        elif dequantize and t.ggml_type not in DENSE_TYPES:
            dense = _C.ggml_dequantize(t.data, t.ggml_type, t.rows, t.cols)
        elif online_quantization and t.ggml_type in DENSE_TYPES:
            dense = dequantize_raw(t.data, t.ggml_type, (t.rows, t.cols))
        else:
            core.set_tensor_ggml(t.hf_name, t.data, t.ggml_type, t.rows, t.cols, t.row_perm)
            return
        core.set_tensor(t.hf_name, dense if t.row_perm is None else dense[t.row_perm])

    tensors = sorted(gguf.raw_tensors(), key=lambda t: t.data.nbytes, reverse=True)
    workers = min(len(tensors), core.num_threads) if core.backend == "cpu" else 1
    queue = iter(tensors)
    lock = threading.Lock()
    failed: list[BaseException] = []

    def drain() -> None:
        while not failed:
            with lock:
                t = next(queue, None)
            if t is None:
                return
            try:
                send(t)
            except BaseException as e:  # the first error is raised once every worker stopped
                failed.append(e)

    helpers = [threading.Thread(target=drain, name="fantai-load") for _ in range(workers - 1)]
    for h in helpers:
        h.start()
    drain()
    for h in helpers:
        h.join()
    if failed:
        raise failed[0]


def _return_freed_heap() -> None:
    """Load-time temporaries are gone; hand glibc's freed heap back to the OS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
