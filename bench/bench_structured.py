"""bench: structured outputs — grammar engines' mask time and compile time, and the serving cost.

    python bench/bench_structured.py engines        # llguidance (and xgrammar when importable)
    python bench/bench_structured.py serve          # 64 json_schema vs 64 plain requests
    python bench/bench_structured.py all

Needs fantai installed (the compiled core) and llguidance; xgrammar is measured when importable.
Figures are ratios and microseconds on whatever machine runs it; nothing here gates on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np


# A nested schema of the shape agent frameworks send (pydantic: nested models, lists, enums,
# optional fields) and a large enum (a "pick one of N" constraint).
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"},
            "email": {"type": "string"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}},
            "required": ["name", "email", "address"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer"},
            "color": {"type": "string", "enum": ["red", "green", "blue", "black"]}},
            "required": ["sku", "quantity", "color"], "additionalProperties": False}},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped"]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["customer", "items", "status", "note"],
    "additionalProperties": False,
}
NESTED_VALUE = {
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com",
                 "address": {"street": "12 Analytical Row", "city": "London", "zip": "10115"}},
    "items": [{"sku": "A-100", "quantity": 2, "color": "red"},
              {"sku": "B-7", "quantity": 1, "color": "blue"}],
    "status": "paid", "note": None,
}
ENUM_WORDS = [f"{w}-{i}" for i in range(500) for w in ("alpha", "river", "stone", "maple")]
ENUM_SCHEMA = {"type": "object", "properties": {"pick": {"type": "string", "enum": ENUM_WORDS}},
               "required": ["pick"], "additionalProperties": False}
ENUM_VALUE = {"pick": ENUM_WORDS[1234]}


def _load_tokenizer() -> Any:
    from fantai.model_files import default_model_path
    from fantai.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_model_path())


def _walk(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def bench_llguidance(tok: Any, vocab: int) -> dict[str, Any]:
    from fantai.structured import GrammarCompiler, GrammarSpec

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab)
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"tokenizer_setup_ms": setup * 1e3}
    words = (vocab + 31) // 32
    mask = np.zeros(words, dtype=np.uint32)
    for name, schema, value in (("nested", NESTED_SCHEMA, NESTED_VALUE),
                                ("enum2000", ENUM_SCHEMA, ENUM_VALUE)):
        spec = GrammarSpec("json", json.dumps(schema))
        t0 = time.perf_counter()
        matcher = compiler.matcher(spec)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.matcher(spec)
        cached = time.perf_counter() - t0
        times = []
        for t in _walk(tok, json.dumps(value)):
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append(time.perf_counter() - t0)
            assert (int(mask[t // 32]) >> (t % 32)) & 1, f"llguidance: token {t} masked"
            assert matcher.consume_token(t)
        out[name] = {"compile_first_ms": first * 1e3, "compile_cached_ms": cached * 1e3,
                     "mask_us_mean": statistics.mean(times) * 1e6,
                     "mask_us_p50": statistics.median(times) * 1e6,
                     "mask_us_max": max(times) * 1e6, "tokens": len(times)}
    return out


def bench_xgrammar(tok: Any, vocab: int) -> dict[str, Any] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=tok.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    out: dict[str, Any] = {"tokenizer_setup_ms": (time.perf_counter() - t0) * 1e3}
    mask = xgr.allocate_token_bitmask(1, vocab)
    for name, schema, value in (("nested", NESTED_SCHEMA, NESTED_VALUE),
                                ("enum2000", ENUM_SCHEMA, ENUM_VALUE)):
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_json_schema(text, any_whitespace=False)
        cached = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        times = []
        for t in _walk(tok, json.dumps(value)):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(t), f"xgrammar: token {t} refused"
        out[name] = {"compile_first_ms": first * 1e3, "compile_cached_ms": cached * 1e3,
                     "mask_us_mean": statistics.mean(times) * 1e6,
                     "mask_us_p50": statistics.median(times) * 1e6,
                     "mask_us_max": max(times) * 1e6, "tokens": len(times)}
    return out


def run_engines() -> dict[str, Any]:
    tok = _load_tokenizer()
    vocab = 49152
    results = {"llguidance": bench_llguidance(tok, vocab)}
    xg = bench_xgrammar(tok, vocab)
    if xg is not None:
        results["xgrammar"] = xg
    for engine, res in results.items():
        print(f"{engine}: tokenizer setup {res['tokenizer_setup_ms']:.0f} ms")
        for name in ("nested", "enum2000"):
            r = res[name]
            print(f"  {name:9s} compile first {r['compile_first_ms']:8.2f} ms, cached "
                  f"{r['compile_cached_ms']:6.3f} ms; mask per token mean {r['mask_us_mean']:7.1f}"
                  f" us, p50 {r['mask_us_p50']:7.1f} us, max {r['mask_us_max']:8.1f} us "
                  f"({r['tokens']} tokens)")
    return results


# ---------------------------------------------------------------- serving: 64 vs 64

async def _serve_pass(engine: Any, structured: bool, n: int, max_tokens: int) -> tuple[int, float]:
    from fantai.sampling_params import SamplingParams, StructuredOutputsParams

    async def one(i: int) -> int:
        so = StructuredOutputsParams(json=NESTED_SCHEMA) if structured else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not structured,
                                structured_outputs=so)
        prompt = (f"<|im_start|>user\nWrite order number {i} as JSON.<|im_end|>\n"
                  "<|im_start|>assistant\n")
        last = None
        async for out in engine.generate(prompt, params, f"{'s' if structured else 'p'}{i}"):
            last = out
        assert last is not None
        text = last.outputs[0].text
        if structured and last.outputs[0].finish_reason == "stop":
            json.loads(text)
        return len(last.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(counts), time.perf_counter() - t0


def run_serve(n: int = 64, max_tokens: int = 64) -> dict[str, float]:
    from fantai.engine import AsyncEngine

    engine = AsyncEngine(kv_cache_memory="1G")

    async def main() -> dict[str, float]:
        await _serve_pass(engine, True, 4, 8)  # warm up (tokenizer tables, first compile)
        plain_tok, plain_s = await _serve_pass(engine, False, n, max_tokens)
        before = engine.stats()
        so_tok, so_s = await _serve_pass(engine, True, n, max_tokens)
        after = engine.stats()
        wait = after["time_mask_wait_s"] - before["time_mask_wait_s"]
        step = after["time_step_s"] - before["time_step_s"]
        return {"plain_tok_s": plain_tok / plain_s, "structured_tok_s": so_tok / so_s,
                "plain_tokens": plain_tok, "structured_tokens": so_tok,
                "mask_wait_share": wait / step if step else 0.0}

    try:
        res = asyncio.run(main())
    finally:
        engine.shutdown()
    ratio = res["structured_tok_s"] / res["plain_tok_s"]
    res["ratio"] = ratio
    print(f"serve: {n} concurrent requests, max_tokens {max_tokens}: plain "
          f"{res['plain_tok_s']:.1f} tok/s ({res['plain_tokens']:.0f} tokens), json_schema "
          f"{res['structured_tok_s']:.1f} tok/s ({res['structured_tokens']:.0f} tokens): "
          f"{ratio * 100:.1f}% (goal >= 85%); sampling waited on masks "
          f"{res['mask_wait_share'] * 100:.1f}% of step time")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["engines", "serve", "all"], nargs="?", default="all")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.what in ("engines", "all"):
        run_engines()
    if args.what in ("serve", "all"):
        run_serve(args.n, args.max_tokens)


if __name__ == "__main__":
    main()
