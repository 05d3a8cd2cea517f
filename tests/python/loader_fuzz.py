"""Loader fuzzer: seeded mutations of small valid model files, each loaded by fantai's real loader.

Run as a script (test_loader_fuzz.py runs it in a subprocess, so a crash or a hang is caught as
one): it builds a seed file, then for `--seconds` (or `--count` mutants) mutates it (bit flips,
byte and 8-byte field overwrites with edge values, truncation, duplicated spans; JSON value
swaps for config.json and safetensors headers), loads each mutant and sorts the outcome:
`loaded`, `refused` (a ValueError naming the file) or `bad` (anything else: a wrong exception
type, or a message without the file's name). Prints one JSON line of counts and the first bad
cases; the mutant being loaded is always at <dir>/current.* so a crash leaves its input behind.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
from tiny_gguf import gguf_writer

EDGE_U64 = [0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


def seed_gguf(path: Path) -> None:
    """A two-layer llama GGUF with F32, F16, Q8_0 and Q4_1 tensors and a tiny byte vocabulary."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, inter, vocab, layers = 64, 96, 40, 2
    w = gguf_writer(path, hidden, inter, layers, vocab, heads=4, kv_heads=2, context=128)
    Q = gguf.GGMLQuantizationType
    r = lambda *s: (0.05 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", gguf.quants.quantize(r(vocab, hidden), Q.Q8_0), raw_dtype=Q.Q8_0)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_q.weight", gguf.quants.quantize(r(hidden, hidden), Q.Q4_1), raw_dtype=Q.Q4_1)
        w.add_tensor(f"blk.{i}.attn_k.weight", r(32, hidden).astype(np.float16))
        w.add_tensor(f"blk.{i}.attn_v.weight", r(32, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", gguf.quants.quantize(r(hidden, hidden), Q.Q8_0),
                     raw_dtype=Q.Q8_0)
        for name, shape in (("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(r(*shape), Q.Q8_0), raw_dtype=Q.Q8_0)
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + r(hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + r(hidden))
    w.add_tensor("output_norm.weight", 1 + r(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def seed_safetensors(path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build_tiny_model

    build_tiny_model(path, vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, inter=48)


def mutate_bytes(data: bytes, rng: random.Random, hot: int) -> bytes:
    """One to three mutations, most of them inside the first `hot` bytes (the header)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(min(hot, len(b))) if rng.random() < 0.85 else rng.randrange(len(b))
        kind = rng.randrange(6)
        if kind == 0:
            b[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b[at] = rng.choice([0, 0x7F, 0x80, 0xFF])
        elif kind == 2 and at + 8 <= len(b):
            b[at:at + 8] = struct.pack("<Q", rng.choice(EDGE_U64))
        elif kind == 3 and at + 4 <= len(b):
            b[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 5, 13, 255, 2**31, 2**32 - 1]))
        elif kind == 4:
            b = b[:at]
            if not b:
                b = bytearray(b"G")
        else:
            n = rng.randint(1, 64)
            b[at:at] = b[max(0, at - n):at]
    return bytes(b)


def mutate_json(obj: object, rng: random.Random) -> object:
    """Replace one value somewhere in a JSON document with an edge value of another type."""
    edges = [None, -1, 0, 2**63, 2**70, 1e308, float("nan"), "x", [], {}, [[[[[[1]]]]]], True, -2**31]
    paths: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append((node, k))
                walk(v)
        elif isinstance(node, list):
            for i, v in enumerate(node[:8]):
                paths.append((node, i))
                walk(v)

    walk(obj)
    parent, key = rng.choice(paths)
    if rng.random() < 0.15 and isinstance(parent, dict):
        del parent[key]  # type: ignore[arg-type]
    else:
        parent[key] = rng.choice(edges)  # type: ignore[index]
    return obj


def try_load(path: Path, named: str) -> tuple[str, str]:
    from fantai.loader import load_model
    from fantai.model_files import ModelNotFoundError

    try:
        load_model(str(path), "float32", threads=1)
    except (ValueError, ModelNotFoundError) as e:
        msg = str(e)
        return ("refused", msg) if named in msg else ("bad", f"ValueError without the file name: {msg[:300]}")
    except Exception as e:  # noqa: BLE001 - the fuzzer's job is to see every other kind
        return "bad", f"{type(e).__name__}: {str(e)[:300]}"
    return "loaded", ""


def run(kind: str, seed: int, seconds: float, count: int, workdir: Path) -> dict:
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    counts = {"loaded": 0, "refused": 0, "bad": 0}
    bad: list[str] = []
    messages: dict[str, int] = {}
    if kind == "gguf":
        original = workdir / "seed.gguf"
        seed_gguf(original)
        data = original.read_bytes()
        hot = len(data) - 64 * 1024 if len(data) > 96 * 1024 else len(data) // 2
    else:
        src = workdir / "seed_model"
        seed_safetensors(src)
        st = (src / "model.safetensors").read_bytes()
        (header_len,) = struct.unpack("<Q", st[:8])
        header = json.loads(st[8:8 + header_len])
        config = json.loads((src / "config.json").read_text())
    deadline = time.monotonic() + seconds
    n = 0
    while n < count and time.monotonic() < deadline:
        n += 1
        if kind == "gguf":
            target = workdir / "current.gguf"
            target.write_bytes(mutate_bytes(data, rng, hot))
            named = str(target)
        else:
            target = workdir / "current"
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(src, target)
            choice = rng.randrange(3)
            if choice == 0:  # the safetensors bytes
                (target / "model.safetensors").write_bytes(mutate_bytes(st, rng, 8 + header_len))
            elif choice == 1:  # the safetensors header JSON, re-serialised with a right length
                h = mutate_json(json.loads(json.dumps(header)), rng)
                text = json.dumps(h).encode()
                (target / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + st[8 + header_len:])
            else:  # config.json
                (target / "config.json").write_text(json.dumps(mutate_json(json.loads(json.dumps(config)), rng)))
            named = str(target)
        outcome, msg = try_load(target, named)
        counts[outcome] += 1
        if outcome == "refused":
            key = msg.replace(named, "<file>")[:60]
            messages[key] = messages.get(key, 0) + 1
        if outcome == "bad" and len(bad) < 10:
            keep = workdir / f"bad_{len(bad)}{target.suffix}"
            if target.is_dir():
                shutil.copytree(target, keep)
            else:
                shutil.copy(target, keep)
            bad.append(f"{keep}: {msg}")
    top = sorted(messages.items(), key=lambda kv: -kv[1])[:8]
    return {"kind": kind, "mutants": n, **counts, "bad_cases": bad, "top_refusals": top}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["gguf", "safetensors"], required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--count", type=int, default=100000)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(run(args.kind, args.seed, args.seconds, args.count, args.dir)))


if __name__ == "__main__":
    main()
