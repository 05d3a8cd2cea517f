// sampling: the sampler — raw logprobs, penalties, bias and bans, then greedy or a filtered seeded draw.
//
// Definitions (each row independent of the others):
//  * Order: tokens rank by processed logit descending (= probability descending), ties by lower id.
//  * top_k keeps the k first tokens of that order; top_p then keeps the shortest prefix of the
//    top-k survivors whose mass (renormalised over them) is >= top_p; min_p then drops tokens with
//    prob < min_p * max_prob. top_p mass is counted in integer units of 2^-40 of the top token's
//    weight (order-independent sums). All three keep a prefix of the order, so the kept set is a
//    prefix; it is found exactly, as a full sort would, without sorting the vocab (see below).
//  * The draw: exactly one u = (rng() >> 11) * 2^-53 in [0, 1) per sampled token, then inverse CDF
//    over the kept tokens in ASCENDING TOKEN ID order (with or without filtering). The order of the
//    CDF walk does not change the distribution; fixing it to id order gives one deterministic rule
//    and lets the unfiltered case scan the vocab without sorting anything.
//  * Greedy (temperature <= 1e-5): argmax of the processed logits, ties to the lowest id, no draw.
#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/backend.h"
#include "common/check.h"

namespace fantai::sampling {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Reused across rows and steps so the per-step path does not allocate vocab-sized buffers.
struct Scratch {
  std::vector<float> w;             // exp((l - lmax) / T): unnormalised probabilities
  std::vector<int32_t> edge;        // tokens of the bucket that holds a top-k / top-p boundary
  std::vector<int32_t> cands;       // the top-k tokens, ascending ids
  std::vector<uint32_t> bin_count;  // tokens per bucket (top-k)
  std::vector<uint64_t> bin_mass;   // quantised mass per bucket (top-p)
  std::vector<int32_t> count;       // output count per token (-1: prompt only); all zero between rows
  std::vector<int32_t> touched;     // tokens whose count is non-zero
  std::vector<std::pair<int32_t, float>> saved;  // raw value of each logit before we overwrite it
};

Scratch& scratch_for(int32_t vocab) {
  thread_local Scratch s;
  if (s.count.size() < static_cast<size_t>(vocab)) s.count.resize(vocab, 0);
  if (s.w.size() < static_cast<size_t>(vocab)) s.w.resize(vocab);
  s.touched.clear();
  s.saved.clear();
  return s;
}

// True when token a ranks before token b: higher logit, ties by lower id. A strict weak order
// because the logits hold no NaN (raw NaN is rejected; processing keeps values non-NaN).
struct RanksBefore {
  const float* l;
  bool operator()(int32_t a, int32_t b) const { return l[a] > l[b] || (l[a] == l[b] && a < b); }
};

void check_ids(const std::vector<int32_t>* ids, int32_t vocab, size_t row, const char* what) {
  if (ids == nullptr) return;
  for (int32_t t : *ids) {
    FANTAI_REQUIRE(t >= 0 && t < vocab, "sample: row " << row << ": " << what << " token id " << t
                                                       << " is outside [0, " << vocab << ")");
  }
}

// Checks the row's inputs up front so nothing below can throw half way through mutating scratch.
void check_row(const SampleRow& row, int32_t vocab, size_t r) {
  FANTAI_REQUIRE(row.params != nullptr, "sample: row " << r << " has no SamplingParams");
  const sampling::SamplingParams& p = *row.params;
  check_ids(row.prompt, vocab, r, "prompt");
  check_ids(row.output, vocab, r, "output");
  check_ids(row.banned, vocab, r, "banned");
  for (const auto& [id, bias] : p.logit_bias) {
    FANTAI_REQUIRE(id >= 0 && id < vocab, "sample: row " << r << ": logit_bias token id " << id
                                                         << " is outside [0, " << vocab << ")");
    FANTAI_REQUIRE(std::isfinite(bias),
                   "sample: row " << r << ": logit_bias for token " << id << " is not finite: " << bias);
  }
  if (!p.greedy()) {
    FANTAI_REQUIRE(row.rng != nullptr, "sample: row " << r << " is not greedy but has no rng");
    FANTAI_REQUIRE(std::isfinite(p.temperature),
                   "sample: row " << r << ": temperature must be finite, got " << p.temperature);
  }
  // Keeps the processed logits free of NaN, which the ranking and argmax rely on.
  FANTAI_REQUIRE(p.repetition_penalty > 0.0f && std::isfinite(p.repetition_penalty) &&
                     std::isfinite(p.frequency_penalty) && std::isfinite(p.presence_penalty),
                 "sample: row " << r << ": penalties must be finite (repetition_penalty > 0)");
}

// log(sum(exp(l))) of the raw row, stable (max subtracted, summed in double).
double raw_log_sum_exp(const float* l, int32_t vocab, size_t r) {
  const MaxSumExp ms = host_row_reductions().max_sum_exp(l, vocab);  // cpu/row_reduce.h
  FANTAI_REQUIRE(ms.max != kNegInf, "sample: row " << r << ": every logit is -inf");
  // NaN anywhere, or +inf (inf - inf), poisons the sum: report it rather than sample garbage.
  FANTAI_CHECK(std::isfinite(ms.sum), "sample: row " << r << ": logits contain NaN or +inf");
  return static_cast<double>(ms.max) + std::log(ms.sum);
}

// Top-n raw logprobs, best first. A bounded heap keeps it O(vocab log n) instead of a sort.
void fill_top(const float* l, int32_t vocab, int32_t n, double lse, SampleResult* res) {
  res->top.clear();
  if (n <= 0) return;
  n = std::min(n, vocab);
  const RanksBefore before{l};
  std::vector<int32_t> heap;  // front: the worst of the best n so far
  heap.reserve(n);
  for (int32_t i = 0; i < vocab; ++i) {
    if (static_cast<int32_t>(heap.size()) < n) {
      heap.push_back(i);
      std::push_heap(heap.begin(), heap.end(), before);
    } else if (before(i, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = i;
      std::push_heap(heap.begin(), heap.end(), before);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), before);  // ascending in "ranks before": best first
  res->top.reserve(n);
  for (int32_t t : heap) res->top.emplace_back(t, static_cast<float>(l[t] - lse));
}

// Repetition penalty (HF, prompt ∪ output, once per token), then frequency and presence penalties
// (OpenAI, output only). Counting in a vocab-sized array avoids sorting the context every step.
void apply_penalties(float* l, const SampleRow& row, Scratch& s) {
  const sampling::SamplingParams& p = *row.params;
  const bool rep = p.repetition_penalty != 1.0f;
  if (!rep && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) return;
  if (row.output != nullptr) {
    for (int32_t t : *row.output) {
      if (s.count[t]++ == 0) s.touched.push_back(t);
    }
  }
  if (rep && row.prompt != nullptr) {
    for (int32_t t : *row.prompt) {
      if (s.count[t] == 0) {
        s.count[t] = -1;  // seen in the prompt only: repetition penalty, no frequency/presence
        s.touched.push_back(t);
      }
    }
  }
  for (int32_t t : s.touched) {
    s.saved.emplace_back(t, l[t]);
    float x = l[t];
    if (rep) x = x > 0.0f ? x / p.repetition_penalty : x * p.repetition_penalty;
    const int32_t c = s.count[t];
    if (c > 0) x -= static_cast<float>(c) * p.frequency_penalty + p.presence_penalty;
    l[t] = x;
    s.count[t] = 0;  // restore the all-zero invariant as we go
  }
}

void apply_bias_and_bans(float* l, const SampleRow& row, Scratch& s) {
  for (const auto& [id, bias] : row.params->logit_bias) {
    s.saved.emplace_back(id, l[id]);
    l[id] += bias;
  }
  if (row.banned == nullptr) return;
  for (int32_t t : *row.banned) {
    s.saved.emplace_back(t, l[t]);
    l[t] = kNegInf;
  }
}

// Disallowed tokens get -inf; they are never sampled, so raw_logit needs none of them saved.
void apply_mask(float* l, int32_t vocab, const SampleRow& row) {
  if (row.allowed == nullptr) return;
  for (int32_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t bits = row.allowed[w];
    if (bits == 0xffffffffu) continue;
    const int32_t end = std::min(vocab, w * 32 + 32);
    for (int32_t t = w * 32; t < end; ++t) {
      if (!((bits >> (t - w * 32)) & 1u)) l[t] = kNegInf;
    }
  }
}

// The raw logit of token t: the first saved value if processing overwrote it, else the row's.
float raw_logit(const float* l, int32_t t, const Scratch& s) {
  for (const auto& [id, v] : s.saved) {
    if (id == t) return v;
  }
  return l[t];
}

int32_t argmax(const float* l, int32_t vocab, size_t r) {
  const int32_t best = host_row_reductions().argmax(l, vocab);  // ties keep the lowest id
  FANTAI_REQUIRE(l[best] != kNegInf, "sample: row " << r << ": every token is banned or has -inf logit");
  return best;
}

// ---- filtering and the draw ---------------------------------------------------------------------
// top_k, top_p and min_p each keep a prefix of the order, so the kept set is always a prefix and is
// described by its last token `bound` (-1: no cut) plus min_p's threshold on w. Prefix boundaries
// are found without sorting the vocab: tokens are bucketed by logit distance from the max (a
// monotone function of the order, so bucket i precedes bucket i+1 entirely), and only the one
// bucket holding the boundary is sorted or partitioned.

constexpr int kBins = 2048;
constexpr float kBinsPerUnit = 64.0f;  // bucket width: 1/64 of a (temperature-scaled) logit unit

// top_p mass is counted in integer units of 2^-40 of the max token's weight: integer sums do not
// depend on summation order, so the bucketed walk and a full-sort walk agree bit for bit.
inline uint64_t quantised_mass(float w) {
  return static_cast<uint64_t>(static_cast<double>(w) * 0x1.0p40 + 0.5);
}

struct Dist {
  const float* l;  // processed logits
  const float* w;  // exp((l - lmax) / T); the top token has w == 1
  int32_t vocab;
  float lmax;
  float inv_t;
  int32_t bound = -1;  // last kept token of the order; -1: no prefix cut
  float min_w = 0.0f;  // min_p threshold on w (max w is 1)
  // Tokens still in play, ascending ids; null: the whole vocab. Set after top-k so later passes
  // walk k tokens instead of the vocab.
  const int32_t* ids = nullptr;
  size_t n_ids = 0;

  size_t size() const { return ids ? n_ids : static_cast<size_t>(vocab); }
  int32_t id(size_t i) const { return ids ? ids[i] : static_cast<int32_t>(i); }

  int bin(int32_t c) const {
    const float d = (lmax - l[c]) * inv_t * kBinsPerUnit;  // >= 0; +inf for -inf logits
    return d < static_cast<float>(kBins - 1) ? static_cast<int>(d) : kBins - 1;
  }
  bool in_prefix(int32_t c) const {  // c ranks before `bound`, or is it
    if (bound < 0) return true;
    const float lb = l[bound];
    return l[c] > lb || (l[c] == lb && c <= bound);
  }
  bool kept(int32_t c) const { return w[c] >= min_w && in_prefix(c); }
};

// The k-th token of the order (1-based), 0 < k < vocab: count per bucket, then nth_element inside
// the bucket that holds it. The order is total (ties by id), so the answer is unique.
int32_t top_k_bound(const Dist& d, int32_t k, Scratch& s) {
  s.bin_count.assign(kBins, 0);
  for (int32_t c = 0; c < d.vocab; ++c) ++s.bin_count[d.bin(c)];
  int64_t before = 0;
  int b = 0;
  while (before + s.bin_count[b] < k) before += s.bin_count[b++];
  s.edge.clear();
  for (int32_t c = 0; c < d.vocab; ++c) {
    if (d.bin(c) == b) s.edge.push_back(c);
  }
  const auto nth = s.edge.begin() + (k - 1 - before);
  std::nth_element(s.edge.begin(), nth, s.edge.end(), RanksBefore{d.l});
  return *nth;
}

// Last token of the shortest prefix (within the current bound) whose mass reaches top_p of the
// prefix's mass. Buckets before the crossing bucket are wholly inside; only that one is sorted.
int32_t top_p_bound(const Dist& d, float top_p, Scratch& s) {
  s.bin_mass.assign(kBins, 0);
  uint64_t total = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    const int32_t c = d.id(i);
    if (!d.in_prefix(c)) continue;
    const uint64_t q = quantised_mass(d.w[c]);
    s.bin_mass[d.bin(c)] += q;
    total += q;
  }
  const double want = std::ceil(static_cast<double>(top_p) * static_cast<double>(total));
  const uint64_t target = want <= 0.0 ? 0 : std::min(total, static_cast<uint64_t>(want));
  uint64_t cum = 0;
  int b = 0;
  while (cum + s.bin_mass[b] < target) cum += s.bin_mass[b++];
  s.edge.clear();
  for (size_t i = 0; i < d.size(); ++i) {
    const int32_t c = d.id(i);
    if (d.in_prefix(c) && d.bin(c) == b) s.edge.push_back(c);
  }
  std::sort(s.edge.begin(), s.edge.end(), RanksBefore{d.l});
  for (int32_t c : s.edge) {
    cum += quantised_mass(d.w[c]);
    if (cum >= target) return c;  // checked after adding: at least one token is always kept
  }
  return s.edge.back();  // unreachable: the bucket's mass reaches target
}

// Inverse CDF over the kept tokens in ascending id order, with the one uniform u in [0, 1).
int32_t inverse_cdf(const Dist& d, double z, double u) {
  const bool all = d.ids == nullptr && d.bound < 0 && d.min_w <= 0.0f;
  double mass = z;  // unfiltered: the same id-order sum over the same weights
  if (!all) {
    mass = 0.0;
    for (size_t i = 0; i < d.size(); ++i) {
      if (d.kept(d.id(i))) mass += d.w[d.id(i)];
    }
  }
  const double target = u * mass;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < d.size(); ++i) {
    const int32_t c = d.id(i);
    if (d.w[c] <= 0.0f || (!all && !d.kept(c))) continue;  // zero weight: banned or underflow
    cum += d.w[c];
    last = c;
    if (cum > target) return c;
  }
  return last;  // u * mass rounded up to mass: the last token with weight
}

