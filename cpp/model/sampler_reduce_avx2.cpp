// model: AVX2 sampler row reductions (built with the AVX2 flags; called only when the CPU has
// them). See sampler_reduce.h for the contract.
#include <limits>

#include "model/sampler_reduce.h"

// Last: the rest of this file is AVX2 code (see the header).
#include "cpu/vt_avx2.h"

#ifdef FANTAI_VT_AVX2
namespace fantai::model::reduce {
using VT = cpu::vt_avx2::VT;

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
  if (!finish_max(lanes_max, 8, _mm256_movemask_ps(nan) != 0, l, nv, n, &r)) return r;
  const __m256 m = _mm256_set1_ps(r.max);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int32_t i = 0; i < nv; i += 8) {
    const __m256 y = VT::exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(l + i), m));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(y)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, s0);
  _mm256_store_pd(lanes + 4, s1);
  finish_sum(lanes, 8, l, nv, n, &r);
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
  return finish_argmax(bv, bi, 8, l, nv, n);
}

}  // namespace fantai::model::reduce
#else  // ISA not buildable here: the dispatcher never picks this level; keep the symbols linkable.
namespace fantai::model::reduce {
MaxSumExp max_sum_exp_avx2(const float* l, int32_t n) { return max_sum_exp_isa(cpu::Isa::kScalar, l, n); }
int32_t argmax_avx2(const float* l, int32_t n) { return argmax_isa(cpu::Isa::kScalar, l, n); }
}  // namespace fantai::model::reduce
#endif
