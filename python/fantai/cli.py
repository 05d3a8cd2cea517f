"""CLI room: the `fantai` console script (`serve`, `generate`, `chat`, `bench`, `quantize`, `eval`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

# The engine never calls numpy's BLAS, but OpenBLAS starts one spinning thread per core at import,
# which competes with the engine's own pool for this process's cores (measured: ~9% of the CPU
# time of `fantai generate`'s start-up). The CLI owns its process, so it can say so up front.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from fantai.bench.cli import add_bench_parser  # noqa: E402  argparse and stdlib only: `fantai` starts fast

_T0 = time.monotonic()  # process start, as near as Python lets us see it
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '4G', '512M', '1.5GiB', '1000000' (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4G, 512M or plain bytes)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model folder (config.json + safetensors), .gguf file or hub-style name; "
                        f"default: the embedded {DEFAULT_MODEL_NAME} GGUF")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output tokens); default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in one running batch (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: the engine's choice)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV-cache block (default: %(default)s)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="BYTES",
                   help="KV pool size in bytes; K/M/G/T suffixes (1024-based), e.g. 2G")
    p.add_argument("--memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                   help="KV pool as a fraction of free memory, in (0, 1]")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute / weight dtype (default: %(default)s, the checkpoint's)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="KV cache element type (default: %(default)s: float32 for float32 weights, else "
                        "bfloat16; int8 stores int8 values with a float32 scale per token and KV head)")
    p.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16"],
                   help="activations meeting bf16 weights or a bf16 KV cache: float32 keeps them "
                        "f32-grade; bfloat16 rounds them to bf16 where a bf16 matrix unit (AMX) runs "
                        "the product, as llama.cpp and vLLM do: faster prefill, tokens no longer "
                        "exact against an f32 reference (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="quantize the dense linear weights at load, round-to-nearest: int8 per output "
                        "channel, int4 in groups of 32 (embeddings and lm_head stay dense); GGUF, GPTQ "
                        "and AWQ weights stay as stored (default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes (default: on; "
                        "--no-enable-prefix-caching turns it off)")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed for requests without their own (default: %(default)s)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the model runs: cpu, cuda or cuda:N (needs a CUDA build and an NVIDIA GPU; "
                        "default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: all cores)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="Jinja chat template: a file path or the template text itself; "
                        "default: the model's")


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for all interfaces (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients may use; the first is reported in responses "
                        "(default: MODEL as given)")
    p.add_argument("--api-key", default=os.environ.get("FANTAI_API_KEY"),
                   help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on "
                        "every route but /health, /metrics and /version; default: the "
                        "FANTAI_API_KEY environment variable, else no key")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|PATH",
                   help="default sampling values for fields a request leaves unset: 'auto' reads "
                        "generation_config.json beside the model, 'none' ignores it, or give a "
                        "folder / JSON file (default: %(default)s)")
    p.add_argument("--tool-call-parser", default="hermes",
                   choices=["hermes", "llama3_json", "mistral", "none"],
                   help="how tool calls are read from model text: hermes (<tool_call>{json}"
                        "</tool_call>, Qwen too), llama3_json, mistral ([TOOL_CALLS]); 'none' "
                        "turns tool calling off (default: %(default)s)")
    p.add_argument("--max-request-body-size", type=parse_size, default=32 * 1024 * 1024,
                   metavar="BYTES", help="larger request bodies get 413 (default: 32M)")
    p.add_argument("--idle-release-seconds", type=float, default=10.0, metavar="SECONDS",
                   help="after this long without work, give unused KV memory back to the OS "
                        "(0: never; default: 10)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="grace period on SIGINT/SIGTERM for in-flight requests to finish before "
                        "they are aborted (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="log verbosity (default: %(default)s)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request (its id, prompt size and sampling parameters)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fantai", description="fantai: LLM inference and "
                                     "serving (paged KV cache, continuous batching).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server",
                           description="Serve MODEL over HTTP: /v1/completions, "
                           "/v1/chat/completions, /v1/messages, /v1/models, /tokenize, "
                           "/detokenize, /health, /version, /metrics.")
    _add_engine_options(serve)
    _add_serve_options(serve)
    serve.set_defaults(func=serve_command)
    gen = sub.add_parser("generate", help="one-shot completion of a prompt, printed to stdout")
    _add_engine_options(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.set_defaults(func=generate_command)
    chat = sub.add_parser("chat", help="one-shot chat reply to a user message, printed to stdout")
    _add_engine_options(chat)
    chat.add_argument("--message", required=True, help="the user message")
    chat.add_argument("--system", default=None, help="optional system prompt")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens to generate")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.set_defaults(func=chat_command)
    add_bench_parser(sub, _add_engine_options, _engine_kwargs)
    _add_quantize_parser(sub)
    _add_eval_parser(sub)
    return parser


def _add_quantize_parser(sub: Any) -> None:
    q = sub.add_parser("quantize", help="write a GPTQ or AWQ checkpoint (round-to-nearest, no calibration)",
                       description="Quantize the linear layers of MODEL (a dense Hugging Face folder or a "
                       "GGUF, dequantized) to a GPTQ or AWQ Hugging Face folder that fantai, "
                       "transformers, vLLM and AutoGPTQ/AutoAWQ read.")
    q.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"source model (default: the embedded {DEFAULT_MODEL_NAME} GGUF)")
    q.add_argument("--format", required=True, choices=["gptq", "awq"], help="checkpoint layout")
    q.add_argument("--bits", type=int, default=4, choices=[4, 8], help="bits per weight (AWQ: 4)")
    q.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale; -1: one scale per output row (default: %(default)s)")
    q.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                   help="symmetric (zero point 2^(bits-1)) or, with --no-sym, asymmetric; default: "
                        "symmetric for GPTQ, asymmetric for AWQ")
    q.add_argument("--output", required=True, metavar="DIR", help="output folder")
    q.set_defaults(func=quantize_command)


def quantize_command(args: argparse.Namespace) -> int:
    import json

    from fantai.quantize import quantize_model

    sym = args.sym if args.sym is not None else args.format == "gptq"
    summary = quantize_model(args.model, args.output, args.format, args.bits, args.group_size, sym)
    print(json.dumps(summary, indent=2))
    return 0


def _add_eval_parser(sub: Any) -> None:
    ev = sub.add_parser("eval", help="evaluate a model (perplexity)")
    kinds = ev.add_subparsers(dest="eval_kind", required=True)
    ppl = kinds.add_parser("perplexity", help="perplexity of a text over non-overlapping windows (JSON)",
                           description="Mean negative log-likelihood of every token of --text given the "
                           "ones before it in its window of --context tokens; prints JSON.")
    ppl.add_argument("model", nargs="?", default=None, metavar="MODEL",
                     help=f"model folder or .gguf file (default: the embedded {DEFAULT_MODEL_NAME} GGUF)")
    ppl.add_argument("--text", default=None, metavar="FILE",
                     help="UTF-8 text to score (default: bench/data/python_execmodel_import.txt)")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window (default: %(default)s)")
    ppl.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                     help="online quantization of dense linear weights (default: %(default)s)")
    ppl.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    ppl.add_argument("--dequantize", action="store_true",
                     help="load a GGUF's quantized tensors dense (in --dtype): the unquantized reference")
    ppl.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ppl.set_defaults(func=perplexity_command)


def perplexity_command(args: argparse.Namespace) -> int:
    import json

    from fantai.perplexity import evaluate

    result = evaluate(args.model, args.text, args.context, args.dtype, args.quantization, args.dequantize,
                      args.threads)
    print(json.dumps(result, indent=2))
    return 0


def _chat_template(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "max_model_len": args.max_model_len,
            "kv_cache_memory": args.kv_cache_memory,
            "memory_utilization": args.memory_utilization, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size, "seed": args.seed, "threads": args.threads, "device": args.device,
            "enable_prefix_caching": args.enable_prefix_caching, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype, "matmul_precision": args.matmul_precision,
            "chat_template": _chat_template(args.chat_template)}


def generate_command(args: argparse.Namespace) -> int:
    from fantai import LLM, SamplingParams

    kwargs = _engine_kwargs(args)
    kwargs.pop("chat_template")
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0].text)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    from fantai import LLM, SamplingParams

    llm = LLM(args.model, **_engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
    return 0


def _make_server(app: Any, args: argparse.Namespace, on_ready: Callable[[Any], None],
                 on_exit: Callable[[], None], abort_all: Callable[[], int]) -> Any:
    import uvicorn

    grace = args.shutdown_timeout

    class Server(uvicorn.Server):
        """uvicorn, but a handled SIGINT/SIGTERM ends in exit status 0 (no re-raise), and
        requests still running after the grace period are aborted in the engine, so their
        streams end cleanly (finish_reason 'abort') instead of being cut."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            async def abort_after_grace() -> None:
                await asyncio.sleep(grace)
                n = abort_all()
                if n:
                    logging.getLogger("fantai.server").warning(
                        "grace period over: aborted %d in-flight request(s)", n)

            timer = asyncio.create_task(abort_after_grace())
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                on_ready(self)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.disable_log_requests, lifespan="off",
                            # uvicorn's own cancel is only the backstop after our abort
                            timeout_graceful_shutdown=args.shutdown_timeout + 5.0,
                            timeout_keep_alive=30)
    return Server(config)


