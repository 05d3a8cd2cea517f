// tests: quantized weights — CPU packing, every ISA's linear_q / dequant_row against the slow
// reference (cpu/qkernels_ref.cpp) on ragged shapes, bitwise agreement with the dense linear on
// the dequantized matrix, batch invariance, GGUF block decoding of hand-built blocks, and RTN.
// Over 400 lines: one file for the quantized room; its cases share the matrix builders.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/types.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/qkernels.h"
#include "model/quant_formats.h"
#include "test_support.h"

namespace fantai {
namespace {

using test::randn;
constexpr auto levels = test::isa_levels;

using cpu::Isa;
using model::QuantTensor;

struct Spec {
  int bits;
  int group;  // 0: per channel
  bool zero, min, perm;
  // Values below 2^width when narrower than bits (GGUF Q5_x / Q6_K reach the packer as bytes < 32
  // or < 64); 0: the full bits.
  int width = 0;
  // Values from 16 byte levels (bits 8), which the panels keep as 4-bit codebook indices: 1 the
  // IQ4 levels as GGUF's IQ4_NL / IQ4_XS reach the packer (int8 level + 128), 2 levels spanning
  // 0 .. 255 (the AVX2 sign trick's extremes); 0: none.
  int codebook = 0;
  int value_bits() const { return width ? width : bits; }
};

constexpr uint8_t kIq4Levels[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
constexpr uint8_t kWideLevels[16] = {0, 3, 17, 40, 64, 90, 127, 128, 129, 150, 177, 200, 222, 240, 254, 255};
const uint8_t* levels_of(const Spec& s) { return s.codebook == 1 ? kIq4Levels : kWideLevels; }

// A random canonical matrix: q uniform, per-group zero / min when asked.
QuantTensor random_quant(int64_t rows, int64_t cols, const Spec& s, uint32_t seed) {
  std::mt19937 g(seed);
  QuantTensor t;
  t.bits = s.bits;
  t.group = s.group ? s.group : static_cast<int32_t>(cols);
  t.rows = rows;
  t.cols = cols;
  const int64_t ng = (cols + t.group - 1) / t.group;
  const int qmax = (1 << s.value_bits()) - 1;
  std::uniform_int_distribution<int> qd(0, qmax);
  std::uniform_real_distribution<float> sd(0.001f, 0.05f), md(-0.5f, 0.5f);
  t.q.resize(rows * cols);
  if (s.codebook) {
    std::uniform_int_distribution<int> id(0, 15);
    for (auto& v : t.q) v = levels_of(s)[id(g)];
  } else {
    for (auto& v : t.q) v = static_cast<uint8_t>(qd(g));
  }
  t.scale.resize(rows * ng);
  for (auto& v : t.scale) v = sd(g);
  if (s.zero) {
    t.zero.resize(rows * ng);
    for (auto& v : t.zero) v = static_cast<uint8_t>(qd(g));
  } else {
    t.zero_point = 1 << (s.value_bits() - 1);
  }
  if (s.min) {
    t.min.resize(rows * ng);
    for (auto& v : t.min) v = md(g);
  }
  if (s.perm) {
    t.perm.resize(cols);
    for (int64_t c = 0; c < cols; ++c) t.perm[c] = static_cast<int32_t>(c);
    std::shuffle(t.perm.begin(), t.perm.end(), g);
  }
  return t;
}

struct Packed {
  std::vector<uint8_t> mem;
  QuantMatrix w;
};

Packed pack(const QuantTensor& t) {
  Packed p;
  p.mem.resize(cpu::cpu_quant_packed_bytes(t.view()) + 64);
  void* dst = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p.mem.data()) + 63) & ~uintptr_t{63});
  p.w = cpu::cpu_pack_quant(t.view(), dst);
  return p;
}

const Spec kSpecs[] = {
    {4, 32, false, false, false},
    {4, 32, false, true, false},
    {4, 32, true, false, true},
    {4, 128, true, false, false},
    {8, 32, false, false, false},
    {8, 16, false, true, true},
    {8, 0, false, false, false},
    {8, 64, true, true, false},
    {4, 0, true, false, false},
    // Byte values the panels keep narrower: 5-bit (Q5_0, Q5_1 / Q5_K), 6-bit (Q6_K), 4-bit.
    {8, 32, false, false, false, 5},
    {8, 32, false, true, false, 5},
    {8, 64, true, true, true, 5},
    {8, 0, false, false, false, 5},
    {8, 16, false, false, false, 6},
    {8, 32, true, true, false, 6},
    {8, 0, true, false, false, 6},
    {8, 32, false, true, false, 4},
    // Nibbles (or bytes) the panels keep at 2 bits (Q2_K) or 3 (Q3_K), in 16-column steps.
    {4, 16, false, true, false, 2},
    {4, 32, true, false, true, 2},
    {8, 64, true, false, false, 2},
    {8, 32, true, true, true, 2},
    {4, 16, false, false, false, 3},
    {4, 0, false, true, false, 3},
    {8, 32, true, true, false, 3},
    // 16 byte levels, kept as codebook indices: IQ4_NL / IQ4_XS-like, and levels at 0 and 255.
    {8, 32, false, false, false, 0, 1},
    {8, 16, false, true, false, 0, 1},
    {8, 0, false, false, false, 0, 1},
    {8, 64, true, false, true, 0, 2},
    {8, 32, false, true, false, 0, 2},
};

class QuantKernels : public ::testing::TestWithParam<Isa> {};

TEST_P(QuantKernels, DequantRowMatchesReference) {
  const cpu::QKernelTable& qk = cpu::qkernels_for(GetParam());
  uint32_t seed = 1;
  for (const Spec& s : kSpecs)
    for (int64_t cols : {16, 40, 100, 257}) {
      const QuantTensor t = random_quant(5, cols, s, seed++);
      const Packed p = pack(t);
      QuantTensor unpermuted = t;
      unpermuted.perm.clear();  // dequant_row is in stored column order
      std::vector<float> want(5 * cols), got(cols);
      cpu::ref::dequantize(unpermuted.view(), want.data());
      for (int64_t r = 0; r < 5; ++r) {
        qk.dequant_row(p.w, r, got.data());
        ASSERT_EQ(0, std::memcmp(got.data(), want.data() + r * cols, cols * 4))
            << "bits " << s.bits << " group " << s.group << " cols " << cols << " row " << r;
      }
    }
}

TEST_P(QuantKernels, LinearMatchesReferenceOnRaggedShapes) {
  auto be = cpu::make_cpu_backend(GetParam(), 2);
  uint32_t seed = 100;
  for (const Spec& s : kSpecs)
    for (int64_t m : {1, 3, 17, 64})
      for (int64_t k : {40, 100, 257}) {
        const int64_t n = 37;
        const QuantTensor t = random_quant(n, k, s, seed++);
        const Packed p = pack(t);
        const std::vector<float> x = randn(m * k, seed++);
        const std::vector<float> bias = randn(n, seed++);
        const bool with_bias = (seed & 1) != 0;
        std::vector<float> got(m * n, -1.f), want(m * n), wd(n * k);
        be->linear_q(x.data(), p.w, with_bias ? bias.data() : nullptr, got.data(), m, n);
        cpu::ref::linear_q(x.data(), t.view(), with_bias ? bias.data() : nullptr, want.data(), m, n);
        cpu::ref::dequantize(t.view(), wd.data());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j) {
            double mag = 0;  // sum |x||w|: the scale of the f32 rounding error
            for (int64_t c = 0; c < k; ++c) mag += std::fabs(x[r * k + c] * wd[j * k + c]);
            const double tol = 4e-7 * static_cast<double>(k) * mag + 1e-6;
            ASSERT_NEAR(got[r * n + j], want[r * n + j], tol)
                << "bits " << s.bits << " group " << s.group << " zero " << s.zero << " min " << s.min
                << " perm " << s.perm << " m " << m << " k " << k << " at (" << r << ", " << j << ")";
          }
      }
}

