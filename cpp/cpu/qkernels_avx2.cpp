// cpu: quantized-weight kernels, AVX2 + FMA (8 lanes); per-file ISA flags, called only after the
// CPUID probe says so.
#include <cstdint>

#include "cpu/qkernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#pragma GCC target("avx2,fma,f16c")
#endif

#if defined(__x86_64__) && ((defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || \
                            (defined(__GNUC__) && !defined(__clang__)))
#include <immintrin.h>

namespace fantai::cpu {
namespace avx2_q {

alignas(32) static const int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                  0,  0,  0,  0,  0,  0,  0,  0};

struct QT {
  static constexpr const char* kName = "avx2";
  static constexpr int W = 8;
  static constexpr int kTileRows = 4, kTileCols = 2, kDecodeCols = 4;
  using V = __m256;

  static __m256i mask(int n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTable + 8 - n)); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_n(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static void store_n(float* p, V a, int n) { _mm256_maskstore_ps(p, mask(n), a); }
  static V keep_n(V a, int n) { return _mm256_and_ps(a, _mm256_castsi256_ps(mask(n))); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  // The product stays rounded: the empty asm hides it from FMA contraction with a following add.
  static V mul_exact(V a, V b) {
    V r = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(r));
    return r;
  }
  static V u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V nib_lo(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0f))));
  }
  static V nib_hi(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f))));
  }
  // Same tree as the dense kernels' VT::hsum (kernels_avx2.cpp).
  static float hsum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

namespace {  // internal linkage: no symbol of one ISA can stand in for another
#include "cpu/qkernels_impl.h"
}  // namespace

}  // namespace avx2_q

const QKernelTable* avx2_qkernels() { return &avx2_q::kQTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const QKernelTable* avx2_qkernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
