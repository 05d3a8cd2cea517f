"""safetensors read as memory-mapped NumPy views (no copy), bf16 kept as raw uint16."""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

# safetensors dtype -> NumPy dtype of the stored bits (BF16 has no NumPy type: raw uint16)
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsFile:
    """One .safetensors file: `get(name)` is a read-only view of the mapping."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            (n,) = struct.unpack_from("<Q", self._mm, 0)
            header: dict[str, Any] = json.loads(self._mm[8:8 + n])
        except (struct.error, ValueError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.header = header

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return str(self.header[name]["dtype"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * dtype.itemsize or self._base + end > len(self._mm):
            raise ValueError(f"{self.path}: tensor {name} has inconsistent offsets")
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._base + begin).reshape(shape)

    def get_f32(self, name: str) -> np.ndarray:
        """A float32 copy (bf16 widened exactly)."""
        a = self.get(name)
        if self.dtype(name) == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def checkpoint_files(path: str) -> list[str]:
    """The model's .safetensors files: model.safetensors or the shards its index lists."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise ValueError(f"{path}: no .safetensors files")
    return [os.path.join(path, n) for n in found]


def iter_tensors(path: str) -> Iterator[tuple[str, SafetensorsFile]]:
    """(name, file) for every tensor of the checkpoint directory."""
    for file in checkpoint_files(path):
        st = SafetensorsFile(file)
        for name in st.header:
            yield name, st
