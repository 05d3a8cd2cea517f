// cpu: the scalar ends of the sampler's row reductions, shared by every ISA's kernel table
// (kernels_reduce_impl.h); compiled with the baseline flags, so no ISA TU defines them.
#include "cpu/row_reduce.h"

#include <cmath>
#include <limits>

namespace fantai::cpu {

bool finish_max(const float* lanes, int nl, bool any_nan, const float* l, int32_t nv, int32_t n,
                MaxSumExp* r) {
  r->max = -std::numeric_limits<float>::infinity();
  for (int k = 0; k < nl; ++k) r->max = lanes[k] > r->max ? lanes[k] : r->max;
  for (int32_t i = nv; i < n; ++i) {
    if (std::isnan(l[i])) any_nan = true;
    r->max = l[i] > r->max ? l[i] : r->max;
  }
  if (any_nan || r->max == std::numeric_limits<float>::infinity()) {
    r->sum = std::numeric_limits<double>::quiet_NaN();
    return false;
  }
  return true;
}

void finish_sum(const double* lanes, int nl, const float* l, int32_t nv, int32_t n, MaxSumExp* r) {
  double sum = 0.0;
  for (int k = 0; k < nl; ++k) sum += lanes[k];  // fixed order
  for (int32_t i = nv; i < n; ++i) sum += std::exp(l[i] - r->max);
  r->sum = sum;
}

int32_t finish_argmax(const float* bv, const int32_t* bi, int nl, const float* l, int32_t nv, int32_t n) {
  int32_t arg = 0;
  float val = l[0];
  int32_t i = 1;
  if (nv > 0) {
    val = bv[0];
    arg = bi[0];
    for (int k = 1; k < nl; ++k) {
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

}  // namespace fantai::cpu