// The quantized chain is the dense chain: equal bit for bit to the dense f32 linear on the
// dequantized matrix (stored column order, activations gathered by perm).
TEST_P(QuantKernels, LinearBitwiseEqualsDenseOnDequantized) {
  auto be = cpu::make_cpu_backend(GetParam(), 2);
  uint32_t seed = 500;
  for (const Spec& s : kSpecs)
    for (int64_t m : {1, 5, 64}) {
      const int64_t n = 33, k = 200;
      const QuantTensor t = random_quant(n, k, s, seed++);
      const Packed p = pack(t);
      QuantTensor stored = t;
      stored.perm.clear();
      std::vector<float> wd(n * k);
      cpu::ref::dequantize(stored.view(), wd.data());
      const std::vector<float> x = randn(m * k, seed++);
      std::vector<float> xg = x;
      if (!t.perm.empty())
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < k; ++c) xg[r * k + c] = x[r * k + t.perm[c]];
      const std::vector<float> bias = randn(n, seed++);
      std::vector<float> got(m * n), want(m * n);
      be->linear_q(x.data(), p.w, bias.data(), got.data(), m, n);
      be->linear(xg.data(), wd.data(), DType::kF32, bias.data(), want.data(), m, n, k);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << "bits " << s.bits << " group " << s.group << " m " << m;
    }
}

TEST_P(QuantKernels, LinearIsBatchAndThreadInvariant) {
  auto be1 = cpu::make_cpu_backend(GetParam(), 1);
  auto be2 = cpu::make_cpu_backend(GetParam(), 2);
  const Spec s{4, 32, false, true, false};
  const int64_t m = 70, n = 301, k = 576;
  const QuantTensor t = random_quant(n, k, s, 7);
  const Packed p = pack(t);
  const std::vector<float> x = randn(m * k, 8);
  std::vector<float> all(m * n), one(n), threaded(m * n);
  be2->linear_q(x.data(), p.w, nullptr, all.data(), m, n);
  be1->linear_q(x.data(), p.w, nullptr, threaded.data(), m, n);
  ASSERT_EQ(0, std::memcmp(all.data(), threaded.data(), all.size() * 4));
  for (int64_t r = 0; r < m; r += 7) {
    be2->linear_q(x.data() + r * k, p.w, nullptr, one.data(), 1, n);
    ASSERT_EQ(0, std::memcmp(one.data(), all.data() + r * n, n * 4)) << "row " << r;
  }
}

TEST_P(QuantKernels, LinearWritesOnlyItsColumnSlice) {
  auto be = cpu::make_cpu_backend(GetParam(), 2);
  const QuantTensor t = random_quant(9, 64, {8, 32, false, false, false}, 11);
  const Packed p = pack(t);
  const std::vector<float> x = randn(3 * 64, 12);
  const int64_t ldy = 20, off = 5;
  std::vector<float> y(3 * ldy, 42.f), want(3 * 9);
  be->linear_q(x.data(), p.w, nullptr, y.data() + off, 3, ldy);
  cpu::ref::linear_q(x.data(), t.view(), nullptr, want.data(), 3, 9);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < ldy; ++c) {
      if (c >= off && c < off + 9) EXPECT_NEAR(y[r * ldy + c], want[r * 9 + c - off], 1e-4);
      else EXPECT_EQ(y[r * ldy + c], 42.f);
    }
}

TEST_P(QuantKernels, EmbeddingGathersDequantizedRows) {
  auto be = cpu::make_cpu_backend(GetParam(), 2);
  for (const Spec& s : kSpecs) {
    const QuantTensor t = random_quant(50, 72, s, 21);
    const Packed p = pack(t);
    std::vector<float> table(50 * 72), out(4 * 72);
    cpu::ref::dequantize(t.view(), table.data());
    const int32_t ids[4] = {3, 0, 49, 3};
    be->embedding_q(ids, 4, p.w, out.data());
    for (int i = 0; i < 4; ++i)
      ASSERT_EQ(0, std::memcmp(out.data() + i * 72, table.data() + ids[i] * 72, 72 * 4)) << i;
    const int32_t bad[1] = {50};
    EXPECT_THROW(be->embedding_q(bad, 1, p.w, out.data()), InvalidArgument);
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, QuantKernels, ::testing::ValuesIn(levels()),
                         [](const auto& info) { return std::string(cpu::isa_name(info.param)); });

// ---- panel path (int8 activations) ---------------------------------------------------------------------

Packed pack_panel(const QuantTensor& t) {
  Packed p;
  p.mem.resize(cpu::cpu_quant_panel_bytes(t.view()) + 64);
  void* dst = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p.mem.data()) + 63) & ~uintptr_t{63});
  p.w = cpu::cpu_pack_quant_panel(t.view(), dst);
  return p;
}

struct XQ {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  cpu::QuantizedRows rows;
};

XQ quantize_x(const float* x, int64_t m, int64_t k, int32_t block) {
  XQ r;
  r.rows.nblocks = (k + block - 1) / block;
  r.rows.ld = r.rows.nblocks * block;
  r.q.resize(m * r.rows.ld);
  r.d.resize(m * r.rows.nblocks);
  r.s.resize(m * r.rows.nblocks);
  cpu::quantize_rows_int8(x, m, k, block, r.q.data(), r.d.data(), r.s.data());
  r.rows.q = r.q.data();
  r.rows.d = r.d.data();
  r.rows.s = r.s.data();
  return r;
}

// Scales and mins rounded to f16 values, as GGUF Q4_0/Q4_1/Q8_0 hold them (the panel layout
// then keeps them in f16).
void round_scales_to_half(QuantTensor* t) {
  for (auto& v : t->scale) v = f16_to_f32(f32_to_f16(v));
  for (auto& v : t->min) v = f16_to_f32(f32_to_f16(v));
}

// Scales (and mins) made of an f16 factor per super-block times an int8 per group, as the GGUF
// K-quants store them: the panel layout then keeps only the factors (kCpuQuantPanelSubLayout).
// Super-blocks of 8, 4, 3, 2 or 1 groups (the first that divides the row's groups); the factors'
// full int8 range (nibble: 0 .. 15 for both, as Q2_K's), negative factors, and products that are
// not f16 values.
void factor_scales(QuantTensor* t, uint32_t seed, bool nibble = false) {
  std::mt19937 g(seed);
  const int64_t ng = (t->cols + t->group - 1) / t->group;
  int32_t fg = 1;
  for (int32_t c : {8, 4, 3, 2})
    if (ng % c == 0) {
      fg = c;
      break;
    }
  const int64_t nsup = ng / fg;
  std::uniform_real_distribution<float> fd(0.0001f, 0.002f);
  std::uniform_int_distribution<int> id(nibble ? 0 : -128, nibble ? 15 : 127), md(0, nibble ? 15 : 63);
  t->fgroups = fg;
  t->fscale.resize(t->rows * nsup);
  t->iscale.resize(t->rows * ng);
  for (size_t i = 0; i < t->fscale.size(); ++i)
    t->fscale[i] = f16_to_f32(f32_to_f16((i % 5 == 4 ? -1.f : 1.f) * fd(g)));
  for (auto& v : t->iscale) v = static_cast<int8_t>(id(g));
  if (!t->min.empty()) {
    t->fmin.resize(t->rows * nsup);
    t->imin.resize(t->rows * ng);
    for (auto& v : t->fmin) v = f16_to_f32(f32_to_f16(-fd(g)));
    for (auto& v : t->imin) v = static_cast<int8_t>(md(g));
  }
  for (int64_t r = 0; r < t->rows; ++r)
    for (int64_t j = 0; j < ng; ++j) {
      const int64_t i = r * ng + j, si = r * nsup + j / fg;
      t->scale[i] = t->fscale[si] * static_cast<float>(t->iscale[i]);
      if (!t->min.empty()) t->min[i] = t->fmin[si] * static_cast<float>(t->imin[i]);
    }
}

// Scale modes of the panel tests: 0 f32 scales, 1 f16 scales, 2 factored (K-quant) scales, 3
// factored with sub-scales and sub-mins in 0 .. 15 (Q2_K), and the layout the packer must choose
// for each: mode 3 keeps nibbles only for 2-bit values with a min.
constexpr int kModes[] = {0, 1, 2, 3};
void set_scale_mode(QuantTensor* t, int mode, uint32_t seed) {
  if (mode == 1) round_scales_to_half(t);
  if (mode >= 2) factor_scales(t, seed, mode == 3);
}
int32_t layout_of_mode(int mode, const Spec& s) {
  if (mode == 3 && s.value_bits() == 2 && s.min) return cpu::kCpuQuantPanelSubNibbleLayout;
  return mode == 0   ? cpu::kCpuQuantPanelLayout
         : mode == 1 ? cpu::kCpuQuantPanelHalfLayout
                     : cpu::kCpuQuantPanelSubLayout;
}

