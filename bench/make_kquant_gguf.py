#!/usr/bin/env python3
"""Write a K-quant GGUF for decode-speed measurements (speed only: the K-quant blocks are random).

No quantizer for the K-quants ships with gguf-py, and the bundled model's width (576) is not a
multiple of 256, so no real K-quant file of it can be made here. This writes one of two shapes:

- the bundled SmolLM2-135M's own shapes (default): every linear whose row length is a multiple of
  256 (ffn_down) becomes random valid blocks of --type, the rest Q5_0 quantized by gguf-py from the
  dequantized weights, as llama.cpp falls back for a Q4_K_M file of this model; embedding Q8_0;
- with --hidden / --inter / --layers: a wider llama of those shapes (heads of 64), every linear
  random valid blocks of --type and the tied embedding random Q8_0, the bundled model's tokenizer.
  There --type may also be q4_1, q8_0 or bf16: a model larger than the last-level cache, so a
  decode streams its weights from DRAM (the bundled model's 98-269 MB sit in some hosts' L3).

Random blocks keep every f16 scale small and finite, so the forward stays finite; the text it
generates is noise, its tokens/s are those of a real file of the same types and shapes.

    python bench/make_kquant_gguf.py --type q4_k --out /tmp/smollm2-q4k.gguf
    python bench/make_kquant_gguf.py --type q4_k --hidden 1024 --inter 2816 --layers 16 --out /tmp/w.gguf
    python bench/make_kquant_gguf.py --type q4_1 --hidden 2048 --inter 5632 --layers 24 --out /tmp/d.gguf
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize, quantize

# (elements, bytes) per block and the byte offsets of its f16 fields, with a scale size that keeps
# weights around 0.01-0.05.
BLOCKS = {T.Q4_K: (256, 144, (0, 2), 0.0003), T.Q6_K: (256, 210, (208,), 0.0003),
          T.Q5_K: (256, 176, (0, 2), 0.0003), T.Q3_K: (256, 110, (108,), 0.0003),
          T.Q2_K: (256, 84, (80, 82), 0.001), T.Q8_0: (32, 34, (0,), 0.0006),
          T.Q4_1: (32, 20, (0,), 0.004)}
TYPES = {"q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
# Only for the --hidden shapes: the bundled model's own shapes in these are its own file,
# make_q8_0_gguf.py's and make_gguf.py's.
WIDE_TYPES = {"q4_1": T.Q4_1, "q8_0": T.Q8_0, "bf16": T.BF16}
# general.file_type of a --hidden file (all its linears are --type).
FILE_TYPES = {"q2_k": LlamaFileType.MOSTLY_Q2_K, "q3_k": LlamaFileType.MOSTLY_Q3_K_M,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_M, "q5_k": LlamaFileType.MOSTLY_Q5_K_M,
              "q6_k": LlamaFileType.MOSTLY_Q6_K, "q4_1": LlamaFileType.MOSTLY_Q4_1,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "bf16": LlamaFileType.MOSTLY_BF16}


def random_blocks(t: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    per, nbytes, halves, mag = BLOCKS[t]
    b = rng.integers(0, 256, (rows * cols // per, nbytes), dtype=np.uint8)
    for at in halves:
        d = (rng.uniform(0.5, 1.0, b.shape[0]) * mag * rng.choice([-1, 1], b.shape[0])).astype(np.float16)
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    if t == T.Q4_1:
        # The minimum at -8 d: weights centred on 0, as a real Q4_1 block's are.
        m = (-8.0 * b[:, 0:2].copy().view(np.float16).astype(np.float32)).astype(np.float16)
        b[:, 2:4] = m.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def random_tensor(t: T, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    if t == T.BF16:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).view(np.uint32)
        return (w >> 16).astype(np.uint16), t  # truncated to bf16: speed only
    return random_blocks(t, rows, cols, rng), t


def copy_fields(reader: GGUFReader, writer: GGUFWriter, override: dict) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == Keys.General.ARCHITECTURE:
            continue
        if field.name in override:
            writer.add_key_value(field.name, override[field.name], GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="source GGUF (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--type", choices=sorted(TYPES) + sorted(WIDE_TYPES), default="q4_k")
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--inter", type=int, default=0)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    if args.type in WIDE_TYPES and not args.hidden:
        p.error(f"--type {args.type} needs --hidden / --inter / --layers")
    kt = TYPES.get(args.type) or WIDE_TYPES[args.type]
    rng = np.random.default_rng(0)
    reader = GGUFReader(args.model)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    tmp = args.out + ".part"
    writer = GGUFWriter(tmp, arch)
    if args.hidden:
        H, I, L = args.hidden, args.inter, args.layers
        assert H % 256 == 0 and I % 256 == 0, "--hidden and --inter must be multiples of 256"
        heads = H // 64
        kv = max(1, heads // 4)
        copy_fields(reader, writer, {f"{arch}.embedding_length": H, f"{arch}.feed_forward_length": I,
                                     f"{arch}.block_count": L, f"{arch}.attention.head_count": heads,
                                     f"{arch}.attention.head_count_kv": kv,
                                     f"{arch}.rope.dimension_count": 64,
                                     Keys.General.FILE_TYPE: int(FILE_TYPES[args.type])})
        vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
        # The tied embedding (the lm_head, read whole every token): Q8_0 as in the bundled file, bf16
        # in a bf16 model, as make_gguf.py writes it.
        data, dt = random_tensor(T.BF16 if kt == T.BF16 else T.Q8_0, vocab, H, rng)
        writer.add_tensor("token_embd.weight", data, raw_dtype=dt)
        shapes = {"attn_q": (H, H), "attn_k": (kv * 64, H), "attn_v": (kv * 64, H), "attn_output": (H, H),
                  "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
        for layer in range(L):
            for part, (rows, cols) in shapes.items():
                data, dt = random_tensor(kt, rows, cols, rng)
                writer.add_tensor(f"blk.{layer}.{part}.weight", data, raw_dtype=dt)
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(H, np.float32))
        writer.add_tensor("output_norm.weight", np.ones(H, np.float32))
    else:
        copy_fields(reader, writer, {})
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if len(shape) == 1:
                writer.add_tensor(t.name, dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32))
            elif t.name == "token_embd.weight" or shape[1] % 256 != 0:
                values = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
                qt = T.Q8_0 if t.name == "token_embd.weight" else T.Q5_0
                packed = quantize(values, qt)
                writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=qt)
            else:
                writer.add_tensor(t.name, random_blocks(kt, *shape, rng), raw_dtype=kt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.0f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
