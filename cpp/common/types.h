// common: element types and the small value types every layer shares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fantai {

// Element type of a weight or cache buffer. Activations are always f32 on CPU.
// kI8 is a KV-cache type only: int8 values with one f32 scale per (slot, kv head) stored beside
// them (see KVLayout); weights never use it.
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

inline size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : t == DType::kI8 ? 1 : 2; }
const char* dtype_name(DType t);
// "float32"/"f32", "float16"/"f16", "bfloat16"/"bf16", "int8"/"i8"
DType dtype_from_name(const std::string& name);

// Symmetric int8 quantization of one row (one token of one KV head): s = max|x| / 127,
// q[i] = round_half_even(x[i] / s) (all zeros when the row is). Returns s. The one definition
// every store path uses, so caches written by the reference and the backend are identical.
float quantize_row_i8(const float* x, int8_t* q, int64_t n);

// bf16 <-> f32 with round-to-nearest-even (NaN kept quiet).
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of `src` (type st) to f32.
void convert_to_f32(const void* src, DType st, float* dst, size_t n);
// Converts n f32 elements to type dt.
void convert_from_f32(const float* src, void* dst, DType dt, size_t n);

}  // namespace fantai
