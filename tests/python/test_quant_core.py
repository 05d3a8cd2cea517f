"""Quantized weights in the core: a model loaded through set_tensor_quant / set_tensor_ggml /
online quantization must compute what the same model computes densely from the dequantized
weights (the f32 kernels share the dense chain, so logits agree bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fantai import _C
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.numpy import load_file
from tiny_models import build_tiny_model, random_prompts

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGML_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
              "q4_1": GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module", params=["llama_tied", "qwen2_bias"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    # hidden 96 and inter 160: rows of 3 and 5 Q4/Q8 blocks, int4 groups of 32 end ragged nowhere
    # but per-channel int8 runs a 96 / 160 long chain with a masked tail on 16 lanes.
    kw = dict(arch="llama", tie=True) if request.param == "llama_tied" else dict(arch="qwen2", use_sliding_window=False)
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), hidden=96, inter=160, **kw)
    config = json.loads((path / "config.json").read_text())
    return json.dumps(config), load_file(str(path / "model.safetensors"))


@pytest.fixture(autouse=True)
def f32_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # The f32-dequant kernels (exact activations) unless a test asks for the int8 path; the
    # backend reads this when a model creates it.
    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "f32")


def make(config: str, quantization: str = "none") -> _C.Model:
    return _C.Model.create(config, "float32", "cpu", 2, quantization)


def is_proj(name: str) -> bool:
    return name.endswith(".weight") and any(p in name for p in PROJ)


def greedy(model: _C.Model, prompts: list[list[int]], n: int) -> list[list[int]]:
    cfg = _C.EngineConfig()
    cfg.num_blocks = 64
    engine = _C.Engine(model, cfg)
    params = _C.SamplingParams()
    params.temperature = 0.0
    params.max_tokens = n
    params.ignore_eos = True
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += list(o.token_ids)
    return [out[i] for i in range(len(prompts))]


def assert_same_model(quant: _C.Model, dense: _C.Model, exact: bool = True) -> None:
    """exact: bitwise logits (same summation order); otherwise f32-rounding close (act-order sums
    the columns in stored order, the dense model in original order)."""
    for prompt in random_prompts(2, 320, [1, 23], seed=3):
        ours, theirs = quant.score(prompt), dense.score(prompt)
        assert np.isfinite(theirs).all() and theirs.std() > 0.1  # a comparison that can fail
        if exact:
            np.testing.assert_array_equal(ours, theirs)
        else:
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    prompts = random_prompts(3, 320, [2, 9, 30], seed=4)
    assert greedy(quant, prompts, 12) == greedy(dense, prompts, 12)


@pytest.mark.parametrize("bits,group,symmetric,act_order", [(8, -1, True, False), (4, 32, True, False),
                                                            (4, 32, False, True), (8, 64, False, False)])
def test_set_tensor_quant_matches_dense_dequantized(tiny: tuple[str, dict[str, np.ndarray]], bits: int, group: int,
                                                    symmetric: bool, act_order: bool) -> None:
    config, tensors = tiny
    quant, dense = make(config), make(config)
    rng = np.random.default_rng(0)
    for name, w in tensors.items():
        if not is_proj(name):
            quant.set_tensor(name, w)
            dense.set_tensor(name, w)
            continue
        perm = rng.permutation(w.shape[1]).astype(np.int32) if act_order else None
        stored = w[:, perm] if perm is not None else w  # stored column c multiplies x[perm[c]]
        r = _C.quantize_rtn(np.ascontiguousarray(stored), bits, group, symmetric)
        g = group  # -1: per channel, as quantize_rtn takes it
        zero = r["zero"]  # symmetric: all 2^(bits-1), which the core keeps as one constant
        quant.set_tensor_quant(name, r["q"], r["scale"], zero, None, perm, bits, g)
        dense.set_tensor(name, _C.quant_dequantize(r["q"], r["scale"], zero, None, perm, bits, g))
    quant.finalize()
    dense.finalize()
    formats = quant.weight_formats()
    assert formats["model.layers.0.self_attn.q_proj.weight"] == (f"int{bits}g{group}" if group > 0 else f"int{bits}")
    assert formats["model.embed_tokens.weight"] == "f32"
    assert quant.weight_bytes() < dense.weight_bytes()
    assert_same_model(quant, dense, exact=not act_order)


@pytest.mark.parametrize("fmt", sorted(GGML_TYPES))
def test_set_tensor_ggml_matches_gguf_dequantized(tiny: tuple[str, dict[str, np.ndarray]], fmt: str) -> None:
    config, tensors = tiny
    quant, dense = make(config), make(config)
    qtype = GGML_TYPES[fmt]
    for name, w in tensors.items():
        if w.ndim != 2:
            quant.set_tensor(name, w)
            dense.set_tensor(name, w)
            continue
        raw = gguf_quantize(w, qtype)
        want = gguf_dequantize(raw, qtype).reshape(w.shape)
        # fantai's own decoder reproduces the gguf package's dequantization exactly.
        got = _C.ggml_dequantize(raw.reshape(-1).view(np.uint8), int(qtype), *w.shape)
        np.testing.assert_array_equal(got, want)
        row_perm = None
        if "q_proj" in name:  # a head-order row permutation applied at load, as the GGUF loader does
            row_perm = np.random.default_rng(1).permutation(w.shape[0]).astype(np.int32)
            src = np.empty_like(raw)
            src[row_perm] = raw  # destination row i takes source row row_perm[i]
            raw = src
        quant.set_tensor_ggml(name, raw.reshape(-1).view(np.uint8), int(qtype), *w.shape, row_perm)
        dense.set_tensor(name, want)
    quant.finalize()
    dense.finalize()
    assert quant.weight_formats()["model.layers.1.mlp.down_proj.weight"] == fmt
    assert quant.weight_formats()["model.embed_tokens.weight"] == fmt  # the tied lm_head reads it too
    assert_same_model(quant, dense)


def test_mixed_formats_in_one_fused_matrix(tiny: tuple[str, dict[str, np.ndarray]]) -> None:
    """q as Q8_0, k as int4 (canonical), v dense: each part writes its own slice of qkv."""
    config, tensors = tiny
    quant, dense = make(config), make(config)
    for name, w in tensors.items():
        if "k_proj.weight" in name:
            r = _C.quantize_rtn(w, 4, 32, False)
            quant.set_tensor_quant(name, r["q"], r["scale"], r["zero"], None, None, 4, 32)
            dense.set_tensor(name, _C.quant_dequantize(r["q"], r["scale"], r["zero"], None, None, 4, 32))
        elif "q_proj.weight" in name or "gate_proj" in name:
            raw = gguf_quantize(w, GGMLQuantizationType.Q8_0).reshape(-1).view(np.uint8)
            quant.set_tensor_ggml(name, raw, int(GGMLQuantizationType.Q8_0), *w.shape)
            dense.set_tensor(name, _C.ggml_dequantize(raw, int(GGMLQuantizationType.Q8_0), *w.shape))
        else:
            quant.set_tensor(name, w)
            dense.set_tensor(name, w)
    quant.finalize()
    dense.finalize()
    assert_same_model(quant, dense)


@pytest.mark.parametrize("quantization,bits,group", [("int8", 8, -1), ("int4", 4, 32)])
def test_online_quantization(tiny: tuple[str, dict[str, np.ndarray]], quantization: str, bits: int,
                             group: int) -> None:
    config, tensors = tiny
    quant, dense = make(config, quantization), make(config)
    for name, w in tensors.items():
        quant.set_tensor(name, w)
        if is_proj(name):
            r = _C.quantize_rtn(w, bits, group, True)
            w = _C.quant_dequantize(r["q"], r["scale"], r["zero"], None, None, bits, group if group > 0 else w.shape[1])
        dense.set_tensor(name, w)
    quant.finalize()
    dense.finalize()
    formats = quant.weight_formats()
    assert formats["model.layers.0.mlp.up_proj.weight"] == ("int8" if bits == 8 else "int4g32")
    assert formats["model.embed_tokens.weight"] == "f32"  # embedding stays dense online
    assert_same_model(quant, dense)


def test_rtn_matches_numpy_rule() -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 70)).astype(np.float32)
    w[2] = 0.0
    for bits, sym in [(4, True), (8, True), (4, False), (8, False)]:
        r = _C.quantize_rtn(w, bits, 32, sym)
        ng = 3
        wp = np.zeros((6, ng * 32), np.float32)
        wp[:, :70] = w
        g = wp.reshape(6, ng, 32)
        mask = np.zeros((ng, 32), bool).reshape(-1)
        mask[:70] = True
        mask = mask.reshape(ng, 32)
        if sym:
            qmax = (1 << (bits - 1)) - 1
            s = np.where(mask, np.abs(g), 0).max(-1) / np.float32(qmax)
            s = np.where(s == 0, np.float32(1), s).astype(np.float32)
            q = np.clip(np.rint(g / s[..., None]), -qmax, qmax) + (1 << (bits - 1))
        else:
            lo = np.minimum(np.where(mask, g, np.inf).min(-1), 0).astype(np.float32)
            hi = np.maximum(np.where(mask, g, -np.inf).max(-1), 0).astype(np.float32)
            s = ((hi - lo) / np.float32((1 << bits) - 1)).astype(np.float32)
            s = np.where(hi == lo, np.float32(1), s).astype(np.float32)
            z = np.clip(np.rint(-lo / s), 0, (1 << bits) - 1)
            q = np.clip(np.rint(g / s[..., None]) + z[..., None], 0, (1 << bits) - 1)
            np.testing.assert_array_equal(r["zero"], z.astype(np.uint8))
        np.testing.assert_array_equal(r["scale"], s)
        np.testing.assert_array_equal(r["q"], q.reshape(6, -1)[:, :70].astype(np.uint8))


def test_bad_input_is_a_value_error(tiny: tuple[str, dict[str, np.ndarray]]) -> None:
    config, tensors = tiny
    m = make(config)
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    raw = gguf_quantize(w, GGMLQuantizationType.Q8_0).reshape(-1).view(np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        m.set_tensor_ggml("model.layers.0.mlp.down_proj.weight", raw[:-1], int(GGMLQuantizationType.Q8_0), *w.shape)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type"):
        _C.ggml_dequantize(raw, int(GGMLQuantizationType.IQ2_XXS), *w.shape)  # no decoder for it
    r = _C.quantize_rtn(w, 4, 32, True)
    with pytest.raises(ValueError, match="shape"):
        m.set_tensor_quant("model.layers.0.mlp.down_proj.weight", r["q"], r["scale"][:, :1], None, None, None, 4, 32)
    with pytest.raises(ValueError, match="dtype"):
        m.set_tensor_quant("model.layers.0.mlp.down_proj.weight", r["q"].astype(np.int32), r["scale"], None, None,
                           None, 4, 32)
    with pytest.raises(ValueError, match="< 16"):
        m.set_tensor_quant("model.layers.0.mlp.down_proj.weight", r["q"] + 16, r["scale"], None, None, None, 4, 32)
    with pytest.raises(ValueError, match="quantization"):
        make(config, "int3")


def test_int8_path_stays_close_to_dense(tiny: tuple[str, dict[str, np.ndarray]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 activations (llama.cpp style) on Q8_0 weights: the logits move by less than the 4-bit
    weights already move them, and decoding stays batch invariant (each prompt alone gives the
    tokens it gives in a batch)."""
    config, tensors = tiny
    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "int8")
    quant = make(config)
    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "f32")
    dense, original, q4 = make(config), make(config), make(config)
    for name, w in tensors.items():
        original.set_tensor(name, w)
        if w.ndim == 2:
            raw = gguf_quantize(w, GGMLQuantizationType.Q8_0).reshape(-1).view(np.uint8)
            quant.set_tensor_ggml(name, raw, int(GGMLQuantizationType.Q8_0), *w.shape)
            dense.set_tensor(name, _C.ggml_dequantize(raw, int(GGMLQuantizationType.Q8_0), *w.shape))
            raw4 = gguf_quantize(w, GGMLQuantizationType.Q4_1).reshape(-1).view(np.uint8)
            q4.set_tensor_ggml(name, raw4, int(GGMLQuantizationType.Q4_1), *w.shape)
        else:
            for m in (quant, dense, q4):
                m.set_tensor(name, w)
    for m in (quant, dense, original, q4):
        m.finalize()
    for prompt in random_prompts(2, 320, [1, 23], seed=3):
        ref = original.score(prompt)
        act_err = np.abs(quant.score(prompt) - dense.score(prompt)).mean()
        w4_err = np.abs(q4.score(prompt) - ref).mean()
        assert act_err < 0.25 * w4_err, (act_err, w4_err)
    prompts = random_prompts(3, 320, [2, 9, 30], seed=4)
    together = greedy(quant, prompts, 12)
    assert together == [greedy(quant, [p], 12)[0] for p in prompts]


