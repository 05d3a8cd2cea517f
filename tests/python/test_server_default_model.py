"""Server room test on the real default model (SmolLM2-135M-Instruct GGUF): HTTP greedy == LLM."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_fixtures import ServerProcess, start_server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("default_model") / "server.log"
    srv = start_server(["--max-model-len", "512", "--kv-cache-memory", "64M", "--threads", "2",
                        "--disable-log-requests"], log)
    print(f"default model ready in {srv.ready_seconds:.2f} s (launch to ready)")
    yield srv
    assert srv.stop() == 0


def test_default_model_greedy_chat_and_completion_match_llm(default_server: ServerProcess) -> None:
    from fantai import LLM, SamplingParams

    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="none",
                           max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=24)
    comp = client.completions.create(model=name, prompt="The capital of France is",
                                     temperature=0, max_tokens=24)
    llm = LLM(None, max_model_len=512, threads=2)
    params = SamplingParams(temperature=0, max_tokens=24)
    want = llm.chat(msgs, params, use_tqdm=False)[0]
    want_chat = want.outputs[0]
    want_comp = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want_chat.text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    assert chat.usage.completion_tokens == len(want_chat.token_ids)
    assert comp.choices[0].text == want_comp.text
    assert "Paris" in chat.choices[0].message.content + comp.choices[0].text
