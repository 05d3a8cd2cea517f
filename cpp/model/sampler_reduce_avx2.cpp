// model: AVX2 sampler row reductions (built with the AVX2 flags; called only when the CPU has
// them). See sampler_reduce.h for the contract.
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

// exp(d) for d <= 0 (Cephes expf, as the AVX-512 body); d < -87.3 (incl. -inf) gives 0.
inline __m256 exp_nonpos(__m256 d) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 keep = _mm256_cmp_ps(d, lo, _CMP_GE_OQ);
  d = _mm256_max_ps(d, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), d);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

}  // namespace

MaxSumExp max_sum_exp_avx2(const float* l, int32_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int32_t nv = n - n % 8;
  __m256 mx = _mm256_set1_ps(kNegInf);
  __m256 nan = _mm256_setzero_ps();
  for (int32_t i = 0; i < nv; i += 8) {
    const __m256 x = _mm256_loadu_ps(l + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mx = _mm256_max_ps(x, mx);  // second operand on NaN: NaN never wins
  }
  alignas(32) float lanes_max[8];
  _mm256_store_ps(lanes_max, mx);
  MaxSumExp r;
  r.max = kNegInf;
  for (float v : lanes_max) r.max = v > r.max ? v : r.max;
  bool bad = _mm256_movemask_ps(nan) != 0;
  for (int32_t i = nv; i < n; ++i) {
    if (std::isnan(l[i])) bad = true;
    r.max = l[i] > r.max ? l[i] : r.max;
  }
  if (bad || r.max == std::numeric_limits<float>::infinity()) {
    r.sum = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  const __m256 m = _mm256_set1_ps(r.max);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int32_t i = 0; i < nv; i += 8) {
    const __m256 y = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(l + i), m));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(y)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, s0);
  _mm256_store_pd(lanes + 4, s1);
  double sum = 0.0;
  for (double v : lanes) sum += v;  // fixed order
  for (int32_t i = nv; i < n; ++i) sum += std::exp(l[i] - r.max);
  r.sum = sum;
  return r;
}

int32_t argmax_avx2(const float* l, int32_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int32_t nv = n - n % 8;
  __m256 best = _mm256_set1_ps(kNegInf);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i best_idx = _mm256_setzero_si256();
  const __m256i step = _mm256_set1_epi32(8);
  for (int32_t i = 0; i < nv; i += 8) {
    const __m256 x = _mm256_loadu_ps(l + i);
    const __m256 gt = _mm256_cmp_ps(x, best, _CMP_GT_OQ);  // strict: a lane keeps its first max
    best = _mm256_blendv_ps(best, x, gt);
    best_idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_idx), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), best_idx);
  // The lowest index among the lanes holding the maximum, then the tail (later ids: strict).
  int32_t arg = 0;
  float val = l[0];
  int32_t i = 1;
  if (nv > 0) {
    val = bv[0];
    arg = bi[0];
    for (int k = 1; k < 8; ++k) {
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
MaxSumExp max_sum_exp_avx2(const float* l, int32_t n) { return max_sum_exp_isa(cpu::Isa::kScalar, l, n); }
int32_t argmax_avx2(const float* l, int32_t n) { return argmax_isa(cpu::Isa::kScalar, l, n); }
}  // namespace fantai::model::reduce
#endif
