// tests: the CPU backend's mixture-of-experts ops on every ISA level this machine runs: routing
// against the double reference, the expert-grouped experts against a per-token reference (dense
// f32 / bf16 / f16, AMX-packed bf16, int8 and int4 experts), and bitwise batch invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/buffer.h"
#include "common/check.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "model/quant_formats.h"
#include "test_support.h"

namespace fantai::cpu {
namespace {

using test::randn;
constexpr auto levels = test::isa_levels;

// Distinct experts per row (a random choice of top_k of E) and positive weights.
void random_routes(int64_t rows, int32_t E, int32_t k, uint32_t seed, std::vector<int32_t>* ids,
                   std::vector<float>* weights) {
  std::mt19937 g(seed);
  std::vector<int32_t> all(E);
  ids->resize(rows * k);
  weights->resize(rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), g);
    for (int32_t j = 0; j < k; ++j) {
      (*ids)[r * k + j] = all[j];
      (*weights)[r * k + j] = std::uniform_real_distribution<float>(0.05f, 1.f)(g);
    }
  }
}

enum class Mode { kF32, kBF16, kF16, kPackedBF16, kInt8, kInt4 };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kF32: return "f32";
    case Mode::kBF16: return "bf16";
    case Mode::kF16: return "f16";
    case Mode::kPackedBF16: return "packed-bf16";
    case Mode::kInt8: return "int8";
    case Mode::kInt4: return "int4g32";
  }
  return "?";
}

// E experts of one layer in a backend's memory, plus the f32 values every kernel sees (for the
// reference): gate_up [E, 2I, H] and down [E, H, I].
struct Experts {
  int32_t E;
  int64_t H, I;
  Mode mode;
  std::vector<float> gate_up, down;  // the values as the kernels see them
  std::vector<Buffer> mem;
  std::vector<MoeExpert> view;
  MoeExperts moe;

  Experts(Backend& be, int32_t e, int64_t h, int64_t i, Mode m, uint32_t seed) : E(e), H(h), I(i), mode(m) {
    gate_up = randn(static_cast<size_t>(E * 2 * I * H), seed, 0.2f);
    down = randn(static_cast<size_t>(E * H * I), seed + 1, 0.2f);
    moe.num_experts = E;
    moe.hidden = H;
    moe.inter = I;
    view.resize(E);
    const bool quant = m == Mode::kInt8 || m == Mode::kInt4;
    const DType dt = m == Mode::kF32 ? DType::kF32 : m == Mode::kF16 ? DType::kF16 : DType::kBF16;
    moe.dtype = dt;
    moe.packed = m == Mode::kPackedBF16;
    for (int32_t x = 0; x < E; ++x) {
      float* gu = gate_up.data() + static_cast<size_t>(x) * 2 * I * H;
      float* dn = down.data() + static_cast<size_t>(x) * H * I;
      if (quant) {
        view[x].gate_up.num_parts = 2;  // gate and up as separate parts, as a GGUF stores them
        for (int part = 0; part < 2; ++part) {
          set_quant(be, gu + part * I * H, I, H, &view[x].gate_up.parts[part]);
          view[x].gate_up.part_row0[part] = part * I;
        }
        view[x].down.num_parts = 1;
        set_quant(be, dn, H, I, &view[x].down.parts[0]);
      } else {
        view[x].gate_up.dense = set_dense(be, gu, 2 * I, H, dt);
        view[x].down.dense = set_dense(be, dn, H, I, dt);
      }
    }
    moe.experts = view.data();
  }

  const void* set_dense(Backend& be, float* w, int64_t n, int64_t k, DType dt) {
    const size_t count = static_cast<size_t>(n * k);
    std::vector<char> raw(count * dtype_size(dt));
    convert_from_f32(w, raw.data(), dt, count);
    convert_to_f32(raw.data(), dt, w, count);  // the reference sees the rounded values
    if (mode == Mode::kPackedBF16) {
      mem.emplace_back(&be, be.dense_packed_bytes(dt, n, k), false);
      be.pack_dense(raw.data(), dt, n, k, mem.back().data());
    } else {
      mem.emplace_back(&be, raw.size(), false);
      std::memcpy(mem.back().data(), raw.data(), raw.size());
    }
    return mem.back().data();
  }

  void set_quant(Backend& be, float* w, int64_t rows, int64_t cols, QuantMatrix* out) {
    const bool int8 = mode == Mode::kInt8;
    const model::QuantTensor t = model::quantize_rtn(w, rows, cols, int8 ? 8 : 4, int8 ? -1 : 32, true);
    model::dequantize(t.view(), w);  // the reference sees the dequantized values
    mem.emplace_back(&be, be.quant_packed_bytes(t.view()), false);
    *out = be.pack_quant(t.view(), mem.back().data());
  }
};

