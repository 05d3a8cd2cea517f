#!/usr/bin/env python3
"""Write a full-precision (bf16 or f32) copy of a GGUF model, for equal-precision benchmarks.

The bundled model ships only as Q4_1 (Q8_0 embedding); fantai dequantizes it at load, llama.cpp runs
the quantized file as is. To compare the two at the same weight precision both must read the same
full-precision file: this script dequantizes every block-quantized / F16 tensor with gguf-py and writes
it back as BF16 (or F32). One-dimensional tensors (norm weights) stay F32, as llama.cpp's own converter
writes them. All metadata is copied unchanged except general.file_type.

The values are exactly the dequantized Q4_1 weights (bf16 rounding of them for --dtype bf16), so
the model's outputs stay those of the quantized file up to that rounding.

    python bench/make_gguf.py --dtype bf16 --out /tmp/smollm2-bf16.gguf     # default model in
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize, quantize

TARGETS = {"bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
           "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32)}


def convert(src: str, dst: str, dtype: str) -> None:
    qtype, file_type = TARGETS[dtype]
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == Keys.General.ARCHITECTURE:
            continue
        if field.name == Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, int(file_type), GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        # reader shapes are ggml order (innermost first); numpy arrays are the reverse.
        values = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = values.reshape(shape)
        if values.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, values)
        else:
            packed = quantize(values, qtype)
            writer.add_tensor(t.name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="source GGUF (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=sorted(TARGETS), default="bf16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    tmp = args.out + ".part"
    convert(args.model, tmp, args.dtype)
    os.replace(tmp, args.out)  # a cut-short run never leaves a half file under the final name
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.0f} MB, {args.dtype})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
