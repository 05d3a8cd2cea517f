// cpu: the sampler's vocab-length row reductions (max, sum of exp, argmax), one per kernel table
// (kernels_reduce_impl.h, over each ISA's VT), reached by sampling/ through the backend seam
// (host_row_reductions in backend.h).
//
// These passes are most of a greedy step's sampling time (three reads of a 49k-float row per
// sequence; the sum needs an exp per token). ref::max_sum_exp / ref::argmax (kernels_ref.cpp) are
// the reference; the SIMD tables use a polynomial exp (float, <= 2 ulp, results below 2^-126
// flushed to 0) and sum in W double lanes, so the sum differs from the reference by ~1e-7
// relative. Every variant reads a row in a fixed order that depends only on its length: a row's
// result never depends on the batch.
#pragma once

#include <cstdint>

#include "common/op_types.h"

namespace fantai::cpu {

// The scalar ends every table's reduction shares, after its vector part has covered l[0, nv) in
// nl lanes.
// r.max = max of the lanes' maxima, then of l[nv, n) in order. False, with r.sum = NaN, when the
// row holds a NaN (any_nan: the vector part saw one) or its max is +inf: no sum to take then.
bool finish_max(const float* lanes, int nl, bool any_nan, const float* l, int32_t nv, int32_t n,
                MaxSumExp* r);
// r.sum = the lanes' double sums in lane order, then exp(l[i] - r.max) for l[nv, n) in order.
void finish_sum(const double* lanes, int nl, const float* l, int32_t nv, int32_t n, MaxSumExp* r);
// Lane k holds its first maximum bv[k] at index bi[k]: the lowest index among the lanes holding
// the maximum, then the tail l[nv, n) (later ids: strict). nv == 0: a plain scan of l.
int32_t finish_argmax(const float* bv, const int32_t* bi, int nl, const float* l, int32_t nv, int32_t n);

}  // namespace fantai::cpu
