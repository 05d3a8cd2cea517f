// tests: CPU backend ops on every ISA level this machine runs, against the scalar reference
// (cpu/kernels_ref.cpp), plus the bitwise batch-invariance guarantees.
// Over 400 lines: one case per op, every one over every ISA level, sharing the helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/check.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/kernels_amx.h"
#include "cpu/thread_pool.h"
#include "test_support.h"

namespace fantai::cpu {
namespace {

using test::randn;
constexpr auto levels = test::isa_levels;

// f32 values rounded to a 16-bit dtype t (bf16 or f16 only).
std::vector<uint16_t> to_half(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> h(v.size());
  convert_from_f32(v.data(), h.data(), t, v.size());
  return h;
}

// |got - want| <= atol + rtol * |scale| elementwise (scale defaults to want).
void expect_close(const float* got, const float* want, size_t n, float rtol, float atol,
                  const float* scale = nullptr, const char* what = "") {
  int bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    const float s = std::fabs(scale ? scale[i] : want[i]);
    if (!(std::fabs(got[i] - want[i]) <= atol + rtol * s)) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << " want " << want[i];
      ++bad;
    }
  }
}

bool bitwise_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * 4) == 0; }

class Kernels : public ::testing::TestWithParam<Isa> {
 protected:
  // precision: Backend::set_matmul_precision (kBF16 changes only the AMX kernels).
  std::shared_ptr<Backend> be(int threads, DType precision = DType::kF32) {
    auto b = make_cpu_backend(GetParam(), threads);
    b->set_matmul_precision(precision);
    return b;
  }
};

// ---- linear ------------------------------------------------------------------------------------

struct LinShape {
  int64_t m, n, k;
};

void check_linear(Backend& b, LinShape s, DType wt, bool with_bias, uint32_t seed) {
  auto x = randn(s.m * s.k, seed), wf = randn(s.n * s.k, seed + 1), bias = randn(s.n, seed + 2);
  std::vector<uint16_t> wh;
  const void* w = wf.data();
  if (wt != DType::kF32) {
    wh = to_half(wf, wt);
    convert_to_f32(wh.data(), wt, wf.data(), wf.size());  // the values the kernel actually sees
    w = wh.data();
  }
  std::vector<float> y(s.m * s.n), want(s.m * s.n), absx(x.size()), absw(wf.size()), mag(y.size());
  b.linear(x.data(), w, wt, with_bias ? bias.data() : nullptr, y.data(), s.m, s.n, s.k);
  ref::linear(x.data(), w, wt, with_bias ? bias.data() : nullptr, want.data(), s.m, s.n, s.k);
  for (size_t i = 0; i < x.size(); ++i) absx[i] = std::fabs(x[i]);
  for (size_t i = 0; i < wf.size(); ++i) absw[i] = std::fabs(wf[i]);
  ref::linear(absx.data(), absw.data(), DType::kF32, nullptr, mag.data(), s.m, s.n, s.k);
  // f32 accumulation vs double: relative to sum |x*w| (the cancellation-free magnitude).
  expect_close(y.data(), want.data(), y.size(), 1e-5f, 1e-6f, mag.data(), "linear");
}

TEST_P(Kernels, LinearMatchesReference) {
  const LinShape shapes[] = {{1, 1, 1},     {1, 37, 100}, {3, 5, 17},    {5, 33, 576},
                             {37, 70, 129}, {67, 19, 31}, {130, 40, 64}, {2, 9, 15}};
  uint32_t seed = 1;
  for (int threads : {1, 2})
    for (DType wt : {DType::kF32, DType::kBF16, DType::kF16})
      for (const auto& s : shapes)
        for (bool bias : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k << " "
                                            << dtype_name(wt) << " bias=" << bias << " t=" << threads);
          auto b = be(threads);
          check_linear(*b, s, wt, bias, seed++);
        }
}

TEST_P(Kernels, LinearBatchInvariant) {
  const int64_t k = 333;
  // 37 rows: one row block with a partial register tile; 130: three row blocks of the driver.
  // n = 204: with one thread, columns 200..203 sit in a 4-wide register tile in the prefill path
  // but in single-column tiles in the decode path; any epilogue that differs by tile width shows.
  for (int64_t n : {200, 204})
    for (int64_t M : {37, 130})
      for (DType wt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " M=" << M << " " << dtype_name(wt));
        auto x = randn(M * k, 7), wf = randn(n * k, 8), bias = randn(n, 9);
        auto wh = to_half(wf, DType::kBF16);
        const void* w = wt == DType::kF32 ? static_cast<const void*>(wf.data()) : wh.data();
        std::vector<float> full(M * n), part(M * n), one(n);
        be(2)->linear(x.data(), w, wt, bias.data(), full.data(), M, n, k);
        be(1)->linear(x.data(), w, wt, bias.data(), part.data(), M, n, k);
        EXPECT_TRUE(bitwise_equal(full.data(), part.data(), full.size())) << "1 vs 2 threads";
        auto b1 = be(1);
        for (int64_t r = 0; r < M; ++r) {
          b1->linear(x.data() + r * k, w, wt, bias.data(), one.data(), 1, n, k);
          ASSERT_TRUE(bitwise_equal(one.data(), full.data() + r * n, n)) << "row " << r << " m=1 vs m=" << M;
        }
        // Rows 5..13 as their own batch (different tile positions for every row).
        std::vector<float> mid(9 * n);
        be(2)->linear(x.data() + 5 * k, w, wt, bias.data(), mid.data(), 9, n, k);
        EXPECT_TRUE(bitwise_equal(mid.data(), full.data() + 5 * n, mid.size())) << "m=9 slice";
      }
}

// A 16-bit weight widens to f32 exactly and its y element keeps the f32 kernel's chain (one lane
// accumulator per k mod W, then VT::hsum), so y must be the f32 kernel's on the widened weights to
// the bit, whatever loader or tile shape the 16-bit path uses: a lane that widened the wrong
// element, or a loader that changed the chain, changes the bits. k covers whole vector steps of
// every lane width, a masked tail and tails alone.
TEST_P(Kernels, HalfWeightsGiveTheF32KernelsBitsOnTheWidenedValues) {
  for (DType wt : {DType::kBF16, DType::kF16})
    for (int64_t k : {1, 15, 16, 24, 31, 333, 576})
      for (int64_t m : {1, 7, 37}) {
        const int64_t n = 29;
        SCOPED_TRACE(::testing::Message() << dtype_name(wt) << " m=" << m << " k=" << k);
        auto x = randn(m * k, 21), wf = randn(n * k, 22), bias = randn(n, 23);
        auto wh = to_half(wf, wt);
        convert_to_f32(wh.data(), wt, wf.data(), wf.size());
        std::vector<float> half(m * n), full(m * n);
        auto b = be(2);
        b->linear(x.data(), wh.data(), wt, bias.data(), half.data(), m, n, k);
        b->linear(x.data(), wf.data(), DType::kF32, bias.data(), full.data(), m, n, k);
        EXPECT_TRUE(bitwise_equal(half.data(), full.data(), half.size()));
      }
}

