#!/usr/bin/env python3
"""fantai vs llama.cpp, side by side on the same GGUF files, in one run (issue 5's comparison).

Not a test: it prints figures and ratios, it asserts nothing about time.

Workload: bench_offline.py's (the same generator and seed): --num-prompts requests (64) of seeded
random token ids, prompt lengths spread evenly over 64..512 (18,432 prompt tokens), exactly
--output-len (128) new tokens each, greedy, EOS ignored, prompts given as token ids (no tokenizer
on either side), prefix caching off, --threads (2) threads.

Systems, each in its own subprocess run one after the other (peak RSS and load time are that
system's alone):
  fantai            LLM(model, dtype=bfloat16, enable_prefix_caching=False), everything through the
                    public LLM.generate loop (bench_offline.fantai_run: the same loop, with a
                    timestamp per step).
  llama.cpp -np N   llama-cpp-python's low-level C API (llama_decode on a llama_batch holding many
                    sequences), run by --llama-cpp-python (a venv's python with llama-cpp-python
                    0.3.x). The offline loop is llama-server's continuous batching: N slots
                    (--parallel, default 16 and 64), a slot takes the next request when it frees;
                    every step puts each generating slot's one token first, then fills the batch
                    with prompt tokens up to n_batch (2048, server default; n_ubatch 512) — a long
                    prompt spans steps (chunked prefill); logits only for rows that sample; greedy
                    = argmax of those logits. Unified KV of N x (max prompt + output) cells.
Per system and model file:
  offline out/total tok/s   output (prompt+output) tokens over the wall time of the whole workload.
  decode tok/s      single stream, prefill excluded: a --single-prompt-len (128) prompt, output_len+1
                    tokens, a timestamp per generated token; output_len / (t_last - t_first).
  tg128             llama-bench's tg: 128 tokens decoded one by one from an empty context (fantai:
                    a 1-token prompt asked for 129 tokens, timed as decode tok/s above).
  pp512             512 prompt tokens prefilled at once, first token sampled; 512 / time.
  TTFT              time to the first token of a 1-output-token request on the 128-token prompt.
  load              fantai: the LLM constructor; llama.cpp: model load + context creation.
  start-up          a fresh process (a worker of this script) from its spawn to its first token:
                    interpreter start, imports, load, a 1-token request on the 128-token prompt
                    (fantai: LLM(...).generate; llama.cpp: load, context, prefill, argmax); median
                    of --repeats fresh processes.
  peak RSS          ru_maxrss of the subprocess at its end.
Single-stream figures are medians of --repeats.

--rounds N (default 1) runs the whole sequence N times, fantai first in odd rounds and llama.cpp
first in even ones, tables every round's rows and ratios, and adds a table of paired ratios: for
each rate, the median over rounds of that round's fantai / llama.cpp, with its range. On a shared
VM whose speed drifts by a third between minutes, that is the figure to quote.

Roofline (with --probe, default: build/wheel/bench/bench_kernels when it exists): the machine's
peaks are measured by bench_kernels --only probe right before the systems run, on --threads
threads: read bandwidth (512 MB array, mostly DRAM), f32 FMA, vdpbf16ps, AMX tdpbf16ps,
on AVX2 vpmaddubsw (the 4-bit kernels' int8 peak) and vpsignb + vpmaddubsw (the 8-bit ones'),
vpdpbusd and AMX tdpbusd (int8 tiles, which fantai's quantized prefill uses where it has them),
and the AMX int8 ceiling of a 32-deep block-scaled format (each block's tile product stored and
folded into f32 with its scales, Q4_1's form: what no exact Q4_1 kernel can pass);
and, where torch is installed, what its GEMM library (oneDNN, AMX where present) reaches on
4096^3 bf16 matmul and int8 _int_mm: a measured peak for real GEMMs, which the instruction peaks
(operands kept in registers) are not. Per row: decode GB/s = the model file's tensor bytes (all read once per decoded token;
the tied embedding is the lm_head) x decode tok/s, as a fraction of the read bandwidth (the median
run's, then the best run's: the probe is a best-of figure); pp512
matmul GFLOP/s = (2 x the matmul weights' elements other than the embedding, plus attention's
Q.K^T and P.V under the causal mask, 4 x head_dim x heads x layers x (512 + 1) / 2, +8% on
SmolLM2-135M: what MFU accounting counts) x pp512 tok/s, as a fraction of each compute peak.
The JSON's costs keep the two parts apart.

fantai rows: one per --fantai-matmul-precision value (default float32,bfloat16): float32 keeps
activations f32-grade (exact tokens against an f32 reference), bfloat16 rounds them to bf16 where
they meet bf16 weights or the bf16 KV cache on AMX, as llama.cpp's own bf16 path does.

Model files: the GGUF given by --model (default: the bundled SmolLM2-135M-Instruct Q4_1), and with
--bf16 (default on) a bf16 copy of it written by bench/make_gguf.py (cached under --cache-dir), so
that both systems also run at equal full precision. fantai keeps quantized GGUF weights quantized
(its int8-activation VNNI kernels, like llama.cpp's); the table says which weight formats each row
computed with (fantai: the core's weight_formats()).

    .venv/bin/python bench/compare_llamacpp.py --llama-cpp-python /tmp/lcpp-venv/bin/python --json out.json
    .venv/bin/python bench/compare_llamacpp.py --llama-cpp-python V/bin/python --num-prompts 8 --output-len 16

Over 400 lines: one script runs and tabulates both systems, so a run is one command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_HINT = ("llama.cpp rows skipped: pass --llama-cpp-python PATH, the python of a venv with "
                "llama-cpp-python, e.g.\n    python -m venv V && V/bin/pip install llama-cpp-python   "
                "# builds llama.cpp from source, several minutes on 2 cores\nthen --llama-cpp-python V/bin/python")


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------------------------
# fantai worker (runs in fantai's venv)


def worker_fantai(args: argparse.Namespace, wl: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    from bench_offline import fantai_build, fantai_run

    import fantai
    from fantai import LLM, SamplingParams

    build = fantai_build()
    t = time.perf_counter()
    llm = LLM(args.model_path, dtype=args.fantai_dtype, threads=args.threads, seed=0,
              enable_prefix_caching=False, matmul_precision=args.matmul_precision)
    load_s = time.perf_counter() - t
    log(f"fantai: loaded {os.path.basename(args.model_path)} in {load_s:.2f} s")

    def sp(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def timed(prompt: list[int], n: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], sp(n), use_tqdm=False)
        return time.perf_counter() - t

    def decode_rate(prompt: list[int], n: int) -> float:
        stamps: list[float] = []
        fantai_run(llm, [prompt], sp(n + 1), stamps)
        return n / (stamps[-1] - stamps[0])

    out_len = args.output_len
    timed(wl["warmup"], 4)
    ttft = [timed(wl["single"], 1) for _ in range(args.repeats)]
    pp = [len(wl["pp"]) / timed(wl["pp"], 1) for _ in range(args.repeats)]
    decode = [decode_rate(wl["single"], out_len) for _ in range(args.repeats)]
    tg = [decode_rate(wl["single"][:1], args.tg_len) for _ in range(args.repeats)]
    log(f"fantai: TTFT {median(ttft) * 1e3:.0f} ms, pp {median(pp):.0f} tok/s, decode {median(decode):.1f} "
        f"tok/s, tg {median(tg):.1f} tok/s")

    prompts = wl["prompts"]
    r = fantai_run(llm, prompts, sp(out_len))
    n_out = sum(len(x.outputs[0].token_ids) for x in r["results"])
    assert n_out == out_len * len(prompts), n_out
    wall = r["wall_s"]
    n_prompt = sum(len(p) for p in prompts)
    log(f"fantai: offline {n_out / wall:.1f} output tok/s ({r['num_steps']} steps)")
    mm = " (bf16 matmuls)" if llm.matmul_precision == "bfloat16" else ""
    return {"system": "fantai", "label": f"fantai {getattr(fantai, '__version__', '')}{mm}", "build": build,
            "matmul_precision": llm.matmul_precision,
            "compute": "/".join(sorted(set(llm._model.weight_formats().values()))), "load_s": load_s,
            "ttft_s": median(ttft), "pp_tok_s": median(pp), "decode_tok_s": median(decode),
            "tg_tok_s": median(tg), "offline_wall_s": wall, "output_tokens": n_out, "prompt_tokens": n_prompt,
            "offline_output_tok_s": n_out / wall, "offline_total_tok_s": (n_prompt + n_out) / wall,
            "num_steps": r["num_steps"], "peak_rss": peak_rss_bytes(),
            "all": {"ttft_s": ttft, "pp_tok_s": pp, "decode_tok_s": decode, "tg_tok_s": tg}}


# ----------------------------------------------------------------------------------------------
# llama.cpp worker (runs in the llama-cpp-python venv: imports only llama_cpp, numpy and stdlib)


class LlamaCpp:
    """A model + one context with `n_seq` sequences over a unified KV of `n_ctx` cells."""

    def __init__(self, path: str, n_ctx: int, n_seq: int, threads: int, n_batch: int, n_ubatch: int) -> None:
        import ctypes

        import llama_cpp as L
        import numpy as np

        self.L, self.np, self.ctypes = L, np, ctypes
        L.llama_backend_init()
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # keep a reference
        L.llama_log_set(self._quiet, ctypes.c_void_p())
        t = time.perf_counter()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.load_s = time.perf_counter() - t
        self.flash_attn_type = int(cp.flash_attn_type)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)
        self.mem = L.llama_get_memory(self.ctx)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def drop(self, seq: int) -> None:
        self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, row: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prefill(self, tokens: list[int], seq: int = 0, start: int = 0) -> int:
        """Whole prompt in n_batch chunks; returns the greedy next token."""
        for c in range(0, len(tokens), self.n_batch):
            chunk = tokens[c:c + self.n_batch]
            last = c + len(chunk) == len(tokens)
            self.decode([(t, start + c + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return self.argmax(len(tokens) - 1 - (len(tokens) - 1) // self.n_batch * self.n_batch)

    def stream(self, prompt: list[int], n: int, stamps: list[float]) -> list[int]:
        """Single sequence: n greedy tokens, a timestamp at each."""
        self.clear()
        tok = self.prefill(prompt)
        stamps.append(time.perf_counter())
        out = [tok]
        for i in range(n - 1):
            self.decode([(tok, len(prompt) + i, 0, True)])
            tok = self.argmax(0)
            stamps.append(time.perf_counter())
            out.append(tok)
        return out

    def serve(self, prompts: list[list[int]], out_len: int, n_slots: int) -> int:
        """llama-server's continuous batching over n_slots slots; returns the steps taken."""
        self.clear()
        pending = list(range(len(prompts)))[::-1]  # pop() takes the next request in order
        slots: list[dict[str, Any] | None] = [None] * n_slots
        steps = 0
        while pending or any(s is not None for s in slots):
            for k in range(n_slots):
                if slots[k] is None and pending:
                    r = pending.pop()
                    slots[k] = {"prompt": prompts[r], "done": 0, "out": []}
            rows: list[tuple[int, int, int, bool]] = []
            samplers: list[tuple[int, int]] = []  # (slot, batch row)
            for k, s in enumerate(slots):  # generating slots first: one token each
                if s is not None and s["done"] == len(s["prompt"]):
                    samplers.append((k, len(rows)))
                    rows.append((s["out"][-1], len(s["prompt"]) + len(s["out"]) - 1, k, True))
            for k, s in enumerate(slots):  # then prompt tokens up to n_batch
                if s is None or s["done"] == len(s["prompt"]) or len(rows) >= self.n_batch:
                    continue
                take = min(len(s["prompt"]) - s["done"], self.n_batch - len(rows))
                for j in range(s["done"], s["done"] + take):
                    rows.append((s["prompt"][j], j, k, j == len(s["prompt"]) - 1))
                s["done"] += take
                if s["done"] == len(s["prompt"]):
                    samplers.append((k, len(rows) - 1))
            self.decode(rows)
            steps += 1
            for k, row in samplers:
                s = slots[k]
                assert s is not None
                s["out"].append(self.argmax(row))
                if len(s["out"]) == out_len:
                    self.drop(k)
                    slots[k] = None
        return steps


