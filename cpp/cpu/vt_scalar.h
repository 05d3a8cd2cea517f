// cpu: portable vector traits VT (any target): 8 plain-float "lanes" so the compiler may use SSE,
// with the same fixed accumulation pattern as vt_avx2.h / vt_avx512.h (results differ from them
// only by rounding). The one definition behind kernels_scalar.cpp and qkernels_scalar.cpp; VT sits
// in an anonymous namespace like the SIMD ones, so each TU keeps its own copy.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/types.h"

namespace fantai::cpu::vt_scalar {
namespace {

struct VT {
  static constexpr const char* kName = "scalar";
  static constexpr int W = 8;
  struct V {
    float v[W];
  };

  static V zero() {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = 0.f;
    return r;
  }
  static V set1(float a) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a;
    return r;
  }
  static V load(const float* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static V load_n(const float* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, V a) {
    for (int i = 0; i < W; ++i) p[i] = a.v[i];
  }
  static void store_n(float* p, V a, int n) {
    for (int i = 0; i < n; ++i) p[i] = a.v[i];
  }
  // First n lanes of a, the rest 0.
  static V keep_n(V a, int n) {
    for (int i = n; i < W; ++i) a.v[i] = 0.f;
    return a;
  }
  static V load_bf16(const uint16_t* p) { return load_bf16_n(p, W); }
  static V load_bf16_lean(const uint16_t* p) { return load_bf16_n(p, W); }
  static V load_bf16_n(const uint16_t* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = bf16_to_f32(p[i]);
    return r;
  }
  static V pin(V a) { return a; }  // the vector levels keep a in a register
  // 2W bf16 in the pair layout: element i of the first half at p[2i], of the second at p[2i + 1].
  static V bf16_pair_lo(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = bf16_to_f32(p[2 * i]);
    return r;
  }
  static V bf16_pair_hi(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = bf16_to_f32(p[2 * i + 1]);
    return r;
  }
  static V load_f16(const uint16_t* p) { return load_f16_n(p, W); }
  static V load_f16_n(const uint16_t* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = f16_to_f32(p[i]);
    return r;
  }
  static V load_i8(const int8_t* p) { return load_i8_n(p, W); }
  static V load_i8_n(const int8_t* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  // 8 unsigned bytes, or the low / high nibbles of 8 bytes, as float lanes (quantized weights).
  static V u8(const uint8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  static V nib_lo(const uint8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i] & 15);
    return r;
  }
  static V nib_hi(const uint8_t* p) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i] >> 4);
    return r;
  }
  // Two roundings (no FMA on the baseline target); fixed, so still batch invariant.
  static V fma(V a, V b, V c) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static float fma1(float a, float b, float c) { return a * b + c; }  // two roundings, as fma
  static V add(V a, V b) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
  static V sub(V a, V b) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] - b.v[i];
    return r;
  }
  static V mul(V a, V b) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  // As mul: the x86-64 baseline has no FMA to contract the product into.
  static V mul_exact(V a, V b) { return mul(a, b); }
  static V div(V a, V b) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] / b.v[i];
    return r;
  }
  static V max(V a, V b) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  // Lane-wise a < b ? x : y.
  static V select_lt(V a, V b, V x, V y) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] < b.v[i] ? x.v[i] : y.v[i];
    return r;
  }
  static float hmax(V a) {
    float m = a.v[0];
    for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m;
    return m;
  }
  static V exp(V a) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = std::exp(a.v[i]);
    return r;
  }
  // Pairwise tree, same shape as the SIMD reductions.
  static float hsum(V a) {
    const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
    return (s0 + s2) + (s1 + s3);
  }
  // Lane i = hsum(a[i]) (the SIMD files compute W of them at once).
  static V hsum_w(const V* a) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = hsum(a[i]);
    return r;
  }

  static V exp_nonpos(V d) { return exp(d); }
  // The sampler's row reductions (kernels_reduce_impl.h): W double sums, a NaN flag, W indices.
  struct DAcc {
    double v[W];
  };
  static DAcc dzero() {
    DAcc a;
    for (int i = 0; i < W; ++i) a.v[i] = 0.0;
    return a;
  }
  static DAcc dadd(DAcc a, V y) {
    for (int i = 0; i < W; ++i) a.v[i] += static_cast<double>(y.v[i]);
    return a;
  }
  static void dstore(double* p, DAcc a) {
    for (int i = 0; i < W; ++i) p[i] = a.v[i];
  }
  using NanAcc = bool;
  static NanAcc nan_none() { return false; }
  static NanAcc nan_or(NanAcc acc, V x) {
    for (int i = 0; i < W; ++i) acc = acc || x.v[i] != x.v[i];
    return acc;
  }
  static bool nan_any(NanAcc acc) { return acc; }
  struct I {
    int32_t v[W];
  };
  static I iota() {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = i;
    return r;
  }
  static I inext(I a) {
    for (int i = 0; i < W; ++i) a.v[i] += W;
    return a;
  }
  static I izero() {
    I r;
    for (int i = 0; i < W; ++i) r.v[i] = 0;
    return r;
  }
  static void istore(int32_t* p, I a) {
    for (int i = 0; i < W; ++i) p[i] = a.v[i];
  }
  // Lanes where x > best (strict: a lane keeps its first maximum; NaN never wins) take x and idx.
  static void keep_greater(V x, I idx, V* best, I* bidx) {
    for (int i = 0; i < W; ++i) {
      if (x.v[i] > best->v[i]) {
        best->v[i] = x.v[i];
        bidx->v[i] = idx.v[i];
      }
    }
  }
};

}  // namespace
}  // namespace fantai::cpu::vt_scalar