// The pair and group layouts keep every y element's chain, so linear_bf16_pairs and
// linear_bf16_groups on a packed matrix must give linear's bits on the row-major one: for k with
// whole pair chunks, a leftover W step, a masked tail, and k below one chunk; row counts that fill
// and split the tiles (m = 1 is the decode path); a column count that leaves a part group (zero
// padded) and a column range that starts and ends inside a group. A half widened from the wrong
// byte pair, halves taken in the wrong order, or a row's chunk read from its neighbour's slot in a
// group changes the bits.
TEST_P(Kernels, Bf16PackedLayoutsGiveTheRowMajorBits) {
  const KernelTable& t = kernels_for(GetParam());
  const int64_t n = 29;
  for (int64_t k : {1, 7, 15, 16, 17, 31, 32, 33, 48, 333, 576})
    for (int64_t m : {1, 2, 3, 4, 5, 9, 37})
      for (bool bias : {false, true}) {
        auto x = randn(m * k, 31), wf = randn(n * k, 32), bv = randn(n, 33);
        auto wh = to_half(wf, DType::kBF16);
        const float* b = bias ? bv.data() : nullptr;
        std::vector<float> want(m * n, -1.f);
        t.linear(x.data(), wh.data(), DType::kBF16, b, want.data(), m, n, k, 0, n);
        for (bool groups : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << (groups ? "groups" : "pairs") << " m=" << m << " k=" << k << " bias=" << bias);
          std::vector<uint16_t> packed(groups ? bf16_groups_bytes(n, k) / 2 : wh.size(), 0xffff);
          if (groups) pack_bf16_groups(wh.data(), n, k, t.lanes, packed.data());
          else pack_bf16_pairs(wh.data(), n, k, t.lanes, packed.data());
          const auto fn = groups ? t.linear_bf16_groups : t.linear_bf16_pairs;
          std::vector<float> got(m * n, -1.f);
          fn(x.data(), packed.data(), b, got.data(), m, n, k, 0, n);
          EXPECT_TRUE(bitwise_equal(got.data(), want.data(), got.size()));
          std::vector<float> part(m * n, -1.f);
          fn(x.data(), packed.data(), b, part.data(), m, n, k, 3, 26);
          for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j)
              ASSERT_EQ(part[r * n + j], j >= 3 && j < 26 ? want[r * n + j] : -1.f)
                  << "r=" << r << " j=" << j;
        }
      }
}

// The group layout's bytes, read back: row j's element i where the layout puts it, and zero rows
// padding the last group (bf16_groups_bytes rounds the rows up to whole groups).
TEST_P(Kernels, Bf16GroupLayoutPlacesEveryElement) {
  const KernelTable& t = kernels_for(GetParam());
  const int G = kBf16GroupRows, L = t.lanes;
  for (int64_t n : {1, 8, 13})
    for (int64_t k : {5, 16, 21}) {
      std::vector<uint16_t> w(n * k);
      for (int64_t e = 0; e < n * k; ++e) w[e] = static_cast<uint16_t>(e + 1);
      std::vector<uint16_t> p(bf16_groups_bytes(n, k) / 2, 0xffff);
      ASSERT_EQ(p.size() % (G * k), 0u);
      pack_bf16_groups(w.data(), n, k, L, p.data());
      const int64_t kv = k - k % L;
      for (int64_t j = 0; j < static_cast<int64_t>(p.size()) / k; ++j)
        for (int64_t i = 0; i < k; ++i) {
          const int64_t base = j / G * G * k, r = j % G;
          const int64_t at = i < kv ? base + i / L * G * L + r * L + i % L
                                    : base + kv * G + r * (k - kv) + i - kv;
          ASSERT_EQ(p[at], j < n ? w[j * k + i] : 0) << "n=" << n << " k=" << k << " j=" << j << " i=" << i;
        }
    }
}

// Where the backend packs bf16 into a vector layout (any level without AMX tiles; FANTAI_BF16_LAYOUT
// picks one), a packed matrix runs on any thread count with the row-major matrix's bits; pairs
// cost no extra bytes, groups only the padding of the last group.
TEST_P(Kernels, PackedBf16MatchesRowMajorOffAmx) {
  const bool amx = GetParam() == Isa::kAvx512 && cpu_switches().amx && amx_usable();
  if (amx) GTEST_SKIP() << "bf16 packs into AMX tiles here (test_amx covers them)";
  for (const char* layout : {"pairs", "groups"}) {
    SCOPED_TRACE(layout);
    std::shared_ptr<Backend> b2, b1;
    {
      const test::ScopedEnv env("FANTAI_BF16_LAYOUT", layout);
      b2 = be(2);
      b1 = be(1);
    }
    const bool groups = !std::strcmp(layout, "groups");
    const int64_t n = 203, k = 333;
    ASSERT_EQ(b2->dense_packed_bytes(DType::kBF16, n, k), static_cast<size_t>((groups ? 208 : n) * k * 2));
    EXPECT_EQ(b2->dense_packed_bytes(DType::kF32, n, k), 0u);
    EXPECT_FALSE(b2->packs_tied_lm_head());
    auto wf = randn(n * k, 41), bias = randn(n, 42);
    auto wh = to_half(wf, DType::kBF16);
    std::vector<uint8_t> packed(b2->dense_packed_bytes(DType::kBF16, n, k));
    b2->pack_dense(wh.data(), DType::kBF16, n, k, packed.data());
    for (int64_t m : {1, 37, 130}) {
      SCOPED_TRACE(::testing::Message() << "m=" << m);
      auto x = randn(m * k, 43);
      std::vector<float> want(m * n), got2(m * n), got1(m * n);
      b2->linear(x.data(), wh.data(), DType::kBF16, bias.data(), want.data(), m, n, k);
      b2->linear_packed(x.data(), packed.data(), DType::kBF16, bias.data(), got2.data(), m, n, k);
      b1->linear_packed(x.data(), packed.data(), DType::kBF16, bias.data(), got1.data(), m, n, k);
      EXPECT_TRUE(bitwise_equal(got2.data(), want.data(), want.size())) << "2 threads";
      EXPECT_TRUE(bitwise_equal(got1.data(), want.data(), want.size())) << "1 thread";
    }
  }
}

// ---- norms, rope, silu, embedding, add ---------------------------------------------------------

TEST_P(Kernels, RmsNormAndAddRmsNorm) {
  for (int64_t dim : {1, 15, 100, 576}) {
    for (int64_t rows : {1, 7, 300}) {
      auto x = randn(rows * dim, 11), w = randn(dim, 12), res = randn(rows * dim, 13);
      std::vector<float> out(x.size()), want(x.size());
      auto b = be(2);
      b->rms_norm(x.data(), w.data(), out.data(), rows, dim, 1e-6f);
      ref::rms_norm(x.data(), w.data(), want.data(), rows, dim, 1e-6f);
      expect_close(out.data(), want.data(), out.size(), 2e-5f, 1e-6f, nullptr, "rms_norm");
      auto inplace = x;  // out aliases x
      b->rms_norm(inplace.data(), w.data(), inplace.data(), rows, dim, 1e-6f);
      EXPECT_TRUE(bitwise_equal(inplace.data(), out.data(), out.size()));

      auto r1 = res, r2 = res;
      b->add_rms_norm(r1.data(), x.data(), w.data(), out.data(), rows, dim, 1e-5f);
      ref::add_rms_norm(r2.data(), x.data(), w.data(), want.data(), rows, dim, 1e-5f);
      EXPECT_TRUE(bitwise_equal(r1.data(), r2.data(), r1.size())) << "residual sum";
      expect_close(out.data(), want.data(), out.size(), 2e-5f, 1e-6f, nullptr, "add_rms_norm");
    }
  }
}

TEST_P(Kernels, Rope) {
  // (head_dim, rotary_dim): full rotation, and Phi-3's partial one (the tail of each head passes).
  for (auto [hd, rot] :
       std::vector<std::pair<int, int>>{{64, 64}, {32, 32}, {8, 8}, {6, 6}, {64, 24}, {96, 32}}) {
    const int nq = 9, nkv = 3, T = 13, max_pos = 50;
    const int64_t stride = (nq + 2 * nkv) * hd + 5;  // fused qkv row with padding
    auto qkv = randn(T * stride, 21);
    std::vector<float> cs(max_pos * rot);
    for (int p = 0; p < max_pos; ++p)
      for (int i = 0; i < rot / 2; ++i) {
        const double f = p * std::pow(10000.0, -2.0 * i / rot);
        cs[p * rot + i] = static_cast<float>(std::cos(f));
        cs[p * rot + rot / 2 + i] = static_cast<float>(std::sin(f));
      }
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = (t * 7 + 3) % max_pos;
    auto got = qkv, want = qkv;
    be(2)->rope(got.data(), stride, got.data() + nq * hd, stride, pos.data(), T, nq, nkv, hd, rot, cs.data());
    ref::rope(want.data(), stride, want.data() + nq * hd, stride, pos.data(), T, nq, nkv, hd, rot, cs.data());
    expect_close(got.data(), want.data(), got.size(), 1e-6f, 1e-6f, nullptr, "rope");
    if (rot < hd) {  // the pass-through dims are the input's bits
      for (int h = 0; h < nq; ++h)
        EXPECT_TRUE(bitwise_equal(got.data() + h * hd + rot, qkv.data() + h * hd + rot, hd - rot));
    }
  }
}

