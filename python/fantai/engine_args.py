"""EngineArgs: the engine options of LLM, AsyncEngine and every `fantai` command, in one place.

Each field carries its default, its help text and its rule; `add_cli_args` builds the command-line
flags from the fields and `from_cli_args` reads them back, so the Python and command-line spellings
cannot drift apart. This module imports neither the compiled core nor anything heavy: parsing
arguments and printing --help stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fantai import _C

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The core's own spellings (dtype_from_name), so LLM(dtype="bf16") keeps loading as it always did.
_DTYPE_ALIASES = {"f32": "float32", "float": "float32", "F32": "float32", "f16": "float16",
                  "half": "float16", "F16": "float16", "bf16": "bfloat16", "BF16": "bfloat16"}
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
MATMUL_PRECISIONS = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int4")
PREEMPTION_MODES = ("auto", "swap", "recompute")
# Past this share of free memory the KV pool starves the weights, the OS and the engine's own
# scratch buffers; vLLM's gpu_memory_utilization tops out near here in practice too.
MAX_MEMORY_UTILIZATION = 0.95

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | float | str) -> int:
    """Bytes from 1073741824, "4G", "512M", "1.5GiB" or "64kb": K/M/G/T are powers of 1024,
    with or without a trailing B / iB."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ValueError(f"not a size: {value!r}")
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"not a size: {value!r} (examples: 4G, 512M, 1.5GiB, 1073741824)")
    return int(float(m.group(1)) * _SCALE[m.group(2).lower()])


# ---- the rules: each takes the Python value and returns it (normalised) or raises ValueError ----
# The message does not name the option: the Python path prefixes the field name, argparse the flag.

def _choice(names: tuple[str, ...], aliases: dict[str, str] | None = None) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        value = (aliases or {}).get(value, value)
        if value not in names:
            raise ValueError(f"must be one of {', '.join(names)}; got {value!r}")
        return str(value)
    return check


def _int_at_least(low: int | None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)  # numpy integers too, never a float
        except TypeError:
            raise ValueError(f"must be an integer, got {value!r}") from None
        if low is not None and value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value
    return check


def _positive_size(value: Any) -> int:
    n = parse_size(value)
    if n <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return n


