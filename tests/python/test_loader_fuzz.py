"""Untrusted model files: thousands of seeded mutants of a GGUF file, a safetensors checkpoint and
its config.json, each loaded by the real loader in a subprocess (so a crash or a hang fails the
test with the mutant left on disk). Every mutant loads or is refused with a ValueError that names
the file; nothing else is allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent / "loader_fuzz.py"
SECONDS = float(os.environ.get("FANTAI_FUZZ_SECONDS", "25"))


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_mutated_model_files_are_loaded_or_refused_cleanly(tmp_path: Path, kind: str) -> None:
    env = dict(os.environ, FANTAI_LOG_LEVEL="error")
    proc = subprocess.run([sys.executable, str(FUZZ), "--kind", kind, "--seed", "1", "--seconds", str(SECONDS),
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=SECONDS + 120,
                          env=env)
    assert proc.returncode == 0, f"fuzzer died ({proc.returncode}); mutant in {tmp_path}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["mutants"] >= 200, report  # a fuzzer that tries nothing proves nothing
    assert report["refused"] >= report["mutants"] // 4, report  # the mutations do hit the parsers
    assert report["bad"] == 0, "\n".join(report["bad_cases"])


def test_hostile_chat_templates_are_bounded() -> None:
    """A template from a model file cannot loop, allocate or print without bound: each of these
    fails as a broken template would, within the time bound."""
    import time

    from fantai.chat import MAX_RENDER_SECONDS, ChatTemplateError, render_chat_template

    hostile = {
        "silent loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "huge string": "{{ 'a' * 10000000000 }}",
        "huge power": "{{ 2 ** 100000000 }}",
        "endless output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    }
    for name, template in hostile.items():
        start = time.monotonic()
        with pytest.raises(ChatTemplateError):
            render_chat_template(template, [{"role": "user", "content": "hi"}])
        assert time.monotonic() - start < MAX_RENDER_SECONDS + 1.5, name


def _safetensors(path: Path, header: dict, payload: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + payload)


def test_lying_safetensors_headers_are_refused(tmp_path: Path) -> None:
    """The cases a reader that trusts its header gets wrong: a data range shorter than the shape
    (an out-of-bounds read), overlapping tensors, and an index that points outside the directory."""
    from fantai.loader import load_model
    from tiny_models import build_tiny_model

    src = build_tiny_model(tmp_path / "m", vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, inter=48)
    data = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, payload = json.loads(data[8:8 + n]), data[8 + n:]
    name = "model.embed_tokens.weight"
    begin, end = header[name]["data_offsets"]

    short = json.loads(json.dumps(header))
    short[name]["data_offsets"] = [begin, end - 4]
    _safetensors(src / "model.safetensors", short, payload)
    with pytest.raises(ValueError, match="needs .* bytes"):
        load_model(str(src), "float32")

    overlap = json.loads(json.dumps(header))
    other = next(k for k in header if k not in (name, "__metadata__"))
    size = header[other]["data_offsets"][1] - header[other]["data_offsets"][0]
    overlap[other]["data_offsets"] = [begin, begin + size]
    _safetensors(src / "model.safetensors", overlap, payload)
    with pytest.raises(ValueError, match="overlap"):
        load_model(str(src), "float32")

    _safetensors(src / "model.safetensors", header, payload)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {name: "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="not a file name in the model directory"):
        load_model(str(src), "float32")
