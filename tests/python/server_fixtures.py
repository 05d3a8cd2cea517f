"""Server test room: a scripted tiny Llama (next token = f(token)) and a `fantai serve` process."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _compiled_core_dir() -> Path | None:
    """An installed `fantai` package folder that holds the compiled core (_C), if any."""
    for entry in sys.path:
        folder = Path(entry or ".") / "fantai"
        local = folder.resolve() == (REPO / "python" / "fantai").resolve()
        if not local and any(folder.glob("_C*.so")):
            return folder
    return None


def package_root() -> Path | None:
    """A folder whose `fantai` is this checkout's Python code with a compiled core beside it:
    python/ itself after an in-place build, else a symlink overlay onto the installed _C;
    None: leave `import fantai` to the environment."""
    local = REPO / "python" / "fantai"
    if any(local.glob("_C*.so")):
        return REPO / "python"
    installed = _compiled_core_dir()
    if installed is None:
        return None
    root = Path(tempfile.mkdtemp(prefix="fantai-overlay-"))
    atexit.register(shutil.rmtree, root, True)
    pkg = root / "fantai"
    pkg.mkdir()
    for item in local.iterdir():
        if item.name != "__pycache__":
            (pkg / item.name).symlink_to(item)
    for item in installed.iterdir():  # the core and the libraries its RPATH ($ORIGIN/lib) needs
        skip = item.name == "__pycache__" or item.name.endswith(".py")
        if not skip and not (pkg / item.name).exists():
            (pkg / item.name).symlink_to(item)
    return root


PACKAGE_ROOT = package_root()
if PACKAGE_ROOT is not None and str(PACKAGE_ROOT) not in sys.path:
    sys.path.insert(0, str(PACKAGE_ROOT))

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|assistant_tools|>", "<|tool|>", "<|end|>"]
# The reply to a chat without tools, and to one with tools (ends in EOS either way).
TEXT_CHAIN = ["Hello", " there", " my", " friend", " how", " are", " you", " today"]
TOOL_CHAIN = ["<tool_call>", '{"name": "', "get_weather", '", "arguments": ', '{"city": "',
              "Paris", '"}}', "</tool_call>"]
# Any prompt ending in one of these words continues the cycle forever (finish_reason "length").
CYCLE = [" alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta", " theta", " iota",
         " kappa", " lambda", " mu"]
WORDS = ["hello", " world", "Once", " upon", " a", " time", "What", " is", " the", " weather",
         " in", " Paris", "Tell", " me", " story", "Hi", "?", ".", ",", "!", " ", "\n", "alpha",
         "sunny", "Sunny", " and", " warm"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content or '' }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if tools -%}<|assistant_tools|>{%- else -%}"
    "<|assistant|>{%- endif -%}{%- endif -%}")
HIDDEN = 128
MARGIN = 8.0  # logit lead of the scripted next token over noise in [-1, 1]


# A scripted reply: after `start` the model writes `seq`, then `end`.
Chain = tuple[str, list[str], str]
DEFAULT_CHAINS: list[Chain] = [("<|assistant|>", TEXT_CHAIN, "</s>"),
                               ("<|assistant_tools|>", TOOL_CHAIN, "</s>")]


def vocab(extra: list[str] | None = None) -> list[str]:
    return SPECIALS + TOOL_CHAIN + TEXT_CHAIN + CYCLE + WORDS + list(extra or [])


def next_token_table(tokens: list[str], chains: list[Chain] | None = None) -> list[int]:
    """f: token id -> the scripted next token id."""
    ids = {t: i for i, t in enumerate(tokens)}
    table = [ids[" alpha"]] * len(tokens)

    def chain(start: str, seq: list[str], end: str) -> None:
        prev = start
        for tok in seq:
            table[ids[prev]] = ids[tok]
            prev = tok
        table[ids[prev]] = ids[end]

    for start, seq, end in chains or DEFAULT_CHAINS:
        chain(start, seq, end)
    for i, word in enumerate(CYCLE):
        table[ids[word]] = ids[CYCLE[(i + 1) % len(CYCLE)]]
    table[ids["alpha"]] = ids[" beta"]
    return table


def _build_tokenizer(path: Path, tokens: list[str], template: str = CHAT_TEMPLATE,
                     specials: list[str] = SPECIALS) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?\w+| ?[^\s\w]|\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CHAIN])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "chat_template": template,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def build_scripted_model(path: Path, seed: int = 0, *, chains: list[Chain] | None = None,
                         extra_tokens: list[str] | None = None, template: str = CHAT_TEMPLATE,
                         extra_specials: list[str] | None = None) -> Path:
    """A 2-layer Llama whose residual stream is the token embedding (o_proj = down_proj = 0), so
    greedy decoding follows next_token_table exactly; noise in lm_head keeps sampling random.
    chains / extra_tokens / template / extra_specials: another script than the default one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokens = vocab(list(extra_specials or []) + list(extra_tokens or []))
    assert len(tokens) <= HIDDEN and len(set(tokens)) == len(tokens)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    table = next_token_table(tokens, chains)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :len(tokens)] += torch.eye(len(tokens))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(len(tokens), HIDDEN)
        head[:, :len(tokens)] = torch.rand(len(tokens), len(tokens)) * 2 - 1
        for i, nxt in enumerate(table):
            head[nxt, i] += MARGIN
        model.lm_head.weight.copy_(head / HIDDEN ** 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    _build_tokenizer(path, tokens, template, SPECIALS + list(extra_specials or []))
    return path


def cycle_text(start_word: str, count: int) -> str:
    """What greedy decoding appends after a prompt ending in CYCLE word `start_word`."""
    i = CYCLE.index(start_word)
    return "".join(CYCLE[(i + 1 + k) % len(CYCLE)] for k in range(count))


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    ready_seconds: float

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    if PACKAGE_ROOT is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    env.pop("FANTAI_API_KEY", None)
    return env


def start_server(args: list[str], log_path: Path, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Launch `fantai serve --port 0 ARGS`; wait for its 'listening on' banner."""
    cmd = [sys.executable, "-m", "fantai.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           *args]
    start = time.monotonic()
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=env or python_env(), cwd=str(REPO))
    pattern = re.compile(r"listening on (http://[0-9.]+:[0-9]+)")
    while time.monotonic() - start < timeout:
        m = pattern.search(log_path.read_text(errors="replace"))
        if m is not None:
            server = ServerProcess(proc, m.group(1), log_path, time.monotonic() - start)
            wait_healthy(server.base_url)
            return server
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log_path.read_text(errors='replace')[-4000:]}")


@contextlib.contextmanager
def scripted_server(tmp_path_factory: object, name: str, args: list[str],
                    env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A `fantai serve` of a fresh scripted model with ARGS (module fixtures: build, start, stop
    and check the exit status 0)."""
    model = build_scripted_model(tmp_path_factory.mktemp(f"{name}_model"))  # type: ignore[attr-defined]
    log = tmp_path_factory.mktemp(f"{name}_logs") / "server.log"  # type: ignore[attr-defined]
    proc = start_server([str(model), *args], log, env=env)
    try:
        yield proc
    except BaseException:
        proc.stop(signal.SIGKILL)
        raise
    assert proc.stop() == 0, proc.log()[-3000:]


def rss_kib(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base_url}/health never answered 200")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(event, data) pairs from SSE text lines."""
    event: str | None = None
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, line[5:].strip()
            event = None