TEST_P(Kernels, RmsNormHeadsInPlace) {
  const int nq = 5, T = 9;
  for (int hd : {16, 64, 100}) {
    const int64_t stride = (nq + 4) * hd + 3;  // q heads as a column slice of a wider row
    auto x = randn(T * stride, 22), w = randn(hd, 23);
    auto got = x, want = x;
    be(2)->rms_norm_heads(got.data(), stride, T, nq, hd, w.data(), 1e-6f);
    ref::rms_norm_heads(want.data(), stride, T, nq, hd, w.data(), 1e-6f);
    expect_close(got.data(), want.data(), got.size(), 2e-5f, 1e-6f, nullptr, "rms_norm_heads");
    for (int t = 0; t < T; ++t)  // columns past the heads are left alone
      EXPECT_TRUE(bitwise_equal(got.data() + t * stride + nq * hd, x.data() + t * stride + nq * hd,
                                stride - nq * hd));
  }
}

TEST_P(Kernels, SiluMul) {
  for (int64_t inter : {1, 17, 1536}) {
    const int64_t rows = 5;
    auto gu = randn(rows * 2 * inter, 31, 3.f);
    gu[0] = -100.f;  // deep in the exp clamp
    std::vector<float> out(rows * inter), want(rows * inter);
    be(2)->silu_mul(gu.data(), out.data(), rows, inter);
    ref::silu_mul(gu.data(), want.data(), rows, inter);
    expect_close(out.data(), want.data(), out.size(), 1e-5f, 1e-6f, nullptr, "silu_mul");
  }
}

TEST_P(Kernels, GeluTanhMul) {
  for (int64_t inter : {1, 17, 1536}) {
    const int64_t rows = 5;
    auto gu = randn(rows * 2 * inter, 32, 3.f);
    gu[0] = -100.f, gu[1] = 100.f, gu[2] = 0.f;  // both saturations and zero
    std::vector<float> out(rows * inter), want(rows * inter);
    be(2)->gelu_tanh_mul(gu.data(), out.data(), rows, inter);
    ref::gelu_tanh_mul(gu.data(), want.data(), rows, inter);
    expect_close(out.data(), want.data(), out.size(), 1e-5f, 1e-6f, nullptr, "gelu_tanh_mul");
  }
}

TEST_P(Kernels, ScaleAndSoftcap) {
  for (int64_t n : {1, 17, 100003}) {
    auto x = randn(n, 33, 40.f);
    auto got = x, want = x;
    be(2)->scale(got.data(), 24.0f, n);
    ref::scale(want.data(), 24.0f, n);
    EXPECT_TRUE(bitwise_equal(got.data(), want.data(), n)) << "scale";
    got = x, want = x;
    be(2)->softcap(got.data(), 30.0f, n);
    ref::softcap(want.data(), 30.0f, n);
    expect_close(got.data(), want.data(), n, 1e-6f, 1e-6f, nullptr, "softcap");
    for (int64_t i = 0; i < n; ++i) ASSERT_LE(std::abs(got[i]), 30.0f);
  }
}

TEST_P(Kernels, EmbeddingAndAdd) {
  const int64_t vocab = 50, dim = 37;
  auto tf = randn(vocab * dim, 41);
  std::vector<int32_t> ids = {3, 0, 49, 3, 17};
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const auto th = dt == DType::kF32 ? std::vector<uint16_t>() : to_half(tf, dt);
    const void* t = dt == DType::kF32 ? static_cast<const void*>(tf.data()) : th.data();
    std::vector<float> out(ids.size() * dim), want(out.size());
    be(2)->embedding(ids.data(), ids.size(), t, dt, dim, out.data());
    ref::embedding(ids.data(), ids.size(), t, dt, dim, want.data());
    EXPECT_TRUE(bitwise_equal(out.data(), want.data(), out.size())) << dtype_name(dt);
  }
  std::vector<int32_t> bad = {1, -1};
  std::vector<float> out(2 * dim);
  EXPECT_THROW(be(1)->embedding(bad.data(), 2, tf.data(), DType::kF32, dim, out.data()), InvalidArgument);
  for (int64_t n : {1, 17, 100003}) {
    auto x = randn(n, 51), y = randn(n, 52), want = x;
    be(2)->add(x.data(), y.data(), n);
    ref::add(want.data(), y.data(), n);
    EXPECT_TRUE(bitwise_equal(x.data(), want.data(), n));
  }
}

// VT::hsum_w (W reductions at once, used by attention's score tiles) must equal W separate
// VT::hsum calls bit for bit: mixed magnitudes and signs make any change of addition order show.
TEST_P(Kernels, HsumTreeEqualsSeparateHsums) {
  const KernelTable& k = kernels_for(GetParam());
  const int w = k.lanes;
  std::mt19937 g(17);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-30, 30);
  std::vector<float> x(w * w), tree(w), each(w);
  int differs_from_plain = 0;
  for (int it = 0; it < 2000; ++it) {
    for (auto& v : x) v = std::ldexp(nd(g), ex(g));
    k.hsum_both(x.data(), tree.data(), each.data());
    ASSERT_TRUE(bitwise_equal(tree.data(), each.data(), w)) << "iteration " << it;
    for (int i = 0; i < w; ++i) {  // the data is hard enough that summation order matters
      float plain = 0.f;
      for (int l = 0; l < w; ++l) plain += x[i * w + l];
      differs_from_plain += plain != each[i];
    }
  }
  EXPECT_GT(differs_from_plain, 100);
}

// ---- KV cache and attention --------------------------------------------------------------------

struct AttnCase {
  int head_dim, group, num_kv_heads, block_size;
  DType kv;
};

// A mixed batch: a fresh prefill, a decode deep in its context, a chunked-prefill continuation
// spanning blocks, a first-token decode.
struct Batch {
  std::vector<int32_t> qlen = {20, 1, 7, 1}, ctx = {20, 37, 40, 1};
};

struct AttnFixture {
  AttnCase c;
  KVLayout L;
  int nq_heads, max_blocks = 8;
  std::vector<uint8_t> kc, vc;
  std::vector<int32_t> tables;  // [num_seqs, max_blocks]
  std::vector<int32_t> ctx;

  AttnFixture(AttnCase cc, const std::vector<int32_t>& contexts, uint32_t seed) : c(cc), ctx(contexts) {
    nq_heads = c.group * c.num_kv_heads;
    L.block_size = c.block_size;
    L.num_kv_heads = c.num_kv_heads;
    L.head_dim = c.head_dim;
    L.dtype = c.kv;
    const int ns = static_cast<int>(ctx.size());
    max_blocks = 0;
    for (int x : ctx) max_blocks = std::max(max_blocks, (x + c.block_size - 1) / c.block_size);
    L.num_blocks = ns * max_blocks + 3;
    const size_t bytes = L.bytes();  // int8: scales after the values
    kc.assign(bytes, 0);
    vc.assign(bytes, 0);
    // Physical blocks shuffled so logical order != physical order.
    std::vector<int32_t> phys(L.num_blocks);
    std::iota(phys.begin(), phys.end(), 0);
    std::shuffle(phys.begin(), phys.end(), std::mt19937(seed));
    tables.assign(ns * max_blocks, -1);
    int next = 0;
    for (int s = 0; s < ns; ++s)
      for (int b = 0; b < (ctx[s] + c.block_size - 1) / c.block_size; ++b)
        tables[s * max_blocks + b] = phys[next++];
    // Fill every sequence's KV with the reference store (one token per slot, plus a skipped one).
    const int64_t row = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
    for (int s = 0; s < ns; ++s) {
      auto k = randn(ctx[s] * row, seed + 100 + s), v = randn(ctx[s] * row, seed + 200 + s);
      std::vector<int64_t> slots(ctx[s]);
      for (int t = 0; t < ctx[s]; ++t)
        slots[t] = static_cast<int64_t>(tables[s * max_blocks + t / c.block_size]) * c.block_size +
                   t % c.block_size;
      ref::store_kv(k.data(), v.data(), row, slots.data(), ctx[s], kc.data(), vc.data(), L);
    }
  }