int32_t draw(const float* l, int32_t vocab, const SampleRow& row, size_t r, Scratch& s) {
  const sampling::SamplingParams& p = *row.params;
  float lmax = kNegInf;
  for (int32_t i = 0; i < vocab; ++i) lmax = std::max(lmax, l[i]);
  FANTAI_REQUIRE(lmax != kNegInf, "sample: row " << r << ": every token is banned or has -inf logit");
  float* w = s.w.data();
  double z = 0.0;
  for (int32_t i = 0; i < vocab; ++i) {
    w[i] = std::exp((l[i] - lmax) / p.temperature);
    z += w[i];
  }
  FANTAI_CHECK(std::isfinite(z), "sample: row " << r << ": processed logits contain NaN");
  // The one rng draw for this token, taken up front so the count never depends on the filters.
  const double u = draw_uniform(*row.rng);
  Dist d{l, w, vocab, lmax, 1.0f / p.temperature};
  if (p.top_k > 0 && p.top_k < vocab) {
    d.bound = top_k_bound(d, p.top_k, s);
    s.cands.clear();
    for (int32_t c = 0; c < vocab; ++c) {
      if (d.in_prefix(c)) s.cands.push_back(c);
    }
    d.ids = s.cands.data();
    d.n_ids = s.cands.size();
  }
  if (p.top_p < 1.0f) d.bound = top_p_bound(d, p.top_p, s);  // within the top-k prefix
  if (p.min_p > 0.0f) d.min_w = std::min(p.min_p, 1.0f);     // the top token (w == 1) survives
  return inverse_cdf(d, z, u);
}

