"""examples: builds examples/generate against the installed package and checks it against fantai.LLM."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import fantai
import pytest
from fantai import SamplingParams
from tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def generate_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # cmake and g++ are set-up requirements (make system-deps), so a missing one fails here.
    build = tmp_path_factory.mktemp("examples-build")
    # Ninja when present (faster, as the README shows); the default generator otherwise.
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(EXAMPLES), "-B", str(build), *generator,
                 f"-DCMAKE_PREFIX_PATH={fantai.cmake_prefix_path}"]
    for cmd in (configure, ["cmake", "--build", str(build), "-j2"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    return build / "generate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Bytes, decoded strictly by hand: text mode would turn a generated "\r" into "\n", and
    # strict decoding checks that the binary writes valid UTF-8.
    res = subprocess.run([str(binary), *args], capture_output=True, timeout=300)
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode("utf-8"),
                                       res.stderr.decode("utf-8", errors="replace"))


def _parse(stdout: str) -> tuple[list[int], str]:
    """'ids: 1 2\ntext: ...\n'; the text is everything after 'text: ' (it may hold newlines)."""
    ids_line, sep, rest = stdout.partition("\ntext: ")
    assert ids_line.startswith("ids:") and sep and rest.endswith("\n"), stdout
    return [int(t) for t in ids_line[len("ids:"):].split()], rest[:-1]


def test_matches_python_llm(generate_bin: Path, model_dir: Path) -> None:
    prompt = [1, 17, 42, 99, 7, 250]
    res = _run(generate_bin, str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", "12", "--ignore-eos", "--threads", "2")
    assert res.returncode == 0, res.stderr
    ids, text = _parse(res.stdout)

    llm = fantai.LLM(str(model_dir), dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ids == list(out.token_ids)
    assert len(ids) == 12
    # The tokenizer's decode of the ids alone (out.text continues the prompt, so it may start with
    # the space that joins it to the prompt's last word).
    assert text == llm.get_tokenizer().decode(ids)


def test_word_prompt_matches_ids(generate_bin: Path, model_dir: Path) -> None:
    by_ids = _run(generate_bin, str(model_dir), "--prompt-ids", "10,11,12", "--max-tokens", "5",
                  "--ignore-eos")
    by_text = _run(generate_bin, str(model_dir), "--prompt", "w10 w11  w12", "--max-tokens", "5",
                   "--ignore-eos")
    assert by_ids.returncode == 0 and by_text.returncode == 0, by_ids.stderr + by_text.stderr
    assert _parse(by_ids.stdout) == _parse(by_text.stdout)


def test_seeded_sampling_is_reproducible(generate_bin: Path, model_dir: Path) -> None:
    args = (str(model_dir), "--prompt-ids", "3,4,5", "--max-tokens", "8", "--ignore-eos",
            "--temperature", "1.0", "--seed", "123")
    a, b = _run(generate_bin, *args), _run(generate_bin, *args)
    assert a.returncode == 0, a.stderr
    assert _parse(a.stdout)[0] == _parse(b.stdout)[0]
    assert len(_parse(a.stdout)[0]) == 8


@pytest.mark.parametrize("case", ["missing_dir", "not_a_model", "unknown_word", "bad_id",
                                  "garbage_ids", "no_prompt", "unknown_flag"])
def test_bad_input_fails_cleanly(generate_bin: Path, model_dir: Path, tmp_path: Path, case: str) -> None:
    args = {
        "missing_dir": [str(tmp_path / "nope"), "--prompt-ids", "1,2"],
        "not_a_model": [str(tmp_path), "--prompt-ids", "1,2"],
        "unknown_word": [str(model_dir), "--prompt", "w10 hello"],
        "bad_id": [str(model_dir), "--prompt-ids", "1,100000"],
        "garbage_ids": [str(model_dir), "--prompt-ids", "1,x"],
        "no_prompt": [str(model_dir)],
        "unknown_flag": [str(model_dir), "--prompt-ids", "1", "--bogus"],
    }[case]
    res = _run(generate_bin, *args)
    assert res.returncode > 0, (res.returncode, res.stderr)  # nonzero, and not killed by a signal
    assert "error:" in res.stderr
    assert "ids:" not in res.stdout
    expected = {"missing_dir": "not found", "not_a_model": "config.json", "unknown_word": "hello",
                "bad_id": "100000", "garbage_ids": "x", "no_prompt": "prompt",
                "unknown_flag": "--bogus"}[case]
    assert expected in res.stderr


def _swap_tokenizer(src: Path, dst: Path, kind: str) -> Path:
    """The tiny model with a trained byte-level BPE or SentencePiece-style (Metaspace) tokenizer."""
    from tokenizers.implementations import ByteLevelBPETokenizer, SentencePieceBPETokenizer

    shutil.copytree(src, dst)
    text = ["the quick brown fox jumps over the lazy dog", "héllo wörld, naïve café",
            "中文 字符 测试", "emoji 🙂 ok", "line one\nline two\ttab"] * 4
    tok = ByteLevelBPETokenizer() if kind == "byte_level" else SentencePieceBPETokenizer()
    tok.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    tok.save(str(dst / "tokenizer.json"))
    return dst


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_bpe_decode_matches_tokenizers(generate_bin: Path, model_dir: Path, tmp_path: Path,
                                       kind: str) -> None:
    from tokenizers import Tokenizer

    path = _swap_tokenizer(model_dir, tmp_path / kind, kind)
    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    for prompt in ("40,41,42", "7,250,3,99"):
        res = _run(generate_bin, str(path), "--prompt-ids", prompt, "--max-tokens", "24", "--ignore-eos")
        assert res.returncode == 0, res.stderr
        ids, text = _parse(res.stdout)
        assert text == hf.decode(ids)  # random ids: cut UTF-8 sequences come out as U+FFFD too
    # Text prompts need a word-level vocabulary; a BPE one is refused with a pointer to --prompt-ids.
    res = _run(generate_bin, str(path), "--prompt", "hello")
    assert res.returncode > 0 and "--prompt-ids" in res.stderr
