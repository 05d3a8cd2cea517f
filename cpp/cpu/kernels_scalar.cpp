// cpu: portable kernels (any target): 8 plain-float "lanes" so the compiler may use SSE, with the
// same fixed accumulation pattern as the SIMD files (results differ from them only by rounding).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/kernels.h"

namespace fantai::cpu {
namespace scalar_impl {

struct VT {
  static constexpr const char* kName = "scalar";
  static constexpr int W = 8;
  static constexpr int kTileRows = 2, kTileCols = 4, kDecodeCols = 4;
  static constexpr int kAttnQkRows = 2, kAttnRows = 4, kAttnChunks = 1;
  static constexpr int kAttnPrefetchBlocks = 1;  // how far ahead attention prefetches K/V
  struct V { float v[W]; };

  static V zero() { V r; for (int i = 0; i < W; ++i) r.v[i] = 0.f; return r; }
  static V set1(float a) { V r; for (int i = 0; i < W; ++i) r.v[i] = a; return r; }
  static V load(const float* p) { V r; for (int i = 0; i < W; ++i) r.v[i] = p[i]; return r; }
  static V load_n(const float* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, V a) { for (int i = 0; i < W; ++i) p[i] = a.v[i]; }
  static void store_n(float* p, V a, int n) { for (int i = 0; i < n; ++i) p[i] = a.v[i]; }
  static V load_bf16(const uint16_t* p) { return load_bf16_n(p, W); }
  static V load_bf16_n(const uint16_t* p, int n) {
    V r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = bf16_to_f32(p[i]);
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
  // Two roundings (no FMA on the baseline target); fixed, so still batch invariant.
  static V fma(V a, V b, V c) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  static float fma1(float a, float b, float c) { return a * b + c; }  // two roundings, as fma
  static V add(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
  static V sub(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
  static V mul(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static V div(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] / b.v[i]; return r; }
  static V max(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
  static float hmax(V a) { float m = a.v[0]; for (int i = 1; i < W; ++i) m = a.v[i] > m ? a.v[i] : m; return m; }
  static V exp(V a) { V r; for (int i = 0; i < W; ++i) r.v[i] = std::exp(a.v[i]); return r; }
  // Pairwise tree, same shape as the SIMD files' reductions.
  static float hsum(V a) {
    const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
    return (s0 + s2) + (s1 + s3);
  }
  // Lane i = hsum(a[i]) (the SIMD files compute W of them at once).
  static V hsum_w(const V* a) { V r; for (int i = 0; i < W; ++i) r.v[i] = hsum(a[i]); return r; }
};

namespace {  // internal linkage: no symbol of one ISA can stand in for another
#include "cpu/kernels_impl.h"
}  // namespace

}  // namespace scalar_impl

const KernelTable* scalar_kernels() { return &scalar_impl::kTable; }

}  // namespace fantai::cpu