def worker_llamacpp(args: argparse.Namespace, wl: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    prompts = wl["prompts"]
    out_len = args.output_len
    longest = max(max(len(p) for p in prompts), len(wl["pp"]), len(wl["single"]) + out_len + 1,
                  args.tg_len + 1)
    n_ctx = args.parallel * (max(len(p) for p in prompts) + out_len)
    n_ctx = max(n_ctx, longest + out_len)
    lc = LlamaCpp(args.model_path, n_ctx, args.parallel, args.threads, n_batch=2048, n_ubatch=512)
    log(f"llama.cpp -np {args.parallel}: loaded in {lc.load_s:.2f} s (n_ctx {n_ctx})")

    lc.stream(wl["warmup"], 4, [])
    ttft, pp, decode, tg = [], [], [], []
    for _ in range(args.repeats):
        lc.clear()
        t = time.perf_counter()
        lc.prefill(wl["single"])
        ttft.append(time.perf_counter() - t)
        lc.clear()
        t = time.perf_counter()
        lc.prefill(wl["pp"])
        pp.append(len(wl["pp"]) / (time.perf_counter() - t))
        stamps: list[float] = []
        lc.stream(wl["single"], out_len + 1, stamps)
        decode.append(out_len / (stamps[-1] - stamps[0]))
        stamps = []
        lc.stream(wl["single"][:1], args.tg_len + 1, stamps)
        tg.append(args.tg_len / (stamps[-1] - stamps[0]))
    log(f"llama.cpp -np {args.parallel}: TTFT {median(ttft) * 1e3:.0f} ms, pp {median(pp):.0f} tok/s, "
        f"decode {median(decode):.1f} tok/s, tg {median(tg):.1f} tok/s")

    t = time.perf_counter()
    steps = lc.serve(prompts, out_len, args.parallel)
    wall = time.perf_counter() - t
    n_out = out_len * len(prompts)
    n_prompt = sum(len(p) for p in prompts)
    log(f"llama.cpp -np {args.parallel}: offline {n_out / wall:.1f} output tok/s ({steps} steps)")
    return {"system": "llama.cpp", "label": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) -np {args.parallel}",
            "compute": args.model_kind, "parallel": args.parallel, "n_ctx": n_ctx,
            "flash_attn_type": lc.flash_attn_type, "load_s": lc.load_s,
            "ttft_s": median(ttft), "pp_tok_s": median(pp), "decode_tok_s": median(decode), "tg_tok_s": median(tg),
            "offline_wall_s": wall, "output_tokens": n_out, "prompt_tokens": n_prompt,
            "offline_output_tok_s": n_out / wall, "offline_total_tok_s": (n_prompt + n_out) / wall,
            "num_steps": steps, "peak_rss": peak_rss_bytes(),
            "all": {"ttft_s": ttft, "pp_tok_s": pp, "decode_tok_s": decode, "tg_tok_s": tg}}


