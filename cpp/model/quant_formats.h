// model: quantized weight formats — GGUF block decoding and round-to-nearest quantization into
// the canonical group-quantized form (QuantMatrix in backend/backend.h), and its dequantization.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace fantai::model {

// GGUF / ggml tensor type ids this loader understands.
enum GgmlType : int32_t {
  kGgmlF32 = 0,
  kGgmlF16 = 1,
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ5_0 = 6,
  kGgmlQ5_1 = 7,
  kGgmlQ8_0 = 8,
  kGgmlQ2_K = 10,
  kGgmlQ3_K = 11,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
  kGgmlIQ4_NL = 20,
  kGgmlIQ4_XS = 23,
  kGgmlBF16 = 30,
};

bool ggml_is_float(int32_t type);  // F32, F16, BF16
bool ggml_is_quant(int32_t type);  // the supported block formats
// "q4_0", "q4_k", "f16", ...; throws for unsupported types.
const char* ggml_format_name(int32_t type);
// Bytes of a [rows, cols] tensor; throws when the type is unsupported or cols is not a whole
// number of blocks.
size_t ggml_tensor_bytes(int32_t type, int64_t rows, int64_t cols);

// A canonical quantized matrix owning its arrays (zero / min / perm empty when absent).
struct QuantTensor {
  int32_t bits = 8;
  int32_t group = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> q;     // [rows, cols], one value per byte
  std::vector<float> scale;   // [rows, ngroups]
  std::vector<uint8_t> zero;  // [rows, ngroups] or empty (then zero_point for every group)
  int32_t zero_point = 0;
  std::vector<float> min;     // [rows, ngroups] or empty
  std::vector<int32_t> perm;  // [cols] or empty
  // The file's factoring of scale / min (QuantMatrix::fgroups): K-quants and IQ4_XS, else empty.
  int32_t fgroups = 0;
  std::vector<float> fscale, fmin;   // [rows, ngroups / fgroups]
  std::vector<int8_t> iscale, imin;  // [rows, ngroups]
  std::string format;                // "q4_k", "int4g32", ...
  QuantMatrix view() const;
};

// Decodes a GGUF block tensor (ggml_is_quant). Destination row i reads source row row_perm[i]
// when row_perm is given (q/k head un-permutation; whole rows, so blocks never split).
QuantTensor ggml_decode(const void* data, size_t nbytes, int32_t type, int64_t rows, int64_t cols,
                        const int32_t* row_perm = nullptr);
// Any supported type to f32 [rows, cols] (row_perm as above).
void ggml_to_f32(const void* data, size_t nbytes, int32_t type, int64_t rows, int64_t cols,
                 const int32_t* row_perm, float* out);

// Round-to-nearest-even quantization of w [rows, cols]. group <= 0 means per channel.
// symmetric: s = max|w| / (2^(b-1) - 1) (1 for an all-zero group), q = clamp(rint(w / s),
// -(2^(b-1) - 1), 2^(b-1) - 1) + 2^(b-1), zero = 2^(b-1).
// asymmetric: lo = min(min w, 0), hi = max(max w, 0), s = (hi - lo) / (2^b - 1) (1 if equal),
// zero = clamp(rint(-lo / s), 0, 2^b - 1), q = clamp(rint(w / s) + zero, 0, 2^b - 1).
QuantTensor quantize_rtn(const float* w, int64_t rows, int64_t cols, int32_t bits, int32_t group,
                         bool symmetric);

// out[r, perm[c]] = scale * float(q - zero) (+ min) for a canonical matrix (any group > 0).
void dequantize(const QuantMatrix& canonical, float* out);

}  // namespace fantai::model
