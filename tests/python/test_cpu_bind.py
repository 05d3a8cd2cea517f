"""--cpu-bind: the pool's workers end up on the CPUs the plan names (read back from /proc),
tokens do not change, the calling thread's mask is left alone in the main thread, and a bad
spec is refused with its reason before or at load."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fantai import LLM, EngineArgs, SamplingParams
from tiny_models import build_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bind"), layers=2)


def worker_masks() -> dict[str, str]:
    """fantai-cpu-N -> its Cpus_allowed_list, for this process's pool workers."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        if comm.startswith("fantai-cpu-"):
            out[comm] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                             if line.startswith("Cpus_allowed_list"))
    return out


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(len(CPUS) < 2, reason="binding two threads needs two CPUs")
@pytest.mark.parametrize("spec", ["compact", "spread", "list"])
def test_bound_workers_sit_on_their_cpus_and_tokens_hold(model_dir: Path, spec: str) -> None:
    prompts = random_prompts(6, 320, [5, 17, 40])
    ref = tokens(LLM(str(model_dir), dtype="float32", threads=2).generate(prompts, GREEDY, use_tqdm=False))
    before = worker_masks()
    # A list names the CPUs in reverse: thread 1 (the only worker) must get the first CPU.
    bind = f"{CPUS[1]},{CPUS[0]}" if spec == "list" else spec
    llm = LLM(str(model_dir), dtype="float32", threads=2, cpu_bind=bind)
    got = {k: v for k, v in worker_masks().items() if before.get(k) != v or k not in before}
    expect = str(CPUS[0]) if spec == "list" else str(CPUS[1])
    assert expect in got.values(), (got, before)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    # The main thread ran those steps and kept its whole mask (threads it starts inherit it).
    assert sorted(os.sched_getaffinity(0)) == CPUS
    seen: list[set[int]] = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    assert sorted(seen[0]) == CPUS


def test_bad_specs_are_refused_with_the_reason(model_dir: Path) -> None:
    for bad in ("cores", "1-", "0,,1", 3):
        with pytest.raises(ValueError, match="cpu_bind"):
            EngineArgs(cpu_bind=bad)
    outside = max(CPUS) + 1
    with pytest.raises(Exception, match=f"CPU {outside} is not in this process's affinity mask"):
        LLM(str(model_dir), dtype="float32", threads=1, cpu_bind=str(outside))
    with pytest.raises(Exception, match=f"names 1 CPUs for {len(CPUS) + 1} threads"):
        LLM(str(model_dir), dtype="float32", threads=len(CPUS) + 1, cpu_bind=str(CPUS[0]))


def test_cli_flag_parses_and_reaches_the_log(model_dir: Path) -> None:
    args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
                                    .parse_args(["--cpu-bind", "spread"]))
    assert args.cpu_bind == "spread"
    # The start-up log says where the threads went, in a process of its own.
    code = ("from fantai import LLM; LLM(%r, dtype='float32', threads=1, cpu_bind='compact')"
            % str(model_dir))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=os.environ | {"FANTAI_LOG_LEVEL": "info"})
    assert r.returncode == 0, r.stderr
    assert f"1 threads bound 'compact' to CPUs {CPUS[0]} of {len(CPUS)} CPU" in r.stderr, r.stderr
