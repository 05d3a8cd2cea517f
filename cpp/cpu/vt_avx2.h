// cpu: AVX2 + FMA + F16C vector traits VT, 8 lanes: the one definition behind kernels_avx2.cpp,
// qkernels_avx2.cpp and qkernels_panel_avx2.cpp.
//
// Include it last in a TU, after every baseline header: from here on the TU is AVX2 code (the
// per-file CMake flags, or the pragma below where a target in another CMake directory compiles
// the file without them). VT sits in an anonymous namespace, so each TU gets its own copy with
// internal linkage and no AVX2 code can become the symbol a baseline caller links to; for the
// same reason nothing here is an external-linkage inline function or a std:: template.
// FANTAI_VT_AVX2 is defined when this compiler can build it; a TU falls back otherwise.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#pragma GCC target("avx2,fma,f16c")
#endif

#if defined(__x86_64__) && ((defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || \
                            (defined(__GNUC__) && !defined(__clang__)))
#define FANTAI_VT_AVX2 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace fantai::cpu::vt_avx2 {
namespace {

alignas(32) const int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
// VT::load_bf16's shuffle control: bf16 element i of each 128-bit lane's copy into the high half
// of 32-bit lane i (lane 0 takes elements 0-3, lane 1 4-7).
alignas(32) const int8_t kBf16Spread[32] = {-1, -1, 0, 1, -1, -1, 2,  3,  -1, -1, 4,  5,  -1, -1, 6,  7,
                                            -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15};

struct VT {
  static constexpr const char* kName = "avx2";
  static constexpr int W = 8;
  using V = __m256;