TEST(QuantPanel, DequantRowIsExact) {
  uint32_t seed = 900;
  for (int mode : kModes)
    for (const Spec& s : kSpecs)
      for (int64_t rows : {5, 16, 37}) {
        QuantTensor t = random_quant(rows, 100, s, seed++);
        set_scale_mode(&t, mode, seed++);
        const Packed p = pack_panel(t);
        ASSERT_EQ(p.w.layout, layout_of_mode(mode, s));
        QuantTensor stored = t;
        stored.perm.clear();
        std::vector<float> want(rows * 100), got(100);
        cpu::ref::dequantize(stored.view(), want.data());
        for (int64_t r = 0; r < rows; ++r) {
          cpu::panel_dequant_row(p.w, r, got.data());
          ASSERT_EQ(0, std::memcmp(got.data(), want.data() + r * 100, 400)) << "row " << r;
        }
      }
}

TEST(QuantPanel, HalfScalesKeepTheFileSize) {
  // Q4_1-like: 4-bit, group 32, f16 scale and min: 16 + 2 + 2 bytes per 32 weights, as in GGUF.
  QuantTensor t = random_quant(64, 576, {4, 32, false, true, false}, 31);
  round_scales_to_half(&t);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 576 / 32 * 20);
}

TEST(QuantPanel, NarrowValuesKeepTheirWidth) {
  // Q5_0-like: byte values < 32, group 32, f16 scale: 16 nibble bytes, 4 bit-plane bytes and the
  // 2-byte scale per 32 weights, GGUF's 22.
  QuantTensor t = random_quant(64, 576, {8, 32, false, false, false, 5}, 41);
  round_scales_to_half(&t);
  EXPECT_EQ(pack_panel(t).w.bits, 5);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 576 / 32 * 22);
  // Q6_K-like: values < 64, group 16, factored scales: 0.75 bytes per value, an int8 sub-scale
  // per 16 and an f16 factor per super-block of 8 groups.
  t = random_quant(64, 512, {8, 16, false, false, false, 6}, 43);
  factor_scales(&t, 44);
  EXPECT_EQ(pack_panel(t).w.bits, 6);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 512 * 3 / 4 + 64 * 32 + 64 * 4 * 2);
  // One value of 32 (or 64) is enough to need the wider form.
  t = random_quant(16, 64, {8, 32, false, false, false, 5}, 45);
  t.q[17] = 32;
  EXPECT_EQ(pack_panel(t).w.bits, 6);
  t.q[17] = 64;
  EXPECT_EQ(pack_panel(t).w.bits, 8);
  t = random_quant(16, 64, {8, 32, false, false, false, 4}, 46);
  EXPECT_EQ(pack_panel(t).w.bits, 4);
  EXPECT_EQ(pack_panel(t).w.codebook, nullptr);
}

TEST(QuantPanel, TwoAndThreeBitValuesKeepTheirWidth) {
  // Q2_K-like: nibbles < 4, group 16, factored scale and min: 0.25 bytes per value, an int8
  // sub-scale and sub-min per 16, f16 factors per super-block of 8 groups.
  QuantTensor t = random_quant(64, 512, {4, 16, false, true, false, 2}, 61);
  factor_scales(&t, 62);
  EXPECT_EQ(pack_panel(t).w.bits, 2);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 512 / 4 + 2 * 64 * 32 + 2 * 64 * 4 * 2);
  // Q2_K itself: sub-scales and sub-mins in 0 .. 15 share a byte, as in the file.
  factor_scales(&t, 62, true);
  EXPECT_EQ(pack_panel(t).w.layout, cpu::kCpuQuantPanelSubNibbleLayout);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 512 / 4 + 64 * 32 + 2 * 64 * 4 * 2);
  // One sub-min of 16 (or a sub-scale below 0) needs a byte each again.
  const int8_t keep = t.imin[40];
  t.imin[40] = 16;
  t.min[40] = t.fmin[40 / 8] * 16.f;
  EXPECT_EQ(pack_panel(t).w.layout, cpu::kCpuQuantPanelSubLayout);
  t.imin[40] = keep;
  t.min[40] = t.fmin[40 / 8] * static_cast<float>(keep);
  t.iscale[3] = -1;
  t.scale[3] = -t.fscale[0];
  EXPECT_EQ(pack_panel(t).w.layout, cpu::kCpuQuantPanelSubLayout);
  // Q3_K-like: values < 8: 0.375 bytes per value (0.25 + one bit plane).
  t = random_quant(64, 512, {4, 16, false, false, false, 3}, 63);
  factor_scales(&t, 64);
  EXPECT_EQ(pack_panel(t).w.bits, 3);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 512 * 3 / 8 + 64 * 32 + 64 * 4 * 2);
  // One value of 4 (or 8) is enough to need the wider form; bytes narrow the same way.
  t = random_quant(16, 64, {4, 32, false, false, false, 2}, 65);
  t.q[17] = 4;
  EXPECT_EQ(pack_panel(t).w.bits, 3);
  t.q[17] = 8;
  EXPECT_EQ(pack_panel(t).w.bits, 4);
  t = random_quant(16, 64, {8, 32, false, false, false, 3}, 66);
  EXPECT_EQ(pack_panel(t).w.bits, 3);
}

TEST(QuantPanel, SixteenLevelsBecomeCodebookIndices) {
  // IQ4_NL-like: IQ4 levels, group 32, f16 scale: 16 index bytes and the 2-byte scale per 32
  // weights, GGUF's 18, plus the codebook's own 64-byte region.
  QuantTensor t = random_quant(64, 576, {8, 32, false, false, false, 0, 1}, 51);
  round_scales_to_half(&t);
  Packed p = pack_panel(t);
  EXPECT_EQ(p.w.bits, 4);
  ASSERT_NE(p.w.codebook, nullptr);
  EXPECT_EQ(0, std::memcmp(p.w.codebook, kIq4Levels, 16));
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 576 / 32 * 18 + 64);
  // IQ4_XS-like: factored scales over super-blocks of 8 groups of 32: an int8 sub-scale per 32
  // and an f16 factor per 256 (the file's 6-bit sub-scales take a byte).
  t = random_quant(64, 512, {8, 32, false, false, false, 0, 1}, 53);
  factor_scales(&t, 54);
  p = pack_panel(t);
  EXPECT_EQ(p.w.layout, cpu::kCpuQuantPanelSubLayout);
  ASSERT_NE(p.w.codebook, nullptr);
  EXPECT_EQ(cpu::cpu_quant_panel_bytes(t.view()), 64u * 512 / 2 + 64 * 16 + 64 * 2 * 2 + 64);
  // Fewer levels give a shorter codebook (in ascending order); a 17th value needs the bytes.
  t = random_quant(16, 64, {8, 32, false, false, false, 0, 2}, 55);
  for (auto& v : t.q) v = v == 0 ? 255 : v;
  p = pack_panel(t);
  ASSERT_NE(p.w.codebook, nullptr);
  EXPECT_EQ(0, std::memcmp(p.w.codebook, kWideLevels + 1, 15));
  t.q[5] = 100;
  t.q[9] = 101;
  EXPECT_EQ(pack_panel(t).w.bits, 8);
  EXPECT_EQ(pack_panel(t).w.codebook, nullptr);
}

TEST(QuantPanel, HalfLayoutOnlyWhenEveryScaleIsAnF16Value) {
  // The packer decides from the scale's bits; each value is set as the first scale of a matrix
  // whose other scales are ordinary f16 values, and the layout must follow the f16 round trip.
  const float values[] = {
      0.5f,     -0.f,         65504.f,  65520.f,  1.f + 0x1p-10f, 1.f + 0x1p-11f, 0x1p-14f,
      0x1p-20f, 3 * 0x1p-24f, 0x1p-24f, 0x1p-25f, 5 * 0x1p-25f,   0x1p-126f,      std::ldexp(1.f, -140),
      INFINITY};
  for (float v : values) {
    QuantTensor t = random_quant(16, 64, {4, 32, false, true, false}, 77);
    round_scales_to_half(&t);
    t.scale[0] = v;
    const bool want = std::isfinite(v) && f16_to_f32(f32_to_f16(v)) == v;
    const Packed p = pack_panel(t);
    EXPECT_EQ(p.w.layout, want ? cpu::kCpuQuantPanelHalfLayout : cpu::kCpuQuantPanelLayout) << "scale " << v;
  }
}

