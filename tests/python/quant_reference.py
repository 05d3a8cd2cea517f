"""Slow, obvious NumPy references for the quantized formats, written from their specifications.

GGUF blocks (ggml's reference dequantizers, same float operation order so results are bit-exact
with a faithful implementation), GPTQ / AWQ unpacking one bit field at a time, and the round-to-
nearest quantizer of the core's contract. Independent of fantai's own (vectorised) unpackers.
"""

from __future__ import annotations

import numpy as np

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 13, 14, 30
Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS = 6, 7, 10, 11, 20, 23
BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
         Q5_0: (32, 22), Q5_1: (32, 24), Q2_K: (256, 84), Q3_K: (256, 110), IQ4_NL: (32, 18),
         IQ4_XS: (256, 136), F32: (1, 4), F16: (1, 2), BF16: (1, 2)}
# byte offsets of f16 fields inside a block (the rest of a block is free-form bits)
_HALF_FIELDS = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
                Q5_0: (0,), Q5_1: (0, 2), Q2_K: (80, 82), Q3_K: (108,), IQ4_NL: (0,), IQ4_XS: (0,)}
# llama.cpp's 16-level IQ4 codebook (kvalues_iq4nl): part of the IQ4_NL / IQ4_XS formats
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(block: np.ndarray, at: int) -> np.float32:
    return np.float32(block[at:at + 2].copy().view(np.float16)[0])


