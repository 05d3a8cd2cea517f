"""`fantai quantize`: round-to-nearest GPTQ / AWQ checkpoints from a dense HF directory or a GGUF.

The output is a Hugging Face directory in the on-disk layout AutoGPTQ (checkpoint_format "gptq")
or AutoAWQ (GEMM) write: config.json with their quantization_config, model.safetensors with packed
qweight / qzeros / scales (/ g_idx) per linear layer and f16 dense tensors, and the tokenizer files.
No calibration: the scales come from _C.quantize_rtn (what the core's online quantization uses).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np

from fantai.model_files import is_gguf_file, resolve_model
from fantai.weights.gptq_awq import (
    CanonicalWeight,
    canonical_to_awq,
    canonical_to_gptq,
    read_quantization_config,
)

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def is_quantized_linear(name: str, ndim: int) -> bool:
    parts = name.split(".")
    return ndim == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_LAYERS


def quantization_config(fmt: str, bits: int, group_size: int, sym: bool) -> dict[str, Any]:
    """quantization_config as AutoGPTQ (via transformers' GPTQConfig) / AutoAWQ write it."""
    if fmt == "gptq":
        return {"bits": bits, "group_size": group_size, "damp_percent": 0.01, "desc_act": False,
                "static_groups": False, "sym": sym, "true_sequential": True, "model_name_or_path": None,
                "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": bits,
                "version": "gemm", "modules_to_not_convert": None}
    raise ValueError(f"unknown format {fmt!r} (gptq or awq)")


def rtn_quantize(w: np.ndarray, bits: int, group_size: int, sym: bool, fmt: str) -> CanonicalWeight:
    """One linear weight [out, in] through the core's round-to-nearest quantizer."""
    from fantai import _C

    cols = w.shape[1]
    res = _C.quantize_rtn(np.ascontiguousarray(w, dtype=np.float32), bits, group_size, sym)
    q, scale, zero = np.asarray(res["q"]), np.asarray(res["scale"]), np.asarray(res["zero"])
    if fmt == "gptq" and not sym:
        # GPTQ v1 stores zero - 1: a zero of 0 (an all-positive group) would wrap, and readers
        # that add 1 back without masking (AutoGPTQ, vLLM) would read 2^bits. Move those groups'
        # zero to 1 and their codes up one step (the top code saturates: one step of error at most).
        bad = zero == 0
        if bad.any():
            zero = np.where(bad, 1, zero).astype(np.uint8)
            group_of = np.arange(cols) // (cols if group_size == -1 else group_size)
            bump = bad[:, group_of]
            q = np.where(bump, np.minimum(q.astype(np.int16) + 1, (1 << bits) - 1), q).astype(np.uint8)
    return CanonicalWeight(q, scale, zero, None, bits, cols if group_size == -1 else group_size)


def _hf_source(path: str) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    from fantai.weights.gptq_awq import TensorIndex

    if read_quantization_config(path) is not None:
        raise ValueError(f"{path} is already quantized; quantize a dense (f32/bf16/f16) checkpoint")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    index = TensorIndex(path)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for name, st in index.files.items():
            yield name, st.get_f32(name)

    return config, tensors()


def _gguf_source(path: str) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]], Any]:
    from fantai.weights.gguf_loader import load_gguf

    gguf = load_gguf(path)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for gguf_name, hf_name in gguf.tensor_names():
            yield hf_name, np.asarray(gguf.tensor(gguf_name), dtype=np.float32)

    return dict(gguf.config), tensors(), gguf


def quantize_model(model: str | None, output: str, fmt: str, bits: int = 4, group_size: int = 128,
                   sym: bool = True) -> dict[str, Any]:
    """Writes the quantized checkpoint to `output`; returns a summary (tensors, bytes).

    A last partial group (in_features not a multiple of group_size) is written as AutoGPTQ does
    (ceil(in / group) scale rows); fantai and AutoGPTQ read it, vLLM's kernels need whole groups."""
    from safetensors.numpy import save_file

    fmt = fmt.lower()
    if fmt == "awq" and bits != 4:
        raise ValueError("AWQ GEMM checkpoints are 4-bit")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group size must be positive or -1, got {group_size}")
    src = resolve_model(model)
    gguf = None
    if is_gguf_file(src):
        config, tensors, gguf = _gguf_source(src)
    else:
        config, tensors = _hf_source(src)
    out: dict[str, np.ndarray] = {}
    n_quantized = 0
    for name, w in tensors:
        if is_quantized_linear(name, w.ndim):
            cw = rtn_quantize(w, bits, group_size, sym, fmt)
            packed = canonical_to_gptq(cw) if fmt == "gptq" else canonical_to_awq(cw)
            prefix = name[: -len(".weight")]
            out.update({f"{prefix}.{k}": v for k, v in packed.items()})
            n_quantized += 1
        else:
            out[name] = np.ascontiguousarray(w, dtype=np.float16)
    if n_quantized == 0:
        raise ValueError(f"{src}: no linear layer weights found to quantize")
    os.makedirs(output, exist_ok=True)
    save_file(out, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config(fmt, bits, group_size, sym)
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if fmt == "gptq":  # AutoGPTQ reads its own file beside config.json
        with open(os.path.join(output, "quantize_config.json"), "w", encoding="utf-8") as f:
            json.dump(config["quantization_config"], f, indent=2)
    if gguf is not None:
        write_gguf_tokenizer(gguf, output)
    else:
        for name in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(output, name))
    return {"source": src, "output": output, "format": fmt, "bits": bits, "group_size": group_size, "sym": sym,
            "quantized_linears": n_quantized,
            "bytes": os.path.getsize(os.path.join(output, "model.safetensors"))}


def write_gguf_tokenizer(gguf: Any, output: str) -> None:
    """tokenizer.json / tokenizer_config.json / generation_config.json from GGUF metadata: the
    tokenizer fantai builds from the file, saved in the `tokenizers` format HF tools read."""
    from fantai.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(gguf.tokenizer_metadata, gguf.eos_token_ids)
    tok.hf.save(os.path.join(output, "tokenizer.json"))
    meta = gguf.tokenizer_metadata
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos, eos = gguf.bos_token_id, (gguf.eos_token_ids or [None])[0]
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": tok.spec.add_bos, "add_eos_token": tok.spec.add_eos,
        "model_max_length": gguf.config.get("max_position_embeddings"),
    }
    if gguf.chat_template:
        cfg["chat_template"] = gguf.chat_template
    with open(os.path.join(output, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    gen = {"bos_token_id": bos, "eos_token_id": gguf.eos_token_ids or None}
    with open(os.path.join(output, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
