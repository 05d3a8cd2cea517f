// cpu: the CPU backend's mixture-of-experts ops: routing (softmax, top-k) and the experts run
// grouped by expert through the backend's own linears.
#include <cmath>
#include <cstring>
#include <limits>

#include "common/check.h"
#include "cpu/cpu_backend_impl.h"

namespace fantai::cpu {

// Plain C++ compiled once (no ISA flags): every ISA level routes a row to the same experts with
// the same weights, bit for bit. The arithmetic is transformers' in f32: max, exp(l - max), the
// sum in expert order, p / sum; the top-k on the probabilities (a rounding tie between two
// different logits is a tie here too, as there).
void CpuBackend::moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k,
                           bool renormalize, int32_t* ids, float* weights) {
  FANTAI_REQUIRE(rows >= 0 && num_experts > 0 && top_k > 0 && top_k <= num_experts,
                 "moe_route: bad shape rows=" << rows << " experts=" << num_experts << " top_k=" << top_k);
  if (rows == 0) return;
  const size_t need = static_cast<size_t>(rows) * num_experts;
  if (moe_probs_.size() < need) moe_probs_.resize(need);
  float* const probs = moe_probs_.data();
  for_rows(rows, static_cast<int64_t>(num_experts) * (top_k + 4), [&](int64_t r) {
    const float* l = logits + r * num_experts;
    float* p = probs + r * num_experts;
    float mx = l[0];
    for (int32_t e = 1; e < num_experts; ++e) mx = std::max(mx, l[e]);
    float sum = 0.f;
    for (int32_t e = 0; e < num_experts; ++e) sum += p[e] = std::exp(l[e] - mx);
    for (int32_t e = 0; e < num_experts; ++e) p[e] /= sum;
    int32_t* id = ids + r * top_k;
    float* w = weights + r * top_k;
    // Selection, k passes: k is small (2..8) and the row is already in cache. A chosen expert's
    // probability becomes -inf (no probability is), so it is never picked twice, NaN rows included.
    constexpr float kTaken = -std::numeric_limits<float>::infinity();
    for (int32_t j = 0; j < top_k; ++j) {
      int32_t best = -1;
      for (int32_t e = 0; e < num_experts; ++e)
        if (p[e] != kTaken && (best < 0 || p[e] > p[best])) best = e;  // strict: ties keep the lower id
      id[j] = best;
      w[j] = p[best];
      p[best] = kTaken;
    }
    if (renormalize) {
      float chosen = 0.f;
      for (int32_t j = 0; j < top_k; ++j) chosen += w[j];
      for (int32_t j = 0; j < top_k; ++j) w[j] /= chosen;
    }
  });
}

// One expert linear on m gathered rows: the dense rows (plain or packed), then each quantized
// part into its column slice, as the model's fused matrices do.
void CpuBackend::moe_linear(const float* x, const MoeLinear& L, const MoeExperts& ex, float* y, int64_t m,
                            int64_t n, int64_t k) {
  if (L.dense && ex.packed) linear_packed(x, L.dense, ex.dtype, nullptr, y, m, n, k);
  else if (L.dense) linear(x, L.dense, ex.dtype, nullptr, y, m, n, k);
  for (int32_t i = 0; i < L.num_parts; ++i) linear_q(x, L.parts[i], nullptr, y + L.part_row0[i], m, n);
}

// Tokens grouped by expert (moe_group_slots: rows ascending within an expert), then expert
// by expert in ascending id: gather its rows, gate|up, silu-mul, down (one fused call where the
// packed path has one), and add its weighted rows into `out`. A row meets each of its experts
// once and in ascending id whatever the batch, so its sum has one order; the rows of one expert
// are distinct, so the scatter splits freely over the pool.
void CpuBackend::moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows,
                             int32_t top_k, const MoeExperts& ex, float* out) {
  const int32_t E = ex.num_experts;
  const int64_t H = ex.hidden, I = ex.inter;
  FANTAI_REQUIRE(rows >= 0 && top_k > 0 && top_k <= E && H > 0 && I > 0 && ex.experts,
                 "moe_experts: bad shape rows=" << rows << " top_k=" << top_k << " experts=" << E
                                                << " hidden=" << H << " inter=" << I);
  if (rows == 0) return;
  moe_offsets_.resize(static_cast<size_t>(E) + 1);
  moe_slots_.resize(static_cast<size_t>(rows * top_k));
  moe_group_slots(ids, rows, top_k, E, moe_offsets_.data(), moe_slots_.data());
  int64_t max_m = 0;
  for (int32_t e = 0; e < E; ++e) max_m = std::max(max_m, moe_offsets_[e + 1] - moe_offsets_[e]);
  std::memset(out, 0, static_cast<size_t>(rows * H) * sizeof(float));
  const size_t need_x = static_cast<size_t>(max_m * std::max(H, I)),
               need_gu = static_cast<size_t>(max_m * 2 * I);
  if (moe_x_.size() < need_x) moe_x_.resize(need_x);
  if (moe_y_.size() < need_x) moe_y_.resize(need_x);
  if (moe_gu_.size() < need_gu) moe_gu_.resize(need_gu);
  float *const xg = moe_x_.data(), *const yg = moe_y_.data(), *const gu = moe_gu_.data();
  for (int32_t e = 0; e < E; ++e) {
    const int64_t m = moe_offsets_[e + 1] - moe_offsets_[e];
    if (m == 0) continue;
    const int64_t* sl = moe_slots_.data() + moe_offsets_[e];
    for_rows(m, H, [&](int64_t i) {
      std::memcpy(xg + i * H, x + sl[i] / top_k * H, static_cast<size_t>(H) * sizeof(float));
    });
    const MoeExpert& w = ex.experts[e];
    const bool fused = ex.packed && w.gate_up.dense && w.down.dense && !w.gate_up.num_parts &&
                       !w.down.num_parts &&
                       mlp_packed(xg, w.gate_up.dense, w.down.dense, ex.dtype, yg, m, I, H);
    if (!fused) {
      moe_linear(xg, w.gate_up, ex, gu, m, 2 * I, H);
      silu_mul(gu, xg, m, I);  // the gathered rows are spent: their room takes the activations
      moe_linear(xg, w.down, ex, yg, m, H, I);
    }
    for_rows(m, H, [&](int64_t i) {
      const int64_t s = sl[i];
      const float wt = weights[s];
      float* o = out + s / top_k * H;
      const float* y = yg + i * H;
      // Product, then sum, as transformers (this file has no FMA flags, so nothing contracts them).
      for (int64_t h = 0; h < H; ++h) o[h] += wt * y[h];
    });
  }
}

}  // namespace fantai::cpu
