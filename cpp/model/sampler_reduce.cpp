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