  // The cache row (slot x KV head) of sequence s's key t for KV head g.
  int64_t kv_row(int s, int t, int g) const {
    return (static_cast<int64_t>(tables[s * max_blocks + t / c.block_size]) * c.num_kv_heads + g) *
               c.block_size +
           t % c.block_size;
  }

  AttentionParams params(const std::vector<int32_t>& qlen, std::vector<int32_t>& cu) const {
    AttentionParams p;
    p.num_seqs = static_cast<int32_t>(qlen.size());
    cu.assign(qlen.size() + 1, 0);
    for (size_t s = 0; s < qlen.size(); ++s) cu[s + 1] = cu[s] + qlen[s];
    p.num_tokens = cu.back();
    p.cu_seqlens_q = cu.data();
    p.context_lens = ctx.data();
    p.block_tables = tables.data();
    p.max_blocks_per_seq = max_blocks;
    return p;
  }
};

TEST_P(Kernels, StoreKvMatchesReference) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kI8}) {
    KVLayout L{6, 8, 3, 32, dt};
    const int T = 11;
    const int64_t stride = 3 * 32 * 3 + 4;
    auto kv = randn(T * stride, 61);
    std::vector<int64_t> slots = {0, 5, -1, 47, 8, 9, 23, -1, 30, 31, 16};
    const size_t bytes = L.bytes();
    std::vector<uint8_t> k1(bytes, 0), v1(bytes, 0), k2(bytes, 0), v2(bytes, 0);
    be(2)->store_kv(kv.data(), kv.data() + 96, stride, slots.data(), T, k1.data(), v1.data(), L);
    ref::store_kv(kv.data(), kv.data() + 96, stride, slots.data(), T, k2.data(), v2.data(), L);
    EXPECT_EQ(k1, k2) << dtype_name(dt);
    EXPECT_EQ(v1, v2) << dtype_name(dt);
  }
  KVLayout L{2, 8, 1, 8, DType::kF32};
  std::vector<float> kv(8), cache(2 * 8 * 8);
  int64_t slot = 16;  // one past the end
  EXPECT_THROW(be(1)->store_kv(kv.data(), kv.data(), 8, &slot, 1, cache.data(), cache.data(), L),
               InvalidArgument);
}

// int8 KV: per (slot, head) scale max|x| / 127, values rounded half to even, every stored value
// within half a step of its input, and the scales laid out after the values.
TEST_P(Kernels, StoreKvInt8RoundsPerTokenPerHead) {
  const int hd = 80, kvh = 2, bs = 8;
  KVLayout L{3, bs, kvh, hd, DType::kI8};
  ASSERT_EQ(L.scales_offset() % 64, 0u);
  ASSERT_GE(L.scales_offset(), L.data_bytes());
  ASSERT_EQ(L.bytes(), L.scales_offset() + 3 * kvh * bs * sizeof(float));
  const int T = 5;
  const int64_t stride = kvh * hd;
  auto k = randn(T * stride, 7, 3.f), v = randn(T * stride, 8, 0.1f);
  // Token 0, head 0: ties that round half to even with scale exactly 1 (max 127).
  const float ties[6] = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -3.5f};
  const int8_t want_ties[6] = {127, 0, 2, 2, 0, -4};
  for (int d = 0; d < hd; ++d) k[d] = d < 6 ? ties[d] : 0.f;
  for (int d = 0; d < hd; ++d) v[stride + hd + d] = 0.f;  // an all-zero row: scale 0
  std::vector<int64_t> slots = {3, 8, 23, -1, 12};
  std::vector<uint8_t> kc(L.bytes(), 0), vc(L.bytes(), 0);
  be(2)->store_kv(k.data(), v.data(), stride, slots.data(), T, kc.data(), vc.data(), L);
  const auto* kq = reinterpret_cast<const int8_t*>(kc.data());
  const auto* vq = reinterpret_cast<const int8_t*>(vc.data());
  const auto* ksc = reinterpret_cast<const float*>(kc.data() + L.scales_offset());
  const auto* vsc = reinterpret_cast<const float*>(vc.data() + L.scales_offset());
  for (int d = 0; d < 6; ++d) EXPECT_EQ(kq[3 * hd + d], want_ties[d]) << d;
  EXPECT_EQ(ksc[3], 1.f);
  for (int t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    const int64_t blk = slots[t] / bs, off = slots[t] % bs;
    for (int h = 0; h < kvh; ++h) {
      const int64_t row = (blk * kvh + h) * bs + off;
      for (auto [src, q, sc] : {std::tuple{k.data(), kq, ksc}, std::tuple{v.data(), vq, vsc}}) {
        const float* x = src + t * stride + h * hd;
        float amax = 0.f;
        for (int d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(x[d]));
        ASSERT_EQ(sc[row], amax / 127.f) << "token " << t << " head " << h;
        int peak = 0;
        for (int d = 0; d < hd; ++d) {
          peak = std::max(peak, std::abs(static_cast<int>(q[row * hd + d])));
          EXPECT_LE(std::fabs(q[row * hd + d] * sc[row] - x[d]), 0.5f * sc[row] * (1 + 1e-6f) + 1e-30f);
        }
        EXPECT_EQ(peak, amax > 0 ? 127 : 0);
      }
    }
  }
  EXPECT_EQ(vsc[(1 * kvh + 1) * bs + 0], 0.f);  // token 1 (slot 8), head 1 of V: all zeros
}

std::vector<AttnCase> attn_cases() {
  return {{64, 1, 2, 16, DType::kF32},
          {64, 3, 3, 16, DType::kF32},
          {32, 4, 2, 8, DType::kF32},
          {32, 3, 1, 8, DType::kBF16},
          {64, 4, 1, 16, DType::kF16},
          {40, 1, 1, 8, DType::kF32},
          {64, 3, 3, 16, DType::kI8},
          {80, 4, 2, 8, DType::kI8},
          {96, 1, 2, 16, DType::kI8},
          {64, 4, 1, 8, DType::kI8},
          {40, 3, 1, 16, DType::kI8},
          {128, 5, 1, 16, DType::kBF16},
          {17, 5, 2, 5, DType::kF16},
          {24, 2, 3, 6, DType::kI8},
          {128, 2, 2, 16, DType::kF32},
          // bf16 layouts the AMX tile kernel takes (head_dim % 32, block_size % 16), where it runs.
          {64, 3, 3, 16, DType::kBF16},
          {64, 1, 2, 32, DType::kBF16},
          {96, 4, 1, 16, DType::kBF16},
          {32, 8, 1, 16, DType::kBF16}};
}

// The largest error and the largest error / bound seen by attention_within_bound.
struct BoundCheck {
  double max_err = 0, worst = 0;
};

