#!/usr/bin/env python3
"""Every weight format of the default model side by side: size, memory, perplexity, speed.

Formats: bf16 (the Q4_1 file dequantized: the unquantized reference), q4_1 (the file as shipped),
q8_0 (bench/make_q8_0_gguf.py), int8 / int4 (online round-to-nearest of the dequantized weights),
gptq / awq (4-bit, group 64 — SmolLM2's 576 inputs are not whole groups of 128 — written by
`fantai quantize` from the GGUF).

Per format, each in fresh processes: weight bytes and RSS after load, load time, perplexity of
bench/data/python_execmodel_import.txt (`fantai eval perplexity`: non-overlapping --context
windows), and single-stream decode tok/s + offline output tok/s from bench/bench_offline.py
(--skip-hf, a shorter workload by default). With --llama-cpp-python PATH (a Python with
llama_cpp, e.g. /tmp/lcpp-venv/bin/python), llama.cpp's perplexity of the GGUF formats over the
same token windows (logits_all), and the relative difference to fantai's.

Usage: python bench/bench_quant.py [--formats q4_1,q8_0,...] [--json out.json] [--llama-cpp-python PY]
Not a test: it gates nothing. Timing is noisy on a shared machine: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "python_execmodel_import.txt")
FORMATS = ("bf16", "q4_1", "q8_0", "int8", "int4", "gptq", "awq")


def log(msg: str) -> None:
    print(f"[bench_quant] {msg}", file=sys.stderr, flush=True)


def run_json(cmd: list[str], timeout: float = 3600) -> Any:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def prepare(fmt: str, work: str, default: str) -> dict[str, Any]:
    """How to load `fmt`: model path and LLM keyword flags (creating files on first use)."""
    if fmt == "bf16":
        return {"model": default, "dtype": "bfloat16", "dequantize": True}
    if fmt == "q4_1":
        return {"model": default, "dtype": "auto"}
    if fmt == "q8_0":
        path = os.path.join(work, "SmolLM2-135M-Instruct.Q8_0.gguf")
        if not os.path.isfile(path):
            subprocess.run([sys.executable, os.path.join(HERE, "make_q8_0_gguf.py"), path], check=True,
                           stdout=subprocess.DEVNULL)
        return {"model": path, "dtype": "auto"}
    if fmt in ("int8", "int4"):
        return {"model": default, "dtype": "bfloat16", "dequantize": True, "quantization": fmt}
    if fmt in ("gptq", "awq"):
        path = os.path.join(work, f"SmolLM2-135M-Instruct-{fmt}-4bit-g64")
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            subprocess.run([sys.executable, "-m", "fantai.cli", "quantize", default, "--format", fmt, "--bits", "4",
                            "--group-size", "64", "--output", path], check=True, stdout=subprocess.DEVNULL)
        return {"model": path, "dtype": "auto"}
    raise ValueError(f"unknown format {fmt!r} (one of {FORMATS})")


def fantai_perplexity(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "fantai.cli", "eval", "perplexity", spec["model"], "--text", args.text,
           "--context", str(args.context), "--dtype", spec["dtype"], "--threads", str(args.threads)]
    if spec.get("dequantize"):
        cmd.append("--dequantize")
    if spec.get("quantization"):
        cmd += ["--quantization", spec["quantization"]]
    return run_json(cmd)


def offline(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        cmd = [sys.executable, os.path.join(HERE, "bench_offline.py"), "--skip-hf", "--model", spec["model"],
               "--dtype", spec["dtype"],
               "--threads", str(args.threads), "--num-prompts", str(args.num_prompts),
               "--output-len", str(args.output_len), "--repeats", "1", "--json", out]
        if spec.get("dequantize"):
            cmd.append("--dequantize")
        if spec.get("quantization"):
            cmd += ["--quantization", spec["quantization"]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=7200)
        with open(out) as fh:
            return json.load(fh)["results"][0]
    finally:
        os.unlink(out)


_LLAMA_CPP_SCRIPT = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
model, ids_file, context, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = json.load(open(ids_file))
llm = Llama(model_path=model, n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
            n_threads=threads, verbose=False)
total, count, wins = 0.0, 0, 0
for start in range(0, len(ids), context):
    w = ids[start:start + context]
    if len(w) < 2:
        continue
    llm.reset()
    llm.eval(w)
    x = np.asarray(llm.scores[:len(w) - 1], dtype=np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    total += float((lse - x[np.arange(len(w) - 1), np.asarray(w[1:])]).sum())
    count += len(w) - 1
    wins += 1
print(json.dumps({"nll": total / count, "perplexity": math.exp(total / count), "predicted_tokens": count,
                  "windows": wins}))
"""


