"""CLI room: the `fantai` console script (`serve`, `generate`, `chat`, `bench`, `quantize`, `eval`).

Each command imports what it runs only once it runs: `fantai generate` never loads the server's
web stack, and `fantai --help` loads neither the core nor numpy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

# The engine never calls numpy's BLAS, but OpenBLAS starts one spinning thread per core at import,
# which competes with the engine's own pool for this process's cores (measured: ~9% of the CPU
# time of `fantai generate`'s start-up). The CLI owns its process, so it can say so up front.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from fantai.engine_args import (  # noqa: E402  stdlib only: `fantai` starts fast
    DEFAULT_MODEL_NAME,
    AsyncEngineArgs,
    EngineArgs,
    parse_size,
)

_T0 = time.monotonic()  # process start, as near as Python lets us see it


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    p.add_argument("--reasoning-parser", default=None,
                   choices=["deepseek_r1", "qwen3", "qwq"],
                   help="split a reasoning model's <think>...</think> text from its answer: chat "
                        "completions return it as reasoning_content, /v1/messages as thinking "
                        "blocks, /v1/responses as reasoning items (default: off)")
    p.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="/v1/responses kept in memory (least recently used dropped first) for "
                        "GET, DELETE and previous_response_id (default: %(default)s)")
    p.add_argument("--max-request-body-size", type=_size, default=32 * 1024 * 1024,
                   metavar="BYTES", help="larger request bodies get 413 (default: 32M)")
    p.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="requests that may wait beyond the running batch (max-num-seqs); past them "
                        "a request gets 503 with Retry-After at once instead of queueing without "
                        "bound (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="grace period on SIGINT/SIGTERM for in-flight requests to finish before "
                        "they are aborted (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="log verbosity (default: %(default)s)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request (its id, prompt size and sampling parameters)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole `fantai` parser. Given the command line about to be parsed, `bench`'s subcommands
    (whose module pulls in asyncio and the bench code) are only built when it names `bench`."""
    parser = argparse.ArgumentParser(prog="fantai", description="fantai: LLM inference and "
                                     "serving (paged KV cache, continuous batching).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server",
                           description="Serve MODEL over HTTP: /v1/completions, "
                           "/v1/chat/completions, /v1/messages, /v1/models, /tokenize, "
                           "/detokenize, /health, /version, /metrics.")
    AsyncEngineArgs.add_cli_args(serve)
    _add_serve_options(serve)
    serve.set_defaults(func=serve_command)
    gen = sub.add_parser("generate", help="one-shot completion of a prompt, printed to stdout")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.set_defaults(func=generate_command)
    chat = sub.add_parser("chat", help="one-shot chat reply to a user message, printed to stdout")
    EngineArgs.add_cli_args(chat)
    chat.add_argument("--message", required=True, help="the user message")
    chat.add_argument("--system", default=None, help="optional system prompt")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens to generate")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.set_defaults(func=chat_command)
    if argv is None or "bench" in argv:
        from fantai.bench.cli import add_bench_parser

        add_bench_parser(sub, EngineArgs.add_cli_args, _llm_kwargs)
    else:  # never chosen: argv has no "bench"; only `fantai --help` shows it
        sub.add_parser("bench", help="benchmarks: throughput, latency, serve, plot")
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
    EngineArgs.add_cli_args(ppl, only=("dtype", "quantization", "dequantize", "threads"))
    ppl.add_argument("--text", default=None, metavar="FILE",
                     help="UTF-8 text to score (default: bench/data/python_execmodel_import.txt)")
    ppl.add_argument("--context", type=int, default=512, help="tokens per window (default: %(default)s)")
    ppl.set_defaults(func=perplexity_command)


def perplexity_command(args: argparse.Namespace) -> int:
    import json

    from fantai.perplexity import evaluate

    result = evaluate(args.model, args.text, args.context, args.dtype, args.quantization, args.dequantize,
                      args.threads)
    print(json.dumps(result, indent=2))
    return 0


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keyword arguments from parsed engine flags (what `bench` passes on with the model)."""
    engine_args = EngineArgs.from_cli_args(args)
    return {k: v for k, v in vars(engine_args).items() if k != "model"}


def generate_command(args: argparse.Namespace) -> int:
    from fantai.llm import LLM
    from fantai.sampling_params import SamplingParams

    llm = LLM(engine_args=EngineArgs.from_cli_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0].text)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    from fantai.llm import LLM
    from fantai.sampling_params import SamplingParams

    llm = LLM(engine_args=EngineArgs.from_cli_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
    return 0


def serve_command(args: argparse.Namespace) -> int:
    from fantai.server.launch import ListenOptions, run
    from fantai.server.state import ServerConfig

    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = ServerConfig(served_model_names=args.served_model_name or [args.model or DEFAULT_MODEL_NAME],
                          api_key=args.api_key or None, max_body_bytes=args.max_request_body_size,
                          tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                          generation_config=args.generation_config,
                          reasoning_parser=args.reasoning_parser,
                          responses_store_size=args.responses_store_size,
                          disable_log_requests=args.disable_log_requests,
                          max_waiting_requests=args.max_waiting_requests)
    listen = ListenOptions(host=args.host, port=args.port, log_level=args.log_level,
                           access_log=not args.disable_log_requests, shutdown_timeout=args.shutdown_timeout)
    return run(engine_args, config, listen, started_at=_T0)  # non-zero after an engine fault


def main(argv: list[str] | None = None) -> int:
    """argv None: the process's own command line, so this call owns the process (see below)."""
    owns_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    status = int(args.func(args))
    if owns_process and args.command in ("generate", "chat"):
        # The answer is out; tearing down the model, the KV pool, the thread pool and the
        # tokenizer's ~100k objects one by one would only delay the exit (~40 ms measured).
        import logging

        from fantai.tp_launch import finalize

        finalize()  # tensor parallelism: stop the other ranks and finalize MPI (a no-op without)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
