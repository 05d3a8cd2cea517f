"""matmul_precision="bfloat16": activations rounded to bf16 where they meet bf16 weights or a bf16 KV
cache in a matrix unit (CPU AMX). Checked against transformers (bf16 weights, f32 math), against the
float32 mode, and for the engine's invariants (batching and chunked prefill never change tokens).
Also the other form bf16 weights take: the pair layout off AMX, the row-major kernels' bits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fantai import LLM, SamplingParams
from fantai.config import EngineOptions
from server_fixtures import REPO, python_env
from tiny_models import build_tiny_model, hf_greedy, hf_logits, hf_model, random_prompts
from transformers import AutoModelForCausalLM

VOCAB = 320
# head_dim 32 and 16-token blocks: the AMX attention kernel takes this layout, so both the linears
# and the attention run in the bf16 form where the CPU has AMX.
HIDDEN, HEADS, KV_HEADS = 128, 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = build_tiny_model(tmp_path_factory.mktemp("mmp_src"), vocab_size=VOCAB, hidden=HIDDEN, heads=HEADS,
                           kv_heads=KV_HEADS, inter=320, layers=2, max_pos=2048)
    out = tmp_path_factory.mktemp("mmp_bf16")
    hf_model(src).to(torch.bfloat16).save_pretrained(out)  # a bf16 checkpoint: weights exact in bf16
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    return hf_model(model_dir).float()  # bf16 weights, f32 math


@pytest.fixture(scope="module")
def hf_bf16(model_dir: Path):
    """transformers run in bfloat16 throughout: the yardstick for what bf16 arithmetic costs."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def llm(model_dir: Path, precision: str, **kw) -> LLM:
    return LLM(str(model_dir), dtype="bfloat16", matmul_precision=precision, num_kv_blocks=256, **kw)


def rounds(model_dir: Path) -> bool:
    return llm(model_dir, "bfloat16").matmul_precision == "bfloat16"


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        total += len(x)
    return same / total


def test_bad_precision_is_a_clear_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="matmul_precision must be one of float32, bfloat16; got 'fp16'"):
        LLM(str(model_dir), matmul_precision="fp16")
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
        EngineOptions(matmul_precision="tf32")


def test_logits_close_to_transformers(model_dir: Path, reference, hf_bf16) -> None:
    """Within what transformers' own bf16 run is off by: only the matmuls' inputs are rounded here
    (norms, residual stream and softmax stay f32), so the error is about half of it."""
    prompt = random_prompts(1, VOCAB, [300], seed=5)[0]
    want = hf_logits(reference, prompt).numpy()
    f32 = llm(model_dir, "float32")._model.score(prompt)
    bf = llm(model_dir, "bfloat16")._model.score(prompt)
    hf = hf_logits(hf_bf16, prompt).float().numpy()
    err32, errbf, errhf = (np.abs(x - want).max() for x in (f32, bf, hf))
    print(f"max |logit - transformers f32 math|: float32 mode {err32:.2e}, bfloat16 mode {errbf:.2e}, "
          f"transformers bf16 {errhf:.2e} (logit std {want.std():.2f})")
    assert err32 < 1e-3
    assert errbf < errhf
    if rounds(model_dir):
        assert errbf > 4 * err32, "bfloat16 mode gave float32 logits: were activations rounded?"
    else:  # no AMX: the setting changes nothing
        assert np.array_equal(bf, f32)