def _banner(server: Any, engine: Any, names: list[str]) -> None:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    kv = engine.kv_pool_info()
    print(f"fantai serve: model {engine.model_path} (served as {', '.join(names)}), "
          f"max model len {engine.max_model_len}", flush=True)
    print(f"fantai serve: KV pool {kv['num_blocks']} blocks x {kv['block_size']} tokens = "
          f"{kv['num_tokens']} tokens, {kv['bytes']} bytes ({kv['bytes'] / 2**20:.1f} MiB)",
          flush=True)
    print(f"fantai serve: listening on http://{host}:{port} (OpenAI base URL "
          f"http://{host}:{port}/v1)", flush=True)
    print(f"fantai serve: ready in {time.monotonic() - _T0:.2f} s", flush=True)


async def _serve(args: argparse.Namespace) -> None:
    from fantai.engine import AsyncEngine
    from fantai.server.app import ServerConfig, build_app

    engine = AsyncEngine(args.model, idle_release_seconds=args.idle_release_seconds,
                         **_engine_kwargs(args))
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    parser = None if args.tool_call_parser == "none" else args.tool_call_parser
    config = ServerConfig(served_model_names=names, api_key=args.api_key or None,
                          max_body_bytes=args.max_request_body_size, tool_call_parser=parser,
                          generation_config=args.generation_config,
                          disable_log_requests=args.disable_log_requests)
    try:
        app = build_app(engine, config)

        def draining() -> None:
            app.state.ctx.draining = True

        server = _make_server(app, args, lambda s: _banner(s, engine, names), draining,
                              app.state.ctx.abort_all)
        await server.serve()
    finally:
        engine.shutdown()


def serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
