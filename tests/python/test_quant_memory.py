"""Resident bytes of quantized weights against the GGUF file's bytes, per format and ISA level.

A one-layer llama GGUF whose seven linears are random valid blocks of one type is loaded with the
default kernels (the int8-activation panel layout, which every ISA level runs); Model.quant_bytes()
reports what the CPU backend keeps for each tensor (values, scales, mins, zeros, alignment), set
beside the file's tensor bytes. Each ISA level this CPU can run is loaded in its own process
(FANTAI_CPU_ISA), so an AVX-512 machine checks what an AVX2-only or a portable one keeps.

The layout's bytes per weight are documented in docs/DESIGN.md (quantization); the overhead over
the file's for the formats at the file's size:
- alignment: each of the layout's regions (values, scales, mins, zeros, super-block factors,
  a codebook's 16 bytes) starts on 64 bytes, at most 6 x 63 bytes per tensor (rows here are
  whole 16-row panels and columns whole blocks, so there is no other padding);
- Q4_K, Q5_K, Q3_K: 4 bytes per 256 weights (1/64 byte per weight, +2.8% / +2.3% / +3.6%):
  their 6-bit sub-scales and sub-mins take a byte each;
- IQ4_XS: 2 bytes per 256 weights (+1.5%): its 6-bit sub-scales take a byte each.
Q2_K's 4-bit sub-scale and sub-min share a byte, as in the file. 2- and 3-bit values (Q2_K, Q3_K) are kept as 2-bit crumbs (plus one bit plane for Q3_K), 5- and
6-bit values (Q5_0, Q5_1, Q5_K, Q6_K) as nibbles plus one or two bit planes, and IQ4 indices
(IQ4_NL, IQ4_XS) as nibbles into a 16-byte codebook (in its own 64-byte region, so within the
alignment slack): every format's values at the file's width.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fantai import _C
from tiny_gguf import gguf_writer, write_gguf
from quant_reference import BLOCK, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, \
    random_blocks

ALIGN_SLACK = 6 * 63  # bytes per tensor
# Bytes per weight the panel layout keeps: (values + per-group scale / min / zero + per-super-block
# factors) per block, over the block's weights.
PANEL_BPW = {Q4_0: 18 / 32, Q4_1: 20 / 32, Q8_0: 34 / 32, Q4_K: 148 / 256,
             Q5_0: 22 / 32, Q5_1: 24 / 32, IQ4_NL: 18 / 32, Q5_K: 180 / 256, Q6_K: 210 / 256,
             Q2_K: 84 / 256, Q3_K: 114 / 256, IQ4_XS: 138 / 256}
# Documented overhead over the file's bytes per weight (beyond ALIGN_SLACK).
ALLOWED_OVER_FILE = {Q4_K: 4 / 256, Q5_K: 4 / 256, Q3_K: 4 / 256, IQ4_XS: 2 / 256}
NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0", Q4_K: "q4_k", Q5_0: "q5_0", Q5_1: "q5_1", IQ4_NL: "iq4_nl",
         Q5_K: "q5_k", Q6_K: "q6_k", Q2_K: "q2_k", Q3_K: "q3_k", IQ4_XS: "iq4_xs"}

_PARTS = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
          "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}


def _one_type_gguf(path: Path, ggml_type: int) -> dict[str, int]:
    """The file; returns {gguf tensor name: its bytes in the file} for the quantized linears."""
    import gguf

    rng = np.random.default_rng(ggml_type)
    hidden, inter, vocab = 256, 512, 64
    w = gguf_writer(path, hidden, inter, 1, vocab, heads=4, kv_heads=2, context=128)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.5)
    sizes = {}
    for part, (rows, cols) in _PARTS.items():
        data = random_blocks(ggml_type, rows, cols, rng, 0.001)
        name = f"blk.0.{part}.weight"
        w.add_tensor(name, data.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType(ggml_type))
        sizes[name] = data.size
        per, nbytes = BLOCK[ggml_type]
        assert data.size == rows * cols // per * nbytes
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    write_gguf(w)
    return sizes


_CHILD = """
import json, sys
from fantai.loader import load_model
out = {}
for path in sys.argv[1:]:
    m = load_model(path, "float32", threads=1).model
    out[path] = {"bytes": m.quant_bytes(), "formats": m.weight_formats()}
print(json.dumps(out))
"""


def _resident(paths: list[Path], isa: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FANTAI_QUANT_KERNEL"}
    env["FANTAI_CPU_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", _CHILD, *map(str, paths)], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def resident(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{(ggml_type, isa): (file bytes by HF name, resident bytes by HF name, formats)}."""
    from fantai.weights.gguf_loader import hf_tensor_name

    root = tmp_path_factory.mktemp("qmem")
    paths, sizes = {}, {}
    for t in PANEL_BPW:
        paths[t] = root / f"{NAMES[t]}.gguf"
        sizes[t] = {hf_tensor_name(k): v for k, v in _one_type_gguf(paths[t], t).items()}
    got = {}
    for isa in _C.cpu_isa_levels():
        r = _resident(list(paths.values()), isa)
        for t, path in paths.items():
            got[t, isa] = (sizes[t], r[str(path)]["bytes"], r[str(path)]["formats"])
    return got


@pytest.mark.parametrize("ggml_type", list(PANEL_BPW), ids=[NAMES[t] for t in PANEL_BPW])
def test_resident_bytes_at_most_the_files(resident: dict, ggml_type: int) -> None:
    per, nbytes = BLOCK[ggml_type]
    for isa in _C.cpu_isa_levels():
        sizes, held, formats = resident[ggml_type, isa]
        assert set(held) == set(sizes), (isa, sorted(held))
        for name, file_bytes in sizes.items():
            assert formats[name] == NAMES[ggml_type]
            weights = file_bytes // nbytes * per
            allowed = file_bytes + ALLOWED_OVER_FILE.get(ggml_type, 0) * weights + ALIGN_SLACK
            assert held[name] <= allowed, (isa, name, held[name] / weights, file_bytes / weights)


@pytest.mark.parametrize("ggml_type", list(PANEL_BPW), ids=[NAMES[t] for t in PANEL_BPW])
def test_resident_bytes_per_weight_are_the_documented_ones(resident: dict, ggml_type: int) -> None:
    """The layout's exact figure on every ISA level (the same layout everywhere)."""
    per, nbytes = BLOCK[ggml_type]
    for isa in _C.cpu_isa_levels():
        sizes, held, _ = resident[ggml_type, isa]
        for name, file_bytes in sizes.items():
            want = file_bytes // nbytes * per * PANEL_BPW[ggml_type]
            assert want <= held[name] <= want + ALIGN_SLACK, (isa, name, held[name], want)