  // First n lanes set (n in [0, 8]).
  static __m256i mask(int n) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTable + 8 - n));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_n(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static void store_n(float* p, V a, int n) { _mm256_maskstore_ps(p, mask(n), a); }
  // First n lanes of a, the rest 0.
  static V keep_n(V a, int n) { return _mm256_and_ps(a, _mm256_castsi256_ps(mask(n))); }
  static __m128i load8_u16_n(const uint16_t* p, int n) {
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    __builtin_memcpy(t, p, static_cast<unsigned>(n) * 2);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  // 8 bf16 already in a register (the tails): widened in place, as a broadcast from a register
  // would take a port-5 op of its own.
  static V bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  // 8 bf16 from memory: both 128-bit lanes get all 8 (a broadcast load, no ALU port), then one
  // in-lane byte shuffle moves elements 0-3 (lane 0) and 4-7 (lane 1) into the high 16 bits of
  // their 32-bit lanes. Same values as bf16x8, whose shift runs on Intel's FMA ports (p0/p1).
  static V load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(kBf16Spread))));
  }
  // load_bf16 with vpshufb reading its control from memory: no register holds it. Attention's
  // few-row PV tile (3 rows x 4 chunks of accumulators, 3 weights, the value) needs all 16, and
  // with the control in one GCC spilled an accumulator whose store-to-load round trip then
  // gated every key.
  static V load_bf16_lean(const uint16_t* p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __asm__("vpshufb %1, %0, %0" : "+x"(v) : "m"(kBf16Spread));
    return _mm256_castsi256_ps(v);
  }
  static V load_bf16_n(const uint16_t* p, int n) { return bf16x8(load8_u16_n(p, n)); }
  // The two halves of 2W bf16 in the pair layout (element i of each half in 32-bit lane i, the
  // first half low), each by one in-lane byte shuffle into the high 16 bits of its lane. A shift
  // and a mask give the same bits but run on Intel's FMA ports (p0/p1) and were no faster than
  // the row-major loads; vpshufb runs on p5.
  static V bf16_pair_lo(const uint16_t* p) {
    const __m256i c = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13, -1, -1, 0, 1,
                                       -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13);
    return _mm256_castsi256_ps(
        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), c));
  }
  static V bf16_pair_hi(const uint16_t* p) {
    const __m256i c = _mm256_setr_epi8(-1, -1, 2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1, 2,
                                       3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15);
    return _mm256_castsi256_ps(
        _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), c));
  }
  // a, held in a register from here: GCC otherwise folds a tile's x loads into every FMA that
  // uses them, a load per FMA.
  static V pin(V a) {
    __asm__("" : "+x"(a));
    return a;
  }
  // The same for an integer vector (the int8 panel tiles' running sums).
  static __m256i pin(__m256i a) {
    __asm__("" : "+x"(a));
    return a;
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_f16_n(const uint16_t* p, int n) { return _mm256_cvtph_ps(load8_u16_n(p, n)); }
  static V i8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
  static V load_i8(const int8_t* p) { return i8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static V load_i8_n(const int8_t* p, int n) {
    alignas(16) int8_t t[16] = {};
    __builtin_memcpy(t, p, static_cast<unsigned>(n));
    return i8x8(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  // 8 unsigned bytes, or the low / high nibbles of 8 bytes, as float lanes (quantized weights).
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
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // a * b + c with one rounding, spelled out so no compiler contraction choice can change it.
  static float fma1(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  // The product stays rounded: the empty asm hides it from FMA contraction with a following add.
  static V mul_exact(V a, V b) {
    V r = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(r));
    return r;
  }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  // Lane-wise a < b ? x : y.
  static V select_lt(V a, V b, V x, V y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static float hmax(V a) {  // max is exact: any order
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // (l0+l4, l1+l5, l2+l6, l3+l7) then ((0+2), (1+3)) then the pair: one fixed tree.
  static float hsum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Lane i = hsum(a[i]) for 8 vectors at once: the same tree per vector run transposed (IEEE
  // addition commutes, so every lane is bit-identical to hsum's).
  static V hsum_w(const V* a) {
    V x[4], z[2];
    for (int i = 0; i < 4; ++i)  // lanes 0-3: a[2i] folded 8->4; lanes 4-7: a[2i+1]
      x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i) {  // half h: vectors 4i+h (lanes 0-1) and 4i+h+2 (lanes 2-3), 4->2
      const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(x[2 * i]), _mm256_castps_pd(x[2 * i + 1]));
      const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(x[2 * i]), _mm256_castps_pd(x[2 * i + 1]));
      z[i] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
    }
    // Half h, lane m: vector h + 2m; then lanes back into vector order.
    const V r = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  // exp (Cephes expf) of x already clamped to [-87.33654, 88.37626]: range-reduce by ln2
  // (two-part constant), degree-5 polynomial, scale by 2^n.
  static V exp_clamped(V x) {
    const V fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    V p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  // exp of any x: clamped into exp_clamped's range (the kernels' softmax and SiLU).
  static V exp(V x) {
    return exp_clamped(
        _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f)));
  }
  // exp of d <= 0 with d < -87.33654 (incl. -inf) flushed to 0 rather than clamped (the
  // sampler's sum of exps, where those terms must vanish).
  static V exp_nonpos(V d) {
    const V lo = _mm256_set1_ps(-87.33654f);
    const V keep = _mm256_cmp_ps(d, lo, _CMP_GE_OQ);
    return _mm256_and_ps(keep, exp_clamped(_mm256_max_ps(d, lo)));
  }

  // The sampler's row reductions (kernels_reduce_impl.h): W double sums, a NaN flag, W indices.
  struct DAcc {
    __m256d lo, hi;
  };
  static DAcc dzero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static DAcc dadd(DAcc a, V y) {
    return {_mm256_add_pd(a.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(y))),
            _mm256_add_pd(a.hi, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)))};
  }
  static void dstore(double* p, DAcc a) {
    _mm256_storeu_pd(p, a.lo);
    _mm256_storeu_pd(p + 4, a.hi);
  }
  using NanAcc = __m256;
  static NanAcc nan_none() { return _mm256_setzero_ps(); }
  static NanAcc nan_or(NanAcc acc, V x) { return _mm256_or_ps(acc, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
  static bool nan_any(NanAcc acc) { return _mm256_movemask_ps(acc) != 0; }
  using I = __m256i;
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I inext(I i) { return _mm256_add_epi32(i, _mm256_set1_epi32(W)); }
  static I izero() { return _mm256_setzero_si256(); }
  static void istore(int32_t* p, I i) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), i); }
  // Lanes where x > best (strict: a lane keeps its first maximum; NaN never wins) take x and idx.
  static void keep_greater(V x, I idx, V* best, I* bidx) {
    const __m256 gt = _mm256_cmp_ps(x, *best, _CMP_GT_OQ);
    *best = _mm256_blendv_ps(*best, x, gt);
    *bidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(*bidx), _mm256_castsi256_ps(idx), gt));
  }
};

}  // namespace
}  // namespace fantai::cpu::vt_avx2
#endif