def worker_startup(args: argparse.Namespace, wl: dict[str, Any]) -> dict[str, Any]:
    """Import, load and one token, as a user's fresh process does; the parent timed the spawn."""
    prompt = wl["single"]
    if args._worker == "fantai-start":
        from fantai import LLM, SamplingParams

        llm = LLM(args.model_path, dtype=args.fantai_dtype, threads=args.threads, seed=0,
                  enable_prefix_caching=False)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        token = out[0].outputs[0].token_ids[0]
    else:
        lc = LlamaCpp(args.model_path, len(prompt) + 16, 1, args.threads, n_batch=512, n_ubatch=512)
        token = lc.prefill(prompt)
    return {"first_token_unix": time.time(), "token": token}


# ----------------------------------------------------------------------------------------------
# Parent


def model_kind(path: str) -> str:
    from collections import Counter

    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1)
    return "/".join(name for name, _ in types.most_common())


def llamacpp_isa_above(python: str, isa: str) -> list[str] | None:
    """The ISA extensions in llama.cpp's system info that FANTAI_CPU_ISA=isa does not use; None when
    `python` cannot import llama_cpp."""
    r = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()
        log(f"{python} cannot import llama_cpp: {last[-1] if last else f'exit {r.returncode}'}")
        return None
    info = r.stdout
    on = {k.strip() for k, _, v in (f.partition("=") for f in info.split("|")) if v.strip() == "1"}
    above = {"avx512": (), "avxvnni": ("AVX512", "AMX_"), "avx2": ("AVX512", "AVX_VNNI", "AMX_"),
             "scalar": ("AVX", "FMA", "F16C", "AMX_")}
    return sorted(f for f in on if f.startswith(above.get(isa, ())))


