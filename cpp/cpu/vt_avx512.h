// cpu: AVX-512 (F/BW/VL/DQ) vector traits VT, 16 lanes with mask-register tails: the one
// definition behind kernels_avx512.cpp and qkernels_avx512.cpp.
//
// Include it last in a TU, after every baseline header: from here on the TU is AVX-512 code (the
// per-file CMake flags, or the pragma below where a target in another CMake directory compiles
// the file without them). VT sits in an anonymous namespace, so each TU gets its own copy with
// internal linkage and no AVX-512 code can become the symbol a baseline caller links to; for the
// same reason nothing here is an external-linkage inline function or a std:: template.
// FANTAI_VT_AVX512 is defined when this compiler can build it; a TU falls back otherwise.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#if defined(__x86_64__) &&                                                                                \
    ((defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)) || \
     (defined(__GNUC__) && !defined(__clang__)))
#define FANTAI_VT_AVX512 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the intrinsics' own _mm512_undefined_* placeholders (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace fantai::cpu::vt_avx512 {
namespace {

struct VT {
  static constexpr const char* kName = "avx512";
  static constexpr int W = 16;
  using V = __m512;

  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static void store_n(float* p, V a, int n) { _mm512_mask_storeu_ps(p, mask(n), a); }
  // First n lanes of a, the rest 0.
  static V keep_n(V a, int n) { return _mm512_maskz_mov_ps(mask(n), a); }
  static V bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static V load_bf16(const uint16_t* p) {
    return bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_bf16_n(const uint16_t* p, int n) { return bf16x16(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static V load_bf16_lean(const uint16_t* p) { return load_bf16(p); }  // 32 registers: no need
  // a, held in a register from here (see vt_avx2.h).
  static V pin(V a) {
    __asm__("" : "+v"(a));
    return a;
  }
  // 2W bf16 in the pair layout (see vt_avx2.h).
  static V bf16_pair_lo(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
  }
  static V bf16_pair_hi(const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_f16_n(const uint16_t* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p));
  }
  static V load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load_i8_n(const int8_t* p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask(n), p)));
  }
  // 16 unsigned bytes, or the low / high nibbles of 16 bytes, as float lanes (quantized weights).
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
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // a * b + c with one rounding, spelled out so no compiler contraction choice can change it.
  static float fma1(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  // The product stays rounded: the empty asm hides it from FMA contraction with a following add.
  static V mul_exact(V a, V b) {
    V r = _mm512_mul_ps(a, b);
    __asm__("" : "+v"(r));
    return r;
  }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // Lane-wise a < b ? x : y.
  static V select_lt(V a, V b, V x, V y) {
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), x);
  }
  static float hmax(V a) { return _mm512_reduce_max_ps(a); }  // max is exact: any order
  // Halves folded 512->256->128, then the AVX2 tree (vt_avx2.h): one fixed order.
  static float hsum(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Lane i = hsum(a[i]) for 16 vectors at once: the same fold per vector (halves of 8, then of 4,
  // then pairs, then the last pair), run as a transposed tree so each add serves several vectors.
  // IEEE addition commutes, so every lane's sum is bit-identical to hsum's.
  static V hsum_w(const V* a) {
    V x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i] folded 16->8; lanes 8-15: a[2i+1]
      x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit block k: vector 4i+k folded 8->4
      y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) {  // block k: vectors 8i+k (lanes 0-1) and 8i+k+4 (lanes 2-3), 4->2
      const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(y[2 * i]), _mm512_castps_pd(y[2 * i + 1]));
      const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(y[2 * i]), _mm512_castps_pd(y[2 * i + 1]));
      z[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    // Block k, lane m: vector k + 4m; then lanes back into vector order.
    const V r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
  }
  // exp (Cephes expf) of x already clamped to [-87.33654, 88.37626]: range-reduce by ln2
  // (two-part constant), degree-5 polynomial, scale by 2^n.
  static V exp_clamped(V x) {
    const V fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    V p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  }
  // exp of any x: clamped into exp_clamped's range (the kernels' softmax and SiLU).
  static V exp(V x) {
    return exp_clamped(
        _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.3762626647949f)));
  }
  // exp of d <= 0 with d < -87.33654 (incl. -inf) flushed to 0 rather than clamped (the
  // sampler's sum of exps, where those terms must vanish).
  static V exp_nonpos(V d) {
    const V lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 keep = _mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(keep, exp_clamped(_mm512_max_ps(d, lo)));
  }

  // The sampler's row reductions (kernels_reduce_impl.h): W double sums, a NaN flag, W indices.
  struct DAcc {
    __m512d lo, hi;
  };
  static DAcc dzero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static DAcc dadd(DAcc a, V y) {
    return {_mm512_add_pd(a.lo, _mm512_cvtps_pd(_mm512_castps512_ps256(y))),
            _mm512_add_pd(a.hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1)))};
  }
  static void dstore(double* p, DAcc a) {
    _mm512_storeu_pd(p, a.lo);
    _mm512_storeu_pd(p + 8, a.hi);
  }
  using NanAcc = __mmask16;
  static NanAcc nan_none() { return 0; }
  static NanAcc nan_or(NanAcc acc, V x) { return acc | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
  static bool nan_any(NanAcc acc) { return acc != 0; }
  using I = __m512i;
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static I inext(I i) { return _mm512_add_epi32(i, _mm512_set1_epi32(W)); }
  static I izero() { return _mm512_setzero_si512(); }
  static void istore(int32_t* p, I i) { _mm512_storeu_si512(p, i); }
  // Lanes where x > best (strict: a lane keeps its first maximum; NaN never wins) take x and idx.
  static void keep_greater(V x, I idx, V* best, I* bidx) {
    const __mmask16 gt = _mm512_cmp_ps_mask(x, *best, _CMP_GT_OQ);
    *best = _mm512_mask_mov_ps(*best, gt, x);
    *bidx = _mm512_mask_mov_epi32(*bidx, gt, idx);
  }
};

}  // namespace
}  // namespace fantai::cpu::vt_avx512
#endif
