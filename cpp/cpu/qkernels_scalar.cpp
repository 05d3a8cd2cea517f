// cpu: quantized-weight kernels, portable: 8 plain-float lanes with the same fixed accumulation
// pattern as the SIMD files and as the dense scalar kernels.
#include <cstdint>

#include "cpu/qkernels.h"

namespace fantai::cpu {
namespace scalar_q {

struct QT {
  static constexpr const char* kName = "scalar";
  static constexpr int W = 8;
  static constexpr int kTileRows = 2, kTileCols = 4, kDecodeCols = 4;
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
  static V keep_n(V a, int n) { for (int i = n; i < W; ++i) a.v[i] = 0.f; return a; }
  // Two roundings, like the dense scalar VT::fma (no FMA on the baseline target).
  static V fma(V a, V b, V c) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  static V add(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
  static V sub(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] - b.v[i]; return r; }
  static V mul_exact(V a, V b) { V r; for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
  static V u8(const uint8_t* p) { V r; for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i]); return r; }
  static V nib_lo(const uint8_t* p) { V r; for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i] & 15); return r; }
  static V nib_hi(const uint8_t* p) { V r; for (int i = 0; i < W; ++i) r.v[i] = static_cast<float>(p[i] >> 4); return r; }
  // Same pairwise tree as the dense scalar VT::hsum.
  static float hsum(V a) {
    const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
    return (s0 + s2) + (s1 + s3);
  }
};

namespace {  // internal linkage: no symbol of one ISA can stand in for another
#include "cpu/qkernels_impl.h"
}  // namespace

}  // namespace scalar_q

const QKernelTable* scalar_qkernels() { return &scalar_q::kQTable; }

}  // namespace fantai::cpu
