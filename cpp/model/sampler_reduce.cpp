// model: scalar reference of the sampler's row reductions and the run-time ISA dispatch.
#include "model/sampler_reduce.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fantai::model::reduce {
namespace {

MaxSumExp max_sum_exp_scalar(const float* l, int32_t n) {
  MaxSumExp r;
  r.max = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) r.max = std::max(r.max, l[i]);  // NaN never wins std::max here
  for (int32_t i = 0; i < n; ++i) r.sum += std::exp(l[i] - r.max);  // NaN / inf - inf poison it
  return r;
}

int32_t argmax_scalar(const float* l, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) {
    if (l[i] > l[best]) best = i;  // strict: ties keep the lowest id
  }
  return best;
}

}  // namespace

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

int32_t finish_argmax(const float* bv, const int32_t* bi, int nl, const float* l, int32_t nv,
                      int32_t n) {
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

MaxSumExp max_sum_exp_isa(cpu::Isa isa, const float* l, int32_t n) {
  switch (isa) {
    case cpu::Isa::kAvx512: return max_sum_exp_avx512(l, n);
    case cpu::Isa::kAvx2: return max_sum_exp_avx2(l, n);
    case cpu::Isa::kScalar: break;
  }
  return max_sum_exp_scalar(l, n);
}

int32_t argmax_isa(cpu::Isa isa, const float* l, int32_t n) {
  switch (isa) {
    case cpu::Isa::kAvx512: return argmax_avx512(l, n);
    case cpu::Isa::kAvx2: return argmax_avx2(l, n);
    case cpu::Isa::kScalar: break;
  }
  return argmax_scalar(l, n);
}

MaxSumExp max_sum_exp(const float* l, int32_t n) {
  static const cpu::Isa isa = cpu::active_isa();
  return max_sum_exp_isa(isa, l, n);
}

int32_t argmax(const float* l, int32_t n) {
  static const cpu::Isa isa = cpu::active_isa();
  return argmax_isa(isa, l, n);
}

}  // namespace fantai::model::reduce
