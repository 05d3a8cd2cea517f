// model: the sampler's vocab-length row reductions (max, sum of exp, argmax), vectorized per ISA.
//
// These passes are most of a greedy step's sampling time (three reads of a 49k-float row per
// sequence; the sum needs an exp per token). The scalar versions are the reference; the SIMD ones
// use a polynomial exp (float, <= 2 ulp, results below 2^-126 flushed to 0) and sum in double, so
// the sum differs from the reference by ~1e-7 relative. Every variant reads a row in a fixed
// order that depends only on its length: a row's result never depends on the batch.
#pragma once

#include <cstdint>

#include "cpu/cpu_features.h"

namespace fantai::model::reduce {

struct MaxSumExp {
  float max = 0.0f;   // largest non-NaN value (-inf when all are -inf / NaN)
  double sum = 0.0;   // sum of exp(l - max); NaN when the row holds a NaN or max is +inf
};

// Dispatched on cpu::active_isa() (FANTAI_CPU_ISA can lower it).
MaxSumExp max_sum_exp(const float* l, int32_t n);
// First index of the largest value (ties: the lowest id; NaN never wins); n >= 1.
int32_t argmax(const float* l, int32_t n);

// One ISA level explicitly (tests); a level the CPU lacks must not be asked for.
MaxSumExp max_sum_exp_isa(cpu::Isa isa, const float* l, int32_t n);
int32_t argmax_isa(cpu::Isa isa, const float* l, int32_t n);

// Per-ISA bodies (sampler_reduce_<isa>.cpp).
MaxSumExp max_sum_exp_avx2(const float* l, int32_t n);
int32_t argmax_avx2(const float* l, int32_t n);
MaxSumExp max_sum_exp_avx512(const float* l, int32_t n);
int32_t argmax_avx512(const float* l, int32_t n);

// The scalar ends those bodies share, after their vector part has covered l[0, nv) in nl lanes
// (kept in the baseline sampler_reduce.cpp, so no ISA TU defines them).
// r.max = max of the lanes' maxima, then of l[nv, n) in order. False, with r.sum = NaN, when the
// row holds a NaN (any_nan: the vector part saw one) or its max is +inf: no sum to take then.
bool finish_max(const float* lanes, int nl, bool any_nan, const float* l, int32_t nv, int32_t n,
                MaxSumExp* r);
// r.sum = the lanes' double sums in lane order, then exp(l[i] - r.max) for l[nv, n) in order.
void finish_sum(const double* lanes, int nl, const float* l, int32_t nv, int32_t n, MaxSumExp* r);
// Lane k holds its first maximum bv[k] at index bi[k]: the lowest index among the lanes holding
// the maximum, then the tail l[nv, n) (later ids: strict). nv == 0: a plain scan of l.
int32_t finish_argmax(const float* bv, const int32_t* bi, int nl, const float* l, int32_t nv,
                      int32_t n);

}  // namespace fantai::model::reduce
