"""Tensor parallelism on GPU ranks (NCCL). Everywhere: the build says whether NCCL is in it, and a
CUDA device with tensor_parallel_size 2 where NCCL or a GPU is missing is a clear error raised
before any rank starts. With a GPU and NCCL: a one-rank engine whose all-reduces run over NCCL
(FANTAI_NCCL_ONE_RANK=1: a real ncclCommInitRankConfig, all-gather and rank-order sum per
layer) gives the plain engine's tokens and logprobs bit for bit (one partial: the sum is a copy).
With two GPUs: TP = 2 over NCCL gives TP = 1's greedy tokens, logprobs within
test_tensor_parallel's bound, and the same bits when run again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fantai import _C, LLM, SamplingParams
from server_fixtures import python_env
from tiny_models import build_tiny_model, random_prompts

HERE = Path(__file__).resolve().parent

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("nccl"), hidden=128, heads=4, kv_heads=2, layers=2,
                            inter=256)


def _gpu_and_nccl() -> str | None:
    """Why the NCCL path cannot run here, or None when it can."""
    if _C.nccl_unavailable_reason():
        return f"this build has no NCCL: {_C.nccl_unavailable_reason()}"
    if "cuda" not in _C.available_backends():
        return "no CUDA device is visible"
    return None


def test_build_reports_nccl() -> None:
    why = _C.nccl_unavailable_reason()
    assert isinstance(why, str)
    if why:
        assert any(w in why for w in ("CUDA", "NCCL", "FANTAI_NCCL")), why
    # bench/gpu_check.sh sets this where it built against NCCL on purpose.
    if os.environ.get("FANTAI_EXPECT_NCCL") == "1":
        assert why == "", why


def test_cuda_tensor_parallel_without_nccl_or_gpu_is_a_clear_error(model_dir: Path) -> None:
    if _C.mpi_unavailable_reason():
        pytest.skip(f"no MPI in this build: {_C.mpi_unavailable_reason()}")
    if _gpu_and_nccl() is None:
        pytest.skip("NCCL and a GPU are here: TP = 2 would start for real (bench/gpu_check.sh runs it)")
    with pytest.raises((RuntimeError, ValueError), match="NCCL|cuda") as e:
        LLM(str(model_dir), device="cuda", tensor_parallel_size=2, num_kv_blocks=8)
    want = "NCCL" if _C.nccl_unavailable_reason() else "unavailable"
    assert want in str(e.value), str(e.value)


def _run(model_dir: Path) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=64)
    outs = llm.generate(random_prompts(4, 320, [3, 17, 40], seed=2), GREEDY, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
    del llm
    return res


def test_one_rank_over_nccl_matches_the_plain_engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    why = _gpu_and_nccl()
    if why:
        pytest.skip(why)
    plain = _run(model_dir)
    monkeypatch.setenv("FANTAI_NCCL_ONE_RANK", "1")
    over_nccl = _run(model_dir)
    assert over_nccl == plain
    # The NCCL communicator says where it runs when it is made.
    assert "NCCL" in capfd.readouterr().err


def _gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    out = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def test_two_gpu_ranks_match_one(model_dir: Path) -> None:
    why = _gpu_and_nccl() or _C.mpi_unavailable_reason()
    if why:
        pytest.skip(why)
    if _gpus() < 2:
        pytest.skip(f"TP = 2 on GPUs needs two GPUs, this host has {_gpus()}")
    # Its own process, as test_tensor_parallel runs its groups (MPI stays out of pytest's).
    out = subprocess.run([sys.executable, str(HERE / "tp_run.py"), str(model_dir), "2", "cuda"],
                         env=python_env() | {"PYTHONPATH": os.pathsep.join([str(HERE), python_env().get(
                             "PYTHONPATH", "")])}, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["heads_per_rank"] == 2
    assert r["tp"]["tokens"] == r["tp1"]["tokens"]
    assert r["tp_again"] == r["tp"]
    for a, b in zip(r["tp"]["logprobs"], r["tp1"]["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3
