// cpu: quantized-weight kernels, AVX-512 (16 lanes, mask-register tails); per-file ISA flags,
// called only after the CPUID probe says so.
#include <cstdint>

#include "cpu/qkernels.h"

// Compiled without the per-file flags (another CMake directory): ask GCC for the ISA here.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#if defined(__x86_64__) && ((defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)) || (defined(__GNUC__) && !defined(__clang__)))
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace fantai::cpu {
namespace avx512_q {

struct QT {
  static constexpr const char* kName = "avx512";
  static constexpr int W = 16;
  static constexpr int kTileRows = 4, kTileCols = 4, kDecodeCols = 8;
  using V = __m512;

  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static void store_n(float* p, V a, int n) { _mm512_mask_storeu_ps(p, mask(n), a); }
  static V keep_n(V a, int n) { return _mm512_maskz_mov_ps(mask(n), a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  // The product stays rounded: the empty asm hides it from FMA contraction with a following add.
  static V mul_exact(V a, V b) {
    V r = _mm512_mul_ps(a, b);
    __asm__("" : "+v"(r));
    return r;
  }
  static V u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V nib_lo(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0f))));
  }
  static V nib_hi(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f))));
  }
  // Same fold as the dense kernels' VT::hsum (kernels_avx512.cpp): one fixed order.
  static float hsum(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

namespace {  // internal linkage: no symbol of one ISA can stand in for another
#include "cpu/qkernels_impl.h"
}  // namespace

}  // namespace avx512_q

const QKernelTable* avx512_qkernels() { return &avx512_q::kQTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const QKernelTable* avx512_qkernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