def test_greedy_tokens_track_transformers(model_dir: Path, reference, hf_bf16) -> None:
    prompts = random_prompts(8, VOCAB, [5, 40, 150], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = tokens(llm(model_dir, "bfloat16").generate(prompts, params, use_tqdm=False))
    want = [hf_greedy(reference, p, 24) for p in prompts]
    hf = [hf_greedy(hf_bf16, p, 24) for p in prompts]
    a, a_hf = agreement(ours, want), agreement(hf, want)
    print(f"greedy agreement with transformers (f32 math) before first divergence: bfloat16 mode {a:.3f}, "
          f"transformers bf16 {a_hf:.3f}")
    # A random tiny model has near-ties everywhere; bf16 arithmetic flips some of them either way.
    assert a >= min(0.7, a_hf - 0.1), (a, a_hf)
    assert sum(x[0] == y[0] for x, y in zip(ours, want)) >= 6


def test_batching_and_chunked_prefill_never_change_tokens(model_dir: Path) -> None:
    """Rows stay batch invariant in the bf16 form: alone, batched, or prefilled in 32-token chunks,
    a prompt's greedy tokens are the same."""
    prompts = random_prompts(6, VOCAB, [3, 70, 300], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    whole = llm(model_dir, "bfloat16", enable_prefix_caching=False)
    chunked = llm(model_dir, "bfloat16", enable_prefix_caching=False, max_num_batched_tokens=32)
    batched = tokens(whole.generate(prompts, params, use_tqdm=False))
    alone = [tokens(whole.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert tokens(chunked.generate(prompts, params, use_tqdm=False)) == batched


def test_bf16_packed_layouts_keep_bits_and_size(tmp_path: Path) -> None:
    """Off AMX (FANTAI_AMX=0 here, so on any CPU) FANTAI_BF16_LAYOUT=pairs|groups repacks bf16
    matrices at load into the pair or the group layout (pairs the default there, groups on AVX2):
    the same bytes when every projection's rows fill whole groups (a tied lm_head gets no packed
    copy beside the embedding) and the bits of the row-major kernels (FANTAI_BF16_LAYOUT=rows), for
    logits and batched greedy tokens."""
    src = build_tiny_model(tmp_path / "src", vocab_size=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                           inter=320, layers=2, max_pos=2048, tie=True)
    out = tmp_path / "bf16"
    hf_model(src).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FANTAI_AMX", "0")
        for layout in ("rows", "pairs", "groups"):
            mp.setenv("FANTAI_BF16_LAYOUT", layout)
            runs[layout] = LLM(str(out), dtype="bfloat16", num_kv_blocks=256)
    rows = runs["rows"]
    prompts = random_prompts(4, VOCAB, [5, 40, 77, 130], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = tokens(rows.generate(prompts, params, use_tqdm=False))
    for layout in ("pairs", "groups"):
        packed = runs[layout]
        assert packed._model.weight_bytes() == rows._model.weight_bytes(), layout
        for p in prompts:
            assert np.array_equal(packed._model.score(p).view(np.uint32), rows._model.score(p).view(np.uint32)), layout
        assert tokens(packed.generate(prompts, params, use_tqdm=False)) == want, layout


def test_cli_flag(model_dir: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fantai.cli", *args], check=False, env=python_env(),
                              cwd=str(REPO), capture_output=True, text=True, timeout=120)

    bad = cli("generate", str(model_dir), "--prompt", "w1 w2", "--matmul-precision", "fp16")
    assert bad.returncode == 2 and "--matmul-precision: invalid choice: 'fp16'" in bad.stderr
    res = cli("generate", str(model_dir), "--prompt", "w5 w6 w7", "--max-tokens", "8", "--temperature", "0",
              "--threads", "1", "--matmul-precision", "bfloat16", "--kv-cache-memory", "4M")
    assert res.returncode == 0, res.stderr[-2000:]
    out = LLM(str(model_dir), matmul_precision="bfloat16", kv_cache_memory="4M", threads=1).generate(
        ["w5 w6 w7"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert res.stdout.strip() == out.outputs[0].text.strip()
    for cmd in ("serve", "chat", "bench throughput"):
        help_text = cli(*cmd.split(), "--help")
        assert help_text.returncode == 0 and "--matmul-precision" in help_text.stdout, cmd


CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "List three prime numbers greater than 10 and explain why they are prime.",
        "Explain photosynthesis to a child.", "Give me a recipe for pancakes."]


def test_default_model_bf16_matmuls() -> None:
    """The bundled SmolLM2-135M with bf16 weights: teacher-forced perplexity of a fixed paragraph and
    greedy chat replies, bfloat16 matmuls against float32 ones."""
    text = ("The river starts high in the mountains, where snow melts slowly through the spring. Small streams "
            "join it as it runs down the valley, and by the time it reaches the town it is wide enough for boats.")
    runs, ppl = {}, {}
    for precision in ("float32", "bfloat16"):
        m = LLM(dtype="bfloat16", dequantize=True, matmul_precision=precision, kv_cache_memory="64M")
        ids = m.tokenizer.encode(text, add_special_tokens=False)
        x = m._model.score(ids).astype(np.float64)[:-1]
        x -= x.max(axis=1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        ppl[precision] = float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
        runs[precision] = tokens(m.chat([[{"role": "user", "content": q}] for q in CHAT],
                                        SamplingParams(temperature=0, max_tokens=48), use_tqdm=False))
    a = agreement(runs["bfloat16"], runs["float32"])
    print(f"default model: perplexity float32 {ppl['float32']:.4f}, bfloat16 {ppl['bfloat16']:.4f}; "
          f"greedy agreement before first divergence {a:.3f}")
    assert abs(ppl["bfloat16"] / ppl["float32"] - 1) < 0.02, ppl
    assert a >= 0.6, a
