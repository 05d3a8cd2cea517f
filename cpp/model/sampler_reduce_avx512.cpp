// model: AVX-512 sampler row reductions (built with the AVX-512 flags; called only when the CPU
// has them). See sampler_reduce.h for the contract.
#include <limits>

#include "model/sampler_reduce.h"

// Last: the rest of this file is AVX-512 code (see the header).
#include "cpu/vt_avx512.h"

#ifdef FANTAI_VT_AVX512
namespace fantai::model::reduce {
using VT = cpu::vt_avx512::VT;

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
  if (!finish_max(lanes_max, 16, nan != 0, l, nv, n, &r)) return r;
  const __m512 m = _mm512_set1_ps(r.max);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int32_t i = 0; i < nv; i += 16) {
    const __m512 y = VT::exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(l + i), m));
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(y)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(y, 1)));
  }
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, s0);
  _mm512_store_pd(lanes + 8, s1);
  finish_sum(lanes, 16, l, nv, n, &r);
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
  return finish_argmax(bv, bi, 16, l, nv, n);
}

}  // namespace fantai::model::reduce
#else  // ISA not buildable here: the dispatcher never picks this level; keep the symbols linkable.
namespace fantai::model::reduce {
MaxSumExp max_sum_exp_avx512(const float* l, int32_t n) { return max_sum_exp_isa(cpu::Isa::kScalar, l, n); }
int32_t argmax_avx512(const float* l, int32_t n) { return argmax_isa(cpu::Isa::kScalar, l, n); }
}  // namespace fantai::model::reduce
#endif