def random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator,
                  magnitude: float = 0.05) -> np.ndarray:
    """Random bytes of a rows x cols tensor of `ggml_type` whose f16 scale fields are finite, of
    either sign and magnitude in [magnitude / 50, magnitude]."""
    per, nbytes = BLOCK[ggml_type]
    assert cols % per == 0
    if ggml_type == F32:
        return rng.standard_normal(rows * cols).astype(np.float32).view(np.uint8)
    if ggml_type == F16:
        return rng.standard_normal(rows * cols).astype(np.float16).view(np.uint8)
    if ggml_type == BF16:
        x = rng.standard_normal(rows * cols).astype(np.float32).view(np.uint32)
        return (x >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[ggml_type]:
        sign = rng.choice([-1.0, 1.0], size=blocks.shape[0])
        halves = (sign * rng.uniform(magnitude / 50, magnitude, size=blocks.shape[0])).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    qs = b[2:18]
    lo = ((qs & 0xF).astype(np.int32) - 8).astype(np.float32) * d
    hi = ((qs >> 4).astype(np.int32) - 8).astype(np.float32) * d
    return np.concatenate([lo, hi])


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    qs = b[4:20]
    lo = (qs & 0xF).astype(np.float32) * d + m
    hi = (qs >> 4).astype(np.float32) * d + m
    return np.concatenate([lo, hi])


def _q8_0(b: np.ndarray) -> np.ndarray:
    return b[2:34].view(np.int8).astype(np.float32) * _f16(b, 0)


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    """The j-th 6-bit (scale, min) pair of a K-quant super-block's 12 packed scale bytes."""
    if j < 4:
        return int(s[j]) & 63, int(s[j + 4]) & 63
    return (int(s[j + 4]) & 0xF) | ((int(s[j - 4]) >> 6) << 4), (int(s[j + 4]) >> 4) | ((int(s[j]) >> 6) << 4)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, qs = b[4:16], b[16:144]
    out = []
    for chunk in range(4):  # 64 values: 32 low nibbles then 32 high nibbles of 32 bytes
        q = qs[32 * chunk:32 * chunk + 32]
        for half, vals in enumerate((q & 0xF, q >> 4)):
            sc, mn = _scale_min_k4(2 * chunk + half, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(mn)
            out.append(d1 * vals.astype(np.float32) - m1)
    return np.concatenate(out)


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, qh, qs = b[4:16], b[16:48], b[48:176]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk:32 * chunk + 32]
        for half, low in enumerate((q & 0xF, q >> 4)):
            bit = 2 * chunk + half  # qh bit that holds the 5th bit of these 32 values
            high = ((qh >> bit) & 1).astype(np.int32) * 16
            sc, mn = _scale_min_k4(2 * chunk + half, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(mn)
            out.append(d1 * (low.astype(np.int32) + high).astype(np.float32) - m1)
    return np.concatenate(out)


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    y = np.empty(256, np.float32)
    for n in range(2):  # two halves of 128 values
        l_ = ql[64 * n:64 * n + 64]
        h = qh[32 * n:32 * n + 32]
        s = sc[8 * n:8 * n + 8]
        for i in range(32):
            q1 = ((int(l_[i]) & 0xF) | (((int(h[i]) >> 0) & 3) << 4)) - 32
            q2 = ((int(l_[i + 32]) & 0xF) | (((int(h[i]) >> 2) & 3) << 4)) - 32
            q3 = ((int(l_[i]) >> 4) | (((int(h[i]) >> 4) & 3) << 4)) - 32
            q4 = ((int(l_[i + 32]) >> 4) | (((int(h[i]) >> 6) & 3) << 4)) - 32
            is_ = i // 16
            base = 128 * n
            y[base + i] = d * np.float32(s[is_]) * np.float32(q1)
            y[base + i + 32] = d * np.float32(s[is_ + 2]) * np.float32(q2)
            y[base + i + 64] = d * np.float32(s[is_ + 4]) * np.float32(q3)
            y[base + i + 96] = d * np.float32(s[is_ + 6]) * np.float32(q4)
    return y


def _nibble(qs: np.ndarray, i: int) -> int:
    """Element i of a 32-element run stored as 16 bytes: low nibbles first, then high nibbles."""
    return (int(qs[i % 16]) >> (4 * (i // 16))) & 0xF


def _q5(b: np.ndarray, with_min: bool) -> np.ndarray:
    at = 4 if with_min else 2
    qh = int.from_bytes(b[at:at + 4].tobytes(), "little")  # bit i: 5th bit of element i
    q = np.array([_nibble(b[at + 4:at + 20], i) | (((qh >> i) & 1) << 4) for i in range(32)])
    d = _f16(b, 0)
    if with_min:
        return q.astype(np.float32) * d + _f16(b, 2)
    return (q - 16).astype(np.float32) * d


def _two_bits(qs: np.ndarray, e: int) -> int:
    """Q2_K / Q3_K low bits: per 128 elements 32 bytes, element 32 t + l in bits 2t.. of byte l."""
    return (int(qs[32 * (e // 128) + e % 32]) >> (2 * ((e // 32) % 4))) & 3


def _q2_k(b: np.ndarray) -> np.ndarray:
    sc, qs, d, dmin = b[0:16], b[16:80], _f16(b, 80), _f16(b, 82)
    y = np.empty(256, np.float32)
    for e in range(256):
        s = int(sc[e // 16])  # low nibble: scale, high nibble: min
        dl, ml = d * np.float32(s & 0xF), dmin * np.float32(s >> 4)
        y[e] = dl * np.float32(_two_bits(qs, e)) - ml
    return y


def _q3_k(b: np.ndarray) -> np.ndarray:
    hmask, qs, sc, d = b[0:32], b[32:96], b[96:108], _f16(b, 108)
    scales = []
    for s in range(16):  # 4 low bits: nibbles of bytes 0..7; 2 high bits: crumbs of bytes 8..11
        low = (int(sc[s % 8]) >> (4 * (s // 8))) & 0xF
        high = (int(sc[8 + s % 4]) >> (2 * (s // 4))) & 3
        scales.append(np.float32((low | (high << 4)) - 32))
    y = np.empty(256, np.float32)
    for e in range(256):
        hbit = (int(hmask[e % 32]) >> (e // 32)) & 1
        q = _two_bits(qs, e) - (0 if hbit else 4)
        y[e] = (d * scales[e // 16]) * np.float32(q)
    return y


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return np.array([d * np.float32(IQ4_LEVELS[_nibble(b[2:18], i)]) for i in range(32)], np.float32)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    scales_h = int(b[2]) | (int(b[3]) << 8)
    y = np.empty(256, np.float32)
    for j in range(8):
        low = (int(b[4 + j // 2]) >> (4 * (j % 2))) & 0xF
        ls = low | (((scales_h >> (2 * j)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        qs = b[8 + 16 * j:24 + 16 * j]
        for i in range(32):
            y[32 * j + i] = dl * np.float32(IQ4_LEVELS[_nibble(qs, i)])
    return y


_BLOCK_FN = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
             Q5_0: lambda b: _q5(b, False), Q5_1: lambda b: _q5(b, True), Q2_K: _q2_k, Q3_K: _q3_k,
             IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs}


def ggml_dequantize_ref(data: np.ndarray, ggml_type: int, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] of raw GGUF tensor bytes, one block at a time."""
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    if ggml_type == F32:
        return data.view(np.float32).reshape(rows, cols).copy()
    if ggml_type == F16:
        return data.view(np.float16).astype(np.float32).reshape(rows, cols)
    if ggml_type == BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
    per, nbytes = BLOCK[ggml_type]
    blocks = data.reshape(-1, nbytes)
    assert blocks.shape[0] == rows * cols // per
    return np.concatenate([_BLOCK_FN[ggml_type](b) for b in blocks]).reshape(rows, cols)


# ---- GPTQ / AWQ, one bit field at a time -----------------------------------------------------
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column order[i]


def gptq_unpack_ref(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray,
                    bits: int, zeros_minus_one: bool) -> np.ndarray:
    """W [out, in] of a GPTQ module: W[n, i] = scales[g, n] * (q[i, n] - zero[g, n]), g = g_idx[i]."""
    per, mask = 32 // bits, (1 << bits) - 1
    words, out = qweight.view(np.uint32), qweight.shape[1]
    k = words.shape[0] * per
    w = np.zeros((out, k), np.float32)
    zw = qzeros.view(np.uint32)
    for i in range(k):
        q = (words[i // per] >> np.uint32(bits * (i % per))) & np.uint32(mask)
        g = int(g_idx[i])
        z = np.array([(int(zw[g, n // per]) >> (bits * (n % per))) & mask for n in range(out)])
        if zeros_minus_one:
            z = (z + 1) & mask
        w[:, i] = scales[g].astype(np.float32) * (q.astype(np.float32) - z.astype(np.float32))
    return w


def awq_unpack_ref(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    words, zw = qweight.view(np.uint32), qzeros.view(np.uint32)
    k, out = words.shape[0], words.shape[1] * 8
    w = np.zeros((out, k), np.float32)
    for i in range(k):
        for n in range(out):
            nib = AWQ_PACK_ORDER.index(n % 8)
            q = (int(words[i, n // 8]) >> (4 * nib)) & 0xF
            z = (int(zw[i // group, n // 8]) >> (4 * nib)) & 0xF
            w[n, i] = np.float32(scales[i // group, n]) * (np.float32(q) - np.float32(z))
    return w


def gptq_pack_ref(q_in_out: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ-style packing along the input dimension, one value at a time."""
    per = 32 // bits
    k, n = q_in_out.shape
    out = np.zeros((k // per, n), np.uint32)
    for i in range(k):
        out[i // per] |= q_in_out[i].astype(np.uint32) << np.uint32(bits * (i % per))
    return out.view(np.int32)


def gptq_pack_cols_ref(z: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    m, n = z.shape
    out = np.zeros((m, n // per), np.uint32)
    for j in range(n):
        out[:, j // per] |= z[:, j].astype(np.uint32) << np.uint32(bits * (j % per))
    return out.view(np.int32)


def awq_pack_ref(v: np.ndarray) -> np.ndarray:
    m, n = v.shape
    out = np.zeros((m, n // 8), np.uint32)
    for c in range(n // 8):
        for i in range(8):
            out[:, c] |= v[:, c * 8 + AWQ_PACK_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def rtn_ref(w: np.ndarray, bits: int, group: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract's round-to-nearest quantizer: (q u8, scale f32, zero u8), [rows, ng]."""
    rows, cols = w.shape
    group = cols if group == -1 else group
    ng = -(-cols // group)
    q = np.zeros((rows, cols), np.uint8)
    scale = np.zeros((rows, ng), np.float32)
    zero = np.zeros((rows, ng), np.uint8)
    for g in range(ng):
        x = w[:, g * group:(g + 1) * group].astype(np.float32)
        if symmetric:
            qmax = np.float32(2 ** (bits - 1) - 1)
            s = np.abs(x).max(axis=1) / qmax
            s = np.where(s == 0, np.float32(1), s).astype(np.float32)
            qq = np.clip(np.rint(x / s[:, None]), -qmax, qmax) + 2 ** (bits - 1)
            z = np.full(rows, 2 ** (bits - 1))
        else:
            top = np.float32(2 ** bits - 1)
            lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
            s = ((hi - lo) / top).astype(np.float32)
            s = np.where(hi == lo, np.float32(1), s).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, top)
            qq = np.clip(np.rint(x / s[:, None]) + z[:, None], 0, top)
        q[:, g * group:(g + 1) * group] = qq.astype(np.uint8)
        scale[:, g] = s
        zero[:, g] = z.astype(np.uint8)
    return q, scale, zero