TEST(QuantPanel, ActivationQuantizationRoundsPerBlock) {
  const float x[40] = {1.f, -0.5f, 0.25f, 127.f};  // rest 0; second block all zero
  const XQ q = quantize_x(x, 1, 40, 32);
  EXPECT_EQ(q.d[0], 1.f);
  EXPECT_EQ(q.q[0], 1);
  EXPECT_EQ(q.q[1], 0);  // -0.5 rounds half to even
  EXPECT_EQ(q.q[3], 127);
  EXPECT_EQ(q.s[0], 128);
  EXPECT_EQ(q.d[1], 0.f);
  EXPECT_EQ(q.s[1], 0);
}

// Every ISA level's panel kernels: the activation quantizer is bit-equal to the reference, and the
// linear to the portable kernel (the exact reference of the panel arithmetic) on every format and
// ragged shape, with and without bias, and a panel sub-range writes only its columns.
class PanelKernels : public ::testing::TestWithParam<Isa> {};

TEST_P(PanelKernels, QuantizerIsBitEqualToTheReference) {
  const cpu::QuantizeRowsFn fast = cpu::panel_kernels_for(GetParam()).quantize;
  for (int32_t block : {16, 32})
    for (int64_t k : {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 576, 1000, 1536}) {
      const int64_t m = 5, nb = (k + block - 1) / block, ld = nb * block;
      std::vector<float> x = randn(static_cast<size_t>(m * k), static_cast<uint32_t>(k * block));
      for (int64_t i = 0; i < k; ++i) x[i] = 0.f;  // an all-zero row
      for (int64_t i = 0; i < k; ++i) x[k + i] = static_cast<float>(i % 9) - 4.f + (i % 2 ? 0.5f : 0.f);
      x[k] = 127.f;                                           // ties at .5 steps
      for (int64_t i = 0; i < k; ++i) x[2 * k + i] *= 1e30f;  // huge values
      std::vector<int8_t> q0(m * ld, 99), q1(m * ld, -99);
      std::vector<float> d0(m * nb), d1(m * nb);
      std::vector<int32_t> s0(m * nb), s1(m * nb);
      cpu::quantize_rows_int8(x.data(), m, k, block, q0.data(), d0.data(), s0.data());
      fast(x.data(), m, k, block, q1.data(), d1.data(), s1.data());
      EXPECT_EQ(q0, q1) << "k=" << k << " block=" << block;
      EXPECT_EQ(0, std::memcmp(d0.data(), d1.data(), d0.size() * 4)) << "k=" << k;
      EXPECT_EQ(s0, s1) << "k=" << k;
    }
}

// Weights at the ends of their range (every u4 / u8 value 0 and 15 / 255, a codebook's lowest and
// highest level) against activations at
// +-127 are where an int16 pair sum would saturate if the kernel's bound reasoning were wrong.
void extreme_weights(QuantTensor* t, const Spec& s, uint32_t seed) {
  std::mt19937 g(seed);
  const uint8_t top = s.codebook ? levels_of(s)[15] : static_cast<uint8_t>((1 << s.value_bits()) - 1);
  const uint8_t bottom = s.codebook ? levels_of(s)[0] : 0;
  for (auto& v : t->q) v = (g() & 1) ? top : bottom;
}

void expect_panel_equal(cpu::LinearPanelFn fn, cpu::LinearPanelFn ref, const XQ& xq, const Packed& p,
                        const float* bias, int64_t m, int64_t n, const std::string& what) {
  const int64_t panels = (n + 15) / 16;
  std::vector<float> want(m * n, -1.f), got(m * n, -2.f);
  ref(xq.rows, p.w, bias, want.data(), m, n, 0, panels);
  fn(xq.rows, p.w, bias, got.data(), m, n, 0, panels);
  ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4)) << what;
  std::vector<float> part(m * n, 7.f);
  fn(xq.rows, p.w, bias, part.data(), m, n, 1, panels);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(part[r * n + j], j < 16 ? 7.f : want[r * n + j]) << what << " r " << r << " j " << j;
}

// fn against the portable kernel on every format, scale mode and ragged shape, with extreme values.
void expect_linear_bit_equal(cpu::LinearPanelFn fn, const char* label) {
  const cpu::LinearPanelFn ref = cpu::scalar_linear_panel();
  ASSERT_NE(fn, nullptr);
  uint32_t seed = 5000;
  for (int mode : kModes)
    for (bool extreme : {false, true})
      for (const Spec& s : kSpecs)
        for (int64_t m : {1, 2, 4, 7, 17})  // the 4-row tile: full, and tails of 1, 2 and 3
          for (int64_t k : {40, 100, 257, 576}) {
            const int64_t n = 53;
            QuantTensor t = random_quant(n, k, s, seed++);
            set_scale_mode(&t, mode, seed++);
            if (extreme) extreme_weights(&t, s, seed++);
            const Packed p = pack_panel(t);
            std::vector<float> x = randn(m * k, seed++);
            if (extreme)
              for (size_t i = 0; i < x.size(); ++i) x[i] = (i * 7919 % 3 == 0) ? -1.f : 1.f;  // all +-127
            const std::vector<float> bias = randn(n, seed++);
            const XQ xq = quantize_x(x.data(), m, k, cpu::xq_block(p.w));
            std::ostringstream what;
            what << label << " bits " << s.bits << " width " << s.width << " codebook " << s.codebook
                 << " group " << s.group << " scale mode " << mode << " extreme " << extreme << " m " << m
                 << " k " << k;
            for (const float* b : {static_cast<const float*>(nullptr), bias.data()})
              expect_panel_equal(fn, ref, xq, p, b, m, n, what.str());
          }
}

TEST_P(PanelKernels, LinearIsBitEqualToThePortableKernel) {
  const cpu::PanelKernels pk = cpu::panel_kernels_for(GetParam());
  expect_linear_bit_equal(pk.linear, pk.name);
}

// Both AVX2 twins wherever this CPU runs them, whichever one the avx2 level picked: plain AVX2,
// and with AVX-VNNI (u8 x s8 straight into int32: no sign trick, no int16 sums).
TEST(QuantPanel, AvxTwinsAreBitEqualToThePortableKernel) {
  if (cpu::detected_isa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2 here";
  expect_linear_bit_equal(cpu::avx2_linear_panel(), "avx2");
  if (!cpu::cpu_features().avx_vnni) GTEST_SKIP() << "no AVX-VNNI here (the AVX2 twin passed)";
  if (!cpu::avx_vnni_linear_panel()) GTEST_SKIP() << "this compiler built no AVX-VNNI kernel";
  expect_linear_bit_equal(cpu::avx_vnni_linear_panel(), "avxvnni");
}

TEST_P(PanelKernels, BackendLinearMatchesInt8Reference) {
  auto be = cpu::make_cpu_backend(GetParam(), 2);
  uint32_t seed = 1000;
  for (int mode : kModes)
    for (const Spec& s : kSpecs)
      for (int64_t m : {1, 3, 17, 64})
        for (int64_t k : {40, 100, 257}) {
          const int64_t n = 37;
          QuantTensor t = random_quant(n, k, s, seed++);
          set_scale_mode(&t, mode, seed++);
          const Packed p = pack_panel(t);
          ASSERT_EQ(p.w.layout, layout_of_mode(mode, s));
          const std::vector<float> x = randn(m * k, seed++);
          const std::vector<float> bias = randn(n, seed++);
          std::vector<float> xg = x;
          if (!t.perm.empty())
            for (int64_t r = 0; r < m; ++r)
              for (int64_t c = 0; c < k; ++c) xg[r * k + c] = x[r * k + t.perm[c]];
          const XQ xq = quantize_x(xg.data(), m, k, cpu::xq_block(p.w));
          QuantTensor stored = t;
          stored.perm.clear();
          std::vector<float> got(m * n), want(m * n), exact(m * n), wd(n * k);
          be->linear_q(x.data(), p.w, bias.data(), got.data(), m, n);
          cpu::ref::linear_q_int8x(xq.rows, stored.view(), bias.data(), want.data(), m, n);
          cpu::ref::linear_q(x.data(), t.view(), bias.data(), exact.data(), m, n);
          cpu::ref::dequantize(stored.view(), wd.data());
          double rel = 0, norm = 0;
          for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j) {
              double mag = 0;
              for (int64_t c = 0; c < k; ++c) mag += std::fabs(xg[r * k + c] * wd[j * k + c]);
              ASSERT_NEAR(got[r * n + j], want[r * n + j], 4e-7 * k * mag + 1e-5)
                  << "bits " << s.bits << " group " << s.group << " m " << m << " k " << k;
              rel += std::fabs(got[r * n + j] - exact[r * n + j]) / (mag + 1e-6);
              norm += 1;
            }
          // int8 activations: the error against exact activations stays at the per-block rounding
          // level (half a step of 1/127 of the block max, relative to sum |x||w|).
          EXPECT_LT(rel / norm, 4e-3) << "bits " << s.bits << " group " << s.group;
        }
}