void sample_row(float* l, int32_t vocab, const SampleRow& row, size_t r, SampleResult* res) {
  check_row(row, vocab, r);
  Scratch& s = scratch_for(vocab);
  const double lse = raw_log_sum_exp(l, vocab, r);
  fill_top(l, vocab, row.params->logprobs, lse, res);
  apply_penalties(l, row, s);
  apply_bias_and_bans(l, row, s);
  apply_mask(l, vocab, row);
  const int32_t tok = row.params->greedy() ? argmax(l, vocab, r) : draw(l, vocab, row, r, s);
  res->token = tok;
  res->logprob = static_cast<float>(raw_logit(l, tok, s) - lse);
}

}  // namespace

float device_uniform(double u) {
  float f = static_cast<float>(u);
  if (static_cast<double>(f) > u) f = std::nextafter(f, 0.0f);
  return f;
}

bool plain_row(const SamplingParams& p, bool has_bans) {
  // min_p never drops the argmax, and greedy is the argmax, so it matters to sampled rows only.
  return p.logprobs < 0 && p.logit_bias.empty() && p.repetition_penalty == 1.0f &&
         p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f && (p.min_p <= 0.0f || p.greedy()) &&
         !p.constrained && !has_bans && std::isfinite(p.temperature);
}

void sample(float* logits, int32_t vocab, const std::vector<SampleRow>& rows,
            std::vector<SampleResult>* results) {
  FANTAI_REQUIRE(results != nullptr, "sample: results must not be null");
  FANTAI_REQUIRE(vocab > 0, "sample: vocab must be > 0, got " << vocab);
  FANTAI_REQUIRE(logits != nullptr || rows.empty(), "sample: logits must not be null");
  results->assign(rows.size(), SampleResult{});
  for (size_t r = 0; r < rows.size(); ++r) {
    sample_row(logits + r * static_cast<size_t>(vocab), vocab, rows[r], r, &(*results)[r]);
  }
}

}  // namespace fantai::sampling