std::vector<float> reference(const Experts& ex, const std::vector<float>& x, const std::vector<int32_t>& ids,
                             const std::vector<float>& w, int64_t rows, int32_t k) {
  std::vector<float> out(rows * ex.H);
  ref::moe_experts(x.data(), ids.data(), w.data(), rows, k, ex.gate_up.data(), ex.down.data(), DType::kF32,
                   ex.E, ex.H, ex.I, out.data());
  return out;
}

std::vector<float> run(Backend& be, const Experts& ex, const float* x, const int32_t* ids, const float* w,
                       int64_t rows, int32_t k) {
  std::vector<float> out(rows * ex.H, std::nanf(""));
  be.moe_experts(x, ids, w, rows, k, ex.moe, out.data());
  return out;
}

class Moe : public ::testing::TestWithParam<Isa> {
 protected:
  std::shared_ptr<Backend> be(int threads) { return make_cpu_backend(GetParam(), threads); }
  std::vector<Mode> modes() {
    std::vector<Mode> m{Mode::kF32, Mode::kBF16, Mode::kF16, Mode::kInt8, Mode::kInt4};
    if (be(1)->dense_packed_bytes(DType::kBF16, 64, 64) > 0) m.push_back(Mode::kPackedBF16);
    return m;
  }
};

TEST_P(Moe, RouteMatchesReference) {
  struct Shape {
    int32_t E, k;
  };
  uint32_t seed = 1;
  for (int threads : {1, 2})
    for (Shape s : {Shape{8, 2}, Shape{8, 1}, Shape{60, 4}, Shape{128, 8}, Shape{3, 3}})
      for (bool renorm : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "E=" << s.E << " k=" << s.k << " renorm=" << renorm);
        const int64_t rows = 37;
        const auto logits = randn(rows * s.E, seed++, 2.f);
        std::vector<int32_t> ids(rows * s.k), want_ids(rows * s.k);
        std::vector<float> w(rows * s.k), want_w(rows * s.k);
        be(threads)->moe_route(logits.data(), rows, s.E, s.k, renorm, ids.data(), w.data());
        ref::moe_route(logits.data(), rows, s.E, s.k, renorm, want_ids.data(), want_w.data());
        EXPECT_EQ(ids, want_ids);
        for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], want_w[i], 2e-6f * std::max(1.f, want_w[i]));
        // Each row alone: the same bits.
        for (int64_t r = 0; r < rows; r += 7) {
          std::vector<int32_t> one_ids(s.k);
          std::vector<float> one_w(s.k);
          be(1)->moe_route(logits.data() + r * s.E, 1, s.E, s.k, renorm, one_ids.data(), one_w.data());
          EXPECT_TRUE(std::equal(one_ids.begin(), one_ids.end(), ids.begin() + r * s.k));
          EXPECT_EQ(0, std::memcmp(one_w.data(), w.data() + r * s.k, s.k * sizeof(float)));
        }
      }
}

TEST_P(Moe, RouteTiesGoToTheLowerExpertAndNanRowsStayDistinct) {
  const float logits[] = {1.f, 3.f, 0.f, 3.f, 3.f, 2.f, 0.f, 0.f,  // ties
                          1.f, 3.f, 0.f, 3.f, 3.f, NAN, 0.f, 0.f};
  int32_t ids[8];
  float w[8];
  be(1)->moe_route(logits, 2, 8, 4, true, ids, w);
  EXPECT_EQ(std::vector<int32_t>(ids, ids + 4), (std::vector<int32_t>{1, 3, 4, 5}));
  EXPECT_EQ(w[0], w[1]);
  EXPECT_EQ(w[1], w[2]);
  std::vector<int32_t> nan_row(ids + 4, ids + 8);  // NaN probabilities: still four distinct experts
  std::sort(nan_row.begin(), nan_row.end());
  EXPECT_TRUE(std::adjacent_find(nan_row.begin(), nan_row.end()) == nan_row.end());
  EXPECT_GE(nan_row.front(), 0);
  EXPECT_LT(nan_row.back(), 8);
}

