"""A lean GGUF reader for the load path: metadata and tensor infos parsed straight from an mmap.

gguf-py's GGUFReader builds a NumPy view per field part (one per token string), which costs
seconds for a 49k-token vocabulary; this reads the same header with struct in tens of
milliseconds. Tensor data stays in the mapping: `tensor_bytes` is a uint8 view, never a copy.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec: GGUFValueType)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: ("<B", 1), _INT8: ("<b", 1), _UINT16: ("<H", 2), _INT16: ("<h", 2), _UINT32: ("<I", 4),
    _INT32: ("<i", 4), _FLOAT32: ("<f", 4), _BOOL: ("<?", 1), _UINT64: ("<Q", 8), _INT64: ("<q", 8),
    _FLOAT64: ("<d", 8),
}
_NUMPY = {
    _UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4", _INT32: "<i4",
    _FLOAT32: "<f4", _BOOL: "?", _UINT64: "<u8", _INT64: "<i8", _FLOAT64: "<f8",
}

# ggml type -> (elements per block, bytes per block) for the types whose size we must know
GGML_BLOCK = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    20: (32, 18), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2),
}
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 20: "IQ4_NL",
                   23: "IQ4_XS", 30: "BF16"}
# The types the core loads (cpp/model/quant_formats.cpp): dense, or block formats it keeps quantized.
SUPPORTED_TYPES = (0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)


def ggml_type_name(ggml_type: int) -> str:
    """Q4_K, IQ2_XXS, ...: gguf-py's name for types this reader does not list, else the number."""
    if ggml_type in GGML_TYPE_NAMES:
        return GGML_TYPE_NAMES[ggml_type]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return str(ggml_type)


