// cpu: the CPU backend's mixture-of-experts ops: routing (softmax, top-k) and the experts run
// grouped by expert through the backend's own linears.
#include <cmath>
#include <cstring>
#include <limits>

#include "common/check.h"
#include "cpu/cpu_backend_impl.h"

namespace fantai::cpu {
namespace {

// out[h] += w * y[h]: the product, then the sum, as transformers (this file has no FMA flags, so
// nothing contracts the two).
void add_weighted_row(float* out, const float* y, float w, int64_t n) {
  for (int64_t h = 0; h < n; ++h) out[h] += w * y[h];
}

}  // namespace

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

// One expert linear on m rows, on the calling thread: the same kernels, with the same per-element
// arithmetic, as linear() / linear_q() run over the pool (their splits never change a result), so
// either route gives the same bits. `xq`: this task's int8 activation scratch. Dense matrices
// row-major or packed (pairs or groups), unpermuted quantized ones (moe_experts_fit_one_thread checks).
void CpuBackend::moe_linear_one_thread(const float* x, const MoeLinear& L, const MoeExperts& ex, float* y,
                                       int64_t m, int64_t n, int64_t k, MoeTaskScratch* xq) {
  if (L.dense && ex.packed) bf16_packed_fn_(x, L.dense, nullptr, y, m, n, k, 0, n);
  else if (L.dense) k_.linear(x, L.dense, ex.dtype, nullptr, y, m, n, k, 0, n);
  for (int32_t i = 0; i < L.num_parts; ++i) {
    const QuantMatrix& w = L.parts[i];
    float* yp = y + L.part_row0[i];
    if (!is_panel_layout(w.layout)) {
      qk_.linear_q(x, w, nullptr, yp, m, n, 0, w.rows);
      continue;
    }
    const int32_t block = xq_block(w);
    QuantizedRows r;
    r.nblocks = ceil_div(w.cols, block);
    r.ld = r.nblocks * block;
    if (xq->q.size() < static_cast<size_t>(m * r.ld)) xq->q.resize(static_cast<size_t>(m * r.ld));
    if (xq->d.size() < static_cast<size_t>(m * r.nblocks)) {
      xq->d.resize(static_cast<size_t>(m * r.nblocks));
      xq->s.resize(static_cast<size_t>(m * r.nblocks));
    }
    quant_rows_fn_(x, m, w.cols, block, xq->q.data(), xq->d.data(), xq->s.data());
    r.q = xq->q.data();
    r.d = xq->d.data();
    r.s = xq->s.data();
    const LinearPanelFn fn = amx_panel_fn_ && m >= kAmxPanelMinRows ? amx_panel_fn_ : panel_fn_;
    fn(r, w, nullptr, yp, m, n, 0, ceil_div(w.rows, 16));
  }
}

bool CpuBackend::moe_experts_fit_one_thread(const MoeExperts& ex, const int64_t* offsets) const {
  if (ex.packed && amx_) return false;  // the AMX tiles are set up per call over the pool
  for (int32_t e = 0; e < ex.num_experts; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (const MoeLinear* L : {&ex.experts[e].gate_up, &ex.experts[e].down})
      for (int32_t i = 0; i < L->num_parts; ++i) {
        const QuantMatrix& w = L->parts[i];
        if (w.perm || (is_panel_layout(w.layout) && !panel_fn_)) return false;
      }
  }
  return true;
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
  // A decode's few rows per expert make each linear too small to split well: the pool then runs
  // whole experts side by side instead (one task each, its linears on one thread), every
  // expert's output into its own rows, and the weighted adds follow in ascending expert id as
  // below. Same kernels, same bits.
  int64_t active = 0;
  for (int32_t e = 0; e < E; ++e) active += moe_offsets_[e + 1] > moe_offsets_[e];
  if (pool_.size() > 1 && max_m <= kMoeSideBySideRows && active >= 2 &&
      moe_experts_fit_one_thread(ex, moe_offsets_.data())) {
    const int64_t slots = rows * top_k, xw = std::max(H, I), per_slot = xw + 2 * I + H;
    if (moe_side_.size() < static_cast<size_t>(slots * per_slot))
      moe_side_.resize(static_cast<size_t>(slots * per_slot));
    if (moe_task_scratch_.size() < static_cast<size_t>(pool_.size())) moe_task_scratch_.resize(pool_.size());
    moe_active_.clear();
    for (int32_t e = 0; e < E; ++e)
      if (moe_offsets_[e + 1] > moe_offsets_[e]) moe_active_.push_back(e);
    // Expert e's rows take slots [offsets[e], offsets[e + 1]) of the scratch: x (then the
    // activations) | gate|up | y.
    pool_.parallel_for(static_cast<int64_t>(moe_active_.size()), [&](int64_t t, int thread) {
      const int32_t e = moe_active_[t];
      const int64_t m = moe_offsets_[e + 1] - moe_offsets_[e];
      const int64_t* sl = moe_slots_.data() + moe_offsets_[e];
      float* xe = moe_side_.data() + moe_offsets_[e] * per_slot;
      float* gue = xe + m * xw;
      float* ye = gue + m * 2 * I;
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(xe + i * H, x + sl[i] / top_k * H, static_cast<size_t>(H) * sizeof(float));
      const MoeExpert& w = ex.experts[e];
      moe_linear_one_thread(xe, w.gate_up, ex, gue, m, 2 * I, H, &moe_task_scratch_[thread]);
      for (int64_t i = 0; i < m; ++i) k_.silu_mul(gue + i * 2 * I, gue + i * 2 * I + I, xe + i * I, I);
      moe_linear_one_thread(xe, w.down, ex, ye, m, H, I, &moe_task_scratch_[thread]);
    });
    for (int32_t e : moe_active_) {
      const int64_t m = moe_offsets_[e + 1] - moe_offsets_[e];
      const float* ye = moe_side_.data() + moe_offsets_[e] * per_slot + m * (xw + 2 * I);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t s = moe_slots_[moe_offsets_[e] + i];
        add_weighted_row(out + s / top_k * H, ye + i * H, weights[s], H);
      }
    }
    return;
  }
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
      add_weighted_row(out + s / top_k * H, yg + i * H, weights[s], H);
    });
  }
}

}  // namespace fantai::cpu
