"""GPTQ and AWQ checkpoints: packed int32 tensors <-> the core's canonical quantized form.

Canonical form (what Model.set_tensor_quant takes), for a linear weight W [out, in]:
  q u8 [out, in] one value per byte, scale f32 [out, ng], zero u8 [out, ng], perm i32 [in] | None,
  W[r, perm[c]] = scale[r, c // group] * (q[r, c] - zero[r, c // group]).

GPTQ (AutoGPTQ / GPTQModel "gptq" format, as vLLM and transformers read it), per linear module:
  qweight int32 [in * bits / 32, out]: input row i sits in word i // (32 / bits) at bit
      bits * (i % (32 / bits)) (values packed along the input dimension);
  qzeros int32 [ng, out * bits / 32]: output column j of group g in word j // (32 / bits) at bit
      bits * (j % (32 / bits)); checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" the zero;
  scales f16 [ng, out]; g_idx i32 [in]: the group of each input row (act-order permutes it).
AWQ GEMM (AutoAWQ version "gemm"), 4-bit:
  qweight int32 [in, out / 8] and qzeros int32 [ng, out / 8]: eight outputs per word, output
      8w + AWQ_ORDER[p] in nibble p; scales f16 [ng, out]; zeros stored as they are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from fantai.weights.safetensors_file import SafetensorsFile, checkpoint_files

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column AWQ_ORDER[p] of its 8
_AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(8))
QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


# ---- packing along one axis ---------------------------------------------------------------
def _check_bits(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"only 4- and 8-bit packed weights are supported, got bits={bits}")
    return 32 // bits


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """u8 [k, n] -> int32 [k * bits / 32, n]: GPTQ's qweight packing (along the first axis)."""
    per = _check_bits(bits)
    k, n = q.shape
    if k % per:
        raise ValueError(f"{k} rows do not pack into whole {per}-value int32 words")
    parts = q.reshape(k // per, per, n).astype(np.uint32)
    word = np.zeros((k // per, n), np.uint32)
    for i in range(per):
        word |= parts[:, i, :] << np.uint32(bits * i)
    return word.view(np.int32)


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [k * bits / 32, n] -> u8 [k, n] (inverse of pack_rows)."""
    per = _check_bits(bits)
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * np.uint32(bits))[None, :, None]
    vals = (words[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.astype(np.uint8).reshape(words.shape[0] * per, words.shape[1])


def pack_cols(q: np.ndarray, bits: int) -> np.ndarray:
    """u8 [m, n] -> int32 [m, n * bits / 32]: GPTQ's qzeros packing (along the last axis)."""
    return np.ascontiguousarray(pack_rows(np.ascontiguousarray(q.T), bits).T)


def unpack_cols(packed: np.ndarray, bits: int) -> np.ndarray:
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(packed.T), bits).T)


def awq_pack(q: np.ndarray) -> np.ndarray:
    """u8 [m, n] (4-bit values) -> int32 [m, n / 8] in AWQ's interleaved nibble order."""
    m, n = q.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 columns per word; {n} columns do not divide")
    cols = q.reshape(m, n // 8, 8).astype(np.uint32)
    word = np.zeros((m, n // 8), np.uint32)
    for p, c in enumerate(AWQ_ORDER):
        word |= cols[:, :, c] << np.uint32(4 * p)
    return word.view(np.int32)


def awq_unpack(packed: np.ndarray) -> np.ndarray:
    """int32 [m, n / 8] -> u8 [m, n] (inverse of awq_pack)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.array(_AWQ_NIBBLE_OF_COLUMN, dtype=np.uint32) * np.uint32(4))[None, None, :]
    vals = (words[:, :, None] >> shifts) & np.uint32(0xF)
    return vals.astype(np.uint8).reshape(words.shape[0], words.shape[1] * 8)


# ---- checkpoint description ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group per output row
    sym: bool
    zeros_minus_one: bool  # GPTQ v1 stores zero - 1

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> QuantSpec:
        method = str(qc.get("quant_method", "")).lower()
        if method == "gptq":
            bits = int(qc.get("bits", 4))
            _check_bits(bits)
            fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
            if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq and gptq_v2 are)")
            return cls("gptq", bits, int(qc.get("group_size", 128)), bool(qc.get("sym", True)), fmt == "gptq")
        if method == "awq":
            bits = int(qc.get("bits", qc.get("w_bit", 4)))
            version = str(qc.get("version", "gemm")).lower()
            if bits != 4 or version != "gemm":
                raise ValueError(f"AWQ {bits}-bit version {version!r} is not supported (4-bit GEMM is)")
            if not qc.get("zero_point", True):
                raise ValueError("AWQ without zero points is not supported")
            group = int(qc.get("group_size", qc.get("q_group_size", 128)))
            return cls("awq", 4, group, False, False)
        raise ValueError(f"unknown quant_method {method!r}")


@dataclass(slots=True)
class CanonicalWeight:
    q: np.ndarray  # u8 [out, in]
    scale: np.ndarray  # f32 [out, ng]
    zero: np.ndarray  # u8 [out, ng]
    perm: np.ndarray | None  # i32 [in]
    bits: int
    group: int  # columns per group (in for per-channel)

    def dequantize(self) -> np.ndarray:
        """W [out, in] in the original column order (NumPy; what the core computes)."""
        group_of = np.arange(self.q.shape[1]) // self.group
        w = self.scale[:, group_of] * (self.q.astype(np.float32) - self.zero[:, group_of].astype(np.float32))
        if self.perm is None:
            return w
        out = np.empty_like(w)
        out[:, self.perm] = w
        return out


def gptq_to_canonical(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
                      spec: QuantSpec) -> CanonicalWeight:
    bits = spec.bits
    q = unpack_rows(qweight, bits)  # [in, out]
    k, n = q.shape
    group = k if spec.group_size in (-1, 0) else spec.group_size
    ng = -(-k // group)
    if scales.shape != (ng, n):
        raise ValueError(f"GPTQ scales shape {scales.shape}, expected {(ng, n)} for in={k} group={group}")
    zeros = unpack_cols(qzeros, bits)[:, :n]
    if zeros.shape[0] != ng:
        raise ValueError(f"GPTQ qzeros has {zeros.shape[0]} groups, expected {ng}")
    if spec.zeros_minus_one:
        # v1 stores zero - 1 in `bits` bits; the wrap of a zero of 0 is undone by the mask.
        zeros = ((zeros.astype(np.uint16) + 1) & ((1 << bits) - 1)).astype(np.uint8)
    perm = _act_order_perm(g_idx, k, group)
    q_t = q.T if perm is None else q[perm].T
    return CanonicalWeight(np.ascontiguousarray(q_t), np.ascontiguousarray(scales.astype(np.float32).T),
                           np.ascontiguousarray(zeros.T), perm, bits, group)


def _act_order_perm(g_idx: np.ndarray | None, k: int, group: int) -> np.ndarray | None:
    """Columns sorted by group (act-order); None when g_idx is already the identity grouping."""
    contiguous = np.arange(k, dtype=np.int64) // group
    if g_idx is None:
        return None
    g = np.asarray(g_idx).astype(np.int64).reshape(-1)
    if g.shape != (k,):
        raise ValueError(f"g_idx has {g.size} entries, expected {k}")
    if np.array_equal(g, contiguous):
        return None
    perm = np.argsort(g, kind="stable").astype(np.int32)
    if not np.array_equal(g[perm], contiguous):
        raise ValueError("g_idx does not assign exactly group_size columns to each group")
    return perm


def awq_to_canonical(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, spec: QuantSpec) -> CanonicalWeight:
    q = awq_unpack(qweight)  # [in, out]
    k, n = q.shape
    group = k if spec.group_size in (-1, 0) else spec.group_size
    ng = -(-k // group)
    zeros = awq_unpack(qzeros)[:, :n]
    if scales.shape != (ng, n) or zeros.shape != (ng, n):
        raise ValueError(f"AWQ scales {scales.shape} / qzeros {zeros.shape}, expected {(ng, n)}")
    return CanonicalWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(scales.astype(np.float32).T),
                           np.ascontiguousarray(zeros.T), None, 4, group)


def canonical_to_gptq(w: CanonicalWeight, zeros_minus_one: bool = True) -> dict[str, np.ndarray]:
    """Packed GPTQ tensors (qweight, qzeros, scales, g_idx) of a contiguous-group weight."""
    if w.perm is not None:
        raise ValueError("writing act-order GPTQ is not supported")
    mask = (1 << w.bits) - 1
    zeros = w.zero.T.astype(np.int16)
    if zeros_minus_one:
        zeros = (zeros - 1) & mask
    k = w.q.shape[1]
    return {
        "qweight": pack_rows(np.ascontiguousarray(w.q.T), w.bits),
        "qzeros": pack_cols(zeros.astype(np.uint8), w.bits),
        "scales": np.ascontiguousarray(w.scale.T.astype(np.float16)),
        "g_idx": (np.arange(k, dtype=np.int32) // w.group).astype(np.int32),
    }


def canonical_to_awq(w: CanonicalWeight) -> dict[str, np.ndarray]:
    if w.bits != 4 or w.perm is not None:
        raise ValueError("AWQ GEMM holds 4-bit weights without act-order")
    return {
        "qweight": awq_pack(np.ascontiguousarray(w.q.T)),
        "qzeros": awq_pack(np.ascontiguousarray(w.zero.T)),
        "scales": np.ascontiguousarray(w.scale.T.astype(np.float16)),
    }


# ---- loading ------------------------------------------------------------------------------
def read_quantization_config(path: str) -> dict[str, Any] | None:
    """config.json's quantization_config, else AutoGPTQ's quantize_config.json or AutoAWQ's
    quant_config.json beside it; None for a dense checkpoint."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if qc:
        return dict(qc)
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                qc = json.load(f)
            qc.setdefault("quant_method", method)
            return dict(qc)
    return None


def load_quantized_checkpoint(path: str, quant_config: dict[str, Any], dtype: str, backend: str,
                              threads: int) -> Any:
    """A GPTQ / AWQ Hugging Face directory into a core Model: packed linears unpacked to the
    canonical form (set_tensor_quant), everything else dense (set_tensor)."""
    from fantai import _C

    spec = QuantSpec.from_config(quant_config)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config_text = f.read()
    core = _C.Model.create(config_text, dtype, backend, threads)
    index = TensorIndex(path)
    modules = index.quantized_modules()
    for prefix in modules:
        w = module_canonical(index, prefix, spec)
        core.set_tensor_quant(prefix + ".weight", w.q, w.scale, w.zero, None, w.perm, w.bits, w.group)
    packed = {p + s for p in modules for s in QUANT_SUFFIXES}
    for name, st in index.files.items():
        if name in packed:
            continue
        if st.dtype(name) == "BF16":
            core.set_tensor(name, st.get(name), "bfloat16")
        elif st.dtype(name) in ("F32", "F16"):
            core.set_tensor(name, st.get(name))
        else:
            raise ValueError(f"{st.path}: unexpected {st.dtype(name)} tensor {name}")
    core.finalize()
    return core


class TensorIndex:
    """Every tensor of a (possibly sharded) checkpoint by name, mapped, nothing read yet."""

    def __init__(self, path: str) -> None:
        self.files: dict[str, SafetensorsFile] = {}
        for file in checkpoint_files(path):
            st = SafetensorsFile(file)
            for name in st.header:
                self.files[name] = st

    def quantized_modules(self) -> list[str]:
        return sorted(n[: -len(".qweight")] for n in self.files if n.endswith(".qweight"))

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise ValueError(f"checkpoint lacks tensor {name}")
        return self.files[name].get(name)


def module_canonical(index: TensorIndex, prefix: str, spec: QuantSpec) -> CanonicalWeight:
    qweight, qzeros, scales = (index.get(prefix + s) for s in (".qweight", ".qzeros", ".scales"))
    try:
        if spec.method == "awq":
            return awq_to_canonical(qweight, qzeros, scales, spec)
        g_idx = index.get(prefix + ".g_idx") if prefix + ".g_idx" in index.files else None
        return gptq_to_canonical(qweight, qzeros, scales, g_idx, spec)
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from e