TEST_P(Moe, ExpertsMatchPerTokenReference) {
  uint32_t seed = 10;
  for (Mode mode : modes())
    for (int threads : {1, 2}) {
      // I = 40: not a multiple of 32 (no fused packed MLP); I = 64: the fused path where there is
      // one; I = 96: wider than hidden, as Mixtral's experts are.
      for (int64_t I : {40, 64, 96}) {
        SCOPED_TRACE(::testing::Message() << mode_name(mode) << " threads=" << threads << " I=" << I);
        auto b = be(threads);
        const int32_t E = 6, k = 2;
        const int64_t H = 72, rows = 45;
        Experts ex(*b, E, H, I, mode, seed++);
        const auto x = randn(rows * H, seed++);
        std::vector<int32_t> ids;
        std::vector<float> w;
        random_routes(rows, E, k, seed++, &ids, &w);
        const auto got = run(*b, ex, x.data(), ids.data(), w.data(), rows, k);
        const auto want = reference(ex, x, ids, w, rows, k);
        float scale = 0;
        for (float v : want) scale = std::max(scale, std::fabs(v));
        // Dense: f32 sums against double. Quantized: the int8 activations of the panel kernels.
        const bool quant = mode == Mode::kInt8 || mode == Mode::kInt4;
        const float tol = (quant ? 3e-2f : mode == Mode::kPackedBF16 ? 2e-3f : 1e-4f) * scale;
        int bad = 0;
        for (size_t i = 0; i < got.size() && bad < 5; ++i)
          if (!(std::fabs(got[i] - want[i]) <= tol)) {
            ADD_FAILURE() << "element " << i << ": got " << got[i] << " want " << want[i];
            ++bad;
          }
      }
    }
}

// A row's output must not depend on what else is in the call: each row alone, and the rows in a
// batch where every other row chose other experts, give the same bits as the full batch.
TEST_P(Moe, ExpertsBatchInvariant) {
  uint32_t seed = 50;
  for (Mode mode : modes())
    for (int threads : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << mode_name(mode) << " threads=" << threads);
      auto b = be(threads);
      const int32_t E = 8, k = 3;
      const int64_t H = 64, I = 96, rows = 70;  // more than one 64-row block for some experts
      Experts ex(*b, E, H, I, mode, seed++);
      const auto x = randn(rows * H, seed++);
      std::vector<int32_t> ids;
      std::vector<float> w;
      random_routes(rows, E, k, seed++, &ids, &w);
      // Skew the routing so one expert gets most rows (a tall group) and some get none.
      for (int64_t r = 0; r < rows; r += 2)
        if (std::find(ids.begin() + r * k, ids.begin() + (r + 1) * k, 0) == ids.begin() + (r + 1) * k)
          ids[r * k] = 0;
      const auto all = run(*b, ex, x.data(), ids.data(), w.data(), rows, k);
      for (int64_t r = 0; r < rows; ++r) {
        const auto one = run(*b, ex, x.data() + r * H, ids.data() + r * k, w.data() + r * k, 1, k);
        ASSERT_EQ(0, std::memcmp(one.data(), all.data() + r * H, H * sizeof(float))) << "row " << r;
      }
      // A decode-sized batch (a few rows per expert: the side-by-side path on two threads).
      const auto few = run(*b, ex, x.data(), ids.data(), w.data(), 4, k);
      ASSERT_EQ(0, std::memcmp(few.data(), all.data(), 4 * H * sizeof(float)));
      // Row 5 beside rows that chose none of its experts.
      std::vector<int32_t> other_ids(ids);
      std::vector<int32_t> mine(ids.begin() + 5 * k, ids.begin() + 6 * k), rest;
      for (int32_t e = 0; e < E; ++e)
        if (std::find(mine.begin(), mine.end(), e) == mine.end()) rest.push_back(e);
      for (int64_t r = 0; r < rows; ++r)
        if (r != 5)
          for (int32_t j = 0; j < k; ++j) other_ids[r * k + j] = rest[(r + j) % rest.size()];
      const auto mixed = run(*b, ex, x.data(), other_ids.data(), w.data(), rows, k);
      EXPECT_EQ(0, std::memcmp(mixed.data() + 5 * H, all.data() + 5 * H, H * sizeof(float)));
    }
}

TEST_P(Moe, ZeroRowsAndBadRoutesAreHandled) {
  auto b = be(2);
  Experts ex(*b, 4, 32, 32, Mode::kF32, 7);
  const std::vector<float> x(2 * 32, 1.f), w{0.5f, 0.5f, 0.5f, 0.5f};
  EXPECT_NO_THROW(b->moe_experts(x.data(), nullptr, nullptr, 0, 2, ex.moe, nullptr));
  std::vector<float> out(2 * 32);
  const int32_t bad[] = {0, 4, 1, 2};
  EXPECT_THROW(b->moe_experts(x.data(), bad, w.data(), 2, 2, ex.moe, out.data()), InvalidArgument);
  const int32_t twice[] = {0, 1, 3, 3};
  EXPECT_THROW(b->moe_experts(x.data(), twice, w.data(), 2, 2, ex.moe, out.data()), InvalidArgument);
  int32_t ids[2];
  float rw[2];
  EXPECT_THROW(b->moe_route(x.data(), 1, 4, 5, true, ids, rw), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Moe, ::testing::ValuesIn(levels()),
                         [](const ::testing::TestParamInfo<Isa>& i) {
                           return std::string(isa_name(i.param));
                         });

}  // namespace
}  // namespace fantai::cpu