def run_worker(args: argparse.Namespace, python: str, extra: list[str], wl_path: str) -> dict[str, Any]:
    from bench_offline import run_json_worker

    cmd = [python, os.path.abspath(__file__), "--_workload", wl_path,
           "--threads", str(args.threads), "--output-len", str(args.output_len), "--repeats", str(args.repeats),
           "--tg-len", str(args.tg_len), *extra]
    res = run_json_worker(cmd, args.threads)
    if "error" in res:
        res["cmd"] = " ".join(extra)
    return res


PROBES = {"read_gbs": "probe read bandwidth 512 MB", "fma_gflops": "probe peak f32 FMA (zmm)",
          "fma_ymm_gflops": "probe peak f32 FMA (ymm)",
          "maddubs_gops": "probe peak vpmaddubsw+vpmaddwd u8*s8 (ymm)",
          "sign_gops": "probe peak vpsignb+vpmaddubsw s8*s8 (ymm)",
          "vnni_ymm_gops": "probe peak vpdpbusd u8*s8 (ymm)",
          "bf16dot_gflops": "probe peak vdpbf16ps (zmm)", "amx_bf16_gflops": "probe peak AMX tdpbf16ps",
          "vnni_gops": "probe peak vpdpbusd u8*s8 (zmm)", "amx_int8_gops": "probe peak AMX tdpbusd u8*s8",
          "amx_q4_1_gops": "probe AMX int8, 32-blocks + fold (Q4_1 form)"}


GEMM_PROBE = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
n = 4096

def best(f, reps=3):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)

if len(sys.argv) > 2 and sys.argv[2] == "f32":
    # No bf16 GEMM below AVX512-BF16 (oneDNN falls back to a reference loop): the f32 GEMM is the
    # vendor figure there, and int8 would take the same slow road.
    a, b = torch.randn(n, n), torch.randn(n, n)
    print(json.dumps({"onednn_f32_gflops": 2 * n ** 3 / best(lambda: a @ b) * 1e-9}))
    sys.exit(0)
a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
out = {"onednn_bf16_gflops": 2 * n ** 3 / best(lambda: a @ b) * 1e-9}
try:
    ai = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    bi = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    out["onednn_int8_gops"] = 2 * n ** 3 / best(lambda: torch._int_mm(ai, bi)) * 1e-9
except (RuntimeError, AttributeError):
    pass