def unsupported_type_message(tensor: str, ggml_type: int) -> str:
    supported = ", ".join(GGML_TYPE_NAMES[t] for t in SUPPORTED_TYPES)
    return (f"tensor {tensor} has ggml type {ggml_type} ({ggml_type_name(ggml_type)}), which fantai cannot load "
            f"(supported: {supported})")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, cols) of the row-major matrix this tensor is; 1-D tensors are one row."""
        cols = self.shape[0]
        rows = 1
        for d in self.shape[1:]:
            rows *= d
        return rows, cols


# Bounds a well-formed file never reaches; a file past them is refused before anything is sized
# from its counts (ggml's own limit is 4 dims).
MAX_DIMS = 4
MAX_ALIGNMENT = 1 << 20
MAX_NESTING = 8


class GGUFFile:
    """Header of a GGUF file (v2/v3, little-endian) plus a read-only mapping of its data.

    Every count, length and offset is checked against the bytes that are left before it is used,
    so a truncated, corrupt or lying file is refused with a ValueError naming the file and the
    field, never a huge allocation, a long loop or a read past the mapping.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"{path}: not a GGUF file ({size} bytes, shorter than its header)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mm, dtype=np.uint8)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[TensorInfo] = []
        self._field = "header"  # what _parse is reading, for the error message
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, MemoryError, TypeError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF file at {self._field} ({e})") from e

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {self._field}: {what}")

    def _need(self, pos: int, n: int) -> None:
        if n < 0 or pos + n > len(self._mm):
            raise self._fail(f"needs {n} bytes at offset {pos}, the file has {len(self._mm) - pos} left")

    def _parse(self) -> None:
        buf = self._mm
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} unsupported (2 and 3 are)")
        pos = 24
        # each key/value takes at least 12 bytes and each tensor info 24: larger counts are lies
        left = len(buf) - pos
        if n_kv > left // 12 or n_tensors > left // 24:
            self._field = "header"
            raise self._fail(f"truncated or corrupt: claims {n_kv} metadata entries and {n_tensors} "
                             f"tensors, more than {left} bytes can hold")
        for i in range(n_kv):
            self._field = f"metadata entry {i}"
            key, pos = self._string(pos)
            self._field = f"metadata {key!r}"
            if key in self.metadata:
                raise self._fail("appears twice")
            self._need(pos, 4)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.metadata[key], pos = self._value(vtype, pos, 0)
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            self._field = f"tensor info {i}"
            name, pos = self._string(pos)
            self._field = f"tensor {name!r}"
            if name in names:
                raise self._fail("appears twice")
            names.add(name)
            self._need(pos, 4)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._fail(f"has {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
            self._need(pos + 4, 8 * n_dims + 12)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            gtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), gtype, offset))
        self._field = "metadata 'general.alignment'"
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= MAX_ALIGNMENT \
                or align & (align - 1):
            raise self._fail(f"{align!r} is not a power of two up to {MAX_ALIGNMENT}")
        start = (pos + align - 1) // align * align
        spans = []
        for name, dims, gtype, offset in infos:
            self._field = f"tensor {name!r}"
            if gtype not in GGML_BLOCK:
                raise ValueError(f"{self.path}: {unsupported_type_message(name, gtype)}")
            block, block_bytes = GGML_BLOCK[gtype]
            if any(d <= 0 for d in dims):
                raise self._fail(f"has shape {list(dims)}: every dimension must be positive")
            n = 1
            for d in dims:
                n *= d
            if dims[0] % block:
                raise ValueError(f"{self.path}: tensor {name} row of {dims[0]} is not whole {block}-blocks")
            if offset % align:
                raise self._fail(f"data offset {offset} is not a multiple of the alignment {align}")
            nbytes = n // block * block_bytes
            if start + offset + nbytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            spans.append((offset, offset + nbytes, name))
            self.tensors.append(TensorInfo(name, dims, gtype, start + offset, nbytes))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                self._field = f"tensor {b!r}"
                raise self._fail(f"overlaps tensor {a!r} in the file")

    def _string(self, pos: int) -> tuple[str, int]:
        self._need(pos, 8)
        (n,) = struct.unpack_from("<Q", self._mm, pos)
        self._need(pos + 8, n)
        end = pos + 8 + n
        return self._mm[pos + 8:end].decode("utf-8"), end

    def _value(self, vtype: int, pos: int, depth: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(pos)
        if vtype in _SCALAR:
            fmt, size = _SCALAR[vtype]
            self._need(pos, size)
            return struct.unpack_from(fmt, self._mm, pos)[0], pos + size
        if vtype != _ARRAY:
            raise self._fail(f"unknown GGUF value type {vtype}")
        if depth >= MAX_NESTING:
            raise self._fail(f"arrays nested deeper than {MAX_NESTING}")
        self._need(pos, 12)
        etype, count = struct.unpack_from("<IQ", self._mm, pos)
        pos += 12
        if etype in _NUMPY:
            self._need(pos, count * _SCALAR[etype][1])
            arr = np.frombuffer(self._mm, dtype=_NUMPY[etype], count=count, offset=pos)
            return arr.tolist(), pos + arr.nbytes
        if etype == _STRING:
            self._need(pos, count * 8)  # every string has its 8-byte length at least
            return self._strings(count, pos)
        if etype != _ARRAY:
            raise self._fail(f"unknown GGUF array element type {etype}")
        self._need(pos, count * 12)  # every nested array has its 12-byte header at least
        items = []
        for _ in range(count):
            item, pos = self._value(etype, pos, depth + 1)
            items.append(item)
        return items, pos

    def _strings(self, count: int, pos: int) -> tuple[list[str], int]:
        mm, unpack = self._mm, struct.Struct("<Q").unpack_from
        size = len(mm)
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self._need(pos, 8)
            (n,) = unpack(mm, pos)
            pos += 8
            if pos + n > size:
                self._need(pos, n)
            append(mm[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        return out, pos

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a uint8 view of the mapping (no copy)."""
        return self.data[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        """Drops the mapping once no view of it is alive (views keep it open otherwise)."""
        self.data = np.empty(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a tensor view still references it: the GC will unmap later
            pass
