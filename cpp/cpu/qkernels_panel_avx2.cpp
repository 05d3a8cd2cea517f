// cpu: the panel-layout int8 kernels on AVX2 (no VNNI): quantized weights x int8 activations with
// vpmaddubsw + vpmaddwd (the linear is qkernels_panel_avx2_impl.h, shared with the AVX-VNNI
// build), and the activation quantizer. Bit-equal to the AVX-512 VNNI kernel and to the portable
// one: a block's integer sum is exact whatever instruction forms it, and the per-block float
// updates are the same f32 operations in the same order, one lane per output row.
#include <cstdint>
#include <cstring>

#include "cpu/qkernels.h"
// Last: the rest of this file is AVX2 code (see the header).
#include "cpu/vt_avx2.h"

#ifdef FANTAI_VT_AVX2
namespace fantai::cpu {
namespace {

#define FV_INLINE inline __attribute__((always_inline))

#include "cpu/qkernels_panel_avx2_impl.h"

// 8 values to int8 with the block's 127 / max, rounded to nearest even (vcvtps2dq under the default
// rounding mode, what nearbyint does) and clamped; returns the int32 values for the block's sum.
FV_INLINE __m256i quantize8(__m256 v, __m256 vinv, int8_t* out) {
  __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv));
  qi = _mm256_min_epi32(_mm256_max_epi32(qi, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
  // int32 -> int16 -> int8: every value is in range, so the saturating packs are exact.
  const __m128i lo = _mm256_castsi256_si128(qi), hi = _mm256_extracti128_si256(qi, 1);
  const __m128i w16 = _mm_packs_epi32(lo, hi);
  const __m128i b8 = _mm_packs_epi16(w16, w16);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), b8);
  return qi;
}

FV_INLINE int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// quantize_rows_int8's arithmetic 8 lanes at a time: |x| max (exact in any order), the same d and
// 127 / max in f32, x * inv, round to nearest even, clamp, an exact integer sum. Padding past k is
// quantized from zeros, so it is 0 as the reference writes it.
template <int PARTS>
void quantize_rows_t(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s) {
  constexpr int block = 8 * PARTS;
  const int64_t nb = (k + block - 1) / block, ld = nb * block;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    int8_t* qr = q + r * ld;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * block, len = min64(block, k - c0);
      __m256 v[PARTS];
      __m256 amax = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int h = 0; h < PARTS; ++h) {
        const int64_t n = len - 8 * h;
        v[h] = n >= 8  ? _mm256_loadu_ps(xr + c0 + 8 * h)
               : n > 0 ? vt_avx2::VT::load_n(xr + c0 + 8 * h, static_cast<int>(n))
                       : _mm256_setzero_ps();
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[h]));
      }
      const float am = vt_avx2::VT::hmax(amax);
      const float inv = am > 0.f ? 127.f / am : 0.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int h = 0; h < PARTS; ++h) sum = _mm256_add_epi32(sum, quantize8(v[h], vinv, qr + c0 + 8 * h));
      d[r * nb + b] = am / 127.f;
      s[r * nb + b] = hsum8(sum);
    }
  }
}

void quantize_rows(const float* x, int64_t m, int64_t k, int32_t block, int8_t* q, float* d, int32_t* s) {
  if (block == 32) quantize_rows_t<4>(x, m, k, q, d, s);
  else quantize_rows_t<2>(x, m, k, q, d, s);
}

#undef FV_INLINE

}  // namespace

LinearPanelFn avx2_linear_panel() { return linear_panel; }
QuantizeRowsFn avx2_quantize_rows_int8() { return quantize_rows; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
LinearPanelFn avx2_linear_panel() { return nullptr; }
QuantizeRowsFn avx2_quantize_rows_int8() { return nullptr; }
}  // namespace fantai::cpu
#endif
