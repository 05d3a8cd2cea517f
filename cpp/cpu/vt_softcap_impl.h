// cpu: attention's logit soft-cap, cap * tanh(s / cap), over a vector-traits type VT; included
// inside each kernel TU's own namespace (kernels_attention_impl.h, attention_amx.cpp) once VT is
// set, so every ISA compiles its own copy. No #include, no std:: (see kernels_impl.h).
#pragma once

// tanh to a few ulp, lane-wise and the same for every lane, so a score's value depends on nothing
// but itself. Below |y| = 1/4 the odd Taylor series through y^11 (the first dropped term is under
// 3e-10 of the result): 1 - exp(-2|y|) would lose the small values to cancellation there. Above,
// (1 - t) / (1 + t) with t = exp(-2|y|) <= 0.61, which keeps 1 - t exact enough (a few ulp).
inline __attribute__((always_inline)) VT::V tanh_v(VT::V y) {
  using V = VT::V;
  const V z = VT::mul(y, y);
  V p = VT::set1(-1382.f / 155925.f);
  p = VT::fma(p, z, VT::set1(62.f / 2835.f));
  p = VT::fma(p, z, VT::set1(-17.f / 315.f));
  p = VT::fma(p, z, VT::set1(2.f / 15.f));
  p = VT::fma(p, z, VT::set1(-1.f / 3.f));
  const V small = VT::fma(VT::mul(y, z), p, y);
  const V a = VT::max(y, VT::sub(VT::zero(), y));
  const V t = VT::exp(VT::mul(a, VT::set1(-2.f)));
  const V one = VT::set1(1.f);
  const V big = VT::div(VT::sub(one, t), VT::add(one, t));
  const V big_signed = VT::select_lt(y, VT::zero(), VT::sub(VT::zero(), big), big);
  return VT::select_lt(a, VT::set1(0.25f), small, big_signed);
}

// cap * tanh(s / cap), as transformers computes it (a division, then the tanh, then the product).
inline __attribute__((always_inline)) VT::V softcap_v(VT::V s, float cap) {
  const VT::V c = VT::set1(cap);
  return VT::mul(c, tanh_v(VT::div(s, c)));
}
