"""NCCL and cuBLASLt are opened at run time, never linked (cuda/lazy_library.h). Linked, they were
loaded by every process that imports fantai and held ~170 MiB of RSS even on the CPU backend.
Checked in fresh processes (each library is opened once per process, so the environment that
chooses it must be set before): a CPU model loads and generates without either in
/proc/self/maps; where the build has them, _C.cuda_library_versions() opens both, resolves every
function and reports ncclGetVersion / cublasLtGetVersion (no GPU needed), and they appear in the
maps then (so the first check can see them); a bad FANTAI_NCCL_LIBRARY / FANTAI_CUBLASLT_LIBRARY
path, or a library without NCCL's functions, is an error that names it, and TP > 1 on CUDA
repeats it before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fantai import _C
from server_fixtures import python_env
from tiny_models import build_tiny_model

LIBS = {"nccl": "libnccl", "cublaslt": "libcublasLt"}

# Prints {"maps": [the two libraries' names as far as they are mapped], "rss": bytes, ...} after
# the statements given; the statements may add entries to `out`.
PROBE = """
import json, os, sys
out = {}
{body}
maps = open('/proc/self/maps').read()
out['maps'] = [n for n in ('libnccl', 'libcublasLt') if n in maps]
out['rss'] = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('Rss:')][0] * 1024
print(json.dumps(out))
"""


def _probe(body: str, **env: str) -> dict:
    e = python_env()
    for k in ("FANTAI_NCCL_LIBRARY", "FANTAI_CUBLASLT_LIBRARY"):
        e.pop(k, None)
    e.update(env)
    code = PROBE.replace("{body}", body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _built(name: str) -> str | None:
    """Why this build cannot open `name` at all (no CUDA, or no header at build time), else None.
    Asked in a child: opening it here would load it into the test process."""
    err = _probe("import fantai._C as c\nout['v'] = c.cuda_library_versions()")["v"][name]["error"]
    return err if err.startswith("this build") else None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lazy"), hidden=64, layers=2)


def test_import_and_a_cpu_model_load_neither_library(model_dir: Path) -> None:
    bare = _probe("import fantai._C")
    assert bare["maps"] == [], bare
    run = _probe(
        "from fantai import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, device='cpu', dtype='float32', num_kv_blocks=16)\n"
        "p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)\n"
        "o = llm.generate(['a b c'], p, use_tqdm=False)\n"
        "out['tokens'] = len(o[0].outputs[0].token_ids)")
    assert run["tokens"] == 4
    assert run["maps"] == [], run
    print(f"import fantai._C: RSS {bare['rss'] / 2**20:.0f} MiB; "
          f"CPU load + generate {run['rss'] / 2**20:.0f} MiB")


def test_versions_open_both_libraries_and_resolve_every_symbol() -> None:
    res = _probe("import fantai._C as c\n"
                 "out['v'] = c.cuda_library_versions()\n"
                 "out['nccl'] = c.nccl_unavailable_reason()")
    v = res["v"]
    assert set(v) == set(LIBS)
    opened = [n for n in LIBS if not v[n]["error"].startswith("this build")]
    if not opened:
        pytest.skip(f"this build has neither library compiled in: {v}")
    for name in opened:
        lib = v[name]
        assert lib["error"] == "", lib  # the header was there at build time, and the wheel beside it
        assert LIBS[name] in Path(lib["path"]).name and Path(lib["path"]).is_file(), lib
        # Mapped now: the absence above is not a blind check.
        assert LIBS[name] in res["maps"], res
    if "nccl" in opened:
        assert v["nccl"]["version"] >= 21800, v  # 2.18: non-blocking communicators
        assert res["nccl"] == ""
    if "cublaslt" in opened:
        assert v["cublaslt"]["version"] >= 120000, v
    print({n: (v[n]["version"], v[n]["path"]) for n in opened}, f"RSS with them {res['rss'] / 2**20:.0f} MiB")


def test_a_bad_nccl_library_path_is_the_clear_reason(model_dir: Path) -> None:
    why = _built("nccl")
    if why:
        pytest.skip(why)
    bad = "/nonexistent/libnccl.so.2"
    res = _probe(
        "import fantai._C as c\n"
        "out['reason'] = c.nccl_unavailable_reason()\n"
        "out['error'] = c.cuda_library_versions()['nccl']['error']\n"
        "from fantai import LLM\n"
        "try:\n"
        f"    LLM({str(model_dir)!r}, device='cuda', tensor_parallel_size=2, num_kv_blocks=8)\n"
        "    out['raised'] = ''\n"
        "except (RuntimeError, ValueError) as e:\n"
        "    out['raised'] = str(e)\n",
        FANTAI_NCCL_LIBRARY=bad)
    assert f"FANTAI_NCCL_LIBRARY={bad}" in res["reason"] and "NCCL" in res["reason"], res
    assert res["error"] == res["reason"]
    assert "libnccl" not in res["maps"], res  # no other copy was opened in its place
    if not _C.mpi_unavailable_reason():  # without MPI, TP > 1 is refused for that first
        assert "needs NCCL" in res["raised"] and bad in res["raised"], res
    # A file that opens but is not NCCL: the first function it lacks is named, and it is closed.
    res = _probe("import fantai._C as c\nout['reason'] = c.nccl_unavailable_reason()",
                 FANTAI_NCCL_LIBRARY="libm.so.6")
    assert "lacks ncclGetVersion" in res["reason"] and "libm.so.6" in res["reason"], res


def test_a_bad_cublaslt_library_path_is_the_clear_reason() -> None:
    why = _built("cublaslt")
    if why:
        pytest.skip(why)
    bad = "/nonexistent/libcublasLt.so.13"
    res = _probe("import fantai._C as c\nout['error'] = c.cuda_library_versions()['cublaslt']['error']",
                 FANTAI_CUBLASLT_LIBRARY=bad)
    assert f"FANTAI_CUBLASLT_LIBRARY={bad}" in res["error"] and "cuBLASLt" in res["error"], res
    assert "libcublasLt" not in res["maps"], res
