// tests: the AMX bf16 dense linear (cpu/kernels_amx.cpp) through the CPU backend's packed-dense
// hooks, against the double-accumulating reference, and its bitwise batch/thread invariance.
// Skips where the CPU or kernel offers no AMX.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "common/types.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/kernels_amx.h"
#include "test_support.h"

namespace fantai::cpu {
namespace {

// precision: Backend::set_matmul_precision (kBF16: activations rounded to bf16, one tile part).
std::shared_ptr<Backend> amx_backend(int threads, DType precision = DType::kF32) {
  if (detected_isa() < Isa::kAvx512 || !amx_usable()) return nullptr;
  auto be = make_cpu_backend(Isa::kAvx512, threads);
  if (be->dense_packed_bytes(DType::kBF16, 16, 32) == 0) return nullptr;
  EXPECT_EQ(precision == DType::kBF16, be->set_matmul_precision(precision));
  return be;
}

#define SKIP_WITHOUT_AMX(be)                                                         \
  if (!(be))                                                                         \
  GTEST_SKIP() << "AMX not usable here (no AMX-TILE/AMX-BF16/AVX512-BF16 in CPUID, " \
                  "no kernel permission for tile data, or FANTAI_AMX=0)"

struct Problem {
  int64_t m, n, k;
  std::vector<float> x, bias;
  std::vector<uint16_t> w;  // bf16 [n, k]
  Problem(int64_t m_, int64_t n_, int64_t k_, uint32_t seed) : m(m_), n(n_), k(k_) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    x.resize(m * k);
    for (auto& v : x) v = d(g);
    bias.resize(n);
    for (auto& v : bias) v = d(g);
    w.resize(n * k);
    for (auto& v : w) v = f32_to_bf16(0.05f * d(g));
  }
};

std::vector<uint8_t> pack(Backend& be, const Problem& p) {
  std::vector<uint8_t> packed(be.dense_packed_bytes(DType::kBF16, p.n, p.k));
  be.pack_dense(p.w.data(), DType::kBF16, p.n, p.k, packed.data());
  return packed;
}

TEST(Amx, LinearMatchesReferenceOnOddShapes) {
  auto be = amx_backend(2);
  SKIP_WITHOUT_AMX(be);
  // k = 1000 and 1536 take the k-chunked sweeps (partial sums parked between chunks); n = 16 is a
  // one-sweep group there.
  for (int64_t m : {1, 3, 17, 64, 200})
    for (int64_t k : {64, 576, 100, 1000, 1536})
      for (int64_t n : {16, 17, 1536}) {
        Problem p(m, n, k, static_cast<uint32_t>(m * 7919 + n * 31 + k));
        const auto packed = pack(*be, p);
        // Without a bias, whole 16-row x 32-column outputs are stored straight from the tiles.
        const float* bias = n == 1536 && m != 17 ? nullptr : p.bias.data();
        std::vector<float> got(m * n, NAN), want(m * n);
        be->linear_packed(p.x.data(), packed.data(), DType::kBF16, bias, got.data(), m, n, k);
        ref::linear(p.x.data(), p.w.data(), DType::kBF16, bias, want.data(), m, n, k);
        // x = hi + lo in bf16 leaves |x| * 2^-17 (hi: 2^-9, lo: 2^-9 of that); f32 accumulation
        // over k terms adds up to k * 2^-24 of sum |x w|. Dropping lo would miss by ~2^-9.
        const float rel = std::ldexp(1.f, -16) + static_cast<float>(k) * std::ldexp(1.f, -24);
        int bad = 0;
        for (int64_t r = 0; r < m && bad < 5; ++r)
          for (int64_t j = 0; j < n && bad < 5; ++j) {
            double mag = 0;
            for (int64_t i = 0; i < k; ++i)
              mag += std::fabs(p.x[r * k + i] * static_cast<double>(bf16_to_f32(p.w[j * k + i])));
            const double err = std::fabs(static_cast<double>(got[r * n + j]) - want[r * n + j]);
            if (!(err <= rel * mag + 1e-6)) {
              ADD_FAILURE() << "m=" << m << " n=" << n << " k=" << k << " y[" << r << "," << j << "] got "
                            << got[r * n + j] << " want " << want[r * n + j] << " bound " << rel * mag;
              ++bad;
            }
          }
      }
}

// bf16 activations: y = bf16(x) . w + bias, so against the reference on the rounded x only the
// f32 accumulation order differs; against the unrounded x the rounding shows (the mode is on).
TEST(Amx, Bf16ActivationsMatchReferenceOnRoundedInputs) {
  auto be = amx_backend(2, DType::kBF16), be32 = amx_backend(2);
  SKIP_WITHOUT_AMX(be);
  // m >= 32 runs row tiles in pairs (m = 40: the pair's second tile partial; 200: a pair then one).
  for (int64_t m : {1, 17, 40, 64, 200})
    for (int64_t k : {64, 100, 576, 1536})
      for (int64_t n : {17, 1536}) {
        Problem p(m, n, k, static_cast<uint32_t>(m * 31 + n * 7 + k));
        const auto packed = pack(*be, p);
        std::vector<float> xr(p.x.size());
        for (size_t i = 0; i < xr.size(); ++i) xr[i] = bf16_to_f32(f32_to_bf16(p.x[i]));
        const float* bias = n == 17 ? p.bias.data() : nullptr;
        std::vector<float> got(m * n, NAN), want(m * n), exact(m * n), f32(m * n);
        be->linear_packed(p.x.data(), packed.data(), DType::kBF16, bias, got.data(), m, n, k);
        be32->linear_packed(p.x.data(), packed.data(), DType::kBF16, bias, f32.data(), m, n, k);
        ref::linear(xr.data(), p.w.data(), DType::kBF16, bias, want.data(), m, n, k);
        ref::linear(p.x.data(), p.w.data(), DType::kBF16, bias, exact.data(), m, n, k);
        const float rel = static_cast<float>(k) * std::ldexp(1.f, -24);
        int bad = 0;
        double moved = 0, moved32 = 0;
        for (int64_t r = 0; r < m && bad < 5; ++r)
          for (int64_t j = 0; j < n && bad < 5; ++j) {
            double mag = 0;
            for (int64_t i = 0; i < k; ++i)
              mag += std::fabs(xr[r * k + i] * static_cast<double>(bf16_to_f32(p.w[j * k + i])));
            const double err = std::fabs(static_cast<double>(got[r * n + j]) - want[r * n + j]);
            moved = std::max(moved, std::fabs(static_cast<double>(got[r * n + j]) - exact[r * n + j]));
            moved32 = std::max(moved32, std::fabs(static_cast<double>(f32[r * n + j]) - exact[r * n + j]));
            if (!(err <= rel * mag + 1e-6)) {
              ADD_FAILURE() << "m=" << m << " n=" << n << " k=" << k << " y[" << r << "," << j << "] got "
                            << got[r * n + j] << " want " << want[r * n + j];
              ++bad;
            }
          }
        // Rounding x to bf16 (2^-9) must show next to the f32 mode's two parts (2^-17).
        EXPECT_GT(moved, 8 * moved32) << "m=" << m << " n=" << n << " k=" << k << ": x not rounded?";
      }
}

TEST(Amx, MatmulPrecisionIsAnAmxChoice) {
  auto be = make_cpu_backend(Isa::kScalar, 1);
  EXPECT_FALSE(be->set_matmul_precision(DType::kBF16));  // vector kernels: f32 products anyway
  EXPECT_FALSE(be->set_matmul_precision(DType::kF32));
  EXPECT_THROW(be->set_matmul_precision(DType::kF16), std::exception);
  auto amx = amx_backend(1);
  SKIP_WITHOUT_AMX(amx);
  EXPECT_TRUE(amx->set_matmul_precision(DType::kBF16));
  EXPECT_FALSE(amx->set_matmul_precision(DType::kF32));
  EXPECT_THROW(amx->set_matmul_precision(DType::kI8), std::exception);
}

// A row's bits depend on nothing but that row: not m, not its position in a 16-row tile, not the
// thread split (the engine's batch invariance rests on it).
TEST(Amx, LinearRowsBitIdenticalAcrossBatchAndThreads) {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    auto be1 = amx_backend(1, precision), be2 = amx_backend(2, precision);
    SKIP_WITHOUT_AMX(be2);
    // Without a bias, full tiles are stored straight into y and partial ones (past m, past n) go
    // through a buffer: a row's bits must not depend on which.
    for (int64_t k : {576, 100, 1536})
      for (bool with_bias : {true, false}) {
        const int64_t n = 1536 + 17, big = 200;
        Problem p(big, n, k, 99 + static_cast<uint32_t>(k));
        const float* bias = with_bias ? p.bias.data() : nullptr;
        const auto packed = pack(*be2, p);
        std::vector<float> all1(big * n), all2(big * n);
        be1->linear_packed(p.x.data(), packed.data(), DType::kBF16, bias, all1.data(), big, n, k);
        be2->linear_packed(p.x.data(), packed.data(), DType::kBF16, bias, all2.data(), big, n, k);
        ASSERT_EQ(0, std::memcmp(all1.data(), all2.data(), all1.size() * 4)) << "1 vs 2 threads, k=" << k;
        for (int64_t m : {1, 7, 16, 33, 200}) {
          // The last m rows, so each lands at a different offset in its 16-row tile than in `all`.
          const int64_t r0 = big - m;
          std::vector<float> y(m * n);
          be2->linear_packed(p.x.data() + r0 * k, packed.data(), DType::kBF16, bias, y.data(), m, n, k);
          EXPECT_EQ(0, std::memcmp(y.data(), all2.data() + r0 * n, y.size() * 4))
              << "m=" << m << " k=" << k << " bias=" << with_bias << " " << dtype_name(precision);
        }
      }
  }
}