BLOCKS = {  # ggml type: (bytes per block, elements per block, byte offsets of f16 scales)
    GGMLQuantizationType.Q4_0: (18, 32, [0]), GGMLQuantizationType.Q4_1: (20, 32, [0, 2]),
    GGMLQuantizationType.Q8_0: (34, 32, [0]), GGMLQuantizationType.Q4_K: (144, 256, [0, 2]),
    GGMLQuantizationType.Q5_K: (176, 256, [0, 2]), GGMLQuantizationType.Q6_K: (210, 256, [208]),
}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 2.0) -> np.ndarray:
    """Random GGUF bytes of a [rows, cols] tensor with finite f16 scales."""
    size, elems, halves = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    for at in halves:
        d = rng.uniform(-scale, scale, raw.shape[:2]).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(BLOCKS, key=int))
def test_ggml_dequantize_matches_gguf_package(qtype: GGMLQuantizationType) -> None:
    raw = random_blocks(qtype, 3, 512, np.random.default_rng(int(qtype)))
    want = gguf_dequantize(raw, qtype).reshape(3, 512)
    np.testing.assert_array_equal(_C.ggml_dequantize(raw.reshape(-1), int(qtype), 3, 512), want)


def test_k_quant_mix_like_q4_k_m(tmp_path: Path) -> None:
    """A Q4_K_M-style file: q/k/gate/up Q4_K, v/down Q6_K, o Q5_K, embedding Q8_0 (tied)."""
    path = build_tiny_model(tmp_path / "k", arch="llama", tie=True, hidden=256, inter=512, heads=4, kv_heads=2)
    config = (path / "config.json").read_text()
    tensors = load_file(str(path / "model.safetensors"))
    kinds = {"q_proj": GGMLQuantizationType.Q4_K, "k_proj": GGMLQuantizationType.Q4_K,
             "gate_proj": GGMLQuantizationType.Q4_K, "up_proj": GGMLQuantizationType.Q4_K,
             "v_proj": GGMLQuantizationType.Q6_K, "down_proj": GGMLQuantizationType.Q6_K,
             "o_proj": GGMLQuantizationType.Q5_K, "embed_tokens": GGMLQuantizationType.Q8_0}
    quant, dense = make(config), make(config)
    rng = np.random.default_rng(7)
    for name, w in tensors.items():
        qtype = next((t for k, t in kinds.items() if k in name), None)
        if qtype is None or w.ndim != 2:
            quant.set_tensor(name, w)
            dense.set_tensor(name, w)
            continue
        # Random blocks scaled like the weights (K-quant sub-scales reach 63 * d).
        raw = random_blocks(qtype, *w.shape, rng, scale=0.3 if qtype == GGMLQuantizationType.Q8_0 else 0.002)
        quant.set_tensor_ggml(name, raw.reshape(-1), int(qtype), *w.shape)
        dense.set_tensor(name, _C.ggml_dequantize(raw.reshape(-1), int(qtype), *w.shape))
    quant.finalize()
    dense.finalize()
    formats = quant.weight_formats()
    assert formats["model.layers.0.self_attn.v_proj.weight"] == "q6_k"
    assert formats["model.layers.0.self_attn.o_proj.weight"] == "q5_k"
    assert formats["model.layers.1.mlp.gate_proj.weight"] == "q4_k"
    assert_same_model(quant, dense)