// Attention on backend b over f's cache against the reference over ref's (the same K/V values and
// block tables, possibly in another dtype), random queries of Batch B, scale 1 / sqrt(head_dim).
// For every (sequence s, query at position pos, head h) bound(s, pos, kv head, q row) gives the
// allowed error of each of that row's outputs; every output is asserted within it.
template <typename Bound>
BoundCheck attention_within_bound(Backend& b, const AttnFixture& f, const AttnFixture& ref_f, uint32_t seed,
                                  Bound&& bound) {
  Batch B;
  std::vector<int32_t> cu;
  const auto p = f.params(B.qlen, cu);
  const int hd = f.c.head_dim, nh = f.nq_heads;
  const int64_t q_stride = static_cast<int64_t>(nh) * hd;
  const auto q = randn(p.num_tokens * q_stride, seed);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<float> got(p.num_tokens * q_stride), want(got.size());
  b.attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, nh, scale, got.data());
  ref::attention(q.data(), q_stride, ref_f.kc.data(), ref_f.vc.data(), ref_f.L, p, nh, scale, want.data());
  BoundCheck out;
  for (int s = 0; s < p.num_seqs; ++s)
    for (int j = 0; j < B.qlen[s]; ++j) {
      const int row = cu[s] + j, pos = B.ctx[s] - B.qlen[s] + j;
      for (int h = 0; h < nh; ++h) {
        const double lim = bound(s, pos, h / f.c.group, q.data() + row * q_stride + h * hd, scale);
        for (int d = 0; d < hd; ++d) {
          const double err = std::fabs(got[row * q_stride + h * hd + d] - want[row * q_stride + h * hd + d]);
          EXPECT_LE(err, lim) << "seq " << s << " row " << j << " head " << h << " d " << d;
          if (!(err <= lim)) return out;
          out.max_err = std::max(out.max_err, err);
          out.worst = std::max(out.worst, err / lim);
        }
      }
    }
  return out;
}

// int8 attention against the f32 reference on the unquantized K/V: within a bound derived from
// the rounding alone. Per (row, head): each score moves by at most e = scale * sum|q| * s_k / 2,
// so each softmax weight by a factor within exp(+-2 E) (E = max over keys), and each value by
// s_v / 2: |dout| <= (exp(2E) - 1) * max|v| + max s_v / 2.
TEST_P(Kernels, Int8AttentionWithinQuantizationBound) {
  for (const AttnCase c : {AttnCase{64, 3, 3, 16, DType::kI8}, AttnCase{96, 4, 2, 8, DType::kI8}}) {
    Batch B;
    AttnFixture f8(c, B.ctx, 33);
    AttnCase c32 = c;
    c32.kv = DType::kF32;
    AttnFixture f32(c32, B.ctx, 33);  // same seed: same K/V values and block tables
    const auto* ksc = reinterpret_cast<const float*>(f8.kc.data() + f8.L.scales_offset());
    const auto* vsc = reinterpret_cast<const float*>(f8.vc.data() + f8.L.scales_offset());
    const auto* vf = reinterpret_cast<const float*>(f32.vc.data());
    const int hd = c.head_dim;
    const BoundCheck r = attention_within_bound(
        *be(2), f8, f32, 34, [&](int s, int pos, int g, const float* qr, float scale) {
          double ql1 = 0, E = 0, vmax = 0, vs = 0;
          for (int d = 0; d < hd; ++d) ql1 += std::fabs(qr[d]);
          for (int t = 0; t <= pos; ++t) {
            const int64_t row = f8.kv_row(s, t, g);
            E = std::max(E, scale * ql1 * ksc[row] / 2);
            vs = std::max(vs, vsc[row] / 2.0);
            for (int d = 0; d < hd; ++d)
              vmax = std::max(vmax, std::fabs(static_cast<double>(vf[row * hd + d])));
          }
          return std::expm1(2 * E) * vmax + vs + 1e-5;
        });
    // The bound is loose but must not be vacuous: quantization does move the outputs.
    EXPECT_GT(r.max_err, 1e-4) << "int8 attention equals f32: was the cache quantized?";
    RecordProperty("worst_error_over_bound", std::to_string(r.worst));
  }
}

TEST_P(Kernels, AttentionMatchesReference) {
  Batch B;
  for (const auto& c : attn_cases()) {
    SCOPED_TRACE(::testing::Message() << "hd=" << c.head_dim << " group=" << c.group << " kvh="
                                      << c.num_kv_heads << " bs=" << c.block_size << " " << dtype_name(c.kv));
    AttnFixture f(c, B.ctx, 71);
    std::vector<int32_t> cu;
    const auto p = f.params(B.qlen, cu);
    const int64_t q_stride = static_cast<int64_t>(f.nq_heads) * c.head_dim + 3;
    auto q = randn(p.num_tokens * q_stride, 81);
    const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
    std::vector<float> out(p.num_tokens * f.nq_heads * c.head_dim), want(out.size());
    be(2)->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, out.data());
    ref::attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, want.data());
    expect_close(out.data(), want.data(), out.size(), 1e-5f, 2e-6f, nullptr, "attention");
  }
}

TEST_P(Kernels, AttentionBatchInvariant) {
  Batch B;
  for (DType precision : {DType::kF32, DType::kBF16})
    for (const auto& c : attn_cases()) {
      if (precision == DType::kBF16 && !be(1, precision)->set_matmul_precision(precision)) break;
      SCOPED_TRACE(::testing::Message() << "hd=" << c.head_dim << " group=" << c.group
                                        << " bs=" << c.block_size << " matmuls " << dtype_name(precision));
      AttnFixture f(c, B.ctx, 91);
      std::vector<int32_t> cu;
      const auto p = f.params(B.qlen, cu);
      const int64_t q_stride = static_cast<int64_t>(f.nq_heads) * c.head_dim;
      const int64_t orow = q_stride;
      auto q = randn(p.num_tokens * q_stride, 92);
      const float scale = 0.125f;
      std::vector<float> full(p.num_tokens * orow), one(full.size());
      be(2, precision)
          ->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, full.data());
      be(1, precision)
          ->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, one.data());
      EXPECT_TRUE(bitwise_equal(full.data(), one.data(), full.size())) << "1 vs 2 threads";

      // Every query row of sequence 0 (a 20-token prefill) recomputed alone as a decode with the
      // context cut at its position: must be bitwise the row of the batched call.
      auto b1 = be(1, precision);
      for (int j = 0; j < B.qlen[0]; ++j) {
        std::vector<int32_t> ctx1 = {j + 1};
        AttentionParams p1 = p;
        std::vector<int32_t> cu1 = {0, 1};
        p1.num_seqs = 1;
        p1.num_tokens = 1;
        p1.cu_seqlens_q = cu1.data();
        p1.context_lens = ctx1.data();
        p1.block_tables = f.tables.data();  // sequence 0's row
        std::vector<float> o(orow);
        b1->attention(q.data() + j * q_stride, q_stride, f.kc.data(), f.vc.data(), f.L, p1, f.nq_heads, scale,
                      o.data());
        ASSERT_TRUE(bitwise_equal(o.data(), full.data() + j * orow, orow))
            << "prefill row " << j << " as decode";
      }
      // Sequence 0 as two prefill chunks (13 then 7 tokens).
      for (int split : {13, 4}) {
        std::vector<int32_t> ctx1 = {split};
        std::vector<int32_t> cu1 = {0, split};
        AttentionParams p1 = p;
        p1.num_seqs = 1;
        p1.num_tokens = split;
        p1.cu_seqlens_q = cu1.data();
        p1.context_lens = ctx1.data();
        std::vector<float> o(split * orow);
        b1->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p1, f.nq_heads, scale, o.data());
        EXPECT_TRUE(bitwise_equal(o.data(), full.data(), o.size())) << "first chunk " << split;
        std::vector<int32_t> ctx2 = {20};
        std::vector<int32_t> cu2 = {0, 20 - split};
        p1.num_tokens = 20 - split;
        p1.cu_seqlens_q = cu2.data();
        p1.context_lens = ctx2.data();
        std::vector<float> o2((20 - split) * orow);
        b1->attention(q.data() + split * q_stride, q_stride, f.kc.data(), f.vc.data(), f.L, p1, f.nq_heads,
                      scale, o2.data());
        EXPECT_TRUE(bitwise_equal(o2.data(), full.data() + split * orow, o2.size()))
            << "second chunk " << split;
      }
      // The decode of sequence 1 alone equals its row in the mixed batch.
      {
        std::vector<int32_t> ctx1 = {B.ctx[1]}, cu1 = {0, 1};
        AttentionParams p1 = p;
        p1.num_seqs = 1;
        p1.num_tokens = 1;
        p1.cu_seqlens_q = cu1.data();
        p1.context_lens = ctx1.data();
        p1.block_tables = f.tables.data() + f.max_blocks;
        std::vector<float> o(orow);
        b1->attention(q.data() + cu[1] * q_stride, q_stride, f.kc.data(), f.vc.data(), f.L, p1, f.nq_heads,
                      scale, o.data());
        EXPECT_TRUE(bitwise_equal(o.data(), full.data() + cu[1] * orow, orow)) << "decode alone";
      }
    }
}

