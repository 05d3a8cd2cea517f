"""Weights room: GGUF reader giving an HF-style config and HF-layout tensors, one at a time.

The load path hands the core each tensor's raw bytes (a view of the file mapping) with its ggml
type, so quantized weights stay quantized; `tensor()` still dequantizes for tests and tools.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fantai.weights.gguf_file import (
    SUPPORTED_TYPES,
    GGUFFile,
    TensorInfo,
    ggml_type_name,
    unsupported_type_message,
)

GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
DENSE_TYPES = frozenset({GGML_F32, GGML_F16, GGML_BF16})


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one GGUF `general.architecture` maps onto a Hugging Face model class."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter permuted q/k rows (rotate-half -> interleaved)


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", True),
    "mistral": ArchSpec("LlamaForCausalLM", "llama", True),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", False),
    "gemma2": ArchSpec("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ArchSpec("Gemma3ForCausalLM", "gemma3_text", False),
    "phi3": ArchSpec("Phi3ForCausalLM", "phi3", False),
    "qwen3moe": ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", False),
}
# llama.cpp writes Mixtral as arch "llama" with an expert count.
MIXTRAL = ArchSpec("MixtralForCausalLM", "mixtral", True)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts layer's router
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where an architecture's llama.cpp names mean something else: Gemma's ffn_norm is the MLP's input
# norm (its post_attention_norm normalises the attention output); Phi-3's ffn_up is gate|up fused.
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
# Mixture of experts: the router, each layer's experts stacked in one 3-D tensor per matrix
# ([experts, rows, cols] row-major), and the per-expert tensors of early Mixtral files.
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}
_LEGACY_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
EXPERT_PLACEHOLDER = "*"  # in an HF name: one tensor per expert
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Control tokens that end a turn in common chat formats; llama.cpp treats them as end-of-generation.
END_OF_TURN_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
     "</s>", "<|end_of_text|>", "<|return|>", "<|call|>"}
)
CONTROL_TOKEN_TYPES = frozenset({3, 4})  # gguf TokenType CONTROL, USER_DEFINED

def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name, or None when it has no HF counterpart. A stack of
    experts maps to a name with EXPERT_PLACEHOLDER where the expert's index goes."""
    m = _LEGACY_EXPERT_RE.match(gguf_name)
    if m:
        layer, part, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _EXPERT_STACKS and kind == "weight":
            proj = _EXPERT_STACKS[part]
            return f"model.layers.{layer}.mlp.experts.{EXPERT_PLACEHOLDER}.{proj}.weight"
        hf = _ARCH_BLOCK_NAMES.get(arch, {}).get(part) or _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotate-half -> interleaved row permutation of q/k (weights or biases)."""
    rows = w.shape[0]
    grouped = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return grouped.swapaxes(1, 2).reshape(w.shape)


def unpermute_qk_rows(rows: int, n_head: int) -> np.ndarray:
    """unpermute_qk as a row gather: destination row i takes source row perm[i]."""
    return np.ascontiguousarray(unpermute_qk(np.arange(rows, dtype=np.int32), n_head))


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One GGUF tensor as the core takes it: raw bytes in HF row order (after row_perm)."""

    hf_name: str
    data: np.ndarray  # uint8 view of the file mapping
    ggml_type: int
    rows: int
    cols: int
    row_perm: np.ndarray | None  # int32 [rows] (elements for 1-D): destination i takes source row_perm[i]
    ndim: int


def _clean_float(x: float) -> float:
    # GGUF stores f32: 1e-5 reads back as 9.9999997e-06; give the shortest float32 repr instead.
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not np.isfinite(x):
        raise ValueError(f"{x!r} is not a finite number")
    return float(str(np.float32(x)))


def _torch_dtype(file_type: int | None) -> str:
    if file_type is None:
        return "float32"
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "float32")