print(json.dumps(out))
"""


def cpu_has_bf16_gemm() -> bool:
    """Whether oneDNN has a bf16 GEMM here (AVX512-BF16 or AMX): without one its bf16 matmul is a
    reference loop (a 4096^3 one ran over 17 minutes on an AVX2-only EPYC), so the probe takes f32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def run_gemm_probe(python: str, threads: int, isa: str | None = None) -> dict[str, float]:
    """What the vendor's GEMM library reaches here: torch's bf16 matmul and int8 _int_mm (oneDNN,
    AMX where the CPU has it) on 4096^3, best of 3. A measured peak for real GEMMs, beside the
    instruction peaks (operands in registers) that no library reaches; empty without torch."""
    # oneDNN dispatches on its own: cap it at the ISA fantai is held to, so the peak is like for like.
    caps = {"avx2": "AVX2", "avxvnni": "AVX2_VNNI", "avx512": "AVX512_CORE_AMX"}
    env = dict(os.environ, **({"ONEDNN_MAX_CPU_ISA": caps[isa]} if isa in caps else {}))
    f32 = isa in ("avx2", "avxvnni", "scalar") or not cpu_has_bf16_gemm()
    res = subprocess.run([python, "-c", GEMM_PROBE, str(threads), *(["f32"] if f32 else [])],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        log(f"no vendor GEMM probe: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
        return {}
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_probe(binary: str, threads: int, isa: str | None = None) -> dict[str, float]:
    """The machine's peaks from bench_kernels --only probe (first figure on each matching line), at
    isa's vector width when given (ymm peaks for avx2)."""
    out = subprocess.run([binary, "--only", "probe", "--threads", str(threads), *(["--isa", isa] if isa else [])],
                         capture_output=True, text=True, check=True).stdout
    peaks: dict[str, float] = {}
    for line in out.splitlines():
        for key, prefix in PROBES.items():
            if line.startswith(prefix) and key not in peaks:
                try:
                    peaks[key] = float(line[len(prefix):].split()[0])
                except (IndexError, ValueError):
                    pass  # "not usable" lines (no AMX / VNNI here)
    return peaks


def model_costs(path: str, pp_len: int) -> dict[str, float]:
    """Bytes read per decoded token, and matmul FLOPs per token of a pp_len-token prefill: the
    weight matrices' 2 per element, plus attention's Q.K^T and P.V (2 * 2 * head_dim per head
    and layer for each key a query sees, i + 1 for query i under the causal mask), as MFU
    accounting counts them."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    nbytes, flops = 0, 0
    for t in reader.tensors:
        nbytes += int(t.n_bytes)
        if len(t.shape) > 1 and t.name != "token_embd.weight":
            flops += 2 * int(t.n_elements)

    def field(key: str) -> int:
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers, heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count")
    head_dim = field(f"{arch}.embedding_length") // heads
    attn = 4 * head_dim * heads * layers * (pp_len + 1) / 2  # mean keys seen: (pp_len + 1) / 2
    return {"bytes_per_token": nbytes, "prefill_flops_per_token": flops + attn,
            "prefill_weight_flops_per_token": flops, "prefill_attention_flops_per_token": attn}


def roofline(groups: list[tuple[str, list[dict[str, Any]]]], costs: dict[str, dict[str, float]],
             peaks: dict[str, float]) -> str:
    names = [("f32 FMA", "fma_gflops"), ("f32 FMA ymm", "fma_ymm_gflops"), ("vpmaddubsw", "maddubs_gops"),
             ("vpsignb+vpmaddubsw", "sign_gops"),
             ("vpdpbusd ymm", "vnni_ymm_gops"), ("vdpbf16ps", "bf16dot_gflops"), ("AMX bf16", "amx_bf16_gflops"),
             ("oneDNN bf16 GEMM", "onednn_bf16_gflops"), ("oneDNN f32 GEMM", "onednn_f32_gflops"), ("vpdpbusd", "vnni_gops"), ("AMX int8", "amx_int8_gops"),
             ("oneDNN int8 GEMM", "onednn_int8_gops"), ("AMX Q4_1 blocks", "amx_q4_1_gops")]
    names = [(n, k) for n, k in names if k in peaks]
    bw = peaks.get("read_gbs")
    lines = ["| model file | system | decode GB/s | % of read BW " + (f"({bw:.1f} GB/s)" if bw else "") + " | pp512 matmul GFLOP/s | "
             + " | ".join(f"% of {n} ({peaks[k]:.0f})" for n, k in names) + " |",
             "|" + "---|" * (5 + len(names))]
    for fname, rows in groups:
        c = costs[fname]
        for r in rows:
            if "error" in r:
                continue
            gbs = c["bytes_per_token"] * r["decode_tok_s"] * 1e-9
            # The probe is its best of 4 passes; the decode rate the median of --repeats runs. The
            # best run's share is beside it: like against like on a host whose speed drifts.
            runs = r.get("all", {}).get("decode_tok_s") or [r["decode_tok_s"]]
            best = c["bytes_per_token"] * max(runs) * 1e-9
            gf = c["prefill_flops_per_token"] * r["pp_tok_s"] * 1e-9
            r["roofline"] = {"decode_gbs": gbs, "decode_bw_frac": gbs / bw if bw else None,
                             "decode_best_gbs": best, "decode_best_bw_frac": best / bw if bw else None,
                             "pp_gflops": gf, **{f"pp_frac_{k}": gf / peaks[k] for _, k in names}}
            share = f"{100 * gbs / bw:.0f}% (best run {100 * best / bw:.0f}%)" if bw else "–"
            lines.append(f"| {fname} | {r['label']}{round_tag(r)} | {gbs:.1f} | {share}"
                         + f" | {gf:.0f} | " + " | ".join(f"{100 * gf / peaks[k]:.0f}%" for _, k in names) + " |")
    return "\n".join(lines)


def run_startup(args: argparse.Namespace, python: str, worker: str, common: list[str], wl_path: str) -> dict[str, Any]:
    from bench_offline import run_json_worker

    times, tokens = [], set()
    cmd = [python, os.path.abspath(__file__), "--_workload", wl_path, "--threads", str(args.threads),
           "--fantai-dtype", args.fantai_dtype, "--_worker", worker, *common]
    for _ in range(args.repeats):
        res = run_json_worker(cmd, args.threads)
        if "error" in res:
            return {"startup_error": f"{worker}: {res['error']}"}
        times.append(res["first_token_unix"] - res["spawn_unix"])
        tokens.add(res["token"])
    log(f"{worker}: start-up to first token {median(times):.2f} s (all {', '.join(f'{t:.2f}' for t in times)})")
    return {"startup_s": median(times), "startup_all_s": times, "startup_tokens": sorted(tokens)}


def fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "–"
    return format(x, spec)


COLUMNS = [("offline output tok/s", "offline_output_tok_s", ".1f", 1), ("offline total tok/s", "offline_total_tok_s",
           ".0f", 1), ("single-stream decode tok/s", "decode_tok_s", ".1f", 1), ("tg128 tok/s", "tg_tok_s", ".1f", 1),
           ("pp512 tok/s", "pp_tok_s", ".0f", 1), ("TTFT ms", "ttft_s", ".0f", 1e3), ("load s", "load_s", ".2f", 1),
           ("start-up to 1st token s", "startup_s", ".2f", 1), ("peak RSS GB", "peak_rss", ".2f", 1e-9)]


def table(groups: list[tuple[str, list[dict[str, Any]]]]) -> str:
    lines = ["| model file | system | weights computed | " + " | ".join(c[0] for c in COLUMNS) + " | loadavg |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for fname, rows in groups:
        for r in rows:
            if "error" in r:
                lines.append(f"| {fname} | {r['cmd']} | failed: {r['error']} |" + " |" * len(COLUMNS))
                continue
            cells = [fmt(r.get(key) * scale if r.get(key) is not None else None, spec) for _, key, spec, scale in COLUMNS]
            lines.append(f"| {fname} | {r['label']}{round_tag(r)} | {r['compute']} | " + " | ".join(cells)
                         + f" | {fmt(r['loadavg_start'], '.1f')}→{fmt(r['loadavg_end'], '.1f')} |")
        for f in (r for r in rows if r.get("system") == "fantai" and "error" not in r):
            mm = " (bf16 matmuls)" if f.get("matmul_precision") == "bfloat16" else ""
            for r in rows:
                if r.get("system") != "llama.cpp" or "error" in r or r.get("round") != f.get("round"):
                    continue
                cells = [f"{f[key] / r[key]:.2f}x" if r.get(key) and f.get(key) else "–" for _, key, _, _ in COLUMNS]
                lines.append(f"| {fname} | **fantai{mm} / llama.cpp -np {r['parallel']}**{round_tag(f)} | | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines)


def round_tag(r: dict[str, Any]) -> str:
    return f" (round {r['round']})" if r.get("rounds", 1) > 1 else ""


# The rates a paired ratio is taken of (higher is better); start-up is measured in round 1 only.
PAIRED = [c for c in COLUMNS if c[1] in ("offline_output_tok_s", "offline_total_tok_s", "decode_tok_s", "tg_tok_s",
                                         "pp_tok_s")]


def paired_table(groups: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """One line per (fantai precision, llama.cpp -np) pair and model file: for each rate, the median
    over rounds of that round's ratio, with its range. On a host whose speed drifts between minutes
    (a shared VM), each round's two systems ran minutes apart and the ratio of those is steadier
    than either system's own figure."""
    lines = ["| model file | pair | rounds | " + " | ".join(c[0] for c in PAIRED) + " |",
             "|" + "---|" * (len(PAIRED) + 3)]
    for fname, rows in groups:
        ok = [r for r in rows if "error" not in r]
        mms = sorted({r.get("matmul_precision") for r in ok if r.get("system") == "fantai"})
        nps = sorted({r.get("parallel") for r in ok if r.get("system") == "llama.cpp"})
        for mm in mms:
            for n in nps:
                per_round: dict[int, list[float]] = {}
                for f in (r for r in ok if r.get("system") == "fantai" and r.get("matmul_precision") == mm):
                    for r in (x for x in ok if x.get("system") == "llama.cpp" and x.get("parallel") == n
                              and x.get("round") == f.get("round")):
                        for j, (_, key, _, _) in enumerate(PAIRED):
                            if f.get(key) and r.get(key):
                                per_round.setdefault(j, []).append(f[key] / r[key])
                if not per_round:
                    continue
                cells = []
                for j in range(len(PAIRED)):
                    xs = sorted(per_round.get(j, []))
                    cells.append(f"{median(xs):.2f}x ({xs[0]:.2f}–{xs[-1]:.2f})" if xs else "–")
                label = f"fantai{' (bf16 matmuls)' if mm == 'bfloat16' else ''} / llama.cpp -np {n}"
                lines.append(f"| {fname} | {label} | {len(per_round.get(0, []))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="also run a bf16 copy of --model (written by bench/make_gguf.py)")
    p.add_argument("--only-bf16", action="store_true", help="run only the bf16 copy")
    p.add_argument("--q8_0", action=argparse.BooleanOptionalAction, default=False,
                   help="also run a Q8_0 copy of --model (written by bench/make_q8_0_gguf.py)")
    p.add_argument("--fantai-isa", default=None, choices=["avx512", "avxvnni", "avx2", "scalar"],
                   help="run fantai (and the probe) at this ISA level (FANTAI_CPU_ISA), e.g. avx2 against a "
                        "llama.cpp built for AVX2 only (GGML_NATIVE=OFF GGML_AVX=ON GGML_AVX2=ON GGML_FMA=ON "
                        "GGML_F16C=ON), or avxvnni against one built with GGML_AVX_VNNI=ON too: like with like "
                        "on an AVX-512 machine")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fantai-bench"))
    p.add_argument("--llama-cpp-python", default=None, help="python of a venv with llama-cpp-python")
    p.add_argument("--parallel", default="16,64", help="llama.cpp slot counts (comma-separated)")
    p.add_argument("--fantai-dtype", default="bfloat16")
    p.add_argument("--fantai-matmul-precision", default="float32,bfloat16",
                   help="a fantai row per value (comma-separated): float32, and bfloat16 (activations "
                        "rounded to bf16 on AMX, as llama.cpp's bf16 path does)")
    p.add_argument("--_matmul_precision", default="float32", dest="matmul_precision", help=argparse.SUPPRESS)
    p.add_argument("--skip-fantai", action="store_true")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--single-prompt-len", type=int, default=128)
    p.add_argument("--pp-len", type=int, default=512)
    p.add_argument("--tg-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run both systems this many times, alternating who goes first, and add a table of each "
                        "round's ratio (median and range): for hosts whose speed drifts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--probe", default=os.path.join(HERE, "..", "build", "wheel", "bench", "bench_kernels"),
                   help="bench_kernels binary for the roofline peaks ('' to skip)")
    for hidden in ("--_worker", "--_workload", "--_out", "--model-path", "--model-kind"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_parallel", type=int, default=16, dest="parallel_one", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        with open(args._workload) as f:
            wl = json.load(f)
        args.parallel = args.parallel_one
        if args._worker.endswith("-start"):
            res = worker_startup(args, wl)
        else:
            res = worker_fantai(args, wl) if args._worker == "fantai" else worker_llamacpp(args, wl)
        with open(args._out, "w") as f:
            json.dump(res, f)
        return 0

    sys.path.insert(0, HERE)
    import random

    from bench_offline import make_workload

    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    wl = make_workload(args)
    rng = random.Random(args.seed + 1)
    allowed = sorted({t for p in wl["prompts"] for t in p})
    wl["pp"] = [rng.choice(allowed) for _ in range(args.pp_len)]
    n_prompt = sum(len(p) for p in wl["prompts"])

    files = [] if args.only_bf16 else [args.model]
    if args.bf16 or args.only_bf16:
        from make_gguf import convert

        os.makedirs(args.cache_dir, exist_ok=True)
        bf16 = os.path.join(args.cache_dir, os.path.splitext(os.path.basename(args.model))[0] + ".bf16.gguf")
        if not os.path.exists(bf16) or os.path.getmtime(bf16) < os.path.getmtime(args.model):
            log(f"writing {bf16}")
            convert(args.model, bf16 + ".part", "bf16")
            os.replace(bf16 + ".part", bf16)
        files.append(bf16)
    if args.q8_0 and not args.only_bf16:
        from make_q8_0_gguf import convert as convert_q8_0

        os.makedirs(args.cache_dir, exist_ok=True)
        q8 = os.path.join(args.cache_dir, os.path.splitext(os.path.basename(args.model))[0] + ".q8_0.gguf")
        if not os.path.exists(q8) or os.path.getmtime(q8) < os.path.getmtime(args.model):
            log(f"writing {q8}")
            convert_q8_0(args.model, q8 + ".part")
            os.replace(q8 + ".part", q8)
        files.append(q8)
    if args.fantai_isa:
        # Inherited by every worker; llama.cpp's ignore it (its ISA is fixed when it is built).
        os.environ["FANTAI_CPU_ISA"] = args.fantai_isa
        log(f"fantai at FANTAI_CPU_ISA={args.fantai_isa}")
    lcpp = args.llama_cpp_python
    if lcpp and not os.access(lcpp, os.X_OK):
        log(f"--llama-cpp-python {lcpp} is not an executable")
        lcpp = None
    if lcpp is not None and args.fantai_isa:
        above = llamacpp_isa_above(lcpp, args.fantai_isa)
        if above is None:
            lcpp = None
        elif above:
            log(f"--fantai-isa {args.fantai_isa}, but {lcpp}'s llama.cpp was built with {', '.join(above)}: not "
                "like with like. Rebuild it for that level; pip reuses a wheel it built before whatever "
                "CMAKE_ARGS say, so install with --no-cache-dir (bench/README.md has the command)")
            return 2
    if lcpp is None:
        log(INSTALL_HINT)
    log(f"workload: {args.num_prompts} prompts, {n_prompt} prompt tokens, {args.output_len} output tokens each, "
        f"threads {args.threads}")

    peaks: dict[str, float] = {}
    if args.probe and os.access(args.probe, os.X_OK):
        peaks = run_probe(args.probe, args.threads, args.fantai_isa)
        peaks.update(run_gemm_probe(sys.executable, args.threads, args.fantai_isa))
        log("peaks: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()))
    else:
        log(f"no roofline: {args.probe!r} is not an executable (build with FANTAI_BUILD_TESTS=ON)")
    costs = {os.path.basename(path): model_costs(path, args.pp_len) for path in files}

    groups: list[tuple[str, list[dict[str, Any]]]] = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(wl, f)
        wl_path = f.name
    try:
        for path in files:
            kind = model_kind(path)
            common = ["--model-path", path, "--model-kind", kind]
            rows: list[dict[str, Any]] = []
            groups.append((f"{os.path.basename(path)}", rows))
            for rnd in range(1, args.rounds + 1):
                tag = f" (round {rnd} of {args.rounds})" if args.rounds > 1 else ""

                def fantai_rows() -> None:
                    if args.skip_fantai:
                        return
                    for i, mm in enumerate(x.strip() for x in args.fantai_matmul_precision.split(",") if x.strip()):
                        log(f"fantai on {os.path.basename(path)}, {mm} matmuls{tag}")
                        rows.append(run_worker(args, sys.executable, ["--_worker", "fantai", "--fantai-dtype",
                                                                      args.fantai_dtype, "--_matmul_precision", mm,
                                                                      *common], wl_path))
                        rows[-1].update(round=rnd, rounds=args.rounds)
                        if i == 0 and rnd == 1:  # start-up depends on neither
                            rows[-1].update(run_startup(args, sys.executable, "fantai-start", common, wl_path))

                def llamacpp_rows() -> None:
                    if not lcpp:
                        return
                    for n in (int(x) for x in args.parallel.split(",") if x.strip()):
                        log(f"llama.cpp -np {n} on {os.path.basename(path)}{tag}")
                        rows.append(run_worker(args, lcpp, ["--_worker", "llamacpp", "--_parallel", str(n),
                                                            *common], wl_path))
                        rows[-1].update(round=rnd, rounds=args.rounds)
                        if rnd == 1:
                            rows[-1].update(run_startup(args, lcpp, "llamacpp-start", common, wl_path))

                # Who goes first alternates, so neither system always runs in the other's wake.
                for run in ((fantai_rows, llamacpp_rows) if rnd % 2 else (llamacpp_rows, fantai_rows)):
                    run()
            print(table(groups), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "w") as jf:
                    json.dump({"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                               "peaks": peaks, "costs": costs, "results": dict(groups)}, jf, indent=2)
    finally:
        os.unlink(wl_path)

    print(f"\n{os.path.basename(args.model)}, {args.threads} threads, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}: {args.num_prompts} requests, prompts {args.min_prompt}-{args.max_prompt} "
          f"tokens ({n_prompt} in all), {args.output_len} output tokens each, EOS ignored, greedy, prefix caching "
          f"off; single stream medians of {args.repeats}\n")
    print(table(groups))
    if args.rounds > 1:
        print(f"\nPaired ratios over {args.rounds} alternated rounds: median of each round's fantai / llama.cpp "
              "(min–max)\n")
        print(paired_table(groups))
    if peaks:
        print("\nRoofline (peaks measured by bench_kernels --only probe at the start of this run):\n")
        print(roofline(groups, costs, peaks))
        if args.json:
            with open(args.json, "w") as jf:
                json.dump({"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                           "peaks": peaks, "costs": costs, "results": dict(groups)}, jf, indent=2)
    return 0 if all("error" not in r for _, rows in groups for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