// bf16 matmuls (set_matmul_precision(kBF16), AMX tiles on a bf16 cache): Q and the softmax
// weights rounded to bf16. Against the f32 reference, within the bound of those roundings alone:
// per (row, head) each score moves by at most e = scale * sum |q - bf16(q)| |k|, so each weight
// by a factor within exp(+-2E) (E = max over keys); rounding the weights moves the output by at
// most 2^-9 max|v| (and its shorter exp, ~1e-5 relative, 2^-15 max|v|). The rounding must also
// show (else the mode was not on).
TEST_P(Kernels, AttentionBf16MatmulsWithinRoundingBound) {
  if (!be(1)->set_matmul_precision(DType::kBF16)) GTEST_SKIP() << "no bf16 matrix unit on this level";
  int ran = 0;
  for (const auto& c : attn_cases()) {
    if (c.kv != DType::kBF16 || !amx_attention_supported(c.head_dim, c.block_size)) continue;
    ++ran;
    SCOPED_TRACE(::testing::Message()
                 << "hd=" << c.head_dim << " group=" << c.group << " bs=" << c.block_size);
    AttnFixture f(c, Batch{}.ctx, 71);
    const auto* kb = reinterpret_cast<const uint16_t*>(f.kc.data());
    const auto* vb = reinterpret_cast<const uint16_t*>(f.vc.data());
    const int hd = c.head_dim;
    const BoundCheck r = attention_within_bound(
        *be(2, DType::kBF16), f, f, 81, [&](int s, int pos, int g, const float* qr, float scale) {
          double E = 0, vmax = 0;
          for (int t = 0; t <= pos; ++t) {
            const int64_t row = f.kv_row(s, t, g);
            double e = 0;
            for (int d = 0; d < hd; ++d) {
              e += std::fabs(qr[d] - bf16_to_f32(f32_to_bf16(qr[d]))) *
                   std::fabs(bf16_to_f32(kb[row * hd + d]));
              vmax = std::max(vmax, std::fabs(static_cast<double>(bf16_to_f32(vb[row * hd + d]))));
            }
            E = std::max(E, scale * e);
          }
          return std::expm1(2 * E) * vmax * (1 + std::ldexp(1.0, -9)) +
                 (std::ldexp(1.0, -9) + std::ldexp(1.0, -15)) * vmax + 1e-5;
        });
    EXPECT_GT(r.max_err, 1e-4) << "bf16 matmuls equal f32: were Q and P rounded?";
  }
  EXPECT_GT(ran, 0);
}

// ---- sliding window and logit soft-cap --------------------------------------------------------

// Sequence s's table with the blocks before its first query's window dropped (-1, as the block
// manager leaves them), and those physical blocks poisoned (NaN keys, values, int8 scales), so a
// kernel that reads one, or lets one into its sums, fails.
std::vector<int32_t> drop_outside_window(AttnFixture& f, const std::vector<int32_t>& qlen, int window) {
  std::vector<int32_t> t = f.tables;
  const int64_t head_elems = static_cast<int64_t>(f.c.block_size) * f.c.head_dim;
  for (size_t s = 0; s < qlen.size(); ++s) {
    const int first = first_visible_block(f.ctx[s] - qlen[s], window, f.c.block_size);
    for (int b = 0; b < first; ++b) {
      const int32_t phys = t[s * f.max_blocks + b];
      t[s * f.max_blocks + b] = -1;
      for (auto* cache : {&f.kc, &f.vc}) {
        if (f.c.kv == DType::kI8) {
          float* sc = reinterpret_cast<float*>(cache->data() + f.L.scales_offset());
          for (int64_t i = 0; i < f.c.num_kv_heads * f.c.block_size; ++i)
            sc[phys * f.c.num_kv_heads * f.c.block_size + i] = NAN;
          continue;
        }
        const size_t es = dtype_size(f.c.kv);
        const uint16_t nan16 = f.c.kv == DType::kBF16 ? 0x7FC0 : 0x7E00;
        const float nan32 = NAN;
        for (int64_t i = 0; i < f.c.num_kv_heads * head_elems; ++i) {
          uint8_t* dst = cache->data() + (phys * f.c.num_kv_heads * head_elems + i) * es;
          std::memcpy(dst, es == 4 ? static_cast<const void*>(&nan32) : &nan16, es);
        }
      }
    }
  }
  return t;
}

struct WindowCase {
  int window;
  float softcap;
};

// Windows from 1 key to wider than the context, alone and with a soft-cap (and a cap alone).
const WindowCase kWindowCases[] = {{1, 0.f},  {5, 0.f},  {9, 2.5f},  {16, 0.f},
                                   {24, 0.f}, {33, 8.f}, {100, 0.f}, {0, 3.f}};

TEST_P(Kernels, AttentionWindowAndSoftcapMatchReference) {
  Batch B;
  for (const auto& c : attn_cases())
    for (const WindowCase w : kWindowCases) {
      SCOPED_TRACE(::testing::Message() << "hd=" << c.head_dim << " group=" << c.group << " kvh="
                                        << c.num_kv_heads << " bs=" << c.block_size << " " << dtype_name(c.kv)
                                        << " window=" << w.window << " cap=" << w.softcap);
      AttnFixture f(c, B.ctx, 71);
      const std::vector<int32_t> tables = drop_outside_window(f, B.qlen, w.window);
      std::vector<int32_t> cu;
      auto p = f.params(B.qlen, cu);
      p.block_tables = tables.data();
      p.window = w.window;
      p.logit_softcap = w.softcap;
      const int64_t q_stride = static_cast<int64_t>(f.nq_heads) * c.head_dim + 3;
      // Scores of a few units, so the cap bends them.
      auto q = randn(p.num_tokens * q_stride, 81, 2.f);
      const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
      std::vector<float> out(p.num_tokens * f.nq_heads * c.head_dim), want(out.size());
      be(2)->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, out.data());
      ref::attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, want.data());
      expect_close(out.data(), want.data(), out.size(), 2e-5f, 4e-6f, nullptr, "windowed attention");
    }
}

