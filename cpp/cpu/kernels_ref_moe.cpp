// cpu: reference mixture-of-experts routing and experts — plain loops in double, one row at a time.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "common/check.h"
#include "cpu/kernels.h"

namespace fantai::cpu::ref {

void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
               int32_t* ids, float* weights) {
  std::vector<double> p(num_experts);
  std::vector<char> taken(num_experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * num_experts;
    double mx = l[0], sum = 0;
    for (int32_t e = 1; e < num_experts; ++e) mx = std::max<double>(mx, l[e]);
    for (int32_t e = 0; e < num_experts; ++e) sum += p[e] = std::exp(l[e] - mx);
    std::fill(taken.begin(), taken.end(), 0);
    double chosen = 0;
    for (int32_t j = 0; j < top_k; ++j) {
      int32_t best = -1;
      for (int32_t e = 0; e < num_experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;  // strict: ties keep the lower id
      taken[best] = 1;
      ids[r * top_k + j] = best;
      chosen += p[best] / sum;
    }
    for (int32_t j = 0; j < top_k; ++j) {
      const double w = p[ids[r * top_k + j]] / sum;
      weights[r * top_k + j] = static_cast<float>(renormalize ? w / chosen : w);
    }
  }
}

void moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows, int32_t top_k,
                 const void* gate_up, const void* down, DType dtype, int32_t num_experts, int64_t hidden,
                 int64_t inter, float* out) {
  const size_t es = dtype_size(dtype);
  std::vector<float> gu(2 * inter), act(inter), y(hidden);
  std::vector<std::pair<int32_t, float>> picked(top_k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t j = 0; j < top_k; ++j) {
      FANTAI_CHECK(ids[r * top_k + j] >= 0 && ids[r * top_k + j] < num_experts, "ref::moe_experts: bad id");
      picked[j] = {ids[r * top_k + j], weights[r * top_k + j]};
    }
    std::sort(picked.begin(), picked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<double> acc(hidden, 0.0);
    for (const auto& [e, w] : picked) {
      const char* wgu = static_cast<const char*>(gate_up) + static_cast<size_t>(e) * 2 * inter * hidden * es;
      const char* wd = static_cast<const char*>(down) + static_cast<size_t>(e) * hidden * inter * es;
      linear(x + r * hidden, wgu, dtype, nullptr, gu.data(), 1, 2 * inter, hidden);
      silu_mul(gu.data(), act.data(), 1, inter);
      linear(act.data(), wd, dtype, nullptr, y.data(), 1, hidden, inter);
      for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<double>(w) * y[h];
    }
    for (int64_t h = 0; h < hidden; ++h) out[r * hidden + h] = static_cast<float>(acc[h]);
  }
}

}  // namespace fantai::cpu::ref
