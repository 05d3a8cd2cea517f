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


def test_phi3_longrope_switches_to_long_factors_past_original_length(tmp_path: Path) -> None:
    """Decoding past original_max_position_embeddings rotates new tokens with the long factors and
    the attention factor, as transformers does token by token (its prompt stays below the switch)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 16.0]}
    path = build_tiny_model(tmp_path / "phi3", arch="phi3", heads=4, kv_heads=2, max_pos=256, pad_token_id=0,
                            rope_parameters=rope)
    ref = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in random_prompts(2, 320, [12, 30], seed=5):
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy(ref, prompt, 40)
