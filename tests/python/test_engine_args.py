"""EngineArgs: one set of engine options for LLM, AsyncEngine and the CLI (flags, help, rules, the
size parser), and the CLI's lazy imports."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fantai import LLM, AsyncEngineArgs, EngineArgs, SamplingParams
from fantai.cli import build_parser
from fantai.engine import AsyncEngine
from fantai.engine_args import MAX_MEMORY_UTILIZATION, parse_size
from server_fixtures import REPO, python_env
from tiny_models import build_tiny_model

VOCAB = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine_args"), vocab_size=VOCAB, layers=2, heads=4,
                            kv_heads=2, hidden=64, max_pos=2048)


def fantai_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fantai.cli", *args], check=False, env=python_env(),
                          cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("text, expected", [
    ("4G", 4 << 30), ("4GiB", 4 << 30), ("4gb", 4 << 30), ("512M", 512 << 20), ("512 MiB", 512 << 20),
    ("1.5GiB", int(1.5 * (1 << 30))), (".5K", 512), ("64k", 64 << 10), ("2T", 2 << 40), ("1000", 1000),
    (" 7 ", 7), ("0", 0), (1 << 20, 1 << 20), (2.0e6, 2_000_000),
])
def test_size_parser_reads(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "4X", "4 G B", "-1", "1e9", "4GiBs", "1,000", -5, True, None])
def test_size_parser_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)  # type: ignore[arg-type]


# Every field set away from its default, as flags and as the values they must become.
CLI_VALUES = {
    "dtype": ("bf16", "bfloat16"), "max_model_len": ("512", 512), "kv_cache_memory": ("3MiB", 3 << 20),
    "memory_utilization": ("0.5", 0.5), "max_num_seqs": ("7", 7), "max_num_batched_tokens": ("96", 96),
    "block_size": ("8", 8), "seed": ("11", 11), "threads": ("1", 1), "cpu_bind": ("0-1", "0-1"), "num_kv_blocks": ("40", 40),
    "kv_cache_dtype": ("int8", "int8"), "device": ("cpu", "cpu"), "quantization": ("int8", "int8"),
    "matmul_precision": ("bfloat16", "bfloat16"), "chat_template": ("{{ x }}", "{{ x }}"),
    "tensor_parallel_size": ("2", 2), "swap_space": ("512M", "512M"), "preemption_mode": ("swap", "swap"),
}
BOOL_FLAGS = {"enable_chunked_prefill": False, "enable_prefix_caching": False, "dequantize": True}


def test_every_field_is_covered_here() -> None:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert names == set(CLI_VALUES) | set(BOOL_FLAGS) | {"model"}


def test_cli_round_trips_to_engine_config(model_dir: Path) -> None:
    argv = ["generate", str(model_dir), "--prompt", "w1"]
    for name, (text, _) in CLI_VALUES.items():
        argv += [flag(name), text]
    for name, value in BOOL_FLAGS.items():
        argv.append(flag(name) if value else "--no-" + flag(name)[2:])
    args = EngineArgs.from_cli_args(build_parser(argv).parse_args(argv))
    expected = EngineArgs(model=str(model_dir), **{k: v for k, (_, v) in CLI_VALUES.items()}, **BOOL_FLAGS)
    assert args == expected
    assert args.kv_cache_memory == 3 << 20  # bytes by now, whichever way it was spelled
    config = args.core_config([2, 5], model_dtype="bfloat16")
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        8, 7, 96, 512)
    assert (config.seed, config.num_blocks, config.kv_cache_bytes, config.kv_cache_dtype) == (
        11, 40, 3 << 20, "int8")
    assert not config.enable_chunked_prefill and not config.enable_prefix_caching
    assert list(config.eos_token_ids) == [2, 5]
    assert (config.swap_space_bytes, config.preemption_mode) == (512 << 20, "swap")
    # Defaults on both paths are the same object's defaults.
    plain = ["generate", "--prompt", "w1"]
    assert EngineArgs.from_cli_args(build_parser(plain).parse_args(plain)) == EngineArgs()


@pytest.mark.parametrize("value, expected", [
    (4, 4 << 30), (0.5, 1 << 29), ("1.5", int(1.5 * (1 << 30))), ("512M", 512 << 20), ("64KiB", 64 << 10),
    (0, 0), ("0", 0),
])
def test_swap_space_is_gib_like_vllm_unless_a_suffix_says_otherwise(value: object, expected: int) -> None:
    assert EngineArgs(swap_space=value).core_config([2]).swap_space_bytes == expected


@pytest.mark.parametrize("value", [-1, "-2", "lots", True])
def test_swap_space_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="swap_space"):
        EngineArgs(swap_space=value)


# The fields only the server's engine has, as `fantai serve` flags and their values.
SERVE_VALUES = {"idle_release_seconds": ("2.5", 2.5), "request_timeout": ("30", 30.0)}


def test_serve_cli_round_trips_async_fields() -> None:
    extra = {f.name for f in dataclasses.fields(AsyncEngineArgs)} - {f.name for f in dataclasses.fields(EngineArgs)}
    assert extra == set(SERVE_VALUES)
    argv = ["serve"]
    for name, (text, _) in SERVE_VALUES.items():
        argv += [flag(name), text]
    args = AsyncEngineArgs.from_cli_args(build_parser(argv).parse_args(argv))
    assert args == AsyncEngineArgs(**{k: v for k, (_, v) in SERVE_VALUES.items()})
    plain = ["serve"]
    assert AsyncEngineArgs.from_cli_args(build_parser(plain).parse_args(plain)) == AsyncEngineArgs()
    assert AsyncEngineArgs().request_timeout == 0.0  # no limit unless asked
    with pytest.raises(ValueError, match="request_timeout must be a number >= 0"):
        AsyncEngineArgs(request_timeout=-1)
    res = fantai_cli("serve", "--request-timeout", "-1")
    assert res.returncode == 2 and "argument --request-timeout: must be a number >= 0" in res.stderr


def test_chat_template_flag_reads_a_file(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    argv = ["chat", "--message", "hi", "--chat-template", str(template)]
    assert EngineArgs.from_cli_args(build_parser(argv).parse_args(argv)).chat_template == template.read_text()


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench throughput", "bench latency"])
def test_help_lists_every_field(command: str) -> None:
    res = fantai_cli(*command.split(), "--help")
    assert res.returncode == 0, res.stderr
    cls = AsyncEngineArgs if command == "serve" else EngineArgs
    missing = [flag(f.name) for f in dataclasses.fields(cls)
               if f.name != "model" and flag(f.name) not in res.stdout]
    assert not missing, f"`fantai {command} --help` lacks {missing}"
    for name in BOOL_FLAGS:
        assert "--no-" + flag(name)[2:] in res.stdout
    assert "MODEL" in res.stdout


def test_top_level_help_still_lists_bench() -> None:
    res = fantai_cli("--help")
    assert res.returncode == 0 and "bench" in res.stdout and "benchmarks" in res.stdout


@pytest.mark.parametrize("value", ["0.99", "1", "0", "-0.1"])
def test_memory_utilization_rule_is_the_same_on_cli_and_in_python(value: str) -> None:
    rule = f"must be in (0, {MAX_MEMORY_UTILIZATION}], got {float(value)}"
    res = fantai_cli("generate", "--prompt", "w1", "--memory-utilization", value)
    assert res.returncode == 2
    assert f"argument --memory-utilization: {rule}" in res.stderr
    # Python checks before loading anything: a model that does not exist is never looked for.
    for build in (lambda: LLM("/nonexistent/model", memory_utilization=float(value)),
                  lambda: AsyncEngine("/nonexistent/model", memory_utilization=float(value)),
                  lambda: EngineArgs(memory_utilization=float(value))):
        with pytest.raises(ValueError) as err:
            build()
        assert str(err.value) == f"memory_utilization {rule}"


def test_memory_utilization_upper_bound_is_accepted() -> None:
    argv = ["generate", "--prompt", "w1", "--memory-utilization", str(MAX_MEMORY_UTILIZATION)]
    assert build_parser(argv).parse_args(argv).memory_utilization == MAX_MEMORY_UTILIZATION
    assert EngineArgs(memory_utilization=MAX_MEMORY_UTILIZATION).kv_bytes(1000) == 950


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_memory": "4X"}, "kv_cache_memory not a size: '4X' (examples: 4G, 512M, 1.5GiB, 1073741824)"),
    ({"kv_cache_memory": 0}, "kv_cache_memory must be positive, got 0"),
    ({"block_size": 0}, "block_size must be at least 1, got 0"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer, got 2.5"),
    ({"dtype": "fp8"}, "dtype must be one of auto, float32, float16, bfloat16; got 'fp8'"),
    ({"device": "tpu"}, "device must be cpu, cuda or cuda:N; got 'tpu'"),
    ({"quantization": "int3"}, "quantization must be one of none, int8, int4; got 'int3'"),
])
def test_python_rules_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        LLM("/nonexistent/model", **kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-memory", "4X"], "argument --kv-cache-memory: not a size: '4X'"),
    (["--kv-cache-memory", "0"], "argument --kv-cache-memory: must be positive, got '0'"),
    (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
    (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N; got 'tpu'"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_cli_rules_name_the_flag(argv: list[str], message: str) -> None:
    res = fantai_cli("generate", "--prompt", "w1", *argv)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_llm_takes_engine_args_or_keywords_alike(model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_kwargs = LLM(str(model_dir), dtype="float32", threads=1, kv_cache_memory="2M", block_size=8)
    by_args = LLM(engine_args=EngineArgs(model=str(model_dir), dtype="float32", threads=1,
                                         kv_cache_memory="2M", block_size=8))
    assert by_kwargs.options == by_args.options
    assert by_kwargs.engine.num_blocks == by_args.engine.num_blocks
    assert by_kwargs.engine.block_size == 8
    a = by_kwargs.generate(["w3 w4 w5"], params, use_tqdm=False)[0].outputs[0].token_ids
    b = by_args.generate(["w3 w4 w5"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 6
    # Keywords (and the positional model) override what engine_args says.
    over = LLM(str(model_dir), engine_args=EngineArgs(model="/nonexistent", dtype="float32", threads=1,
                                                      num_kv_blocks=64), num_kv_blocks=32)
    assert over.model_path == str(model_dir) and over.engine.num_blocks == 32
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'thread'"):
        LLM(str(model_dir), thread=1)
    with pytest.raises(TypeError, match="engine_args must be an EngineArgs"):
        LLM(engine_args={"threads": 1})  # type: ignore[arg-type]


def test_generate_imports_no_web_stack(model_dir: Path) -> None:
    """`fantai generate` runs in-process here so its sys.modules can be read afterwards."""
    heavy = ["fastapi", "uvicorn", "starlette", "pydantic", "httpx", "transformers", "torch", "asyncio",
             "jinja2", "fantai.server", "fantai.engine", "fantai.bench"]
    code = (
        "import json, sys\n"
        "from fantai.cli import main\n"
        f"status = main(['generate', {str(model_dir)!r}, '--prompt', 'w1 w2', '--max-tokens', '2',"
        " '--kv-cache-memory', '2M', '--threads', '1'])\n"
        f"print(json.dumps([status, [m for m in {heavy!r} if m in sys.modules]]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], check=False, env=python_env(), cwd=str(REPO),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    status, loaded = json.loads(lines[-1])
    assert status == 0 and len(lines) >= 2  # the completion, then the report
    assert loaded == []
    # The same check can fail: serve's launcher really does pull the web stack in.
    probe = subprocess.run([sys.executable, "-c", "import sys, fantai.server.launch; "
                            "print('fastapi' in sys.modules, 'uvicorn' in sys.modules)"],
                           check=False, env=python_env(), capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["True", "True"], probe.stderr


def test_generate_prints_everything_before_its_fast_exit(model_dir: Path) -> None:
    res = fantai_cli("generate", str(model_dir), "--prompt", "w1 w2", "--max-tokens", "4", "--threads", "1",
                     "--kv-cache-memory", "2M", "--temperature", "0")
    assert res.returncode == 0, res.stderr[-2000:]
    want = LLM(str(model_dir), threads=1, kv_cache_memory="2M").generate(
        ["w1 w2"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert res.stdout == want + "\n"
