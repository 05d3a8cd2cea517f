// cpu: the sampler's row reductions written once over VT (see row_reduce.h for the contract);
// included by kernels_impl.h inside each ISA's namespace, like the other kernel bodies.
#pragma once

// Largest non-NaN value and sum of exp(l - max) in W double lanes. NaN or +inf: sum = NaN.
MaxSumExp row_max_sum_exp(const float* l, int32_t n) {
  const int32_t nv = n - n % W;
  V mx = VT::set1(-__builtin_inff());
  typename VT::NanAcc nan = VT::nan_none();
  for (int32_t i = 0; i < nv; i += W) {
    const V x = VT::load(l + i);
    nan = VT::nan_or(nan, x);
    mx = VT::max(x, mx);  // NaN in x keeps mx: NaN never wins
  }
  float lanes_max[W];
  VT::store(lanes_max, mx);
  MaxSumExp r;
  if (!finish_max(lanes_max, W, VT::nan_any(nan), l, nv, n, &r)) return r;
  const V m = VT::set1(r.max);
  typename VT::DAcc s = VT::dzero();
  for (int32_t i = 0; i < nv; i += W) s = VT::dadd(s, VT::exp_nonpos(VT::sub(VT::load(l + i), m)));
  double lanes[W];
  VT::dstore(lanes, s);
  finish_sum(lanes, W, l, nv, n, &r);
  return r;
}

// First index of the largest value: each lane keeps its first maximum, finish_argmax the lowest.
int32_t row_argmax(const float* l, int32_t n) {
  const int32_t nv = n - n % W;
  V best = VT::set1(-__builtin_inff());
  typename VT::I idx = VT::iota(), best_idx = VT::izero();
  for (int32_t i = 0; i < nv; i += W) {
    VT::keep_greater(VT::load(l + i), idx, &best, &best_idx);
    idx = VT::inext(idx);
  }
  float bv[W];
  int32_t bi[W];
  VT::store(bv, best);
  VT::istore(bi, best_idx);
  return finish_argmax(bv, bi, W, l, nv, n);
}