def swap_space_bytes(value: int | float | str) -> int:
    """Bytes of swap space: a plain number (or numeric string) is GiB, vLLM's --swap-space
    unit; a string with a K/M/G/T suffix is that size."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return parse_size(value)
    if not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"must be >= 0 GiB or a size such as 512M, got {value!r}")
    return int(value * (1 << 30))


def _swap_space(value: Any) -> Any:
    swap_space_bytes(value)  # validates; the field keeps what was given, so a re-check reads it alike
    return value


def _memory_utilization(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {value!r}")
    if not 0.0 < value <= MAX_MEMORY_UTILIZATION:
        raise ValueError(f"must be in (0, {MAX_MEMORY_UTILIZATION}], got {value}")
    return float(value)


def _device(value: Any) -> str:
    if not isinstance(value, str) or re.fullmatch(r"cpu|cuda(:\d+)?", value) is None:
        raise ValueError(f"must be cpu, cuda or cuda:N; got {value!r}")
    return value


def _cpu_bind(value: Any) -> str:
    # CPUs outside this process's mask are refused when the model binds (the mask is the OS's).
    if not isinstance(value, str) or re.fullmatch(
            r"none|compact|spread|\d+(-\d+)?(,\d+(-\d+)?)*", value.strip()) is None:
        raise ValueError(f"must be none, compact, spread or a CPU list such as 0-3,8; got {value!r}")
    return value.strip()


def _non_negative_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"must be a number >= 0, got {value!r}")
    return float(value)


def _option(default: Any, help: str, *, check: Callable[[Any], Any] | None = None,
            parse: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,
            metavar: str | None = None, cli: bool = True) -> Any:
    """A field with what the CLI needs: `parse` reads the flag's text, `check` is the rule both
    paths apply, `choices` (argparse's own "invalid choice" error) for closed lists."""
    return field(default=default, metadata={"help": help, "check": check, "parse": parse,
                                             "choices": choices, "metavar": metavar, "cli": cli})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class EngineArgs:
    """Everything that decides how a model is loaded and the engine sized and run.

    >>> LLM(engine_args=EngineArgs(threads=2, kv_cache_memory="512M"))
    >>> LLM(threads=2, kv_cache_memory="512M")  # the same
    """

    model: str | None = _option(
        None, "model folder (config.json + safetensors), .gguf file or hub-style name; "
              f"default: the embedded {DEFAULT_MODEL_NAME} GGUF", cli=False)  # positional on the CLI
    dtype: str = _option(
        "auto", "compute / weight dtype (default: %(default)s, the checkpoint's)",
        check=_choice(DTYPES, _DTYPE_ALIASES), parse=lambda s: _DTYPE_ALIASES.get(s, s), choices=DTYPES)
    max_model_len: int | None = _option(
        None, "context length (prompt + output tokens); default: the model's",
        check=_int_at_least(1), parse=int)
    kv_cache_memory: int | str | None = _option(
        None, "KV pool size in bytes; K/M/G/T suffixes (1024-based), e.g. 2G or 512MiB "
              "(default: the core's share of available memory)",
        check=_positive_size, metavar="BYTES")
    memory_utilization: float | None = _option(
        None, f"KV pool as a fraction of free memory (device memory on a GPU), in "
              f"(0, {MAX_MEMORY_UTILIZATION}]; --kv-cache-memory wins when both are given",
        check=_memory_utilization, parse=float, metavar="FRACTION")
    max_num_seqs: int = _option(
        256, "most sequences in one running batch (default: %(default)s)", check=_int_at_least(1), parse=int)
    max_num_batched_tokens: int | None = _option(
        None, "token budget of one engine step (default: the engine's choice)",
        check=_int_at_least(1), parse=int)
    block_size: int = _option(
        16, "tokens per KV-cache block (default: %(default)s)", check=_int_at_least(1), parse=int)
    seed: int = _option(
        0, "engine seed for requests without their own (default: %(default)s)", check=_int_at_least(None),
        parse=int)
    threads: int | None = _option(
        None, "CPU threads for the model (default: all cores)", check=_int_at_least(0), parse=int)
    cpu_bind: str = _option(
        "none", "pin each CPU thread to one CPU: compact (one per core, one L3 domain before the "
                "next), spread (one per core, L3 domains in turn), a CPU list such as 0-3,8, or none "
                "to leave placement to the OS (default: %(default)s)",
        check=_cpu_bind, metavar="POLICY")
    enable_chunked_prefill: bool = _option(
        True, "split long prompts across engine steps so decodes keep running")
    num_kv_blocks: int | None = _option(
        None, "fix the KV pool at this many blocks, overriding the byte sizing (tests, experiments)",
        check=_int_at_least(1), parse=int, metavar="BLOCKS")
    enable_prefix_caching: bool = _option(
        True, "reuse the KV of cached prompt prefixes")
    swap_space: float | str = _option(
        0, "host memory for the KV of preempted sequences, so they resume without recomputing: "
           "GiB as a plain number, as vLLM's --swap-space (e.g. 4), or a size with a K/M/G/T "
           "suffix (512M); pinned on a GPU (default: %(default)s, preemption recomputes)",
        check=_swap_space, metavar="GIB")
    preemption_mode: str = _option(
        "auto", "how a preempted sequence gives its KV blocks back when there is swap space: auto "
                "(swap when copying out and back measures cheaper than recomputing), swap, or "
                "recompute (default: %(default)s)",
        check=_choice(PREEMPTION_MODES), choices=PREEMPTION_MODES)
    kv_cache_dtype: str = _option(
        "auto", "KV cache element type (default: %(default)s: float32 for float32 weights, else "
                "bfloat16; int8 stores int8 values with a float32 scale per token and KV head)",
        check=_choice(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES)
    device: str = _option(
        "cpu", "where the model runs: cpu, cuda or cuda:N (needs a CUDA build and an NVIDIA GPU; "
               "default: %(default)s)", check=_device, metavar="DEVICE")
    quantization: str = _option(
        "none", "quantize the dense linear weights at load, round-to-nearest: int8 per output "
                "channel, int4 in groups of 32 (embeddings and lm_head stay dense); GGUF, GPTQ "
                "and AWQ weights stay as stored (default: %(default)s)",
        check=_choice(QUANTIZATIONS), choices=QUANTIZATIONS)
    dequantize: bool = _option(
        False, "load a GGUF's quantized tensors as dense --dtype weights (reference runs)")
    matmul_precision: str = _option(
        "float32", "activations meeting bf16 weights or a bf16 KV cache: float32 keeps them "
                   "f32-grade; bfloat16 rounds them to bf16 where a bf16 matrix unit (AMX) runs "
                   "the product, as llama.cpp and vLLM do: faster prefill, tokens no longer "
                   "exact against an f32 reference (default: %(default)s)",
        check=_choice(MATMUL_PRECISIONS), choices=MATMUL_PRECISIONS)
    tensor_parallel_size: int = _option(
        1, "split the model over this many CPU ranks (processes) joined by MPI; they start on "
           "this host by themselves, or span hosts under mpirun -np N (default: %(default)s)",
        check=_int_at_least(1), parse=int, metavar="N")
    chat_template: str | None = _option(
        None, "Jinja chat template: a file path or the template text itself; default: the model's",
        metavar="FILE_OR_TEXT")

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            value = getattr(self, f.name)
            if check is None or value is None:
                continue
            try:
                setattr(self, f.name, check(value))
            except ValueError as e:
                raise ValueError(f"{f.name} {e}") from None

    # ---- the command line ------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
        """Adds MODEL and one flag per field (or per field named in `only`), their defaults, help
        and rules taken from the fields themselves."""
        parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                            help=cls.__dataclass_fields__["model"].metadata["help"])
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            if f.metadata.get("cli", True) and (only is None or f.name in only):
                _add_field_flag(group, f)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["chat_template"] = _template_text(values.get("chat_template"))
        return cls(**values)

    # ---- what the core is given ------------------------------------------------------------
    def kv_bytes(self, device_free_bytes: int = -1) -> int:
        """KV pool bytes; memory_utilization is a share of the device's free memory on a device
        backend (device_free_bytes >= 0, weights already loaded) and of MemAvailable on cpu;
        0 leaves the size to the core."""
        if self.kv_cache_memory is not None:
            return parse_size(self.kv_cache_memory)
        if self.memory_utilization is not None:
            free = device_free_bytes if device_free_bytes >= 0 else _available_bytes()
            return int(free * self.memory_utilization)
        return 0

    def core_config(self, eos_token_ids: list[int], model_dtype: str = "float32",
                    device_free_bytes: int = -1) -> _C.EngineConfig:
        from fantai import _C

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
        c.swap_space_bytes = swap_space_bytes(self.swap_space)
        c.preemption_mode = self.preemption_mode
        c.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype)
        return c


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs plus what only the server's always-running engine has."""

    idle_release_seconds: float = _option(
        10.0, "after this long without work, give unused KV memory back to the OS "
              "(0: never; default: %(default)s)", check=_non_negative_float, parse=float, metavar="SECONDS")
    request_timeout: float = _option(
        0.0, "abort a request that has not finished this many seconds after it reached the engine "
             "(queueing included) and free its KV blocks; the client gets a 504 error, or an error "
             "event on a stream (0: no limit; default: %(default)s)",
        check=_non_negative_float, parse=float, metavar="SECONDS")


