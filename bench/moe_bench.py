"""Mixture-of-experts figures: decode and prefill tok/s of a random-weight Mixtral-shaped model
(~100M parameters, 8 experts, top 2) beside a dense Llama with the same active parameters (its MLP
as wide as the two chosen experts together), on the same threads, for bf16 and online int8
weights; then the expert kernel alone (bench_kernels --only moe: a Qwen3-30B-A3B-sized layer)
against the machine's read bandwidth. A benchmark, never a test: prints figures and ratios,
asserts nothing about time.

    python bench/moe_bench.py [--threads 2] [--bench-kernels build/wheel/bench/bench_kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Shared by both models: 8 layers of hidden 512, 8 query / 2 KV heads, a 32k vocabulary (tied).
COMMON = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 1024


def build(path: Path, moe: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    torch.manual_seed(0)
    if moe:
        cfg = MixtralConfig(**COMMON, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, sliding_window=None)
    else:
        cfg = LlamaConfig(**COMMON, intermediate_size=TOP_K * EXPERT_INTER)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    sys.path.insert(0, str(HERE.parent / "tests" / "python"))
    from tiny_models import save_word_tokenizer

    save_word_tokenizer(path, COMMON["vocab_size"])
    return path


def params(path: Path) -> tuple[float, float]:
    """(total, active per token) parameters in millions, from the checkpoint's shapes."""
    from safetensors import safe_open

    total = active = 0
    with safe_open(str(path / "model.safetensors"), "np") as f:
        for name in f.keys():
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= d
            total += n
            active += n * TOP_K // EXPERTS if ".experts." in name else n
    return total / 1e6, active / 1e6


def measure(path: Path, threads: int, dtype: str, quantization: str) -> dict[str, float]:
    from fantai import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, quantization=quantization, threads=threads, kv_cache_memory="256M",
              enable_prefix_caching=False, max_num_batched_tokens=512)
    vocab = COMMON["vocab_size"]
    prompt = [7 + (i * 131) % (vocab - 7) for i in range(512)]

    def run(p: list[int], n: int, batch: int = 1) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([p] * batch, sp, use_tqdm=False)
        return time.perf_counter() - start

    run(prompt[:32], 4)  # warm-up: workspaces, pages
    prefill = min(run(prompt, 1) for _ in range(3))
    short, decode_n = prompt[:16], 64
    base = min(run(short, 1) for _ in range(3))
    decode = min(run(short, decode_n + 1) for _ in range(2)) - base
    base8 = run(short, 1, 8)
    decode8 = run(short, decode_n + 1, 8) - base8
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": decode_n / decode,
            "decode8_tok_s": 8 * decode_n / decode8, "weight_mib": llm._model.weight_bytes() / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bench-kernels", default=str(HERE.parent / "build" / "wheel" / "bench" / "bench_kernels"),
                   help="bench_kernels binary for the expert kernel figures ('' to skip)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: build(Path(tmp) / name, name == "moe") for name in ("moe", "dense")}
        for name, path in models.items():
            total, active = params(path)
            print(f"{name:5s}: {total:6.1f}M parameters, {active:6.1f}M active per token")
        for dtype, quant in (("bfloat16", "none"), ("float32", "int8")):
            label = "bf16" if quant == "none" else "int8"
            for name, path in models.items():
                r = measure(path, args.threads, dtype, quant)
                results[f"{name}/{label}"] = r
                print(f"{name:5s} {label}: {r['weight_mib']:6.0f} MiB  prefill {r['prefill_tok_s']:7.1f} tok/s  "
                      f"decode {r['decode_tok_s']:6.1f} tok/s  decode x8 {r['decode8_tok_s']:6.1f} tok/s", flush=True)
            m, d = results[f"moe/{label}"], results[f"dense/{label}"]
            print(f"  moe / dense ({label}, same active parameters): prefill {m['prefill_tok_s'] / d['prefill_tok_s']:.2f}x"
                  f"  decode {m['decode_tok_s'] / d['decode_tok_s']:.2f}x  decode x8 "
                  f"{m['decode8_tok_s'] / d['decode8_tok_s']:.2f}x", flush=True)
    if args.bench_kernels and os.path.exists(args.bench_kernels):
        print("\nexpert kernel (bench_kernels --only moe):", flush=True)
        out = subprocess.run([args.bench_kernels, "--only", "moe", "--threads", str(args.threads), "--min-ms", "200"],
                             capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("moe_experts")]
        print("\n".join(lines) if lines else out.stdout + out.stderr)
        results["kernel"] = {"lines": lines}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