// A window changes what a row sees, never how its arithmetic runs: each row of a windowed prefill
// equals that row decoded alone, in chunks, and over 1 or 2 threads, bit for bit (with the
// dropped blocks of each call's own first query).
TEST_P(Kernels, AttentionWindowBatchInvariant) {
  Batch B;
  for (DType precision : {DType::kF32, DType::kBF16})
    for (const auto& c : attn_cases())
      for (const WindowCase w : {WindowCase{5, 0.f}, WindowCase{9, 2.5f}, WindowCase{17, 0.f}}) {
        if (precision == DType::kBF16 && !be(1, precision)->set_matmul_precision(precision)) break;
        SCOPED_TRACE(::testing::Message() << "hd=" << c.head_dim << " group=" << c.group << " bs="
                                          << c.block_size << " " << dtype_name(c.kv) << " window=" << w.window
                                          << " cap=" << w.softcap << " matmuls " << dtype_name(precision));
        AttnFixture f(c, B.ctx, 91);
        std::vector<int32_t> cu;
        auto p = f.params(B.qlen, cu);
        p.window = w.window;
        p.logit_softcap = w.softcap;
        const int64_t q_stride = static_cast<int64_t>(f.nq_heads) * c.head_dim;
        auto q = randn(p.num_tokens * q_stride, 92, 2.f);
        const float scale = 0.125f;
        std::vector<float> full(p.num_tokens * q_stride), two(full.size());
        be(1, precision)
            ->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, full.data());
        be(2, precision)
            ->attention(q.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale, two.data());
        EXPECT_TRUE(bitwise_equal(full.data(), two.data(), full.size())) << "1 vs 2 threads";
        auto b1 = be(1, precision);
        // Sequence 0 (a 20-token prefill): each row alone, then as chunks 0..split, split..20.
        for (int j = 0; j < B.qlen[0]; ++j) {
          std::vector<int32_t> ctx1 = {j + 1}, cu1 = {0, 1};
          std::vector<int32_t> t1(f.tables.begin(), f.tables.begin() + f.max_blocks);
          for (int b = 0; b < first_visible_block(j, w.window, c.block_size); ++b) t1[b] = -1;
          AttentionParams p1 = p;
          p1.num_seqs = 1;
          p1.num_tokens = 1;
          p1.cu_seqlens_q = cu1.data();
          p1.context_lens = ctx1.data();
          p1.block_tables = t1.data();
          std::vector<float> o(q_stride);
          b1->attention(q.data() + j * q_stride, q_stride, f.kc.data(), f.vc.data(), f.L, p1, f.nq_heads,
                        scale, o.data());
          ASSERT_TRUE(bitwise_equal(o.data(), full.data() + j * q_stride, q_stride))
              << "row " << j << " alone";
        }
        for (int split : {13, 4}) {
          std::vector<int32_t> ctx2 = {20}, cu2 = {0, 20 - split};
          std::vector<int32_t> t2(f.tables.begin(), f.tables.begin() + f.max_blocks);
          for (int b = 0; b < first_visible_block(split, w.window, c.block_size); ++b) t2[b] = -1;
          AttentionParams p2 = p;
          p2.num_seqs = 1;
          p2.num_tokens = 20 - split;
          p2.cu_seqlens_q = cu2.data();
          p2.context_lens = ctx2.data();
          p2.block_tables = t2.data();
          std::vector<float> o((20 - split) * q_stride);
          b1->attention(q.data() + split * q_stride, q_stride, f.kc.data(), f.vc.data(), f.L, p2, f.nq_heads,
                        scale, o.data());
          EXPECT_TRUE(bitwise_equal(o.data(), full.data() + split * q_stride, o.size()))
              << "chunk at " << split;
        }
      }
}

// Rows longer than a key partition (kernels.h): rows of prefill chunks, the same rows decoded alone
// on one thread (one item folds their partitions) and on 2, 3 and 8 threads (their partitions
// spread over items, some of several partitions, folded by attention_merge), and two sequences'
// decodes in one call, are the same bits, with and without a window; the chunks within the f32
// reference's bound.
TEST_P(Kernels, AttentionLongRowsSplitOverThreads) {
  const std::vector<int32_t> ctx = {700, 600};
  struct Chunk {
    int start, len;
  };
  // Around the first partition boundary (256 keys, or 255 / 252 for 5- and 6-row blocks) and at
  // the end of sequence 0.
  const Chunk chunks[] = {{242, 20}, {684, 16}};
  for (DType precision : {DType::kF32, DType::kBF16}) {
    if (precision == DType::kBF16 && !be(1, precision)->set_matmul_precision(precision)) break;
    std::map<int, std::shared_ptr<Backend>> backends;  // by thread count (a pool each)
    for (int threads : {1, 2, 3, 8}) backends[threads] = be(threads, precision);
    for (const auto& c : attn_cases())
      for (int window : {0, 300}) {
        SCOPED_TRACE(::testing::Message()
                     << "hd=" << c.head_dim << " group=" << c.group << " kvh=" << c.num_kv_heads
                     << " bs=" << c.block_size << " " << dtype_name(c.kv) << " window=" << window
                     << " matmuls " << dtype_name(precision));
        AttnFixture f(c, ctx, 93);
        const int64_t q_stride = static_cast<int64_t>(f.nq_heads) * c.head_dim;
        std::vector<float> q[2] = {randn(ctx[0] * q_stride, 94, 2.f), randn(ctx[1] * q_stride, 95, 2.f)};
        const float scale = 0.125f;
        // Queries of sequence s at positions pos (one sequence, or one row of each), ending there.
        auto run = [&](int threads, std::vector<int32_t> seq, std::vector<int32_t> pos, int len,
                       std::vector<float>* o, bool reference = false) {
          std::vector<int32_t> ctx1, cu1 = {0}, tables;
          std::vector<float> qs;
          for (size_t i = 0; i < seq.size(); ++i) {
            ctx1.push_back(pos[i] + 1);
            cu1.push_back(cu1.back() + len);
            const float* row = q[seq[i]].data() + (pos[i] + 1 - len) * q_stride;
            qs.insert(qs.end(), row, row + len * q_stride);
            tables.insert(tables.end(), f.tables.begin() + seq[i] * f.max_blocks,
                          f.tables.begin() + (seq[i] + 1) * f.max_blocks);
          }
          AttentionParams p;
          p.num_seqs = static_cast<int32_t>(seq.size());
          p.num_tokens = cu1.back();
          p.cu_seqlens_q = cu1.data();
          p.context_lens = ctx1.data();
          p.block_tables = tables.data();
          p.max_blocks_per_seq = f.max_blocks;
          p.window = window;
          o->assign(p.num_tokens * q_stride, 0.f);
          if (reference)
            ref::attention(qs.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads, scale,
                           o->data());
          else
            backends.at(threads)->attention(qs.data(), q_stride, f.kc.data(), f.vc.data(), f.L, p, f.nq_heads,
                                            scale, o->data());
        };
        std::vector<float> o, want;
        for (const Chunk ch : chunks) {
          std::vector<float> full;
          run(1, {0}, {ch.start + ch.len - 1}, ch.len, &full);
          if (precision == DType::kF32) {
            run(1, {0}, {ch.start + ch.len - 1}, ch.len, &want, true);
            expect_close(full.data(), want.data(), full.size(), 2e-5f, 4e-6f, nullptr, "long rows");
          }
          for (int j : {ch.start, ch.start + 8, ch.start + 13, ch.start + 14, ch.start + ch.len - 1})
            for (int threads : {1, 2, 3, 8}) {
              run(threads, {0}, {j}, 1, &o);
              ASSERT_TRUE(bitwise_equal(o.data(), full.data() + (j - ch.start) * q_stride, q_stride))
                  << "row " << j << " on " << threads << " threads";
            }
        }
        std::vector<float> alone[2];
        run(1, {0}, {699}, 1, &alone[0]);
        run(1, {1}, {599}, 1, &alone[1]);
        for (int threads : {2, 8}) {
          run(threads, {0, 1}, {699, 599}, 1, &o);
          EXPECT_TRUE(bitwise_equal(o.data(), alone[0].data(), q_stride)) << threads << " threads";
          EXPECT_TRUE(bitwise_equal(o.data() + q_stride, alone[1].data(), q_stride))
              << "second sequence, " << threads << " threads";
        }
      }
  }
}

// The planner still checks every block a windowed call reads, and only those.
TEST_P(Kernels, AttentionWindowChecksVisibleBlocksOnly) {
  AttnFixture f({32, 2, 2, 8, DType::kF32}, {40}, 5);
  std::vector<int32_t> cu;
  auto p = f.params({1}, cu);  // a decode at position 39
  p.window = 10;               // keys 30..39: blocks 3 and 4
  std::vector<float> q(128), out(128);
  f.tables[0] = f.tables[1] = f.tables[2] = -1;
  EXPECT_NO_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 4, 1.f, out.data()));
  f.tables[3] = -1;
  EXPECT_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 4, 1.f, out.data()),
               InvalidArgument);
  p.window = -1;
  EXPECT_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 4, 1.f, out.data()),
               InvalidArgument);
}