TEST_P(PanelKernels, BackendLinearIsBatchAndThreadInvariant) {
  auto be1 = cpu::make_cpu_backend(GetParam(), 1);
  auto be2 = cpu::make_cpu_backend(GetParam(), 2);
  // The 8-bit 32-group matrix (346 KiB) is more than one prefill chunk of weights
  // (kPanelChunkBytes), so even one thread splits it into column chunks.
  const std::pair<Spec, int64_t> cases[] = {{Spec{4, 32, false, true, false}, 301},
                                            {Spec{8, 16, true, false, false}, 301},
                                            {Spec{8, 32, true, false, false}, 601}};
  for (const auto& [s, n] : cases) {
    const int64_t m = 300, k = 576;  // 300: AMX row blocks of 128 and a tail
    const QuantTensor t = random_quant(n, k, s, 7);
    const Packed p = pack_panel(t);
    const std::vector<float> x = randn(m * k, 8);
    std::vector<float> all(m * n), one(n), threaded(m * n);
    be2->linear_q(x.data(), p.w, nullptr, all.data(), m, n);
    be1->linear_q(x.data(), p.w, nullptr, threaded.data(), m, n);
    ASSERT_EQ(0, std::memcmp(all.data(), threaded.data(), all.size() * 4));
    for (int64_t r = 0; r < m; r += 3) {
      be2->linear_q(x.data() + r * k, p.w, nullptr, one.data(), 1, n);
      ASSERT_EQ(0, std::memcmp(one.data(), all.data() + r * n, n * 4)) << "row " << r;
    }
  }
}

// A fused matrix's parts (q | k | v, gate | up) in one call give each part's linear_q bits: run
// as one op when every part takes the same activation blocks (ragged parts, a 6-bit one beside
// 4-bit ones), part by part when not (an act-order part, 16-column blocks beside 32), at decode and
// prefill sizes, on 1 and 2 threads; the columns past the parts stay untouched.
TEST_P(PanelKernels, BackendPartsEqualPartByPart) {
  const int64_t k = 576;
  const std::vector<std::vector<Spec>> sets = {
      {Spec{4, 32, false, true, false}, Spec{4, 32, false, true, false}, Spec{8, 32, true, true, false, 6}},
      {Spec{4, 32, false, true, false}, Spec{8, 16, true, false, false}},
      {Spec{4, 32, false, true, false}, Spec{4, 32, true, false, true}},
  };
  const int64_t part_rows[] = {96, 33, 40};
  for (int threads : {1, 2}) {
    auto be = cpu::make_cpu_backend(GetParam(), threads);
    for (size_t si = 0; si < sets.size(); ++si) {
      std::vector<Packed> packed;
      std::vector<const QuantMatrix*> ws;
      std::vector<int64_t> row0;
      int64_t n = 0;
      for (size_t i = 0; i < sets[si].size(); ++i) {
        packed.push_back(
            pack_panel(random_quant(part_rows[i], k, sets[si][i], 20 + static_cast<uint32_t>(i))));
        row0.push_back(n);
        n += part_rows[i];
      }
      for (const Packed& p : packed) ws.push_back(&p.w);
      const int64_t ldy = n + 5;
      const std::vector<float> bias = randn(n, 30);
      for (int64_t m : {1, 70}) {
        const std::vector<float> x = randn(m * k, 31);
        std::vector<float> got(m * ldy, 7.f), want(m * ldy, 7.f);
        be->linear_q_parts(x.data(), ws.data(), row0.data(), static_cast<int>(ws.size()), bias.data(),
                           got.data(), m, ldy);
        for (size_t i = 0; i < ws.size(); ++i)
          be->linear_q(x.data(), *ws[i], bias.data() + row0[i], want.data() + row0[i], m, ldy);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
            << "set " << si << " m " << m << " threads " << threads;
      }
    }
  }
}

TEST_P(PanelKernels, BackendPacksPanelsUnlessAskedForF32) {
  const QuantTensor t = random_quant(20, 64, {4, 32, false, true, false}, 5);
  const test::ScopedEnv kernel("FANTAI_QUANT_KERNEL", "f32");
  auto f32 = cpu::make_cpu_backend(GetParam(), 1);
  kernel.set(nullptr);
  auto int8 = cpu::make_cpu_backend(GetParam(), 1);
  std::vector<uint8_t> a(f32->quant_packed_bytes(t.view())), b(int8->quant_packed_bytes(t.view()));
  EXPECT_EQ(f32->pack_quant(t.view(), a.data()).layout, cpu::kCpuQuantLayout);
  EXPECT_TRUE(cpu::is_panel_layout(int8->pack_quant(t.view(), b.data()).layout));
  kernel.set("fast");
  EXPECT_THROW(cpu::make_cpu_backend(GetParam(), 1), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Isas, PanelKernels, ::testing::ValuesIn(levels()),
                         [](const auto& info) { return std::string(cpu::isa_name(info.param)); });

// The AMX int8 twin must give the portable kernel's bits on every format and ragged shape (the
// backend switches between it and VNNI by row count), including a short last block inside a group
// and rows or panels that fill no whole tile.
TEST(QuantPanel, AmxInt8EqualsThePortableKernelBitForBit) {
  const cpu::LinearPanelFn amx = cpu::amx_int8_linear_panel(), ref = cpu::scalar_linear_panel();
  if (!amx || !cpu::cpu_has_avx512_vnni()) GTEST_SKIP() << "no AMX-INT8 (or no VNNI) here";
  uint32_t seed = 4000;
  for (int mode : kModes)
    for (const Spec& s : kSpecs)
      for (int64_t m : {1, 5, 16, 17, 33, 70, 301})
        for (int64_t k : {40, 100, 257, 576}) {
          const int64_t n = 53;
          QuantTensor t = random_quant(n, k, s, seed++);
          set_scale_mode(&t, mode, seed++);
          const Packed p = pack_panel(t);
          const std::vector<float> x = randn(m * k, seed++);
          const std::vector<float> bias = randn(n, seed++);
          const XQ xq = quantize_x(x.data(), m, k, cpu::xq_block(p.w));
          std::ostringstream what;
          what << "bits " << s.bits << " width " << s.width << " codebook " << s.codebook << " group "
               << s.group << " scale mode " << mode << " m " << m << " k " << k;
          for (const float* b : {static_cast<const float*>(nullptr), bias.data()})
            expect_panel_equal(amx, ref, xq, p, b, m, n, what.str());
        }
}

TEST(QuantPack, RejectsMalformedMatrices) {
  QuantTensor t = random_quant(4, 48, {4, 32, false, false, false}, 3);
  t.q[5] = 16;  // not a 4-bit value
  EXPECT_THROW(cpu::cpu_quant_packed_bytes(t.view()), InvalidArgument);
  t = random_quant(4, 48, {8, 24, false, false, false}, 3);  // group straddles vector steps
  EXPECT_THROW(cpu::cpu_quant_packed_bytes(t.view()), InvalidArgument);
  t = random_quant(4, 48, {8, 16, false, false, true}, 3);
  t.perm[0] = t.perm[1];
  EXPECT_THROW(cpu::cpu_quant_packed_bytes(t.view()), InvalidArgument);
}

TEST(QuantPack, UniformZeroBecomesAConstantAndFourBitStaysFourBit) {
  QuantTensor t = random_quant(8, 256, {4, 32, false, true, false}, 4);
  t.zero.assign(8 * 8, 3);
  const Packed p = pack(t);
  EXPECT_EQ(p.w.zero, nullptr);
  EXPECT_EQ(p.w.zero_point, 3);
  EXPECT_EQ(p.w.ld, 128);  // 256 nibbles
}

// ---- GGUF block decoding -----------------------------------------------------------------------

void put_half(std::vector<uint8_t>& b, size_t at, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(b.data() + at, &h, 2);
}

std::vector<float> decode(const std::vector<uint8_t>& b, int type, int64_t rows, int64_t cols) {
  std::vector<float> out(rows * cols);
  model::ggml_to_f32(b.data(), b.size(), type, rows, cols, nullptr, out.data());
  return out;
}

TEST(Gguf, Q8_0) {
  std::vector<uint8_t> b(34);
  put_half(b, 0, 0.5f);
  for (int i = 0; i < 32; ++i) b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i * 8 - 128));
  const auto y = decode(b, model::kGgmlQ8_0, 1, 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.5f * (i * 8 - 128)) << i;
}

