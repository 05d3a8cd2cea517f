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
// f16 <-> f32, round-to-nearest-even, subnormals exact. Inline because loading a quantized model
// converts every group scale; only baseline translation units call these (an ISA file's copy of
// an inline function could be the one the linker keeps).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ff;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

// Converts n elements of `src` (type st) to f32.
void convert_to_f32(const void* src, DType st, float* dst, size_t n);
// Converts n f32 elements to type dt.
void convert_from_f32(const float* src, void* dst, DType dt, size_t n);

}  // namespace fantai