TEST_P(Kernels, AttentionRejectsBadInput) {
  AttnFixture f({32, 2, 2, 8, DType::kF32}, {9}, 5);  // 4 query heads over 2 KV heads
  std::vector<int32_t> cu;
  auto p = f.params({10}, cu);  // q_len 10 > context 9
  std::vector<float> q(10 * 128), out(10 * 128);
  EXPECT_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 4, 1.f, out.data()),
               InvalidArgument);
  p = f.params({1}, cu);
  EXPECT_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 3, 1.f, out.data()),
               InvalidArgument);  // 3 query heads cannot share 2 KV heads
  f.tables[0] = f.L.num_blocks;   // block id past the pool
  p = f.params({1}, cu);
  EXPECT_THROW(be(1)->attention(q.data(), 128, f.kc.data(), f.vc.data(), f.L, p, 4, 1.f, out.data()),
               InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Kernels, ::testing::ValuesIn(levels()),
                         [](const ::testing::TestParamInfo<Isa>& i) {
                           return std::string(isa_name(i.param));
                         });

// ---- infrastructure ----------------------------------------------------------------------------

TEST(CpuBackend, AllocAlignedAndFactory) {
  auto b = create_cpu_backend(0);
  EXPECT_EQ(b->name(), "cpu");
  EXPECT_GE(b->num_threads(), 1);
  for (size_t n : {1, 63, 64, 1000}) {
    void* p = b->alloc(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    b->fill_zero(p, n);
    b->free(p);
  }
  Isa isa;
  EXPECT_TRUE(parse_isa("avx2", &isa));
  EXPECT_EQ(isa, Isa::kAvx2);
  EXPECT_TRUE(parse_isa("avxvnni", &isa));
  EXPECT_EQ(isa, Isa::kAvx2);
  EXPECT_FALSE(parse_isa("sse9", &isa));
  EXPECT_LE(static_cast<int>(active_isa()), static_cast<int>(detected_isa()));
  // avxvnni is the avx2 level with the AVX-VNNI panels: only there, and only on a CPU with them.
  const bool vnni = avx_vnni_panels();
  EXPECT_TRUE(!vnni || (cpu_features().avx_vnni && active_isa() == Isa::kAvx2));
  EXPECT_STREQ(selected_isa(), vnni ? "avxvnni" : isa_name(active_isa()));
  const char* env = std::getenv("FANTAI_CPU_ISA");
  if (env && *env && cpu_features().avx_vnni) {
    EXPECT_EQ(vnni, !std::strcmp(env, "avxvnni"));
  }
  const std::vector<std::string> levels = runnable_isas();
  EXPECT_EQ(std::count(levels.begin(), levels.end(), "avxvnni"), cpu_features().avx_vnni ? 1 : 0);
}

// The VmFlags of the mapping holding p (from /proc/self/smaps), or "" where none holds it.
std::string vm_flags_at(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    // Only a mapping's header line is "lo-hi ...": a field such as "AnonHugePages:" stops at 'n'.
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2) {
      inside = a >= lo && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// FANTAI_BF16_LAYOUT=rows|pairs|groups forces bf16 row-major or a packed layout where AMX is off
// (the portable level has no AMX); unset, each level takes its default.
TEST(CpuBackend, Bf16LayoutSwitch) {
  // 9 rows: the group layout pads them to 16.
  const size_t rows = 9u * 40 * 2, groups = 16u * 40 * 2;
  // Unset: the pair layout, except groups on AVX2 (its widening costs no FMA-port op either way;
  // its decode needed the one stream).
  const test::ScopedEnv env("FANTAI_BF16_LAYOUT", nullptr);
  EXPECT_EQ(rows, make_cpu_backend(Isa::kScalar, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  const bool avx2 = static_cast<int>(detected_isa()) >= static_cast<int>(Isa::kAvx2);
  if (avx2) {
    EXPECT_EQ(groups, make_cpu_backend(Isa::kAvx2, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  }
  env.set("rows");
  EXPECT_EQ(0u, make_cpu_backend(Isa::kScalar, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  if (avx2) {
    EXPECT_EQ(0u, make_cpu_backend(Isa::kAvx2, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  }
  env.set("pairs");
  EXPECT_EQ(rows, make_cpu_backend(Isa::kScalar, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  if (avx2) {
    EXPECT_EQ(rows, make_cpu_backend(Isa::kAvx2, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  }
  env.set("groups");
  EXPECT_EQ(groups, make_cpu_backend(Isa::kScalar, 1)->dense_packed_bytes(DType::kBF16, 9, 40));
  env.set("1");
  EXPECT_THROW(make_cpu_backend(Isa::kScalar, 1), std::exception);
}

TEST(CpuBackend, WeightsShareHugePageSlabsAndGoBackWhenFreed) {
  auto b = create_cpu_backend(1);
  // 40 tensors of 300 KB overflow one 8 MiB slab; 5 MiB takes a mapping of its own.
  std::vector<size_t> sizes(40, 300 << 10);
  sizes.push_back(100);
  sizes.push_back(size_t{5} << 20);
  std::vector<std::pair<char*, size_t>> got;
  for (size_t i = 0; i < sizes.size(); ++i) {
    char* p = static_cast<char*>(b->alloc_weights(sizes[i]));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    std::memset(p, static_cast<int>(i + 1), sizes[i]);
    got.emplace_back(p, sizes[i]);
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(got.back().first) % (size_t{2} << 20), 0u);
  EXPECT_EQ(got[1].first, got[0].first + (300 << 10)) << "small tensors share a slab";
  for (size_t i = 0; i < got.size(); ++i) {  // nothing overwrote anything
    EXPECT_EQ(got[i].first[0], static_cast<char>(i + 1));
    EXPECT_EQ(got[i].first[got[i].second - 1], static_cast<char>(i + 1));
  }
  auto sorted = got;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i)
    EXPECT_LE(sorted[i - 1].first + sorted[i - 1].second, sorted[i].first);
  // MADV_HUGEPAGE shows as "hg" whether or not the kernel found huge pages to back it with.
  const bool huge = cpu_switches().huge_pages;
  for (const auto& [p, n] : got) {
    const std::string flags = vm_flags_at(p);
    EXPECT_NE(flags, "");
    EXPECT_EQ(flags.find(" hg") != std::string::npos, huge) << flags;
  }
  for (const auto& [p, n] : got) b->free(p);
  for (const auto& [p, n] : got) EXPECT_EQ(vm_flags_at(p), "") << "still mapped after its last tensor went";
}

TEST(ThreadPool, RunsEveryTaskOnceAndNests) {
  ThreadPool pool(3);
  for (int rep = 0; rep < 200; ++rep) {
    std::vector<std::atomic<int>> hits(97);
    pool.parallel_for(97, [&](int64_t t, int tid) {
      ASSERT_LT(tid, 3);
      hits[t].fetch_add(1);
      if (t == 5) pool.parallel_for(4, [&](int64_t, int) {});  // nested: runs inline
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

// The caller may close a job before a worker joins it (a worker parked or not yet scheduled):
// every task still runs exactly once, and every write a worker made is visible on return.
TEST(ThreadPool, BackToBackJobsSeeAllWrites) {
  ThreadPool pool(2);
  std::vector<int64_t> out(64);
  for (int rep = 0; rep < 3000; ++rep) {
    const int64_t tasks = 1 + rep % 7;
    pool.parallel_for(tasks, [&](int64_t t, int) {
      if (rep % 5 == 0) std::this_thread::yield();
      out[t] = rep * 100 + t;
    });
    for (int64_t t = 0; t < tasks; ++t) ASSERT_EQ(out[t], rep * 100 + t) << "rep " << rep;
    if (rep % 500 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));  // workers park
  }
}

}  // namespace
}  // namespace fantai::cpu
