"""The offline API: LLM.generate and LLM.chat (vLLM's names), driving the core synchronously."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fantai.config import CoreHolder
from fantai.engine_args import EngineArgs, engine_args_from
from fantai.outputs import RequestOutput
from fantai.requests import RequestState
from fantai.sampling_params import SamplingParams
from fantai.structured import structured_spec

logger = logging.getLogger("fantai")

PromptType = str | list[int] | dict[str, Any]


class LLM(CoreHolder):
    """A model plus a paged-KV continuous-batching engine, for offline batches.

    >>> llm = LLM()  # the bundled SmolLM2-135M-Instruct
    >>> llm = LLM("model.gguf", threads=2, kv_cache_memory="1G")  # any EngineArgs field
    >>> llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=32))
    """

    def __init__(self, model: str | None = None, *, engine_args: EngineArgs | None = None,
                 **kwargs: Any) -> None:
        """kwargs: any EngineArgs field (dtype, threads, kv_cache_memory, max_model_len, ...);
        with engine_args too, they override its values."""
        super().__init__(engine_args_from(EngineArgs, model, engine_args, kwargs, "LLM"))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> int:
        """Drops every cached prefix block not in use; returns how many."""
        return self.engine.reset_prefix_cache()

    def release_memory(self) -> int:
        """Trims the prefix cache and returns unused KV pages to the OS; returns blocks released."""
        return self.engine.release_memory()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        items = _normalize_prompts(prompts)
        params = _per_prompt(sampling_params, len(items))
        states = [self._make_state(str(i), p, sp) for i, (p, sp) in enumerate(zip(items, params))]
        return self._run(states, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """chat_template_kwargs reach the template as variables (Qwen3's enable_thinking), as in vLLM."""
        conversations: list[list[dict[str, Any]]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages)  # type: ignore[list-item,assignment]
        prompts = [self.tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template or self.chat_template,
                                                      **(chat_template_kwargs or {}))
                   for conv in conversations]
        # The template already carries the special tokens (BOS etc.): don't add them twice.
        ids = [{"prompt": p, "prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(ids, sampling_params, use_tqdm)

    def _make_state(self, request_id: str, prompt: PromptType, params: SamplingParams) -> RequestState:
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict):
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
            elif isinstance(text, str):
                ids = self.tokenizer.encode(text)
            else:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        else:
            text, ids = None, list(prompt)
        return RequestState.create(request_id, text, ids, params, self.tokenizer)

    def _run(self, states: list[RequestState], use_tqdm: bool) -> list[RequestOutput]:
        owner: dict[int, tuple[RequestState, int]] = {}
        try:
            for st in states:
                core = st.core_requests(self.max_model_len)
                spec = structured_spec(st.params)
                if spec is not None:  # ValueError (the grammar's own message) if it won't compile
                    self.grammars.register([cid for cid, _ in core], spec)
                    owner.update({cid: (st, i) for i, (cid, _) in enumerate(core)})
                # n > 1: one request; its siblings fork from it and share the prompt's KV blocks.
                self.engine.add_request(core[0][0], st.prompt_token_ids, core[0][1], core[1:])
                for i, (core_id, _) in enumerate(core):
                    owner[core_id] = (st, i)
            self._loop(owner, len(states), use_tqdm)
        except BaseException:
            for core_id in owner:
                self.engine.abort_request(core_id)
            raise
        finally:
            self.grammars.release(list(owner))
        return [st.result for st in states]

    def _loop(self, owner: dict[int, tuple[RequestState, int]], total: int, use_tqdm: bool) -> None:
        bar = _progress(total, use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                st, i = owner[out.request_id]
                was_done = st.result.finished
                if st.apply(i, out):
                    self.engine.abort_request(out.request_id)
                if st.result.finished and not was_done and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [[int(t) for t in prompts]]  # type: ignore[arg-type]  # one prompt as token ids
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total <= 1:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
