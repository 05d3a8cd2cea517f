"""Quantized formats: GGUF blocks, GPTQ / AWQ checkpoints, online int8 / int4, fantai quantize and
perplexity. References are the slow NumPy ones in quant_reference.py, written from the specs.

Over 400 lines: one file per room (quantized formats); the cases share the file builders.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fantai import _C
from fantai.weights import gptq_awq as ga
from fantai.weights.gguf_loader import unpermute_qk, unpermute_qk_rows
from tiny_gguf import gguf_writer, write_gguf
from quant_reference import (
    BF16,
    BLOCK,
    F16,
    F32,
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    awq_pack_ref,
    awq_unpack_ref,
    ggml_dequantize_ref,
    gptq_pack_cols_ref,
    gptq_pack_ref,
    gptq_unpack_ref,
    random_blocks,
    rtn_ref,
)
from tiny_models import build_tiny_model

NEW_GGML = [Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS]
ALL_GGML = [F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, *NEW_GGML]
needs_quant_core = pytest.mark.skipif(
    not hasattr(_C, "ggml_dequantize") or not hasattr(_C.Model, "set_tensor_quant"),
    reason="this core has no quantized weights (the C++ half lands on branch qcore)")


@pytest.fixture(autouse=True)
def f32_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exact-activation kernels: a quantized model then computes what the dense model of its
    # dequantized weights computes, which is what these tests compare. (The default quantizes
    # activations to int8; test_quant_core.py and test_default_model_quant.py
    # cover that path.) The backend reads this when a model is created; subprocesses inherit it.
    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "f32")


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- the references themselves ----------------------------------------------------------------
@pytest.mark.parametrize("ggml_type", ALL_GGML)
def test_ggml_reference_agrees_with_gguf_py(ggml_type: int) -> None:
    """Two independent readings of each block layout (ours and gguf-py's) agree to the bit."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(ggml_type)
    rows, cols = 3, 512  # K-quants: two super-blocks per row
    data = random_blocks(ggml_type, rows, cols, rng)
    ref = ggml_dequantize_ref(data, ggml_type, rows, cols)
    theirs = dequantize(data.reshape(rows, -1), gguf.GGMLQuantizationType(ggml_type)).astype(np.float32)
    assert np.isfinite(ref).all()
    assert _bits_equal(ref, theirs.reshape(rows, cols))


# ---- GPTQ / AWQ packing ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_packing_matches_one_value_at_a_time(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, size=(64, 24), dtype=np.uint8)
    packed = ga.pack_rows(q, bits)
    assert packed.dtype == np.int32 and packed.shape == (64 * bits // 32, 24)
    assert np.array_equal(packed, gptq_pack_ref(q, bits))
    assert np.array_equal(ga.unpack_rows(packed, bits), q)
    z = rng.integers(0, 1 << bits, size=(3, 64), dtype=np.uint8)
    assert np.array_equal(ga.pack_cols(z, bits), gptq_pack_cols_ref(z, bits))
    assert np.array_equal(ga.unpack_cols(ga.pack_cols(z, bits), bits), z)


def test_awq_packing_matches_one_value_at_a_time() -> None:
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, size=(40, 64), dtype=np.uint8)
    packed = ga.awq_pack(q)
    assert packed.shape == (40, 8) and np.array_equal(packed, awq_pack_ref(q))
    assert np.array_equal(ga.awq_unpack(packed), q)
    # the interleave is real: word 0 of a row 0..7 is not the plain nibble order
    ramp = np.arange(8, dtype=np.uint8)[None, :]
    assert ga.awq_pack(ramp)[0, 0] == np.uint32(0x75316420).view(np.int32)


def _gptq_quantize_given(rng: np.random.Generator, w: np.ndarray, bits: int, group: int, sym: bool,
                         act_order: bool, v1: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Packed GPTQ tensors of weight w [out, k] (RTN), written one value at a time, and their
    dequantized reference."""
    k = w.shape[1]
    g = k if group == -1 else group
    perm = rng.permutation(k) if act_order else np.arange(k)
    q_sorted, scale, zero = rtn_ref(w[:, perm], bits, g, sym)
    q = np.empty_like(q_sorted)
    q[:, perm] = q_sorted
    g_idx = np.empty(k, np.int32)
    g_idx[perm] = np.arange(k) // g
    stored = (((zero.astype(np.int32) - 1) & ((1 << bits) - 1)) if v1 else zero).astype(np.uint8)
    scales = np.ascontiguousarray(scale.T.astype(np.float16))  # save_file writes raw memory order
    t = {"qweight": gptq_pack_ref(np.ascontiguousarray(q.T), bits),
         "qzeros": gptq_pack_cols_ref(np.ascontiguousarray(stored.T), bits), "scales": scales, "g_idx": g_idx}
    return t, gptq_unpack_ref(t["qweight"], t["qzeros"], scales, g_idx, bits, v1)


def _awq_quantize_given(w: np.ndarray, group: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    q, scale, zero = rtn_ref(w, 4, group, False)
    scales = np.ascontiguousarray(scale.T.astype(np.float16))  # save_file writes raw memory order
    t = {"qweight": awq_pack_ref(np.ascontiguousarray(q.T)), "qzeros": awq_pack_ref(np.ascontiguousarray(zero.T)),
         "scales": scales}
    return t, awq_unpack_ref(t["qweight"], t["qzeros"], scales, group)


def _gptq_module(rng: np.random.Generator, out: int, k: int, bits: int, group: int, sym: bool, act_order: bool,
                 v1: bool = True) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """_gptq_quantize_given on a random weight [out, k]."""
    w = rng.standard_normal((out, k)).astype(np.float32)
    return _gptq_quantize_given(rng, w, bits, group, sym, act_order, v1)


def _awq_module(rng: np.random.Generator, out: int, k: int, group: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    return _awq_quantize_given(rng.standard_normal((out, k)).astype(np.float32), group)


GPTQ_CASES = [(4, 32, True, False), (4, 32, False, True), (8, -1, True, False), (8, 32, False, True),
              (4, -1, False, False), (4, 64, True, True)]


@pytest.mark.parametrize(("bits", "group", "sym", "act_order"), GPTQ_CASES)
def test_gptq_canonical_form_dequantizes_like_reference(bits: int, group: int, sym: bool, act_order: bool) -> None:
    rng = np.random.default_rng(bits * 100 + group)
    t, ref = _gptq_module(rng, 24, 128, bits, group, sym, act_order)
    spec = ga.QuantSpec("gptq", bits, group, sym, zeros_minus_one=True)
    cw = ga.gptq_to_canonical(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], spec)
    assert (cw.perm is not None) == act_order
    assert cw.q.shape == (24, 128) and cw.scale.shape == cw.zero.shape
    assert _bits_equal(cw.dequantize(), ref)


def test_gptq_v2_zeros_are_stored_as_they_are() -> None:
    rng = np.random.default_rng(9)
    t, ref = _gptq_module(rng, 16, 64, 4, 32, False, False, v1=False)
    spec = ga.QuantSpec.from_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                                     "checkpoint_format": "gptq_v2"})
    assert not spec.zeros_minus_one
    assert _bits_equal(ga.gptq_to_canonical(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], spec).dequantize(),
                       ref)


def test_awq_canonical_form_dequantizes_like_reference() -> None:
    rng = np.random.default_rng(5)
    t, ref = _awq_module(rng, 32, 256, 128)
    spec = ga.QuantSpec.from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"})
    assert _bits_equal(ga.awq_to_canonical(t["qweight"], t["qzeros"], t["scales"], spec).dequantize(), ref)


def test_bad_quantization_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="bits"):
        ga.QuantSpec.from_config({"quant_method": "gptq", "bits": 3})
    with pytest.raises(ValueError, match="gemv|GEMM"):
        ga.QuantSpec.from_config({"quant_method": "awq", "bits": 4, "version": "gemv"})
    with pytest.raises(ValueError, match="marlin"):
        ga.QuantSpec.from_config({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})
    g_idx = np.zeros(64, np.int32)
    g_idx[:40] = 1  # 40 columns in one group of 32: not a permutation of contiguous groups
    with pytest.raises(ValueError, match="g_idx"):
        ga._act_order_perm(g_idx, 64, 32)


# ---- GGUF header reader and the q/k row permutation -----------------------------------------
def test_gguf_file_reads_what_gguf_py_reads() -> None:
    from fantai.model_files import default_model_path
    from fantai.weights.gguf_file import GGUFFile
    from gguf import GGUFReader

    path = default_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(path, "r")
    meta = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == meta
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.ggml_type, a.offset, a.nbytes) == (b.name, int(b.tensor_type), b.data_offset, b.n_bytes)
        assert np.array_equal(ours.tensor_bytes(a), np.asarray(b.data).reshape(-1).view(np.uint8))


def test_gguf_file_rejects_garbage(tmp_path: Path) -> None:
    from fantai.weights.gguf_file import GGUFFile

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") + (1 << 40).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="corrupt|truncated"):
        GGUFFile(str(bad))


def test_row_permutation_is_unpermute_qk() -> None:
    w = np.random.default_rng(0).standard_normal((48, 8)).astype(np.float32)
    for heads in (1, 3, 6):
        perm = unpermute_qk_rows(48, heads)
        assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(48))
        assert np.array_equal(w[perm], unpermute_qk(w, heads))
    assert not np.array_equal(unpermute_qk_rows(48, 3), np.arange(48))


# ---- perplexity arithmetic -----------------------------------------------------------------
def test_perplexity_windows_and_mean_nll() -> None:
    from fantai.perplexity import perplexity, windows

    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail predicts nothing
    rng = np.random.default_rng(0)
    table = rng.standard_normal((11, 11)).astype(np.float32)  # logits depend on the current token only
    ids = rng.integers(0, 11, 23).tolist()
    res = perplexity(lambda w: table[w], ids, 8)
    expected = []
    for w in windows(ids, 8):
        for a, b in zip(w[:-1], w[1:]):
            row = table[a].astype(np.float64)
            expected.append(math.log(np.exp(row).sum()) - row[b])
    assert res["predicted_tokens"] == len(expected) == 20
    assert res["nll"] == pytest.approx(float(np.mean(expected)), rel=1e-12)
    assert res["perplexity"] == pytest.approx(math.exp(res["nll"]))


# ---- checkpoint writers: what the usual tools read ------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_quantization_config_parses_in_transformers(tmp_path: Path, fmt: str) -> None:
    from fantai.quantize import quantization_config
    from transformers import AutoConfig, AwqConfig, GPTQConfig

    qc = quantization_config(fmt, 4, 128, fmt == "gptq")
    build_tiny_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    parsed = AutoConfig.from_pretrained(tmp_path).quantization_config
    assert parsed["quant_method"] == fmt
    if fmt == "gptq":
        g = GPTQConfig.from_dict(dict(parsed))
        assert (g.bits, g.group_size, g.sym, g.desc_act) == (4, 128, True, False)
    else:
        a = AwqConfig.from_dict(dict(parsed))
        layout = getattr(a, "version", None) or getattr(a, "format", None)  # transformers 4 / 5
        assert (a.bits, a.group_size, a.zero_point) == (4, 128, True) and "gemm" in str(layout).lower()
    assert ga.QuantSpec.from_config(dict(parsed)).bits == 4


# ---- the core's kernels and loaders (need the C++ half) --------------------------------------
@needs_quant_core
@pytest.mark.parametrize("ggml_type", ALL_GGML)
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (5, 512), (3, 768)])
def test_core_ggml_dequantize_is_bit_exact(ggml_type: int, rows: int, cols: int) -> None:
    rng = np.random.default_rng(ggml_type * 7 + rows)
    data = random_blocks(ggml_type, rows, cols, rng)
    got = _C.ggml_dequantize(data, ggml_type, rows, cols)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    assert _bits_equal(got, ggml_dequantize_ref(data, ggml_type, rows, cols))


@needs_quant_core
@pytest.mark.parametrize("ggml_type", NEW_GGML)
def test_core_decodes_new_types_like_gguf_py(ggml_type: int) -> None:
    """The core's decoder against gguf-py's dequantize directly, bit for bit, on random valid
    blocks: every byte random but the f16 scales, which get finite values of both signs and of
    very different sizes (subnormal f16 ones included)."""
    import gguf
    from gguf.quants import dequantize

    per, nbytes = BLOCK[ggml_type]
    for magnitude, rows in ((0.05, 7), (3.0, 2), (1e-5, 3)):
        rng = np.random.default_rng(ggml_type * 31 + rows)
        cols = 4 * 256
        data = random_blocks(ggml_type, rows, cols, rng, magnitude)
        want = dequantize(data.reshape(rows, -1), gguf.GGMLQuantizationType(ggml_type)).astype(np.float32)
        got = _C.ggml_dequantize(data, ggml_type, rows, cols)
        assert np.isfinite(want).all() and np.count_nonzero(want) > rows * cols // 2
        assert _bits_equal(got, want.reshape(rows, cols)), (ggml_type, magnitude)
    # one byte off, a partial block, an unknown type: errors, never a read past the end
    with pytest.raises(ValueError, match="needs"):
        _C.ggml_dequantize(data[:-1], ggml_type, rows, cols)
    with pytest.raises(ValueError, match="block"):
        _C.ggml_dequantize(data[:nbytes], ggml_type, 1, per + 16)


@needs_quant_core
def test_core_ggml_dequantize_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        _C.ggml_dequantize(np.zeros(17, np.uint8), Q4_0, 1, 32)
    with pytest.raises(ValueError):
        _C.ggml_dequantize(np.zeros(18, np.uint8), 99, 1, 32)


@needs_quant_core
@pytest.mark.parametrize(("bits", "group", "sym", "act_order"), GPTQ_CASES)
def test_core_quant_dequantize_matches_canonical(bits: int, group: int, sym: bool, act_order: bool) -> None:
    rng = np.random.default_rng(bits + group)
    t, ref = _gptq_module(rng, 24, 128, bits, group, sym, act_order)
    cw = ga.gptq_to_canonical(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], ga.QuantSpec("gptq", bits, group,
                                                                                               sym, True))
    got = _C.quant_dequantize(cw.q, cw.scale, cw.zero, None, cw.perm, bits, cw.group)
    assert _bits_equal(got, ref)


@needs_quant_core
@pytest.mark.parametrize(("bits", "group", "sym"), [(8, -1, True), (4, 32, True), (4, 32, False), (8, 64, False)])
def test_core_quantize_rtn_matches_reference(bits: int, group: int, sym: bool) -> None:
    w = np.random.default_rng(1).standard_normal((12, 128)).astype(np.float32)
    w[0, :] = 0.0  # an all-zero row: scale 1
    w[1, :64] = np.abs(w[1, :64])  # an all-positive group: asymmetric zero 0
    got = _C.quantize_rtn(w, bits, group, sym)
    q, scale, zero = rtn_ref(w, bits, group, sym)
    assert np.array_equal(got["q"], q) and np.array_equal(got["zero"], zero)
    assert _bits_equal(got["scale"], scale)


# ---- whole checkpoints ---------------------------------------------------------------------
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_quantized_twin(src: Path, out: Path, dense: Path, fmt: str, bits: int, group: int, sym: bool,
                          act_order: bool) -> None:
    """A GPTQ / AWQ checkpoint of `src` written by hand (reference packers) plus its dequantized
    dense f32 twin: the same numbers, one stored packed and one stored plain."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(42)
    state = load_file(str(src / "model.safetensors"))
    packed: dict[str, np.ndarray] = {}
    plain: dict[str, np.ndarray] = {}
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            prefix = name[: -len(".weight")]
            if fmt == "awq":
                t, deq = _awq_quantize_given(w, group)
            else:
                t, deq = _gptq_quantize_given(rng, w, bits, group, sym, act_order)
            packed.update({f"{prefix}.{key}": v for key, v in t.items()})
            plain[name] = deq
        else:
            packed[name] = w.astype(np.float32)
            plain[name] = w.astype(np.float32)
    for d in (out, dense):
        d.mkdir(parents=True, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(cfg))
    save_file(plain, str(dense / "model.safetensors"))
    if fmt == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "zero_point": True, "group_size": group, "bits": 4,
                                      "version": "gemm", "modules_to_not_convert": None}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                                      "desc_act": act_order, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(packed, str(out / "model.safetensors"))


CHECKPOINTS = [("gptq", 4, 32, True, False), ("gptq", 4, 32, False, True), ("gptq", 8, -1, True, False),
               ("gptq", 8, 32, False, True), ("gptq", 4, -1, False, True), ("awq", 4, 32, False, False)]


@needs_quant_core
@pytest.mark.parametrize(("fmt", "bits", "group", "sym", "act_order"), CHECKPOINTS)
def test_quantized_checkpoint_generates_like_its_dense_twin(tmp_path: Path, fmt: str, bits: int, group: int,
                                                            sym: bool, act_order: bool) -> None:
    from fantai import LLM, SamplingParams

    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    qdir, ddir = tmp_path / "q", tmp_path / "dense"
    _write_quantized_twin(src, qdir, ddir, fmt, bits, group, sym, act_order)
    quant = LLM(str(qdir), dtype="float32", kv_cache_memory="16M")
    dense = LLM(str(ddir), dtype="float32", kv_cache_memory="16M")
    formats = quant._model.weight_formats()
    expect = f"int{bits}" + ("" if group == -1 else f"g{group}")
    assert formats["model.layers.0.self_attn.q_proj.weight"] == expect, formats
    assert formats["model.layers.1.mlp.down_proj.weight"] == expect
    prompts = [[5, 17, 99, 3, 250], [7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    assert got == want
    ids = prompts[1]
    np.testing.assert_allclose(quant._model.score(ids), dense._model.score(ids), atol=2e-4, rtol=1e-4)


# The one-layer GGUF's linear types: K-quants beside legacy blocks, and the 2- / 3-bit K-quants
# (kept as 2-bit steps and a bit plane).
K_QUANT_MIXES = {"k": (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q6_K), "low": (Q2_K, Q3_K, Q3_K, Q2_K, Q2_K, Q3_K, Q2_K)}


def _k_quant_gguf(path: Path, mix: str = "k") -> dict[str, tuple[np.ndarray, int, int]]:
    """A one-layer llama GGUF whose linears are random valid K-quant / legacy blocks."""
    import gguf

    rng = np.random.default_rng(11)
    hidden, inter, vocab = 256, 512, 64
    shapes = {"attn_q": (hidden, hidden), "attn_k": (128, hidden), "attn_v": (128, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    types = {part: (t, *shape) for (part, shape), t in zip(shapes.items(), K_QUANT_MIXES[mix])}
    w = _gguf_header(path, hidden, inter, 1, vocab, heads=4, kv_heads=2)
    out: dict[str, tuple[np.ndarray, int, int]] = {}
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.5)
    for part, (t, rows, cols) in types.items():
        data = random_blocks(t, rows, cols, rng)
        name = f"blk.0.{part}.weight"
        w.add_tensor(name, data.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType(t))
        out[name] = (data, t, rows)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    write_gguf(w)
    return out


@needs_quant_core
@pytest.mark.parametrize("mix", list(K_QUANT_MIXES))
def test_k_quant_gguf_loads_like_its_dequantized_twin(tmp_path: Path, mix: str) -> None:
    from fantai.loader import load_model

    path = tmp_path / "kq.gguf"
    _k_quant_gguf(path, mix)
    quant = load_model(str(path), "float32").model
    dense = load_model(str(path), "float32", dequantize=True).model
    formats = quant.weight_formats()
    want = {"q4_k", "q5_k", "q6_k"} if mix == "k" else {"q2_k", "q3_k"}
    assert want <= {v.lower() for v in formats.values()}, formats
    assert quant.weight_bytes() < dense.weight_bytes() / 3
    ids = [1, 5, 9, 33, 12, 40, 2, 7]
    np.testing.assert_allclose(quant.score(ids), dense.score(ids), atol=1e-3, rtol=1e-3)
    assert (quant.score(ids).argmax(-1) == dense.score(ids).argmax(-1)).all()



@needs_quant_core
@pytest.mark.parametrize(("quantization", "fmt", "bits", "group", "min_saved", "max_rel", "min_top1"),
                         [("int8", "int8", 8, -1, 2.9, 0.06, 0.85), ("int4", "int4g32", 4, 32, 3.3, 0.7, 0.3)])
def test_online_quantization(tmp_path: Path, quantization: str, fmt: str, bits: int, group: int, min_saved: float,
                             max_rel: float, min_top1: float) -> None:
    """int8 / int4 at load: each linear weight drops from 4 bytes to ~1 (+ a scale per row) or
    ~0.5 (+ a scale per 32); embeddings stay dense; the model is exactly the dense model of the
    round-to-nearest weights (same greedy tokens); and its error against the unquantized model is
    bounded. Measured on this random tiny model (large random weights amplify it; the default
    model's perplexities are in bench_quant.py): relative logit error 0.039 (int8) / 0.53 (int4),
    teacher-forced top-1 agreement 0.91 / 0.375."""
    from fantai import LLM, SamplingParams
    from safetensors.numpy import load_file

    src = build_tiny_model(tmp_path / "m", hidden=128, inter=256, vocab_size=256, layers=2)
    dense = LLM(str(src), dtype="float32", kv_cache_memory="16M")
    quant = LLM(str(src), dtype="float32", kv_cache_memory="16M", quantization=quantization)
    formats = quant._model.weight_formats()
    assert formats["model.layers.1.self_attn.k_proj.weight"] == formats["model.layers.0.mlp.up_proj.weight"] == fmt
    assert formats["model.embed_tokens.weight"] == formats["lm_head.weight"] == "f32"
    n_linear = 2 * (4 * 128 * 128 - 2 * 128 * 64 + 3 * 128 * 256)  # q,o + k,v (kv heads 2 of 4) + mlp
    saved = dense._model.weight_bytes() - quant._model.weight_bytes()
    assert min_saved * n_linear < saved < 3.5 * n_linear

    # the RTN twin: the dense model of _C.quantize_rtn's weights, built tensor by tensor
    cfg = (src / "config.json").read_text()
    twin = _C.Model.create(cfg, "float32", "cpu", 0)
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.split(".")[-2] in LINEARS:
            r = _C.quantize_rtn(w, bits, group, True)
            w = _C.quant_dequantize(r["q"], r["scale"], r["zero"], None, None, bits,
                                    w.shape[1] if group == -1 else group)
        twin.set_tensor(name, w)
    twin.finalize()
    ids = np.random.default_rng(0).integers(6, 256, 200).tolist()
    lq, lt, ld = quant._model.score(ids), twin.score(ids), dense._model.score(ids)
    np.testing.assert_allclose(lq, lt, atol=1e-5, rtol=1e-5)
    centred = ld - ld.mean(axis=1, keepdims=True)
    rel = float(np.linalg.norm(lq - ld) / np.linalg.norm(centred))
    top1 = float((lq.argmax(1) == ld.argmax(1)).mean())
    print(f"{quantization}: relative logit error {rel:.3f}, teacher-forced top-1 agreement {top1:.3f}")
    assert rel < max_rel and top1 >= min_top1

    prompts = [[5 + i, 17, 99, 3 + i, 200] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params, use_tqdm=False)]
    twin_llm = LLM(str(src), dtype="float32", kv_cache_memory="16M")
    twin_llm._model = twin  # the engine below runs on the twin's weights
    twin_llm.engine = _C.Engine(twin, twin_llm.options.core_config(twin_llm.tokenizer.eos_token_ids))
    want = [o.outputs[0].token_ids for o in twin_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


# ---- CLI: fantai quantize and fantai eval perplexity ---------------------------------------
def _cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "fantai.cli", *args], capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_quant_core
@pytest.mark.parametrize(("fmt", "bits", "group", "sym"), [("gptq", 4, 32, True), ("gptq", 8, -1, False),
                                                          ("awq", 4, 32, False)])
def test_quantize_cli_round_trip(tmp_path: Path, fmt: str, bits: int, group: int, sym: bool) -> None:
    from fantai import LLM, SamplingParams
    from safetensors.numpy import load_file

    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    out = tmp_path / fmt
    summary = _cli("quantize", str(src), "--format", fmt, "--bits", str(bits), "--group-size", str(group),
                   "--sym" if sym else "--no-sym", "--output", str(out))
    assert summary["quantized_linears"] == 2 * 7
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    # the packed tensors decode, with the independent reference unpacker, to RTN of the source
    src_state, state = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    w = src_state[name + ".weight"]
    q, scale, zero = rtn_ref(w, bits, group, sym)
    g = w.shape[1] if group == -1 else group
    expect = (scale.astype(np.float16).astype(np.float32)[:, np.arange(w.shape[1]) // g]
              * (q.astype(np.float32) - zero[:, np.arange(w.shape[1]) // g].astype(np.float32)))
    if fmt == "gptq":
        got = gptq_unpack_ref(state[name + ".qweight"], state[name + ".qzeros"], state[name + ".scales"],
                              state[name + ".g_idx"], bits, True)
    else:
        got = awq_unpack_ref(state[name + ".qweight"], state[name + ".qzeros"], state[name + ".scales"], group)
    if fmt == "gptq" and not sym:  # zeros of 0 are moved to 1 for v1 readers: one step at most
        np.testing.assert_allclose(got, expect, atol=float(scale.max()) * 1.01)
    else:
        assert _bits_equal(got, expect)
    llm = LLM(str(out), dtype="float32", kv_cache_memory="16M")
    dense = LLM(str(src), dtype="float32", kv_cache_memory="16M")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    ids = np.random.default_rng(1).integers(6, 320, 100).tolist()
    lq, ld = llm._model.score(ids), dense._model.score(ids)
    top1 = float((lq.argmax(1) == ld.argmax(1)).mean())
    print(f"{fmt} {bits}-bit: teacher-forced top-1 agreement with the source {top1:.2f}")
    assert top1 >= (0.8 if bits == 8 else 0.2)


@needs_quant_core
def test_eval_perplexity_cli(tmp_path: Path) -> None:
    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{10 + (i * 7) % 200}" for i in range(150)))
    res = _cli("eval", "perplexity", str(src), "--text", str(text), "--context", "64", "--dtype", "float32")
    assert res["tokens"] == 150 and res["windows"] == 3 and res["predicted_tokens"] == 147
    assert 1.0 < res["perplexity"] < 10 * 320  # a random model: near the vocabulary size, finite
    q = _cli("eval", "perplexity", str(src), "--text", str(text), "--context", "64", "--dtype", "float32",
             "--quantization", "int8")
    assert q["weight_bytes"] < res["weight_bytes"]
    assert abs(math.log(q["perplexity"]) - math.log(res["perplexity"])) < 0.05


# ---- the loaders' calls, recorded by a stand-in core (runs without the C++ half) ------------
class _RecordingModel:
    """Takes what the loaders hand the core per the binding contract; keeps it dense."""

    backend = "cpu"
    num_threads = 2  # the loader sends tensors from this many threads: the record must not care

    def __init__(self) -> None:
        self.dense: dict[str, np.ndarray] = {}
        self.kinds: dict[str, str] = {}
        self.finalized = False

    def set_tensor(self, name: str, array: np.ndarray, dtype: str = "") -> None:
        a = np.asarray(array)
        if dtype == "bfloat16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        self.dense[name], self.kinds[name] = a.astype(np.float32), "dense"

    def set_tensor_quant(self, name: str, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                         mn: np.ndarray | None, perm: np.ndarray | None, bits: int, group: int) -> None:
        assert q.dtype == np.uint8 and scale.dtype == np.float32 and q.flags.c_contiguous
        assert zero is None or (zero.dtype == np.uint8 and zero.shape == scale.shape)
        assert perm is None or (perm.dtype == np.int32 and perm.shape == (q.shape[1],))
        assert scale.shape == (q.shape[0], -(-q.shape[1] // group)) and int(q.max()) < (1 << bits)
        z = np.zeros(scale.shape, np.uint8) if zero is None else zero
        self.dense[name] = ga.CanonicalWeight(q, scale, z, perm, bits, group).dequantize()
        self.kinds[name] = f"q{bits}"

    def set_tensor_ggml(self, name: str, data: np.ndarray, ggml_type: int, rows: int, cols: int,
                        row_perm: np.ndarray | None = None) -> None:
        assert data.dtype == np.uint8 and data.ndim == 1 and not data.flags.owndata  # a view, no copy
        w = ggml_dequantize_ref(data, ggml_type, rows, cols)
        self.dense[name] = w if row_perm is None else w[row_perm]
        self.kinds[name] = str(ggml_type)

    def finalize(self) -> None:
        self.finalized = True


class _RecordingCore:
    class Model:
        last: _RecordingModel | None = None

        @staticmethod
        def create(config_json: str, dtype: str, backend: str, threads: int, quantization: str = "none"
                   ) -> _RecordingModel:
            json.loads(config_json)
            _RecordingCore.Model.last = _RecordingModel()
            return _RecordingCore.Model.last


@pytest.mark.parametrize(("fmt", "bits", "group", "sym", "act_order"), CHECKPOINTS)
def test_checkpoint_loader_hands_the_core_its_dense_twin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fmt: str, bits: int, group: int, sym: bool,
                                                         act_order: bool) -> None:
    import fantai
    from safetensors.numpy import load_file

    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    qdir, ddir = tmp_path / "q", tmp_path / "dense"
    _write_quantized_twin(src, qdir, ddir, fmt, bits, group, sym, act_order)
    monkeypatch.setattr(fantai, "_C", _RecordingCore)
    qc = ga.read_quantization_config(str(qdir))
    assert qc is not None and qc["quant_method"] == fmt
    model = ga.load_quantized_checkpoint(str(qdir), qc, "float32", "cpu", 1)
    twin = load_file(str(ddir / "model.safetensors"))
    assert model.finalized and set(model.dense) == set(twin)
    assert sum(k.startswith("q") for k in model.kinds.values()) == 2 * len(LINEARS)
    for name, w in twin.items():
        assert _bits_equal(model.dense[name], w), name


def test_gguf_loader_hands_the_core_raw_blocks_and_row_permutation(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fantai import loader
    from fantai.weights.gguf_loader import load_gguf

    path = tmp_path / "kq.gguf"
    _k_quant_gguf(path)
    monkeypatch.setattr(loader, "_C", _RecordingCore)
    gguf = load_gguf(str(path))
    core = _RecordingCore.Model.create(json.dumps(gguf.config), "float32", "cpu", 1)
    loader._send_gguf_tensors(core, gguf, dequantize=False, online_quantization=False)
    assert core.kinds["model.layers.0.self_attn.q_proj.weight"] == str(Q4_K)
    assert core.kinds["model.layers.0.input_layernorm.weight"] == "dense"
    for gname, hf_name in gguf.tensor_names():
        # gguf-py's dequantization with the dense un-permutation == raw blocks + row_perm
        assert _bits_equal(core.dense[hf_name], gguf.tensor(gname).astype(np.float32)), hf_name
    q = core.dense["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q, gguf.raw_dequantized("blk.0.attn_q.weight"))  # the permutation was applied


class _RecordingCoreWithRTN(_RecordingCore):
    @staticmethod
    def quantize_rtn(w: np.ndarray, bits: int, group: int, symmetric: bool) -> dict[str, np.ndarray]:
        q, scale, zero = rtn_ref(w, bits, group, symmetric)
        return {"q": q, "scale": scale, "zero": zero}


@pytest.mark.parametrize(("fmt", "bits", "group", "sym"), [("gptq", 4, 32, True), ("gptq", 8, -1, False),
                                                          ("gptq", 4, 32, False), ("awq", 4, 32, False)])
def test_quantize_writer_layout_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, bits: int,
                                            group: int, sym: bool) -> None:
    """fantai quantize's files, read by the reference unpackers and by the checkpoint loader, give
    the round-to-nearest weights (f16 scales) of the source; the rest is the source in f16."""
    import fantai
    from fantai.quantize import quantize_model
    from safetensors.numpy import load_file

    monkeypatch.setattr(fantai, "_C", _RecordingCoreWithRTN)
    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    out = tmp_path / "out"
    summary = quantize_model(str(src), str(out), fmt, bits, group, sym)
    assert summary["quantized_linears"] == 2 * len(LINEARS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == fmt and cfg["torch_dtype"] == "float16"
    src_state, state = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    model = ga.load_quantized_checkpoint(str(out), ga.read_quantization_config(str(out)), "auto", "cpu", 1)
    for name, w in src_state.items():
        prefix = name[: -len(".weight")]
        if name.split(".")[-2] not in LINEARS:
            assert state[name].dtype == np.float16 and np.array_equal(model.dense[name], w.astype(np.float16))
            continue
        q, scale, zero = rtn_ref(w, bits, group, sym)
        cols = np.arange(w.shape[1]) // (w.shape[1] if group == -1 else group)
        expect = scale.astype(np.float16).astype(np.float32)[:, cols] * (q.astype(np.float32)
                                                                          - zero[:, cols].astype(np.float32))
        if fmt == "gptq":
            got = gptq_unpack_ref(state[prefix + ".qweight"], state[prefix + ".qzeros"], state[prefix + ".scales"],
                                  state[prefix + ".g_idx"], bits, True)
            assert state[prefix + ".qweight"].shape == (w.shape[1] * bits // 32, w.shape[0])
        else:
            got = awq_unpack_ref(state[prefix + ".qweight"], state[prefix + ".qzeros"], state[prefix + ".scales"],
                                 group)
            assert state[prefix + ".qweight"].shape == (w.shape[1], w.shape[0] // 8)
        assert _bits_equal(model.dense[name], got), name
        if fmt == "gptq" and not sym:
            # zeros of 0 are stored as 1 (v1 readers add 1 back unmasked): codes move up one step,
            # so only a group's top code can lose one step
            step = scale.astype(np.float16).astype(np.float32)[:, cols]
            assert np.all(np.abs(got - expect) <= step * 1.0001), name
        else:
            assert _bits_equal(got, expect), name


def test_quantize_writes_tokenizer_from_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fantai.model_files import default_model_path
    from fantai.quantize import write_gguf_tokenizer
    from fantai.tokenizer import Tokenizer
    from fantai.weights.gguf_loader import load_gguf

    gguf = load_gguf(default_model_path())
    write_gguf_tokenizer(gguf, str(tmp_path))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    original = Tokenizer.from_gguf_metadata(gguf.tokenizer_metadata, gguf.eos_token_ids)
    text = "Hello, world! 12345 <|im_start|>user\nÜber naïve café<|im_end|>"
    assert ours.encode(text) == original.encode(text)
    assert ours.eos_token_ids[0] == original.eos_token_ids[0] and ours.bos_token_id == original.bos_token_id
    assert ours.chat_template == original.chat_template
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf(text, add_special_tokens=False)["input_ids"] == original.encode(text, add_special_tokens=False)


@needs_quant_core
def test_generate_cli_takes_quantization_and_rejects_double_quantization(tmp_path: Path) -> None:
    from fantai.loader import load_model

    src = build_tiny_model(tmp_path / "src", hidden=64, inter=160)
    out = subprocess.run([sys.executable, "-m", "fantai.cli", "generate", str(src), "--prompt", "w10 w11 w12",
                          "--max-tokens", "4", "--quantization", "int4", "--kv-cache-memory", "16M"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("w")  # word-level vocabulary: generated words
    with pytest.raises(ValueError, match="quantization"):
        load_model(str(src), quantization="int3")
    qdir = tmp_path / "q"
    _write_quantized_twin(src, qdir, tmp_path / "dense", "awq", 4, 32, False, False)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(qdir), quantization="int8")


# ---- the GGUF types llama.cpp's common mixes need ------------------------------------------
# Per layer, the types of attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down. Layer 0
# is what llama.cpp's Q4_K_M writes for a hidden size of 576 (not whole 256-blocks): the 576-wide
# rows fall back from Q4_K to Q5_0 and from Q6_K to Q8_0, the 512-wide down rows stay K-quants.
# The other layers put each new type in several places (parts of one fused qkv / gate_up differ).
_GGUF_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NEW_TYPES_MIX = [
    (Q5_0, Q5_0, Q8_0, Q5_0, Q5_0, Q5_0, Q4_K),
    (IQ4_NL, Q5_1, Q5_0, IQ4_NL, Q5_1, IQ4_NL, Q2_K),
    (Q5_1, IQ4_NL, Q5_1, Q5_0, IQ4_NL, Q5_0, Q3_K),
    (Q5_0, Q5_0, IQ4_NL, Q5_1, Q5_0, Q5_1, IQ4_XS),
]
# f16 scale sizes that give weights of roughly 0.01..0.1 (each format multiplies d by a different
# integer range), so the random model's activations stay ordinary through four layers
_WEIGHT_MAGNITUDE = {Q5_0: 0.004, Q5_1: 0.003, Q8_0: 0.0006, Q4_K: 0.0003, Q2_K: 0.004, Q3_K: 0.0008,
                     IQ4_NL: 0.0008, IQ4_XS: 0.00004}


def _gguf_header(path: Path, hidden: int, inter: int, layers: int, vocab: int, heads: int = 9, kv_heads: int = 3):
    """A llama GGUFWriter with every key but the tensors: a tiny byte-level vocabulary."""
    return gguf_writer(path, hidden, inter, layers, vocab, heads, kv_heads)


def _new_types_gguf(path: Path) -> None:
    """A four-layer llama GGUF (hidden 576, 9 heads / 3 kv heads, tied Q8_0 embedding) whose
    linears are random valid blocks of _NEW_TYPES_MIX's types."""
    import gguf

    rng = np.random.default_rng(576)
    hidden, inter, vocab = 576, 512, 64
    w = _gguf_header(path, hidden, inter, len(_NEW_TYPES_MIX), vocab)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (192, hidden), "attn_v": (192, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}

    def raw(name: str, t: int, rows: int, cols: int) -> None:
        data = random_blocks(t, rows, cols, rng, 0.0005 if name == "token_embd.weight" else _WEIGHT_MAGNITUDE[t])
        w.add_tensor(name, data.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType(t))

    raw("token_embd.weight", Q8_0, vocab, hidden)
    for layer, kinds in enumerate(_NEW_TYPES_MIX):
        for part, t in zip(_GGUF_PARTS, kinds):
            raw(f"blk.{layer}.{part}.weight", t, *shapes[part])
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_sizes_the_new_types_as_gguf_py_does(tmp_path: Path) -> None:
    from fantai.weights.gguf_file import GGUFFile
    from fantai.weights.gguf_loader import load_gguf
    from gguf import GGUFReader

    path = tmp_path / "mix.gguf"
    _new_types_gguf(path)
    ours, theirs = GGUFFile(str(path)), GGUFReader(str(path), "r")
    assert {t.ggml_type for t in ours.tensors} >= set(NEW_GGML)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.ggml_type, a.offset, a.nbytes) == (b.name, int(b.tensor_type), b.data_offset, b.n_bytes)
    types = load_gguf(str(path)).tensor_types()
    assert types["blk.1.ffn_down.weight"] == "Q2_K" and types["blk.3.ffn_down.weight"] == "IQ4_XS"
    assert types["blk.1.attn_q.weight"] == "IQ4_NL" and types["blk.0.attn_q.weight"] == "Q5_0"


def test_gguf_types_fantai_cannot_load_are_named(tmp_path: Path) -> None:
    import gguf
    from fantai.weights.gguf_loader import load_gguf

    rng = np.random.default_rng(0)
    for qtype, name in ((16, "IQ2_XXS"), (15, "Q8_K")):  # unknown to the reader / read but not loaded
        path = tmp_path / f"{name}.gguf"
        w = _gguf_header(path, 256, 256, 1, 32)
        per, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        data = rng.integers(0, 256, (256, 256 // per * nbytes), dtype=np.uint8)
        w.add_tensor("blk.0.attn_q.weight", data, raw_dtype=gguf.GGMLQuantizationType(qtype))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ValueError, match=rf"blk\.0\.attn_q\.weight has ggml type {qtype} \({name}\)") as e:
            model = load_gguf(str(path))
            list(model.raw_tensors())
        assert "Q5_0" in str(e.value) and "IQ4_XS" in str(e.value), str(e.value)


@needs_quant_core
def test_gguf_with_the_new_types_computes_gguf_py_dequantized_model(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M-style file of a 576-wide model (Q5_0 / Q8_0 fallbacks) plus every new type: kept
    quantized, its logits equal bit for bit those of a model built from gguf-py's dequantization
    of the same file (exact-activation kernels), greedy tokens those of fantai's dequantized load;
    the default kernel (int8 activations on AVX512-VNNI) stays close."""
    from fantai import LLM, SamplingParams
    from fantai.weights.gguf_file import GGML_TYPE_NAMES
    from fantai.weights.gguf_loader import hf_tensor_name, load_gguf

    path = tmp_path / "mix.gguf"
    _new_types_gguf(path)
    quant = LLM(str(path), dtype="float32", kv_cache_memory="16M")
    formats = quant._model.weight_formats()
    for layer, kinds in enumerate(_NEW_TYPES_MIX):
        for part, t in zip(_GGUF_PARTS, kinds):
            hf = hf_tensor_name(f"blk.{layer}.{part}.weight")
            assert formats[hf] == GGML_TYPE_NAMES[t].lower(), (hf, formats[hf])

    gguf = load_gguf(str(path))  # gguf-py's dequantizers, q/k rows un-permuted in NumPy
    twin = _C.Model.create(json.dumps(gguf.config), "float32", "cpu", 2, "none")
    for name, w in gguf.tensors():
        twin.set_tensor(name, w)
    twin.finalize()
    gguf.close()
    assert quant._model.weight_bytes() < twin.weight_bytes() / 2.5

    ids = np.random.default_rng(3).integers(3, 64, 40).tolist()
    lq, lt = quant._model.score(ids), twin.score(ids)
    assert np.isfinite(lt).all() and lt.std() > 0.1  # a comparison that can fail
    assert _bits_equal(lq, lt)

    dense = LLM(str(path), dtype="float32", kv_cache_memory="16M", dequantize=True)
    prompts = [[5, 17, 9, 33, 12], [7, 8, 9, 10, 11, 12, 13, 40]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    assert got == want

    monkeypatch.delenv("FANTAI_QUANT_KERNEL")
    fast = LLM(str(path), dtype="float32", kv_cache_memory="16M")
    lf = fast._model.score(ids)
    spread = float(np.abs(lt - lt.mean(axis=1, keepdims=True)).mean())
    err = float(np.abs(lf - lt).mean())
    top1 = float((lf.argmax(1) == lt.argmax(1)).mean())
    print(f"new GGUF types, default kernel vs exact: mean |dlogit| {err:.4f} (spread {spread:.3f}), top-1 {top1:.2f}")
    assert err < 0.15 * spread