TEST(Gguf, Q4_0AndQ4_1NibbleOrder) {
  std::vector<uint8_t> b(18);
  put_half(b, 0, 2.0f);
  for (int i = 0; i < 16; ++i) b[2 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  auto y = decode(b, model::kGgmlQ4_0, 1, 32);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(y[i], 2.0f * (i - 8));
    EXPECT_EQ(y[16 + i], 2.0f * (15 - i - 8));
  }
  std::vector<uint8_t> c(20);
  put_half(c, 0, 0.25f);
  put_half(c, 2, -1.5f);
  for (int i = 0; i < 16; ++i) c[4 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  y = decode(c, model::kGgmlQ4_1, 1, 32);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(y[i], 0.25f * i + -1.5f);
    EXPECT_EQ(y[16 + i], 0.25f * (15 - i) + -1.5f);
  }
}

// 6-bit scales sc[j] and mins mn[j] of 8 sub-blocks into the 12-byte K-quant packing.
void pack_scales_k4(const int* sc, const int* mn, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

TEST(Gguf, Q4_KAndQ5_K) {
  const int sc[8] = {1, 63, 17, 32, 5, 48, 33, 63};
  const int mn[8] = {0, 7, 63, 20, 40, 1, 62, 16};
  const float d = 0.0625f, dmin = 0.03125f;
  for (int type : {model::kGgmlQ4_K, model::kGgmlQ5_K}) {
    const bool q5 = type == model::kGgmlQ5_K;
    std::vector<uint8_t> b(q5 ? 176 : 144);
    put_half(b, 0, d);
    put_half(b, 2, dmin);
    pack_scales_k4(sc, mn, b.data() + 4);
    std::vector<int> q(256);
    for (int e = 0; e < 256; ++e) q[e] = (e * 7 + 3) % (q5 ? 32 : 16);
    uint8_t* qs = b.data() + (q5 ? 48 : 16);
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) {
        qs[32 * p + l] = static_cast<uint8_t>((q[64 * p + l] & 15) | ((q[64 * p + 32 + l] & 15) << 4));
        if (q5) {
          b[16 + l] |= static_cast<uint8_t>(((q[64 * p + l] >> 4) << (2 * p)) |
                                            ((q[64 * p + 32 + l] >> 4) << (2 * p + 1)));
        }
      }
    const auto y = decode(b, type, 1, 256);
    for (int e = 0; e < 256; ++e) {
      const int j = e / 32;
      const float d1 = d * static_cast<float>(sc[j]), m1 = dmin * static_cast<float>(mn[j]);
      volatile float prod = d1 * static_cast<float>(q[e]);
      EXPECT_EQ(y[e], prod - m1) << "type " << type << " element " << e;
    }
  }
}

TEST(Gguf, Q6_K) {
  std::vector<uint8_t> b(210);
  std::vector<int> q(256);
  int8_t sc[16];
  for (int s = 0; s < 16; ++s) sc[s] = static_cast<int8_t>(s * 9 - 70);
  for (int e = 0; e < 256; ++e) q[e] = (e * 11 + 5) % 64;
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const int* Q = q.data() + 128 * n;
      b[64 * n + l] = static_cast<uint8_t>((Q[l] & 15) | ((Q[l + 64] & 15) << 4));
      b[64 * n + l + 32] = static_cast<uint8_t>((Q[l + 32] & 15) | ((Q[l + 96] & 15) << 4));
      b[128 + 32 * n + l] = static_cast<uint8_t>((Q[l] >> 4) | ((Q[l + 32] >> 4) << 2) |
                                                 ((Q[l + 64] >> 4) << 4) | ((Q[l + 96] >> 4) << 6));
    }
  std::memcpy(b.data() + 192, sc, 16);
  const float d = 0.0078125f;
  put_half(b, 208, d);
  const auto y = decode(b, model::kGgmlQ6_K, 1, 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], d * static_cast<float>(sc[e / 16]) * static_cast<float>(q[e] - 32)) << e;
}

// Element e's 5-bit value q[e] of a Q5_0 / Q5_1 block: nibbles as Q4_0, 5th bits in a
// little-endian u32 at `at`.
void pack_q5(const int* q, std::vector<uint8_t>& b, size_t at) {
  uint32_t qh = 0;
  for (int i = 0; i < 16; ++i) {
    b[at + 4 + i] = static_cast<uint8_t>((q[i] & 15) | ((q[i + 16] & 15) << 4));
    qh |= static_cast<uint32_t>(q[i] >> 4) << i | static_cast<uint32_t>(q[i + 16] >> 4) << (i + 16);
  }
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(qh >> (8 * i));
}

TEST(Gguf, Q5_0AndQ5_1) {
  int q[32];
  for (int e = 0; e < 32; ++e) q[e] = (e * 7 + 3) % 32;
  q[0] = 31;  // every bit position of the u32 is exercised both ways
  q[31] = 16;
  std::vector<uint8_t> b(22);
  put_half(b, 0, 0.375f);
  pack_q5(q, b, 2);
  auto y = decode(b, model::kGgmlQ5_0, 1, 32);
  for (int e = 0; e < 32; ++e) EXPECT_EQ(y[e], 0.375f * static_cast<float>(q[e] - 16)) << e;
  std::vector<uint8_t> c(24);
  put_half(c, 0, 0.0625f);
  put_half(c, 2, -0.8125f);
  pack_q5(q, c, 4);
  y = decode(c, model::kGgmlQ5_1, 1, 32);
  for (int e = 0; e < 32; ++e) {
    volatile float prod = 0.0625f * static_cast<float>(q[e]);
    EXPECT_EQ(y[e], prod + -0.8125f) << e;
  }
}

TEST(Gguf, Q2_K) {
  std::vector<uint8_t> b(84);
  int q[256];
  for (int e = 0; e < 256; ++e) q[e] = (e * 5 + e / 16) % 4;
  for (int s = 0; s < 16; ++s) b[s] = static_cast<uint8_t>(((15 - s) << 4) | ((s * 7) % 16));
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l)
        b[16 + 32 * n + l] |= static_cast<uint8_t>(q[128 * n + 32 * t + l] << (2 * t));
  const float d = 0.046875f, dmin = 0.0234375f;
  put_half(b, 80, d);
  put_half(b, 82, dmin);
  const auto y = decode(b, model::kGgmlQ2_K, 1, 256);
  for (int e = 0; e < 256; ++e) {
    const float dl = d * static_cast<float>(b[e / 16] & 15), ml = dmin * static_cast<float>(b[e / 16] >> 4);
    volatile float prod = dl * static_cast<float>(q[e]);
    EXPECT_EQ(y[e], prod - ml) << e;
  }
}

TEST(Gguf, Q3_K) {
  std::vector<uint8_t> b(110);
  int q[256], sc[16];
  for (int e = 0; e < 256; ++e) q[e] = (e * 3 + e / 32) % 8 - 4;  // -4..3
  for (int s = 0; s < 16; ++s) sc[s] = (s * 37 + 5) % 64;
  sc[15] = 63;
  sc[3] = 0;
  for (int e = 0; e < 256; ++e) {
    const int v = q[e] + 4;  // 2 low bits, and the third bit set when the value is >= 0
    b[32 + 32 * (e / 128) + e % 32] |= static_cast<uint8_t>((v & 3) << (2 * ((e / 32) % 4)));
    b[e % 32] |= static_cast<uint8_t>((v >> 2) << (e / 32));
  }
  for (int s = 0; s < 16; ++s) {
    b[96 + s % 8] |= static_cast<uint8_t>((sc[s] & 15) << (s < 8 ? 0 : 4));
    b[96 + 8 + s % 4] |= static_cast<uint8_t>((sc[s] >> 4) << (2 * (s / 4)));
  }
  const float d = 0.01171875f;
  put_half(b, 108, d);
  const auto y = decode(b, model::kGgmlQ3_K, 1, 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], (d * static_cast<float>(sc[e / 16] - 32)) * static_cast<float>(q[e])) << e;
}

// llama.cpp's IQ4 codebook, as the GGUF format defines it.
constexpr int kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