// The fused MLP (gate|up with silu * up in its epilogue, written as the down projection's bf16
// halves) gives exactly the bits of linear_packed, silu_mul, linear_packed, on 1 and 2 threads,
// for partial row tiles, hidden sizes that pad k (100) or take the k-chunked sweeps (1000), and
// intermediate sizes of one to many 32-column units; an intermediate size the fused path does
// not take (inter % 32 != 0) is refused, so the caller runs the three ops.
TEST(Amx, FusedMlpBitIdenticalToThreeOps) {
  for (int threads : {1, 2})
    for (DType precision : {DType::kF32, DType::kBF16}) {
      auto be = amx_backend(threads, precision);
      SKIP_WITHOUT_AMX(be);
      for (int64_t hidden : {64, 100, 576, 1000})
        for (int64_t inter : {32, 96, 1536}) {
          Problem gu(200, 2 * inter, hidden, static_cast<uint32_t>(hidden * 13 + inter));
          Problem dn(1, hidden, inter, static_cast<uint32_t>(hidden * 17 + inter));
          const auto gu_p = pack(*be, gu), dn_p = pack(*be, dn);
          for (int64_t m : {1, 7, 16, 33, 200}) {
            std::vector<float> gate_up(m * 2 * inter), act(m * inter), want(m * hidden), got(m * hidden, NAN);
            be->linear_packed(gu.x.data(), gu_p.data(), DType::kBF16, nullptr, gate_up.data(), m, 2 * inter,
                              hidden);
            be->silu_mul(gate_up.data(), act.data(), m, inter);
            be->linear_packed(act.data(), dn_p.data(), DType::kBF16, nullptr, want.data(), m, hidden, inter);
            ASSERT_TRUE(be->mlp_packed(gu.x.data(), gu_p.data(), dn_p.data(), DType::kBF16, got.data(), m,
                                       inter, hidden));
            EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
                << "threads=" << threads << " hidden=" << hidden << " inter=" << inter << " m=" << m << " "
                << dtype_name(precision);
          }
        }
      Problem gu(4, 2 * 48, 64, 5), dn(1, 64, 48, 6);
      const auto gu_p = pack(*be, gu), dn_p = pack(*be, dn);
      std::vector<float> out(4 * 64);
      EXPECT_FALSE(
          be->mlp_packed(gu.x.data(), gu_p.data(), dn_p.data(), DType::kBF16, out.data(), 4, 48, 64));
    }
}

