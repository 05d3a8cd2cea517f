#!/usr/bin/env python3
"""Writes a Q8_0 GGUF of a GGUF model (default: the bundled SmolLM2-135M-Instruct Q4_1) with gguf-py:
every 2-D tensor is dequantized and re-quantized to Q8_0 (Q8_0 ones are copied), 1-D tensors and
all metadata are copied. Rows stay in the file's order (llama.cpp's q/k permutation is kept).

Usage: python bench/make_q8_0_gguf.py OUT.gguf [--model IN.gguf]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def convert(src: str, dst: str) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))
        if len(shape) == 1:
            writer.add_tensor(t.name, np.array(dequantize(t.data, qtype), dtype=np.float32).reshape(shape))
        elif qtype == q8:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=q8)
        else:
            dense = np.asarray(dequantize(t.data, qtype), dtype=np.float32).reshape(shape)
            writer.add_tensor(t.name, quantize(dense, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from fantai.model_files import default_model_path

        args.model = default_model_path()
    convert(args.model, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