TEST(Gguf, IQ4_NL) {
  std::vector<uint8_t> b(18);
  int idx[32];
  for (int e = 0; e < 32; ++e) idx[e] = (e * 9 + 4) % 16;
  for (int i = 0; i < 16; ++i) b[2 + i] = static_cast<uint8_t>(idx[i] | (idx[i + 16] << 4));
  put_half(b, 0, -0.0048828125f);
  const auto y = decode(b, model::kGgmlIQ4_NL, 1, 32);
  for (int e = 0; e < 32; ++e) EXPECT_EQ(y[e], -0.0048828125f * static_cast<float>(kIq4[idx[e]])) << e;
}

TEST(Gguf, IQ4_XS) {
  std::vector<uint8_t> b(136);
  int idx[256], ls[8] = {0, 63, 32, 17, 45, 31, 33, 8};
  for (int e = 0; e < 256; ++e) idx[e] = (e * 5 + e / 32) % 16;
  uint16_t sh = 0;
  for (int j = 0; j < 8; ++j) {
    b[4 + j / 2] |= static_cast<uint8_t>((ls[j] & 15) << (4 * (j % 2)));
    sh |= static_cast<uint16_t>((ls[j] >> 4) << (2 * j));
  }
  b[2] = static_cast<uint8_t>(sh & 0xFF);
  b[3] = static_cast<uint8_t>(sh >> 8);
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 16; ++l)
      b[8 + 16 * j + l] = static_cast<uint8_t>(idx[32 * j + l] | (idx[32 * j + 16 + l] << 4));
  const float d = 0.0029296875f;
  put_half(b, 0, d);
  const auto y = decode(b, model::kGgmlIQ4_XS, 1, 256);
  for (int e = 0; e < 256; ++e)
    EXPECT_EQ(y[e], (d * static_cast<float>(ls[e / 32] - 32)) * static_cast<float>(kIq4[idx[e]])) << e;
}

// Random bytes of a [rows, cols] tensor with its f16 fields set to finite values of either sign.
std::vector<uint8_t> random_gguf_blocks(int type, int64_t rows, int64_t cols, uint32_t seed) {
  struct Layout {
    int elems, bytes;
    std::vector<int> halves;
  };
  const Layout l = type == model::kGgmlQ5_0     ? Layout{32, 22, {0}}
                   : type == model::kGgmlQ5_1   ? Layout{32, 24, {0, 2}}
                   : type == model::kGgmlQ2_K   ? Layout{256, 84, {80, 82}}
                   : type == model::kGgmlQ3_K   ? Layout{256, 110, {108}}
                   : type == model::kGgmlIQ4_NL ? Layout{32, 18, {0}}
                   : type == model::kGgmlQ4_0   ? Layout{32, 18, {0}}
                   : type == model::kGgmlQ4_1   ? Layout{32, 20, {0, 2}}
                   : type == model::kGgmlQ8_0   ? Layout{32, 34, {0}}
                   : type == model::kGgmlQ4_K   ? Layout{256, 144, {0, 2}}
                   : type == model::kGgmlQ5_K   ? Layout{256, 176, {0, 2}}
                   : type == model::kGgmlQ6_K   ? Layout{256, 210, {208}}
                                                : Layout{256, 136, {0}};  // IQ4_XS
  std::mt19937 g(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(0.001f, 0.05f);
  const int64_t nb = rows * cols / l.elems;
  std::vector<uint8_t> b(static_cast<size_t>(nb * l.bytes));
  for (auto& v : b) v = static_cast<uint8_t>(byte(g));
  for (int64_t i = 0; i < nb; ++i)
    for (int at : l.halves)
      put_half(b, static_cast<size_t>(i * l.bytes + at), (byte(g) & 1 ? 1.f : -1.f) * mag(g));
  return b;
}

// The decoded forms are valid canonical matrices (Q2_K / Q3_K: 4-bit values in groups of 16),
// and both CPU kernels run them: the exact one equals the dense linear on the dequantized matrix
// bit for bit; the default one (int8 activations where the CPU has VNNI) stays within the
// activation rounding, max|x| / 254 per 32-column block, times sum |w|.
TEST(Gguf, NewTypesRunOnTheQuantizedKernels) {
  struct Want {
    int type, bits, group;
  };
  const Want types[] = {{model::kGgmlQ5_0, 8, 32}, {model::kGgmlQ5_1, 8, 32},   {model::kGgmlQ2_K, 4, 16},
                        {model::kGgmlQ3_K, 4, 16}, {model::kGgmlIQ4_NL, 8, 32}, {model::kGgmlIQ4_XS, 8, 32}};
  const int64_t n = 21, k = 512, m = 5;
  const test::ScopedEnv kernel("FANTAI_QUANT_KERNEL", "f32");
  auto exact = cpu::make_cpu_backend(cpu::detected_isa(), 2);
  kernel.set(nullptr);
  auto fast = cpu::make_cpu_backend(cpu::detected_isa(), 2);
  uint32_t seed = 70;
  for (const Want& w : types) {
    const std::vector<uint8_t> raw = random_gguf_blocks(w.type, n, k, seed++);
    const QuantTensor t = model::ggml_decode(raw.data(), raw.size(), w.type, n, k);
    ASSERT_EQ(t.bits, w.bits) << t.format;
    ASSERT_EQ(t.group, w.group) << t.format;
    ASSERT_NO_THROW(check_quant_matrix(t.view())) << t.format;
    std::vector<float> wd(n * k);
    model::dequantize(t.view(), wd.data());
    const std::vector<float> x = randn(m * k, seed++);
    std::vector<float> got(m * n), want(m * n);
    for (Backend* be : {exact.get(), fast.get()}) {
      std::vector<uint8_t> mem(be->quant_packed_bytes(t.view()) + 64);
      void* dst = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t{63});
      const QuantMatrix p = be->pack_quant(t.view(), dst);
      be->linear_q(x.data(), p, nullptr, got.data(), m, n);
      if (be == exact.get()) {
        exact->linear(x.data(), wd.data(), DType::kF32, nullptr, want.data(), m, n, k);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << t.format;
        continue;
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < n; ++j) {
          double ref = 0, bound = 0, mag = 0;
          for (int64_t c0 = 0; c0 < k; c0 += 32) {
            double amax = 0, wsum = 0;
            for (int64_t c = c0; c < c0 + 32; ++c) {
              const double xv = x[r * k + c], wv = wd[j * k + c];
              ref += xv * wv;
              mag += std::fabs(xv * wv);
              amax = std::max(amax, std::fabs(xv));
              wsum += std::fabs(wv);
            }
            bound += amax / 254 * wsum;
          }
          ASSERT_NEAR(got[r * n + j], ref, 1.01 * bound + 1e-5 * mag)
              << t.format << " at (" << r << ", " << j << ")";
        }
    }
  }
}

TEST(Gguf, RowPermAndBadInput) {
  std::vector<uint8_t> b(3 * 34);
  for (int r = 0; r < 3; ++r) {
    put_half(b, r * 34, static_cast<float>(r + 1));
    for (int i = 0; i < 32; ++i) b[r * 34 + 2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i));
  }
  const int32_t perm[3] = {2, 0, 1};
  std::vector<float> out(3 * 32);
  model::ggml_to_f32(b.data(), b.size(), model::kGgmlQ8_0, 3, 32, perm, out.data());
  for (int r = 0; r < 3; ++r) EXPECT_EQ(out[r * 32 + 5], 5.f * (perm[r] + 1));
  EXPECT_THROW(model::ggml_to_f32(b.data(), b.size() - 1, model::kGgmlQ8_0, 3, 32, nullptr, out.data()),
               InvalidArgument);
  EXPECT_THROW(model::ggml_to_f32(b.data(), b.size(), 15 /* Q8_K */, 3, 32, nullptr, out.data()),
               InvalidArgument);
  // A whole Q5_0 block's bytes per row of Q8_0 are the wrong size for Q5_0: rejected, not read.
  EXPECT_THROW(model::ggml_to_f32(b.data(), b.size(), model::kGgmlQ5_0, 3, 32, nullptr, out.data()),
               InvalidArgument);
  for (int type : {model::kGgmlQ5_0, model::kGgmlQ5_1, model::kGgmlQ2_K, model::kGgmlQ3_K, model::kGgmlIQ4_NL,
                   model::kGgmlIQ4_XS}) {
    const int64_t cols = type == model::kGgmlQ2_K || type == model::kGgmlQ3_K || type == model::kGgmlIQ4_XS
                             ? 256
                             : 32;
    const std::vector<uint8_t> raw = random_gguf_blocks(type, 2, cols, 1);
    std::vector<float> y(2 * cols);
    EXPECT_NO_THROW(model::ggml_to_f32(raw.data(), raw.size(), type, 2, cols, nullptr, y.data())) << type;
    EXPECT_THROW(model::ggml_to_f32(raw.data(), raw.size() - 1, type, 2, cols, nullptr, y.data()),
                 InvalidArgument);
    EXPECT_THROW(model::ggml_decode(raw.data(), raw.size() / 2, type, 2, cols), InvalidArgument);
    EXPECT_THROW(model::ggml_decode(raw.data(), raw.size(), type, 1, cols + 16),
                 InvalidArgument);  // partial block
  }
  EXPECT_THROW(model::ggml_to_f32(b.data(), b.size(), model::kGgmlQ8_0, 3, 33, nullptr, out.data()),
               InvalidArgument);
}