def _end_token_ids(meta: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    for tid, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype in CONTROL_TOKEN_TYPES and text in END_OF_TURN_TEXTS and tid not in ids:
            ids.append(tid)
    return ids


class GGUFModel:
    """A GGUF checkpoint opened lazily (memory-mapped); tensors are dequantized on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = GGUFFile(path)
        self.metadata: dict[str, Any] = self._file.metadata
        self.arch: str = self.metadata.get("general.architecture", "")
        if self.arch not in ARCHS:
            raise ValueError(
                f"{path}: unsupported GGUF architecture {self.arch!r} (supported: {sorted(ARCHS)})"
            )
        self.spec = ARCHS[self.arch]
        if self.spec.model_type == "llama" and self._arch_value("expert_count", 0):
            self.spec = MIXTRAL
        self._by_name: dict[str, TensorInfo] = {t.name: t for t in self._file.tensors}
        self.tokenizer_metadata: dict[str, Any] = {
            k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")
        }
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template")
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.eos_token_ids: list[int] = _end_token_ids(self.metadata)
        try:
            self.config: dict[str, Any] = self._build_config()
        except (TypeError, KeyError, IndexError, ValueError, OverflowError) as e:  # a key of the wrong kind
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path}: GGUF metadata of the wrong type ({type(e).__name__}: {e})") from e

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _int(self, key: str, default: Any = None, lo: int = 1, hi: int = 1 << 24) -> int:
        """An integer architecture key in [lo, hi]: anything else names the file and the key."""
        value = self._arch_value(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # per-layer arrays (head counts) that are uniform
        if value is None or isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{self.path}: metadata {self.arch}.{key} = {value!r} is not an integer in "
                             f"[{lo}, {hi}]")
        return value

    def _build_config(self) -> dict[str, Any]:
        hidden = self._int("embedding_length")
        heads = self._int("attention.head_count", hi=1 << 16)
        kv_heads = self._int("attention.head_count_kv", heads, hi=heads)
        tokens = self.metadata.get("tokenizer.ggml.tokens", [])
        if not isinstance(tokens, list):
            raise ValueError(f"{self.path}: metadata tokenizer.ggml.tokens is not a list")
        vocab = self._int("vocab_size", len(tokens) or None, hi=1 << 28)
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        cfg: dict[str, Any] = {
            "architectures": [self.spec.hf_architecture],
            "model_type": self.spec.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._int("feed_forward_length"),
            "num_hidden_layers": self._int("block_count", hi=1 << 16),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": self._int("attention.key_length", hidden // heads, hi=1 << 16),
            "hidden_act": "silu",
            "rms_norm_eps": _clean_float(
                self._arch_value("attention.layer_norm_rms_epsilon", 1e-6)
            ),
            "rope_theta": _clean_float(self._arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": self._int("context_length", 2048, hi=1 << 24),
            "tie_word_embeddings": "output.weight" not in self._by_name,
            "attention_bias": "blk.0.attn_q.bias" in self._by_name,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": None if eos is None else int(eos),
            "torch_dtype": self._checkpoint_dtype(),
        }
        pad = self.metadata.get("tokenizer.ggml.padding_token_id")
        if pad is not None:
            cfg["pad_token_id"] = int(pad)
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
        self._family_config(cfg)
        cfg.update(self._moe_config(cfg))
        return cfg

    def _family_config(self, cfg: dict[str, Any]) -> None:
        """The keys llama.cpp's converters keep for Gemma and Phi-3, back into config.json terms."""
        window = self._arch_value("attention.sliding_window")
        if self.arch in ("gemma2", "gemma3"):
            cfg["hidden_activation"] = "gelu_pytorch_tanh"
            # llama.cpp's converter stores Gemma's norms as 1 + w (the weight the model multiplies).
            cfg["norm_weights_include_one"] = True
            # llama.cpp scales by key_length ** -0.5, except the 27B models (told by their layer
            # count: 46 for Gemma 2, 62 for Gemma 3), whose query_pre_attn_scalar is hidden / heads.
            layers = int(cfg["num_hidden_layers"])
            big = (self.arch == "gemma2" and layers == 46) or (self.arch == "gemma3" and layers == 62)
            cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                            else cfg["head_dim"])
            if window is not None:
                cfg["sliding_window"] = int(window)
            # gguf-py's key is {arch}.attn_logit_softcapping; absent, Gemma 2's default 50 holds
            # (as in llama.cpp), so the key is left out rather than written as "no cap".
            cap = self._arch_value("attn_logit_softcapping")
            if cap is not None:
                cfg["attn_logit_softcapping"] = _clean_float(cap)
            final = self._arch_value("final_logit_softcapping")
            if final is not None:
                cfg["final_logit_softcapping"] = _clean_float(final)
            if self.arch == "gemma3":
                cfg["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed base of the sliding layers
        if self.arch == "phi3":
            rot = self._arch_value("rope.dimension_count")
            rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
            if rot is not None:
                rope["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
            if "rope_factors_long.weight" in self._by_name:
                rope.update(
                    rope_type="longrope",
                    long_factor=[float(x) for x in self._dense_vector("rope_factors_long.weight")],
                    short_factor=[float(x) for x in self._dense_vector("rope_factors_short.weight")],
                    original_max_position_embeddings=int(
                        self._arch_value("rope.scaling.original_context_length", cfg["max_position_embeddings"])),
                )
                attn = self._arch_value("rope.scaling.attn_factor")
                if attn is not None:
                    rope["attention_factor"] = _clean_float(attn)
            cfg["rope_parameters"] = rope
            cfg.pop("rope_scaling", None)
            if window is not None:
                cfg["sliding_window"] = int(window)

    def _dense_vector(self, gguf_name: str) -> np.ndarray:
        t = self._by_name[gguf_name]
        return dequantize_raw(self._file.tensor_bytes(t), t.ggml_type, tuple(reversed(t.shape))).reshape(-1)

    def _moe_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Expert counts and sizes; a layer without a router (ffn_gate_inp) keeps a dense MLP."""
        experts = int(self._arch_value("expert_count", 0) or 0)
        if not experts:
            return {}
        layers = cfg["num_hidden_layers"]
        return {
            "num_local_experts": experts,
            "num_experts": experts,
            "num_experts_per_tok": int(self._arch_value("expert_used_count", 2)),
            "moe_intermediate_size": int(self._arch_value("expert_feed_forward_length",
                                                          cfg["intermediate_size"])),
            # llama.cpp always renormalises the chosen experts' weights for these two archs
            "norm_topk_prob": bool(self._arch_value("expert_weights_norm", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(layers)
                                if f"blk.{i}.ffn_gate_inp.weight" not in self._by_name],
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_value("rope.scaling.type")
        factor = self._arch_value("rope.scaling.factor")
        if kind in (None, "none") or factor is None:
            return None
        out: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": _clean_float(factor)}
        orig = self._arch_value("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out

    def tensor_names(self) -> list[tuple[str, str]]:
        """(gguf_name, hf_name) for every tensor with an HF counterpart, in file order."""
        pairs = ((t.name, hf_tensor_name(t.name, self.arch)) for t in self._file.tensors)
        return [(g, h) for g, h in pairs if h is not None]

    def _checkpoint_dtype(self) -> str:
        """The checkpoint's dtype, what dtype="auto" loads: without block-quantized tensors, that of
        most of the matrices' elements. general.file_type only says what the converter meant: a
        file labelled (or left) otherwise would load its BF16 matrices as f32, twice the memory
        and half the decode speed."""
        if not self.is_quantized():
            count: dict[int, int] = {}
            for t in self._file.tensors:
                if len(t.shape) >= 2:
                    count[t.ggml_type] = count.get(t.ggml_type, 0) + int(np.prod(t.shape))
            if count:
                names = {GGML_F32: "float32", GGML_F16: "float16", GGML_BF16: "bfloat16"}
                return names[max(count, key=count.__getitem__)]
        return _torch_dtype(self.metadata.get("general.file_type"))

    def is_quantized(self) -> bool:
        """True when any weight is stored in a block-quantized type (not F32/F16/BF16)."""
        return any(t.ggml_type not in DENSE_TYPES for t in self._file.tensors)

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name -> ggml type name (Q4_1, Q8_0, F32, ...)."""
        return {t.name: ggml_type_name(t.ggml_type) for t in self._file.tensors}

    def unmapped_tensor_names(self) -> list[str]:
        """GGUF tensors with no HF parameter (e.g. rope_freqs); tensors() skips them."""
        return [t.name for t in self._file.tensors if hf_tensor_name(t.name, self.arch) is None]

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (hf_name, array) one tensor at a time: HF layout [out, in], f32 (F16 stays f16);
        a stack of experts as one tensor per expert."""
        for gguf_name, hf_name in self.tensor_names():
            array = self.tensor(gguf_name)
            if EXPERT_PLACEHOLDER in hf_name:
                for e in range(array.shape[0]):
                    yield hf_name.replace(EXPERT_PLACEHOLDER, str(e)), array[e]
            else:
                yield hf_name, array

    def close(self) -> None:
        """Unmaps the file (its pages stop counting as resident once the core holds its copy)."""
        self._file.close()

    def raw_tensors(self) -> Iterator[RawTensor]:
        """Every mapped tensor as raw bytes + type + the q/k row permutation: nothing dequantized.
        A stack of experts comes as one tensor per expert (views of its rows: ggml blocks never
        cross a row, so each expert's bytes are a contiguous slice)."""
        for gguf_name, hf_name in self.tensor_names():
            if EXPERT_PLACEHOLDER not in hf_name:
                yield self.raw_tensor(gguf_name, hf_name)
                continue
            stack = self.raw_tensor(gguf_name, hf_name)
            experts = self._by_name[gguf_name].shape[2]
            rows, per = stack.rows // experts, stack.data.nbytes // experts
            for e in range(experts):
                name = hf_name.replace(EXPERT_PLACEHOLDER, str(e))
                yield RawTensor(name, stack.data[e * per:(e + 1) * per], stack.ggml_type, rows,
                                stack.cols, None, 2)

    def raw_tensor(self, gguf_name: str, hf_name: str | None = None) -> RawTensor:
        t = self._by_name[gguf_name]
        if t.ggml_type not in SUPPORTED_TYPES:  # said here, with the tensor's name, not by the core
            raise ValueError(f"{self.path}: {unsupported_type_message(gguf_name, t.ggml_type)}")
        rows, cols = t.rows_cols
        heads = self._qk_heads(gguf_name)
        n = rows if len(t.shape) >= 2 else cols  # a 1-D q/k bias is permuted element-wise
        perm = unpermute_qk_rows(n, heads) if heads else None
        return RawTensor(hf_name or hf_tensor_name(gguf_name, self.arch) or gguf_name, self._file.tensor_bytes(t),
                         t.ggml_type, rows, cols, perm, len(t.shape))

    def tensor(self, gguf_name: str) -> np.ndarray:
        """Dequantize one GGUF tensor into HF layout (q/k rows un-permuted where needed)."""
        t = self._by_name[gguf_name]
        array = dequantize_raw(self._file.tensor_bytes(t), t.ggml_type, tuple(reversed(t.shape)))
        heads = self._qk_heads(gguf_name)
        return unpermute_qk(array, heads) if heads else array

    def raw_dequantized(self, gguf_name: str) -> np.ndarray:
        """One tensor dequantized in the file's own row order (no q/k un-permutation)."""
        t = self._by_name[gguf_name]
        return dequantize_raw(self._file.tensor_bytes(t), t.ggml_type, tuple(reversed(t.shape)))

    def _qk_heads(self, gguf_name: str) -> int:
        """Head count whose row permutation llama.cpp applied to this tensor, 0 for none."""
        if not self.spec.permuted_qk:
            return 0
        if ".attn_q." in gguf_name:
            return int(self.config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return int(self.config["num_key_value_heads"])
        return 0


def dequantize_raw(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Dense copy of raw GGUF tensor bytes (gguf-py's NumPy dequantizers): f32, F16 stays f16."""
    if ggml_type == GGML_F16:
        return np.array(data.view(np.float16)).reshape(shape)  # copy out of the mmap
    if ggml_type == GGML_F32:
        return np.array(data.view(np.float32)).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(ggml_type)
    try:
        array = dequantize(data.reshape(-1, data.size // max(1, _rows(shape))), qtype)
    except NotImplementedError as e:
        raise NotImplementedError(f"GGUF type {qtype.name} unsupported") from e
    return array.astype(np.float32, copy=False).reshape(shape)


def _rows(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file: metadata is read now, tensors lazily (raw_tensors() / tensors())."""
    return GGUFModel(path)
