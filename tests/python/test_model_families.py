"""Model families beyond Llama: chat templates as transformers renders them, and long-context RoPE.

Exact logits and greedy tokens of every family (Qwen3, Gemma 2 / 3, Phi-3) against transformers are
in test_model_parity.py; this file covers what that one cannot: the families' own chat templates
(rendered by fantai's sandbox and by transformers' apply_chat_template on the same inputs) and
Phi-3's longrope switching to its long factors past original_max_position_embeddings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fantai import LLM, SamplingParams
from fantai.chat import ChatTemplateError
from fantai.tokenizer import Tokenizer
from tiny_gguf import gguf_writer
from tiny_models import build_tiny_model, hf_greedy, hf_model, random_prompts, save_word_tokenizer
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"  # the families' shipped templates

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "  Hello there  "}],
    "system_user": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "How are you?"}],
    # a reasoning model's earlier turn: Qwen3's template drops the thought of past turns
    "thought": [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "and 3+3?"}],
    "tool_turns": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "sunny"}],
}


def _pair(tmp_path: Path, family: str, bos: str, eos: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    template = (TEMPLATES / f"{family}.jinja").read_text()
    save_word_tokenizer(tmp_path, 64)
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token=bos, eos_token=eos)
    ref.chat_template = template
    ours.spec.chat_template = template
    return ours, ref


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False], ids=["gen_prompt", "no_gen_prompt"])
def test_family_templates_render_as_transformers(tmp_path: Path, family: str, conversation: str,
                                                 gen: bool) -> None:
    ours, ref = _pair(tmp_path, family, "<s>", "</s>")
    msgs = CONVERSATIONS[conversation]
    variants: list[dict] = [{}]
    if family == "qwen3":
        variants += [{"enable_thinking": False}, {"enable_thinking": True}, {"tools": TOOLS}]
    for extra in variants:
        kwargs = dict(extra)
        tools = kwargs.pop("tools", None)
        try:
            want = ref.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)
        except Exception as e:  # noqa: BLE001 - the template raised: fantai must refuse the same input
            with pytest.raises(ChatTemplateError):
                ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, **kwargs)
            assert "not supported" in str(e) or "alternate" in str(e)
            continue
        assert ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, **kwargs) == want


def test_qwen3_enable_thinking_reaches_the_prompt(tmp_path: Path) -> None:
    """LLM.chat's chat_template_kwargs (the server's field of the same name) switch thinking off."""
    path = build_tiny_model(tmp_path / "m", arch="qwen3", head_dim=16, use_sliding_window=False)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    template = (TEMPLATES / "qwen3.jinja").read_text()
    msgs = [{"role": "user", "content": "w7 w8"}]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    on = llm.chat(msgs, params, use_tqdm=False, chat_template=template)[0]
    off = llm.chat(msgs, params, use_tqdm=False, chat_template=template,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and not on.prompt.endswith("</think>\n\n")


def _stepped_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' model stepped one token at a time over its cache, as a server decodes."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5 renamed forward's past_key_values to cache (the old name warns until 5.40).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([prompt]), **{name: cache}, use_cache=True).logits[0, -1]
        out: list[int] = []
        for pos in range(len(prompt), len(prompt) + n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), **{name: cache}, use_cache=True,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
    return out


def test_phi3_longrope_switches_to_long_factors_past_original_length(tmp_path: Path) -> None:
    """Decoding past original_max_position_embeddings rotates each new token with the long factors
    (and the attention factor), as transformers' model does stepped token by token: its rotary
    module picks the set by the step's largest position. (transformers' generate() diverges from
    its own stepped model here, so the reference is the stepped model.)"""
    import json

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 16.0]}
    # transformers takes the top-level original_max_position_embeddings over rope_parameters'
    path = build_tiny_model(tmp_path / "phi3", arch="phi3", heads=4, kv_heads=2, max_pos=256, pad_token_id=0,
                            original_max_position_embeddings=32, rope_parameters=rope)
    ref = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(2, 320, [12, 30], seed=5)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == [_stepped_greedy(ref, p, 30) for p in prompts]
    # the long factors are really used: without them the same weights decode differently
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = cfg["rope_parameters"]["short_factor"]
    (path / "config.json").write_text(json.dumps(cfg))
    short_only = LLM(str(path), dtype="float32", num_kv_blocks=32)
    assert [o.outputs[0].token_ids for o in short_only.generate(prompts, params, use_tqdm=False)] != ours


# --- the same families written as GGUF, the way llama.cpp's converter writes them ---------------
_GGUF_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm"}
_GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}


def _gguf_name(hf: str, arch: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    layer, module = parts[2], ".".join(parts[3:-1])
    gemma = arch.startswith("gemma")
    names = dict(_GGUF_BLOCK, post_attention_layernorm="post_attention_norm" if gemma else "ffn_norm",
                 pre_feedforward_layernorm="ffn_norm", post_feedforward_layernorm="post_ffw_norm")
    return f"blk.{layer}.{names[module]}.{parts[-1]}"


def write_family_gguf(model, path: Path, arch: str, quant: str = "F32") -> None:
    """What llama.cpp's HF -> GGUF converter writes for these families (test-side copy of the idea):
    Gemma's norms stored as 1 + w, Phi-3's fused tensors and rope factors as they are."""
    import gguf
    import numpy as np

    cfg = model.config
    rope = cfg.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]
    w = gguf_writer(path, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size,
                    cfg.num_attention_heads, cfg.num_key_value_heads, arch=_GGUF_ARCH[arch],
                    context=cfg.max_position_embeddings, rope_base=rope["rope_theta"], rms_eps=cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_uint32("general.file_type", 0)
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.get("factor", 1.0))
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        attn = 1.0 if factor <= 1 else np.sqrt(1 + np.log(factor) / np.log(rope["original_max_position_embeddings"]))
        w.add_rope_scaling_attn_factors(float(attn))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.float().numpy().astype(np.float32)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            a = a + 1.0
        name = _gguf_name(hf, arch)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_FAMILIES = {
    "qwen3": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=32, use_sliding_window=False),
    # GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim, as Gemma 2 2B / 9B have. A
    # 16-token window (the 37-token prompt and its generation pass it) and soft-capped scores.
    "gemma2": dict(arch="gemma2", heads=4, kv_heads=2, head_dim=16, query_pre_attn_scalar=16,
                   final_logit_softcapping=3.0, attn_logit_softcapping=2.0, sliding_window=16, tie=True),
    # six layers: llama.cpp's fixed Gemma 3 pattern (five sliding, one full) and local base 10000
    "gemma3": dict(arch="gemma3", heads=4, kv_heads=1, head_dim=32, query_pre_attn_scalar=32, layers=6,
                   sliding_window=16,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    "phi3": dict(arch="phi3", heads=4, kv_heads=2, max_pos=1024, pad_token_id=0,
        original_max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 256,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}),
}


@pytest.mark.parametrize("family", sorted(GGUF_FAMILIES))
def test_family_gguf_gives_transformers_tokens(tmp_path: Path, family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An f32 GGUF of each family generates transformers' greedy tokens; a Q8_0 one stays quantized
    and, on the exact-activation kernels, computes its dequantized twin's logits and tokens."""
    import numpy as np

    path = build_tiny_model(tmp_path / family, **GGUF_FAMILIES[family])
    ref = hf_model(path)
    f32, q8 = tmp_path / "f32.gguf", tmp_path / "q8_0.gguf"
    write_family_gguf(ref, f32, family)
    write_family_gguf(ref, q8, family, "Q8_0")
    llm = LLM(str(f32), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts(2, 320, [5, 37], seed=7)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)

    monkeypatch.setenv("FANTAI_QUANT_KERNEL", "f32")
    quant = LLM(str(q8), dtype="float32", num_kv_blocks=32)
    dense = LLM(str(q8), dtype="float32", num_kv_blocks=32, dequantize=True)
    assert "q8_0" in set(quant._model.weight_formats().values())
    assert quant._model.weight_bytes() < dense._model.weight_bytes() / 2
    lq, ld = quant._model.score(prompts[1]), dense._model.score(prompts[1])
    np.testing.assert_allclose(lq, ld, atol=1e-4 * float(ld.std()) + 1e-5, rtol=1e-4)
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("model_type,arch", [("gemma2", "Gemma2ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM")])
def test_gemma_defaults_as_transformers_decides(model_type: str, arch: str) -> None:
    """A config.json that leaves the caps and the query scale out gets the class defaults (Gemma 2:
    scores capped at 50, logits at 30; both scale by 256 ** -0.5), and one written by transformers
    the same values; an explicit null turns a cap off."""
    import json

    from fantai import _C
    from transformers import AutoConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    hf = AutoConfig.for_model(model_type, **base)
    saved = json.loads(hf.to_json_string())
    raw = dict(model_type=model_type, architectures=[arch], **base)
    for text in (json.dumps(saved | {"architectures": [arch]}), json.dumps(raw)):
        ours = _C.ModelConfig.from_json(text)
        assert ours.final_logit_softcap == (hf.final_logit_softcapping or 0.0)
        assert ours.attn_logit_softcap == (hf.attn_logit_softcapping or 0.0)
        assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar
    off = _C.ModelConfig.from_json(json.dumps(raw | dict(final_logit_softcapping=None,
                                                          attn_logit_softcapping=None)))
    assert off.final_logit_softcap == 0.0 and off.attn_logit_softcap == 0.0