// ---- round to nearest --------------------------------------------------------------------------

TEST(Rtn, SymmetricHandExample) {
  const float w[8] = {0.5f, -1.f, 0.25f, 7.f, 0.f, 0.f, 0.f, 0.f};
  const QuantTensor t = model::quantize_rtn(w, 2, 4, 4, 4, true);
  EXPECT_EQ(t.scale[0], 1.f);
  EXPECT_EQ(t.scale[1], 1.f);                         // all-zero row: s = 1
  const uint8_t want[8] = {8, 7, 8, 15, 8, 8, 8, 8};  // rint(0.5) = 0: half to even
  for (int i = 0; i < 8; ++i) EXPECT_EQ(t.q[i], want[i]) << i;
  EXPECT_EQ(t.zero[0], 8);
}

TEST(Rtn, ErrorWithinHalfAStep) {
  const std::vector<float> w = randn(7 * 100, 5);
  for (bool sym : {true, false})
    for (int bits : {4, 8})
      for (int group : {-1, 32}) {
        const QuantTensor t = model::quantize_rtn(w.data(), 7, 100, bits, group, sym);
        std::vector<float> back(w.size());
        model::dequantize(t.view(), back.data());
        const int64_t ng = t.view().ngroups();
        for (int64_t r = 0; r < 7; ++r)
          for (int64_t c = 0; c < 100; ++c) {
            const float s = t.scale[r * ng + c / t.group];
            ASSERT_LE(std::fabs(back[r * 100 + c] - w[r * 100 + c]), 0.5f * s * 1.0001f)
                << "sym " << sym << " bits " << bits << " group " << group;
          }
      }
}

// The K-quants and IQ4_XS keep only their file's factors in the panel layout (f16 super-block
// scale, int8 per group), and every ISA level's kernel gives the bits it gives on the same
// matrix with the f32 products kept instead.
TEST(QuantPanel, FactoredScalesGiveTheF32LayoutsBits) {
  const int types[] = {model::kGgmlQ2_K, model::kGgmlQ3_K, model::kGgmlQ4_K,
                       model::kGgmlQ5_K, model::kGgmlQ6_K, model::kGgmlIQ4_XS};
  const int64_t n = 37, k = 512;
  uint32_t seed = 90;
  for (int type : types) {
    const std::vector<uint8_t> raw = random_gguf_blocks(type, n, k, seed++);
    const QuantTensor t = model::ggml_decode(raw.data(), raw.size(), type, n, k);
    ASSERT_GT(t.fgroups, 0) << t.format;
    QuantTensor plain = t;
    plain.fgroups = 0;
    const Packed sub = pack_panel(t), f32 = pack_panel(plain);
    ASSERT_EQ(sub.w.layout,
              type == model::kGgmlQ2_K ? cpu::kCpuQuantPanelSubNibbleLayout : cpu::kCpuQuantPanelSubLayout)
        << t.format;
    ASSERT_EQ(f32.w.layout, cpu::kCpuQuantPanelLayout) << t.format;
    std::vector<float> a(k), b(k);
    for (int64_t r = 0; r < n; ++r) {
      cpu::panel_dequant_row(sub.w, r, a.data());
      cpu::panel_dequant_row(f32.w, r, b.data());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), k * 4)) << t.format << " row " << r;
    }
    for (Isa isa : levels()) {
      auto be = cpu::make_cpu_backend(isa, 2);
      for (int64_t m : {1, 5, 33}) {
        const std::vector<float> x = randn(m * k, seed++);
        std::vector<float> ya(m * n), yb(m * n);
        be->linear_q(x.data(), sub.w, nullptr, ya.data(), m, n);
        be->linear_q(x.data(), f32.w, nullptr, yb.data(), m, n);
        ASSERT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.size() * 4))
            << t.format << " " << cpu::isa_name(isa) << " m " << m;
      }
    }
  }
}

// A factoring that does not reproduce the scale exactly (or a factor that is no f16 value) is
// not trusted: the packer keeps the f32 scales.
TEST(QuantPanel, InexactFactorsKeepF32Scales) {
  const std::vector<uint8_t> raw = random_gguf_blocks(model::kGgmlQ4_K, 16, 256, 5);
  QuantTensor t = model::ggml_decode(raw.data(), raw.size(), model::kGgmlQ4_K, 16, 256);
  ASSERT_EQ(pack_panel(t).w.layout, cpu::kCpuQuantPanelSubLayout);
  QuantTensor bad = t;
  bad.iscale[3] = static_cast<int8_t>(bad.iscale[3] + 1);
  EXPECT_EQ(pack_panel(bad).w.layout, cpu::kCpuQuantPanelLayout);
  bad = t;
  bad.fscale[0] = bad.fscale[0] * (1.f + 0x1p-20f);  // no f16 value
  EXPECT_EQ(pack_panel(bad).w.layout, cpu::kCpuQuantPanelLayout);
  bad = t;
  bad.imin[7] = static_cast<int8_t>(bad.imin[7] ^ 1);
  EXPECT_EQ(pack_panel(bad).w.layout, cpu::kCpuQuantPanelLayout);
}

// Resident bytes of each GGUF type in the panel layout (the default kernels on every ISA level)
// against the file's bytes for the same tensor. The layout's values, scales, mins and zeros, with
// up to 63 bytes of alignment after each of its (at most six) regions; rows and columns here are
// whole panels and blocks, so there is no other padding. The K-quants' sub-scales and sub-mins
// take a byte each where the file packs them in 6 bits (Q4_K, Q5_K, IQ4_XS) and share one as in
// the file where it packs them in 4 (Q2_K); 2-, 3-, 5- and 6-bit values are 2-bit steps or
// nibbles plus bit planes and IQ4 indices nibbles (with a 16-byte codebook in a region of its
// own), at the file's width.
TEST(QuantPanel, ResidentBytesPerWeight) {
  struct Want {
    int type;
    double file_bpw, panel_bpw;  // bytes per weight
  };
  const Want types[] = {
      {model::kGgmlQ4_0, 18. / 32, 18. / 32},     {model::kGgmlQ4_1, 20. / 32, 20. / 32},
      {model::kGgmlQ8_0, 34. / 32, 34. / 32},     {model::kGgmlQ5_0, 22. / 32, 22. / 32},
      {model::kGgmlQ5_1, 24. / 32, 24. / 32},     {model::kGgmlIQ4_NL, 18. / 32, 18. / 32},
      {model::kGgmlQ4_K, 144. / 256, 148. / 256}, {model::kGgmlQ5_K, 176. / 256, 180. / 256},
      {model::kGgmlQ6_K, 210. / 256, 210. / 256}, {model::kGgmlQ2_K, 84. / 256, 84. / 256},
      {model::kGgmlQ3_K, 110. / 256, 114. / 256}, {model::kGgmlIQ4_XS, 136. / 256, 138. / 256},
  };
  const int64_t n = 64, k = 1024;
  for (const Want& w : types) {
    const std::vector<uint8_t> raw = random_gguf_blocks(w.type, n, k, 3);
    const QuantTensor t = model::ggml_decode(raw.data(), raw.size(), w.type, n, k);
    ASSERT_EQ(raw.size(), model::ggml_tensor_bytes(w.type, n, k));
    EXPECT_DOUBLE_EQ(static_cast<double>(raw.size()), w.file_bpw * n * k) << t.format;
    const double got = static_cast<double>(cpu::cpu_quant_panel_bytes(t.view()));
    EXPECT_GE(got, w.panel_bpw * n * k) << t.format;
    EXPECT_LE(got, w.panel_bpw * n * k + 6 * 63) << t.format;
  }
}

}  // namespace
}  // namespace fantai
