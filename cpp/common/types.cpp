// common: dtype names and scalar conversions.
#include "common/types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/check.h"

namespace fantai {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kI8: return "int8";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  if (n == "float32" || n == "f32" || n == "float" || n == "F32") return DType::kF32;
  if (n == "float16" || n == "f16" || n == "half" || n == "F16") return DType::kF16;
  if (n == "bfloat16" || n == "bf16" || n == "BF16") return DType::kBF16;
  if (n == "int8" || n == "i8") return DType::kI8;
  FANTAI_THROW("unknown dtype '" << n << "' (expected float32, float16, bfloat16 or int8)");
}

float quantize_row_i8(const float* x, int8_t* q, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite = finite && std::isfinite(x[i]);
  if (!(amax > 0.f) || !finite) {
    // All zeros: scale 0 dequantizes to exact zeros. A NaN/inf row has no int8 form; a NaN
    // scale carries it into attention as an f32 cache would, instead of hiding it.
    for (int64_t i = 0; i < n; ++i) q[i] = 0;
    return finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const float s = amax / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    // nearbyint in the default rounding mode: round half to even. |x / s| <= 127 up to one
    // rounding of the division, so the clamp only guards that last ulp.
    const float r = std::nearbyint(x[i] / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  return s;
}

void convert_to_f32(const void* src, DType st, float* dst, size_t n) {
  switch (st) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kBF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::kF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::kI8: break;
  }
  FANTAI_THROW("convert_to_f32: int8 needs its scales (a KV-cache-only type)");
}

void convert_from_f32(const float* src, void* dst, DType dt, size_t n) {
  switch (dt) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::kI8: break;
  }
  FANTAI_THROW("convert_from_f32: int8 needs its scales (use quantize_row_i8)");
}

}  // namespace fantai