def llama_cpp_perplexity(model: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.llama_cpp_python or not os.path.exists(args.llama_cpp_python):
        return None
    probe = subprocess.run([args.llama_cpp_python, "-c", "import llama_cpp"], capture_output=True, check=False)
    if probe.returncode != 0:
        log(f"{args.llama_cpp_python} has no llama_cpp: skipping llama.cpp")
        return None
    from fantai.tokenizer import Tokenizer

    with open(args.text, encoding="utf-8") as f:
        ids = Tokenizer.from_model_path(model).encode(f.read(), add_special_tokens=False)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
        ids_file = f.name
    try:
        return run_json([args.llama_cpp_python, "-c", _LLAMA_CPP_SCRIPT, model, ids_file, str(args.context),
                         str(args.threads)])
    finally:
        os.unlink(ids_file)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'format':<6} {'weights MiB':>11} {'RSS MiB':>8} {'load s':>7} {'ppl':>9} {'llama.cpp':>9} "
            f"{'diff %':>7} {'decode tok/s':>12} {'offline tok/s':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['format']:<6} error: {r['error'][:90]}")
            continue
        lc = r.get("llama_cpp") or {}
        diff = f"{r['llama_cpp_rel_diff'] * 100:+.2f}" if "llama_cpp_rel_diff" in r else "-"
        lines.append(
            f"{r['format']:<6} {r['weight_bytes'] / 2**20:>11.1f} {r['rss_after_load'] / 2**20:>8.0f} "
            f"{r['load_s']:>7.2f} {r['perplexity']:>9.4f} "
            f"{lc.get('perplexity', float('nan')):>9.4f} {diff:>7} {r['decode_tok_s']:>12.1f} "
            f"{r['offline_output_tok_s']:>13.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16, help="offline workload size (bench_offline.py)")
    p.add_argument("--output-len", type=int, default=32, help="offline / decode new tokens per request")
    p.add_argument("--skip-offline", action="store_true", help="perplexity and sizes only")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "fantai-bench-quant"),
                   help="where the Q8_0 GGUF and the GPTQ / AWQ folders are written (kept for reuse)")
    p.add_argument("--llama-cpp-python", default="/tmp/lcpp-venv/bin/python", metavar="PATH",
                   help="a Python with llama-cpp-python; skipped cleanly when absent")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from fantai.model_files import default_model_path

    default = default_model_path()
    os.makedirs(args.workdir, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        row: dict[str, Any] = {"format": fmt, "loadavg_start": os.getloadavg()}
        try:
            spec = prepare(fmt, args.workdir, default)
            row.update(model=spec["model"], dtype=spec["dtype"])
            log(f"{fmt}: perplexity")
            ppl = fantai_perplexity(spec, args)
            row.update(perplexity=ppl["perplexity"], nll=ppl["nll"], predicted_tokens=ppl["predicted_tokens"],
                       weight_bytes=ppl["weight_bytes"], ppl_seconds=ppl["seconds"], load_s=ppl["load_seconds"])
            if spec["model"].endswith(".gguf") and not spec.get("dequantize") and not spec.get("quantization"):
                lc = llama_cpp_perplexity(spec["model"], args)
                if lc is not None:
                    row["llama_cpp"] = lc
                    row["llama_cpp_rel_diff"] = ppl["perplexity"] / lc["perplexity"] - 1
            if not args.skip_offline:
                log(f"{fmt}: bench_offline")
                off = offline(spec, args)
                row.update(decode_tok_s=off["decode_tok_s"], offline_output_tok_s=off["offline_output_tok_s"],
                           rss_after_load=off["rss_after_load"], load_s=off["load_s"], ttft_s=off["ttft_s"])
            else:
                row.update(decode_tok_s=float("nan"), offline_output_tok_s=float("nan"), rss_after_load=0)
        except Exception as e:  # noqa: BLE001 - one broken format must not hide the others' figures
            row["error"] = f"{type(e).__name__}: {e}"
        row["loadavg_end"] = os.getloadavg()
        rows.append(row)
        log(table(rows[-1:]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": args.threads,
                           "context": args.context, "text": args.text, "rows": rows}, f, indent=2)
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