def engine_args_from(cls: type[EngineArgs], model: str | None, engine_args: EngineArgs | None,
                     kwargs: dict[str, Any], caller: str) -> EngineArgs:
    """What LLM(...) and AsyncEngine(...) were given, as one `cls`: engine_args (if any) with
    `model` and the keyword arguments laid over it."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if model is not None:
        kwargs = {**kwargs, "model": model}
    if engine_args is None:
        return cls(**kwargs)
    if not isinstance(engine_args, EngineArgs):
        raise TypeError(f"engine_args must be an EngineArgs, got {type(engine_args).__name__}")
    base = {f.name: getattr(engine_args, f.name) for f in fields(engine_args) if f.name in names}
    return cls(**{**base, **kwargs})


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


def _add_field_flag(group: Any, f: dataclasses.Field[Any]) -> None:
    meta = f.metadata
    if isinstance(f.default, bool):
        state = "on" if f.default else "off"
        group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                           help=f"{meta['help']} (default: {state}; --no-{_flag(f.name)[2:]} turns it off)"
                           if f.default else f"{meta['help']} (default: {state})")
        return
    check, parse = meta["check"], meta["parse"]

    def from_text(text: str) -> Any:
        # argparse turns a ValueError from `type` into a bare "invalid from_text value";
        # ArgumentTypeError keeps the rule's own message.
        try:
            value = parse(text) if parse is not None else text
            return value if meta["choices"] or check is None else check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    group.add_argument(_flag(f.name), type=from_text, default=f.default, choices=meta["choices"],
                       metavar=meta["metavar"], help=meta["help"])


def _template_text(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
