"""Offline throughput of a random-weight ~1B Llama (Llama-3.2-1B's shapes) on the GPU: fantai's
CUDA backend against transformers' generate on the same GPU. No downloads: the model is built
from its config with random bf16 weights. Prints "name: value" lines for bench/gpu_check.sh.

    python bench/bench_cuda_e2e.py --requests 512 --prompt-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 128256  # Llama-3.2-1B's


def build_model(path: Path, layers: int, device: str, tiny: bool) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
    from tiny_models import save_word_tokenizer

    shape = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)
    if tiny:  # a smoke run of this script's plumbing on a machine without a GPU
        shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1)
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=layers, head_dim=64, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rms_norm_eps=1e-5, initializer_range=0.02, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)
    # fantai needs a tokenizer that can detokenize every id the model may emit.
    save_word_tokenizer(path, VOCAB)
    del model
    torch.cuda.empty_cache()
    return path


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(10, VOCAB, (n, length), generator=g).tolist()


def run_fantai(path: Path, ids: list[list[int]], out_len: int, device: str) -> float:
    from fantai import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device=device, memory_utilization=0.5, max_num_seqs=256,
              max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(ids[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    del llm
    return len(ids) * out_len / seconds


def run_hf(path: Path, ids: list[list[int]], out_len: int, batch: int, device: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        model.generate(torch.tensor(ids[:8], device=device), **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        sync()
        start = time.perf_counter()
        for i in range(0, len(ids), batch):  # equal prompt lengths: no padding
            model.generate(torch.tensor(ids[i:i + batch], device=device), **kwargs)
        sync()
        seconds = time.perf_counter() - start
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return len(ids) * out_len / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu with --tiny checks this script without a GPU")
    ap.add_argument("--tiny", action="store_true", help="a 128-wide model instead of the 1B shapes")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_cuda_e2e: skipped, torch sees no CUDA device")
        return 0
    ids = prompts(args.requests, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = build_model(Path(tmp) / "llama-1b-random", args.layers, args.device, args.tiny)
        print(f"model_build_seconds: {time.perf_counter() - t0:.1f}", flush=True)
        ours = run_fantai(path, ids, args.output_len, args.device)
        print(f"fantai_{args.device.split(':')[0]}_output_tokens_per_s: {ours:.0f}", flush=True)
        if not args.skip_hf:
            theirs = run_hf(path, ids, args.output_len, args.hf_batch, args.device)
            print(f"hf_generate_output_tokens_per_s: {theirs:.0f}", flush=True)
            print(f"fantai_over_hf: {ours / theirs:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