// FANTAI_AMX=0 (or a level below AVX-512) packs bf16 into the vector kernels' pair layout instead:
// the row-major size, and no packed copy of a tied lm_head.
TEST(Amx, DisabledByEnvFallsBackToThePairLayout) {
  if (detected_isa() < Isa::kAvx512 || !amx_usable()) GTEST_SKIP() << "AMX not usable here";
  const test::ScopedEnv amx_env("FANTAI_AMX", "0");
  auto be = make_cpu_backend(Isa::kAvx512, 1);
  EXPECT_EQ(64u * 64 * 2, be->dense_packed_bytes(DType::kBF16, 64, 64));
  EXPECT_FALSE(be->packs_tied_lm_head());
  amx_env.set("1");
  auto amx = make_cpu_backend(Isa::kAvx512, 1);
  EXPECT_GT(amx->dense_packed_bytes(DType::kBF16, 64, 64), 0u);
  EXPECT_TRUE(amx->packs_tied_lm_head());
  EXPECT_EQ(0u, make_cpu_backend(Isa::kAvx512, 1)->dense_packed_bytes(DType::kF32, 64, 64));
  auto avx2 = make_cpu_backend(Isa::kAvx2, 1);
  EXPECT_EQ(0u, avx2->dense_packed_bytes(DType::kBF16, 64, 64)) << "AVX2 keeps bf16 row-major by default";
  EXPECT_FALSE(avx2->packs_tied_lm_head());
  amx_env.set("yes");
  EXPECT_THROW(make_cpu_backend(Isa::kAvx512, 1), std::exception);
}

}  // namespace
}  // namespace fantai::cpu
