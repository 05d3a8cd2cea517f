// model: AVX-512 sampler row reductions (built with the AVX-512 flags; called only when the CPU
// has them). See sampler_reduce.h for the contract.
#include <cmath>
#include <limits>

#include "model/sampler_reduce.h"

#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the intrinsics' own _mm*_undefined_* placeholders (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

namespace fantai::model::reduce {
namespace {

// exp(d) for d <= 0 (Cephes expf: 2^n * p(r), |r| <= ln2/2); d < -87.3 (incl. -inf) gives 0.
inline __m512 exp_nonpos(__m512 d) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 keep = _mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ);
  d = _mm512_max_ps(d, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), d);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

}  // namespace

MaxSumExp max_sum_exp_avx512(const float* l, int32_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int32_t nv = n - n % 16;
  __m512 mx = _mm512_set1_ps(kNegInf);
  __mmask16 nan = 0;
  for (int32_t i = 0; i < nv; i += 16) {
    const __m512 x = _mm512_loadu_ps(l + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    mx = _mm512_max_ps(x, mx);  // second operand on NaN: NaN never wins
  }
  alignas(64) float lanes_max[16];
  _mm512_store_ps(lanes_max, mx);
  MaxSumExp r;
  r.max = kNegInf;
  for (float v : lanes_max) r.max = v > r.max ? v : r.max;
  for (int32_t i = nv; i < n; ++i) {
    if (std::isnan(l[i])) nan = 1;
    r.max = l[i] > r.max ? l[i] : r.max;
  }
  if (nan || r.max == std::numeric_limits<float>::infinity()) {
    r.sum = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  const __m512 m = _mm512_set1_ps(r.max);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int32_t i = 0; i < nv; i += 16) {
    const __m512 y = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(l + i), m));
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1)));
  }
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, s0);
  _mm512_store_pd(lanes + 8, s1);
  double sum = 0.0;
  for (double v : lanes) sum += v;  // fixed order
  for (int32_t i = nv; i < n; ++i) sum += std::exp(l[i] - r.max);
  r.sum = sum;
  return r;
}

int32_t argmax_avx512(const float* l, int32_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int32_t nv = n - n % 16;
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i best_idx = _mm512_setzero_si512();
  const __m512i step = _mm512_set1_epi32(16);
  for (int32_t i = 0; i < nv; i += 16) {
    const __m512 x = _mm512_loadu_ps(l + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);  // strict: a lane keeps its first max
    best = _mm512_mask_mov_ps(best, gt, x);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_si512(bi, best_idx);
  // The lowest index among the lanes holding the maximum, then the tail (later ids: strict).
  int32_t arg = 0;
  float val = l[0];
  int32_t i = 1;
  if (nv > 0) {
    val = bv[0];
    arg = bi[0];
    for (int k = 1; k < 16; ++k) {
      if (bv[k] > val || (bv[k] == val && bi[k] < arg)) {
        val = bv[k];
        arg = bi[k];
      }
    }
    i = nv;
  }
  for (; i < n; ++i) {
    if (l[i] > val) {
      val = l[i];
      arg = i;
    }
  }
  return arg;
}

}  // namespace fantai::model::reduce
#else  // not x86-64: the dispatcher never picks this level; keep the symbols linkable.
namespace fantai::model::reduce {
MaxSumExp max_sum_exp_avx512(const float* l, int32_t n) { return max_sum_exp_isa(cpu::Isa::kScalar, l, n); }
int32_t argmax_avx512(const float* l, int32_t n) { return argmax_isa(cpu::Isa::kScalar, l, n); }
}  // namespace fantai::model::reduce
#endif
