// tests/cpp: sampler semantics (filters, penalties, logprobs, seeding) and validate() messages.
// Over 400 lines: one case per sampling rule, sharing the sampling helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/check.h"
#include "cpu/kernels.h"
#include "sampling/sampler.h"
#include "sampling/sampling_params.h"

namespace {

using fantai::sampling::sample;
using fantai::sampling::SampleResult;
using fantai::sampling::SampleRow;
using fantai::sampling::SamplingParams;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Ctx {
  const std::vector<int32_t>* prompt = nullptr;
  const std::vector<int32_t>* output = nullptr;
  const std::vector<int32_t>* banned = nullptr;
  const uint32_t* allowed = nullptr;
};

// Samples one row; `logits` is taken by reference so tests can inspect the in-place processing.
SampleResult sample_one(std::vector<float>& logits, const SamplingParams& p, std::mt19937_64* rng,
                        const Ctx& c = {}) {
  std::vector<SampleRow> rows(1);
  rows[0] = {&p, c.prompt, c.output, rng, c.banned, c.allowed};
  std::vector<SampleResult> res;
  sample(logits.data(), static_cast<int32_t>(logits.size()), rows, &res);
  return res.at(0);
}

// Histogram of `n` draws (fresh copy of `logits` each time) from one seeded generator.
std::vector<int> histogram(const std::vector<float>& logits, const SamplingParams& p, int n,
                           uint64_t seed = 1234, const Ctx& c = {}) {
  std::mt19937_64 rng(seed);
  std::vector<int> h(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    ++h.at(sample_one(l, p, &rng, c).token);
  }
  return h;
}

SamplingParams with_temperature(float t) {
  SamplingParams p;
  p.temperature = t;
  return p;
}

std::vector<double> log_softmax(const std::vector<float>& l) {
  double mx = *std::max_element(l.begin(), l.end()), s = 0;
  for (float x : l) s += std::exp(double(x) - mx);
  std::vector<double> out;
  for (float x : l) out.push_back(double(x) - mx - std::log(s));
  return out;
}

// ---- greedy ----------------------------------------------------------------------------------

TEST(SamplerGreedy, ArgmaxAndLowestIdOnTies) {
  std::mt19937_64 rng(7);
  SamplingParams p = with_temperature(0.0f);
  std::vector<float> l = {0.1f, 3.0f, -2.0f, 2.9f};
  EXPECT_EQ(sample_one(l, p, &rng).token, 1);
  std::vector<float> tie = {1.0f, 5.0f, 2.0f, 5.0f, 5.0f};
  EXPECT_EQ(sample_one(tie, p, &rng).token, 1);
  // Greedy needs no generator at all.
  std::vector<float> l2 = {0.0f, 0.0f, 4.0f};
  EXPECT_EQ(sample_one(l2, p, nullptr).token, 2);
}

// ---- temperature -----------------------------------------------------------------------------

TEST(SamplerTemperature, LowConcentratesHighSpreads) {
  const std::vector<float> l = {2.0f, 1.0f, 0.0f};
  const int n = 4000;
  auto cold = histogram(l, with_temperature(0.25f), n);
  auto hot = histogram(l, with_temperature(4.0f), n);
  // Expected p0: 0.982 at T=0.25, 0.419 at T=4 (p2 0.254).
  EXPECT_GT(cold[0], 0.96 * n);
  EXPECT_LT(hot[0], 0.46 * n);
  EXPECT_GT(hot[2], 0.21 * n);
  EXPECT_NEAR(hot[0] / double(n), 0.419, 0.03);
}

TEST(SamplerStatistics, FrequenciesMatchSoftmaxAtTemperatureOne) {
  const std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  const int n = 20000;
  auto h = histogram(l, with_temperature(1.0f), n, 99);
  EXPECT_NEAR(h[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(h[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(h[2] / double(n), 0.2, 0.02);
}

// ---- top-k / top-p / min-p -------------------------------------------------------------------

TEST(SamplerTopK, TopKOneEqualsGreedyAtAnyTemperature) {
  std::mt19937_64 gen(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (float t : {0.5f, 1.0f, 10.0f, 1000.0f}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> l(257);
      for (float& x : l) x = nd(gen);
      std::vector<float> g = l;
      const int32_t want = sample_one(g, with_temperature(0.0f), nullptr).token;
      SamplingParams p = with_temperature(t);
      p.top_k = 1;
      std::mt19937_64 rng(trial);
      EXPECT_EQ(sample_one(l, p, &rng).token, want) << "T=" << t;
    }
  }
}

TEST(SamplerTopK, TopKTwoOnlyYieldsTheTwoBest) {
  const std::vector<float> l = {1.0f, 3.0f, 0.5f, 2.8f, 2.0f, 0.0f};
  SamplingParams p = with_temperature(5.0f);  // hot: without top_k every token would show up
  p.top_k = 2;
  auto h = histogram(l, p, 3000);
  EXPECT_GT(h[1], 0);
  EXPECT_GT(h[3], 0);
  EXPECT_EQ(h[1] + h[3], 3000);
  auto unfiltered = histogram(l, with_temperature(5.0f), 3000);
  EXPECT_LT(unfiltered[1] + unfiltered[3], 3000);
}

TEST(SamplerTopP, SmallTopPKeepsOnlyTheTopToken) {
  const std::vector<float> l = {0.0f, 1.0f, 0.9f, 0.5f};
  SamplingParams p = with_temperature(3.0f);
  p.top_p = 0.01f;
  auto h = histogram(l, p, 2000);
  EXPECT_EQ(h[1], 2000);
}

TEST(SamplerTopP, NucleusMatchesHandComputedSet) {
  // Probabilities 0.05, 0.40, 0.10, 0.30, 0.15 -> sorted 0.40 0.30 0.15 0.10 0.05; cumulative
  // 0.40 0.70 0.85 0.95 -> the 0.9 nucleus is {1, 3, 4, 2}, token 0 is out.
  const std::vector<double> probs = {0.05, 0.40, 0.10, 0.30, 0.15};
  std::vector<float> l;
  for (double q : probs) l.push_back(static_cast<float>(std::log(q)));
  SamplingParams p = with_temperature(1.0f);
  p.top_p = 0.9f;
  const int n = 20000;
  auto h = histogram(l, p, n, 3);
  EXPECT_EQ(h[0], 0);
  for (int t : {1, 2, 3, 4}) EXPECT_NEAR(h[t] / double(n), probs[t] / 0.95, 0.02) << t;
  p.top_p = 0.8f;  // cumulative 0.85 is the first >= 0.8: {1, 3, 4}
  auto h8 = histogram(l, p, 3000, 3);
  EXPECT_EQ(h8[0] + h8[2], 0);
  EXPECT_GT(h8[4], 0);
}

TEST(SamplerTopP, MassExactlyAtTopPStopsThere) {
  // Two equal tokens: the first (lower id) holds exactly half the mass, so top_p 0.5 keeps only it.
  const std::vector<float> l = {0.0f, 0.0f};
  SamplingParams p = with_temperature(1.0f);
  p.top_p = 0.5f;
  EXPECT_EQ(histogram(l, p, 500)[0], 500);
}

TEST(SamplerTopP, NucleusIsRenormalisedOverTopK) {
  // 0.4 0.3 0.2 0.1 with top_k 2: survivors renormalise to 0.571 0.429, so top_p 0.55 keeps one
  // token (over the whole vocab 0.4 < 0.55 would have kept two).
  const std::vector<float> l = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  SamplingParams p = with_temperature(1.0f);
  p.top_k = 2;
  p.top_p = 0.55f;
  EXPECT_EQ(histogram(l, p, 500)[0], 500);
  p.top_k = 0;
  EXPECT_LT(histogram(l, p, 500)[0], 500);
}

TEST(SamplerMinP, DropsTokensBelowFractionOfMax) {
  // Probabilities 0.5 0.3 0.15 0.05; min_p 0.2 -> threshold 0.1: token 3 is dropped.
  const std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  SamplingParams p = with_temperature(1.0f);
  p.min_p = 0.2f;
  const int n = 10000;
  auto h = histogram(l, p, n, 11);
  EXPECT_EQ(h[3], 0);
  EXPECT_NEAR(h[2] / double(n), 0.15 / 0.95, 0.02);
  auto unfiltered = histogram(l, with_temperature(1.0f), n, 11);
  EXPECT_GT(unfiltered[3], 0);
}

// Full-sort reference of the documented rule: order by logit desc (ties by id), top_k prefix,
// top_p prefix over the renormalised survivors (integer mass), min_p cut, inverse CDF in
// ascending id order.
int32_t reference_draw(const std::vector<float>& l, const SamplingParams& p, double u) {
  const int32_t v = static_cast<int32_t>(l.size());
  const float lmax = *std::max_element(l.begin(), l.end());
  std::vector<float> w(v);
  for (int32_t i = 0; i < v; ++i) w[i] = std::exp((l[i] - lmax) / p.temperature);
  std::vector<int32_t> order(v);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  const bool k_on = p.top_k > 0 && p.top_k < v;
  size_t m = k_on ? p.top_k : v;
  if (p.top_p < 1.0f) {  // mass in integer units of 2^-40 of the top weight
    auto q = [&](int32_t t) { return static_cast<uint64_t>(double(w[t]) * 0x1.0p40 + 0.5); };
    uint64_t total = 0;
    for (size_t i = 0; i < m; ++i) total += q(order[i]);
    const uint64_t target = std::min<uint64_t>(total, std::ceil(double(p.top_p) * double(total)));
    uint64_t cum = 0;
    for (size_t i = 0; i < m; ++i) {
      cum += q(order[i]);
      if (cum >= target) {
        m = i + 1;
        break;
      }
    }
  }
  while (m > 1 && w[order[m - 1]] < p.min_p) --m;
  std::vector<int32_t> kept(order.begin(), order.begin() + m);
  std::sort(kept.begin(), kept.end());
  double mass = 0, cum = 0;
  for (int32_t t : kept) mass += w[t];
  int32_t last = -1;
  for (int32_t t : kept) {
    if (w[t] <= 0) continue;
    cum += w[t];
    last = t;
    if (cum > u * mass) return t;
  }
  return last;
}

TEST(SamplerFilters, PartialSelectionIsExactAgainstFullSortReference) {
  // Big vocab with many exact ties (quantised logits) stresses the prefix boundaries.
  std::mt19937_64 gen(2024);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> base(50000);
  for (float& x : base) x = std::round(nd(gen) * 2.0f) / 2.0f;
  int checked = 0;
  for (float t : {0.7f, 1.0f, 2.5f}) {
    for (int32_t k : {0, 1, 40, 3000}) {
      for (float top_p : {1.0f, 0.3f, 0.9f, 0.995f}) {
        for (float min_p : {0.0f, 0.05f}) {
          SamplingParams p = with_temperature(t);
          p.top_k = k;
          p.top_p = top_p;
          p.min_p = min_p;
          for (uint64_t seed : {1u, 2u}) {
            std::mt19937_64 rng(seed), copy(seed);
            const double u = static_cast<double>(copy() >> 11) * 0x1.0p-53;
            std::vector<float> l = base;
            EXPECT_EQ(sample_one(l, p, &rng).token, reference_draw(base, p, u))
                << "T=" << t << " k=" << k << " top_p=" << top_p << " min_p=" << min_p;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 4 * 4 * 2 * 2);
}

// ---- penalties, bias, bans -------------------------------------------------------------------

TEST(SamplerPenalties, RepetitionPenaltyDividesPositiveAndFlipsArgmax) {
  SamplingParams p = with_temperature(0.0f);
  std::vector<int32_t> out = {0, 0, 0};  // repeated: still penalised once
  std::vector<float> l = {4.0f, 3.0f, 1.0f};
  EXPECT_EQ(sample_one(l, p, nullptr, {nullptr, &out}).token, 0);  // penalty 1: off
  p.repetition_penalty = 2.0f;
  l = {4.0f, 3.0f, 1.0f};
  EXPECT_EQ(sample_one(l, p, nullptr, {nullptr, &out}).token, 1);
  EXPECT_FLOAT_EQ(l[0], 2.0f);
  EXPECT_FLOAT_EQ(l[1], 3.0f);
}

TEST(SamplerPenalties, RepetitionPenaltyMultipliesNegativeLogitsAndCoversPrompt) {
  SamplingParams p = with_temperature(0.0f);
  p.repetition_penalty = 1.5f;
  std::vector<int32_t> prompt = {0, 0};
  std::vector<float> l = {-1.0f, -1.2f, -5.0f};
  // Multiplying: -1.5 < -1.2 so token 1 wins (dividing would have kept token 0 ahead).
  EXPECT_EQ(sample_one(l, p, nullptr, {&prompt, nullptr}).token, 1);
  EXPECT_FLOAT_EQ(l[0], -1.5f);
}

TEST(SamplerPenalties, FrequencyScalesWithCountPresenceDoesNot) {
  std::vector<int32_t> prompt = {2};  // prompt tokens get no frequency/presence penalty
  std::vector<int32_t> out = {0, 0, 0, 1};
  SamplingParams f = with_temperature(0.0f);
  f.frequency_penalty = 0.5f;
  std::vector<float> l = {5.0f, 5.0f, 5.0f, 4.0f};
  sample_one(l, f, nullptr, {&prompt, &out});
  EXPECT_FLOAT_EQ(l[0], 3.5f);
  EXPECT_FLOAT_EQ(l[1], 4.5f);
  EXPECT_FLOAT_EQ(l[2], 5.0f);
  SamplingParams pr = with_temperature(0.0f);
  pr.presence_penalty = 0.5f;
  l = {5.0f, 5.0f, 5.0f, 4.0f};
  sample_one(l, pr, nullptr, {&prompt, &out});
  EXPECT_FLOAT_EQ(l[0], 4.5f);
  EXPECT_FLOAT_EQ(l[1], 4.5f);
  EXPECT_FLOAT_EQ(l[2], 5.0f);
  // Frequency flips the argmax away from the much-repeated token; presence alone does not.
  l = {5.0f, 4.8f, 0.0f, 0.0f};
  std::vector<int32_t> rep = {0, 0, 0};
  EXPECT_EQ(sample_one(l, f, nullptr, {nullptr, &rep}).token, 1);
  l = {5.0f, 4.8f, 0.0f, 0.0f};
  std::vector<int32_t> rep2 = {0, 0, 0, 1};
  EXPECT_EQ(sample_one(l, pr, nullptr, {nullptr, &rep2}).token, 0);
}

TEST(SamplerBias, LogitBiasForcesAToken) {
  const std::vector<float> l = {5.0f, 3.0f, -4.0f, 1.0f};
  SamplingParams p = with_temperature(1.0f);
  p.logit_bias = {{2, 100.0f}};
  auto h = histogram(l, p, 500);
  EXPECT_EQ(h[2], 500);
  SamplingParams g = with_temperature(0.0f);
  g.logit_bias = {{0, -100.0f}, {3, 3.0f}};
  std::vector<float> l2 = l;
  EXPECT_EQ(sample_one(l2, g, nullptr).token, 3);
}

TEST(SamplerBans, BannedTokensAreNeverSampled) {
  const std::vector<float> l = {3.0f, 2.5f, 2.0f, 1.0f};
  std::vector<int32_t> banned = {0, 2};
  auto h = histogram(l, with_temperature(2.0f), 3000, 8, {nullptr, nullptr, &banned});
  EXPECT_EQ(h[0] + h[2], 0);
  EXPECT_GT(h[1], 0);
  EXPECT_GT(h[3], 0);
  std::vector<float> l2 = l;
  EXPECT_EQ(sample_one(l2, with_temperature(0.0f), nullptr, {nullptr, nullptr, &banned}).token, 1);
  // Even a huge bias cannot resurrect a banned token.
  SamplingParams p = with_temperature(1.0f);
  p.logit_bias = {{0, 100.0f}};
  auto hb = histogram(l, p, 500, 8, {nullptr, nullptr, &banned});
  EXPECT_EQ(hb[0], 0);
}

TEST(SamplerBans, EverythingBannedThrows) {
  std::vector<int32_t> banned = {0, 1, 2};
  std::mt19937_64 rng(1);
  for (float t : {0.0f, 1.0f}) {
    std::vector<float> l = {1.0f, 2.0f, 3.0f};
    EXPECT_THROW(sample_one(l, with_temperature(t), &rng, {nullptr, nullptr, &banned}),
                 fantai::InvalidArgument);
  }
  std::vector<float> all_inf = {kNegInf, kNegInf};
  EXPECT_THROW(sample_one(all_inf, with_temperature(1.0f), &rng), fantai::InvalidArgument);
}

// ---- token mask (a grammar's allowed tokens) ------------------------------------------------------

TEST(SamplerMask, OnlyAllowedTokensAreSampledAndLogprobsStayRaw) {
  // 70 tokens: the mask spans three words, the last one partial. Allowed: 3, 40, 69.
  std::vector<float> l(70);
  for (int i = 0; i < 70; ++i) l[i] = static_cast<float>(i % 7) * 0.5f;
  l[10] = 9.0f;  // the raw argmax, disallowed
  uint32_t mask[3] = {1u << 3, 1u << (40 - 32), 1u << (69 - 64)};
  const Ctx c{nullptr, nullptr, nullptr, mask};
  std::vector<float> g = l;
  SamplingParams greedy = with_temperature(0.0f);
  greedy.logprobs = 1;
  const SampleResult r = sample_one(g, greedy, nullptr, c);
  // Greedy over the allowed: l[3] = 1.5, l[40] = 2.5, l[69] = 3.0.
  EXPECT_EQ(r.token, 69);
  const std::vector<double> lsm = log_softmax(l);
  EXPECT_NEAR(r.logprob, lsm[69], 1e-5);
  ASSERT_EQ(r.top.size(), 1u);
  EXPECT_EQ(r.top[0].first, 10);  // top logprobs are of the raw distribution
  auto h = histogram(l, with_temperature(1.0f), 2000, 5, c);
  for (int i = 0; i < 70; ++i) {
    if (i == 3 || i == 40 || i == 69) EXPECT_GT(h[i], 0) << i;
    else EXPECT_EQ(h[i], 0) << i;
  }
  // Nothing allowed: the same clear error as everything banned.
  uint32_t none[3] = {0, 0, 0};
  std::vector<float> n = l;
  EXPECT_THROW(sample_one(n, greedy, nullptr, {nullptr, nullptr, nullptr, none}), fantai::InvalidArgument);
}

TEST(SamplerErrors, BadInputsThrow) {
  std::mt19937_64 rng(1);
  std::vector<float> nan = {1.0f, std::nanf(""), 0.0f};
  EXPECT_THROW(sample_one(nan, with_temperature(1.0f), &rng), std::runtime_error);
  std::vector<float> l = {1.0f, 2.0f};
  std::vector<int32_t> bad = {5};
  EXPECT_THROW(sample_one(l, with_temperature(1.0f), &rng, {nullptr, &bad}), fantai::InvalidArgument);
  EXPECT_THROW(sample_one(l, with_temperature(1.0f), nullptr), fantai::InvalidArgument);
}

// ---- logprobs --------------------------------------------------------------------------------

TEST(SamplerLogprobs, RawLogSoftmaxUnaffectedByProcessing) {
  const std::vector<float> raw = {1.0f, 3.0f, 3.0f, -2.0f, 0.5f, 2.0f};
  const auto want = log_softmax(raw);
  SamplingParams p = with_temperature(0.3f);
  p.repetition_penalty = 1.7f;
  p.frequency_penalty = 1.0f;
  p.logit_bias = {{4, 50.0f}};  // forces token 4
  p.logprobs = 3;
  std::vector<int32_t> out = {1, 1, 2};
  std::mt19937_64 rng(3);
  std::vector<float> l = raw;
  SampleResult r = sample_one(l, p, &rng, {nullptr, &out});
  EXPECT_EQ(r.token, 4);
  EXPECT_NEAR(r.logprob, want[4], 1e-5);
  ASSERT_EQ(r.top.size(), 3u);
  // Sorted descending, tie (tokens 1 and 2) broken by lower id.
  EXPECT_EQ(r.top[0].first, 1);
  EXPECT_EQ(r.top[1].first, 2);
  EXPECT_EQ(r.top[2].first, 5);
  for (const auto& [t, lp] : r.top) EXPECT_NEAR(lp, want[t], 1e-5) << t;
}

TEST(SamplerLogprobs, CountRespectedAndLogprobAlwaysFilled) {
  const std::vector<float> raw = {0.2f, -1.0f, 0.7f, 0.1f};
  const auto want = log_softmax(raw);
  for (int32_t n : {-1, 0, 1, 4, 20}) {
    SamplingParams p = with_temperature(0.0f);
    p.logprobs = n;
    std::vector<float> l = raw;
    SampleResult r = sample_one(l, p, nullptr);
    EXPECT_EQ(r.token, 2);
    EXPECT_NEAR(r.logprob, want[2], 1e-6);
    EXPECT_EQ(r.top.size(), static_cast<size_t>(std::clamp(n, 0, 4))) << n;
    for (size_t i = 1; i < r.top.size(); ++i) EXPECT_GE(r.top[i - 1].second, r.top[i].second);
  }
}

TEST(SamplerLogprobs, StableForHugeLogits) {
  std::vector<float> l = {1000.0f, 999.0f, -1000.0f};
  SamplingParams p = with_temperature(0.0f);
  p.logprobs = 2;
  SampleResult r = sample_one(l, p, nullptr);
  EXPECT_NEAR(r.logprob, -std::log1p(std::exp(-1.0)), 1e-5);
  EXPECT_NEAR(r.top[1].second, -1.0 - std::log1p(std::exp(-1.0)), 1e-5);
}

// ---- seeding and rng accounting --------------------------------------------------------------

std::vector<int32_t> sequence(uint64_t seed, int n) {
  std::mt19937_64 gen(77);  // same logits for every seed
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> base(1000);
  for (float& x : base) x = nd(gen);
  SamplingParams p = with_temperature(1.0f);
  p.top_p = 0.95f;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> seq;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = base;
    seq.push_back(sample_one(l, p, &rng).token);
  }
  return seq;
}

TEST(SamplerSeeding, SameSeedSameSequenceDifferentSeedDifferent) {
  EXPECT_EQ(sequence(42, 100), sequence(42, 100));
  EXPECT_NE(sequence(42, 100), sequence(43, 100));
}

TEST(SamplerSeeding, RowResultIndependentOfOtherRows) {
  const std::vector<float> a = {0.3f, 1.2f, -0.4f, 0.9f, 0.0f};
  const std::vector<float> b = {5.0f, -1.0f, 2.0f, 0.0f, 1.0f};
  SamplingParams pa = with_temperature(1.3f);
  pa.top_k = 4;
  SamplingParams pb = with_temperature(0.8f);
  pb.repetition_penalty = 1.3f;
  std::vector<int32_t> out_b = {0, 2};
  for (uint64_t seed = 0; seed < 50; ++seed) {
    std::mt19937_64 alone(seed);
    std::vector<float> la = a;
    const SampleResult want = sample_one(la, pa, &alone);
    // The same row after another row (with its own rng) in one call.
    std::mt19937_64 ra(seed), rb(seed + 1000);
    std::vector<float> both = b;
    both.insert(both.end(), a.begin(), a.end());
    std::vector<SampleRow> rows(2);
    rows[0] = {&pb, nullptr, &out_b, &rb, nullptr};
    rows[1] = {&pa, nullptr, nullptr, &ra, nullptr};
    std::vector<SampleResult> res;
    sample(both.data(), 5, rows, &res);
    EXPECT_EQ(res[1].token, want.token);
    EXPECT_FLOAT_EQ(res[1].logprob, want.logprob);
    EXPECT_TRUE(ra == alone);
  }
}

TEST(SamplerSeeding, ExactlyOneDrawPerSampleAndNoneForGreedy) {
  const std::vector<float> base = {0.5f, 1.5f, 1.0f, -3.0f, 2.0f};
  std::vector<SamplingParams> ps(4, with_temperature(0.9f));
  ps[1].top_k = 2;
  ps[2].top_p = 0.5f;
  ps[3].min_p = 0.3f;
  for (const SamplingParams& p : ps) {
    std::mt19937_64 rng(9), expect(9);
    for (int i = 0; i < 20; ++i) {
      std::vector<float> l = base;
      sample_one(l, p, &rng);
      expect.discard(1);
      EXPECT_TRUE(rng == expect);
    }
  }
  std::mt19937_64 rng(9), untouched(9);
  std::vector<float> l = base;
  sample_one(l, with_temperature(0.0f), &rng);
  EXPECT_TRUE(rng == untouched);
}

// ---- validate --------------------------------------------------------------------------------

std::string validate_error(const SamplingParams& p, int32_t vocab = 100) {
  try {
    p.validate(vocab);
  } catch (const fantai::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(SamplingParamsValidate, AcceptsDefaultsAndEdges) {
  EXPECT_NO_THROW(SamplingParams{}.validate(100));
  SamplingParams p;
  p.temperature = 0.0f;
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.max_tokens = 1;
  p.min_tokens = 1;
  p.logprobs = 20;
  p.stop_token_ids = {0, 99};
  p.logit_bias = {{99, -100.0f}, {0, 100.0f}};
  EXPECT_NO_THROW(p.validate(100));
}

TEST(SamplingParamsValidate, RejectsEachBadValueWithItsMessage) {
  struct Case {
    void (*set)(SamplingParams&);
    const char* msg;
  };
  const Case cases[] = {
      {[](SamplingParams& p) { p.temperature = -0.5f; },
       "temperature must be a finite number >= 0, got -0.5"},
      {[](SamplingParams& p) { p.temperature = std::nanf(""); }, "temperature must be"},
      {[](SamplingParams& p) { p.top_p = 1.5f; }, "top_p must be in (0, 1], got 1.5"},
      {[](SamplingParams& p) { p.top_p = 0.0f; }, "top_p must be in (0, 1], got 0"},
      {[](SamplingParams& p) { p.min_p = -0.1f; }, "min_p must be in [0, 1], got -0.1"},
      {[](SamplingParams& p) { p.min_p = 1.5f; }, "min_p must be in [0, 1], got 1.5"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty must be > 0, got 0"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty must be in [-2, 2], got 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; },
       "frequency_penalty must be in [-2, 2], got -3"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens must be >= 1, got 0"},
      {[](SamplingParams& p) { p.min_tokens = -1; }, "min_tokens must be in [0, max_tokens=16], got -1"},
      {[](SamplingParams& p) { p.min_tokens = 17; }, "min_tokens must be in [0, max_tokens=16], got 17"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs must be <= 20, got 21"},
      {[](SamplingParams& p) { p.stop_token_ids = {3, 100}; },
       "stop_token_ids entry must be in [0, 100), got 100"},
      {[](SamplingParams& p) { p.stop_token_ids = {-1}; },
       "stop_token_ids entry must be in [0, 100), got -1"},
      {[](SamplingParams& p) { p.logit_bias = {{100, 1.0f}}; },
       "logit_bias token id must be in [0, 100), got 100"},
      {[](SamplingParams& p) { p.logit_bias = {{5, 150.0f}}; },
       "logit_bias value for token 5 must be in [-100, 100], got 150"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.set(p);
    const std::string err = validate_error(p);
    EXPECT_NE(err.find(c.msg), std::string::npos) << "want '" << c.msg << "', got '" << err << "'";
  }
  EXPECT_NE(validate_error(SamplingParams{}, 0).find("vocab_size must be > 0"), std::string::npos);
}

// ---- the sampler's row reductions: every ISA's kernel table vs the reference ------------------

std::vector<fantai::cpu::Isa> levels() {
  std::vector<fantai::cpu::Isa> out{fantai::cpu::Isa::kScalar};
  const auto top = fantai::cpu::detected_isa();
  if (top >= fantai::cpu::Isa::kAvx2) out.push_back(fantai::cpu::Isa::kAvx2);
  if (top >= fantai::cpu::Isa::kAvx512) out.push_back(fantai::cpu::Isa::kAvx512);
  return out;
}

TEST(SamplerReduce, MatchesReferenceOnOddLengthsTiesAndMinusInf) {
  namespace ref = fantai::cpu::ref;
  const float inf = std::numeric_limits<float>::infinity();
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (int32_t n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 257, 49152 + 5}) {
    for (int variant = 0; variant < 4; ++variant) {
      std::vector<float> l(n);
      for (float& v : l) v = nd(gen);
      if (variant == 1) {  // the maximum at several places, one in the scalar tail
        const float top = 30.0f;
        for (int32_t i : {n / 3, n / 2, n - 1}) l[i] = top;
      }
      if (variant == 2) {  // most tokens banned; far-below-max values underflow
        for (int32_t i = 0; i < n; ++i) l[i] = i % 3 ? -inf : -200.0f + static_cast<float>(i % 7);
      }
      if (variant == 3) std::fill(l.begin(), l.end(), 1.5f);  // all tied: id 0
      const fantai::MaxSumExp want = ref::max_sum_exp(l.data(), n);
      const int32_t want_arg = ref::argmax(l.data(), n);
      for (fantai::cpu::Isa isa : levels()) {
        const fantai::cpu::KernelTable& k = fantai::cpu::kernels_for(isa);
        const fantai::MaxSumExp got = k.max_sum_exp(l.data(), n);
        EXPECT_EQ(got.max, want.max) << k.name << " n=" << n << " variant " << variant;
        EXPECT_NEAR(got.sum, want.sum, 2e-6 * want.sum) << k.name << " n=" << n << " variant " << variant;
        EXPECT_EQ(k.argmax(l.data(), n), want_arg) << k.name << " n=" << n << " variant " << variant;
      }
    }
  }
}

TEST(SamplerReduce, NanOrPlusInfPoisonTheSumAndNanNeverWinsArgmax) {
  const float inf = std::numeric_limits<float>::infinity();
  for (fantai::cpu::Isa isa : levels()) {
    const fantai::cpu::KernelTable& k = fantai::cpu::kernels_for(isa);
    for (int32_t n : {40, 37}) {
      for (int32_t at : {3, n - 1}) {  // in the vector body and in the scalar tail
        std::vector<float> l(n, 0.0f);
        l[5] = 2.0f;
        l[at] = std::numeric_limits<float>::quiet_NaN();
        EXPECT_TRUE(std::isnan(k.max_sum_exp(l.data(), n).sum)) << k.name << " " << n << " " << at;
        EXPECT_EQ(k.argmax(l.data(), n), 5) << k.name;
        l[at] = inf;
        EXPECT_TRUE(std::isnan(k.max_sum_exp(l.data(), n).sum)) << k.name << " " << n << " " << at;
        EXPECT_EQ(k.argmax(l.data(), n), at) << k.name;
      }
    }
  }
}

}  // namespace

// ---- the device sampler's contract (Backend::sample_top_k_top_p) ------------------------------

using fantai::sampling::device_uniform;
using fantai::sampling::draw_uniform;
using fantai::sampling::plain_row;

// A device sampler fed draw_uniform of the request's generator must see the very draw sample()
// makes: exactly one per non-greedy token, that value, and none for greedy.
TEST(SamplerDeviceContract, DrawUniformIsTheSamplersOneDraw) {
  const std::vector<float> base = {0.3f, 1.2f, -0.4f, 0.9f, 0.0f, 2.1f, -1.5f};
  for (uint64_t seed = 0; seed < 200; ++seed) {
    SamplingParams p = with_temperature(0.9f);
    std::mt19937_64 used(seed), mirror(seed);
    std::vector<float> l = base;
    const int32_t tok = sample_one(l, p, &used).token;
    const double u = draw_uniform(mirror);
    EXPECT_TRUE(used == mirror) << "seed " << seed << ": the sampler drew other than one uniform";
    // Unfiltered, the token is the inverse CDF at u in ascending id order.
    const float mx = *std::max_element(base.begin(), base.end());
    double z = 0;
    std::vector<double> w;
    for (float x : base) w.push_back(std::exp((x - mx) / p.temperature)), z += w.back();
    double cum = 0;
    int32_t want = static_cast<int32_t>(base.size()) - 1;
    for (size_t i = 0; i < base.size(); ++i) {
      cum += w[i];
      if (cum > u * z) {
        want = static_cast<int32_t>(i);
        break;
      }
    }
    EXPECT_EQ(tok, want) << "seed " << seed << " u " << u;
  }
  std::mt19937_64 used(7), untouched(7);
  std::vector<float> l = base;
  sample_one(l, with_temperature(0.0f), &used);
  EXPECT_TRUE(used == untouched) << "a greedy row drew from its generator";
}

TEST(SamplerDeviceContract, DeviceUniformStaysBelowOneAndNeverRoundsUp) {
  const double below_one = 1.0 - 0x1.0p-53;
  EXPECT_LT(device_uniform(below_one), 1.0f);
  EXPECT_EQ(device_uniform(0.0), 0.0f);
  EXPECT_EQ(device_uniform(0.5), 0.5f);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 10000; ++i) {
    const double u = draw_uniform(rng);
    const float f = device_uniform(u);
    ASSERT_LE(static_cast<double>(f), u);
    ASSERT_GE(f, 0.0f);
    ASSERT_LT(f, 1.0f);
    ASSERT_LT(u - static_cast<double>(f), 0x1.0p-24);
  }
}

// Which rows may be sampled on a device: only temperature, top_k, top_p and seed may differ
// from the defaults; anything else needs the host logits.
TEST(SamplerDeviceContract, PlainRowAcceptsOnlyTemperatureTopKTopPAndSeed) {
  SamplingParams p;
  EXPECT_TRUE(plain_row(p, false));
  p.temperature = 0.0f;
  EXPECT_TRUE(plain_row(p, false));  // greedy
  p.temperature = 0.7f, p.top_k = 1, p.top_p = 0.3f, p.seed = 5, p.max_tokens = 9;
  p.stop_token_ids = {3};
  EXPECT_TRUE(plain_row(p, false));
  EXPECT_FALSE(plain_row(p, true)) << "min_tokens bans need the host logits";
  auto rejects = [&](auto&& change, const char* what) {
    SamplingParams q = p;
    change(q);
    EXPECT_FALSE(plain_row(q, false)) << what;
  };
  rejects([](SamplingParams& q) { q.logprobs = 0; }, "logprobs");
  rejects([](SamplingParams& q) { q.logit_bias = {{1, 2.0f}}; }, "logit_bias");
  rejects([](SamplingParams& q) { q.repetition_penalty = 1.1f; }, "repetition_penalty");
  rejects([](SamplingParams& q) { q.presence_penalty = 0.5f; }, "presence_penalty");
  rejects([](SamplingParams& q) { q.frequency_penalty = -0.5f; }, "frequency_penalty");
  rejects([](SamplingParams& q) { q.min_p = 0.1f; }, "min_p");
  SamplingParams greedy_min_p;
  greedy_min_p.temperature = 0.0f, greedy_min_p.min_p = 0.3f;
  EXPECT_TRUE(plain_row(greedy_min_p, false)) << "min_p cannot change a greedy row's argmax";
  rejects([](SamplingParams& q) { q.constrained = true; }, "grammar");
  rejects([](SamplingParams& q) { q.temperature = std::numeric_limits<float>::infinity(); }, "temperature");
}
