// cpu: the CPU backend's row ops: RMSNorm (with the residual add, per head), RoPE, SiLU / GeGLU, embedding,
// add, scale, soft-capping.
#include "cpu/cpu_backend_impl.h"

#include <cmath>

#include "common/check.h"

namespace fantai::cpu {

void CpuBackend::rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                          float eps) {
  FANTAI_REQUIRE(dim > 0 && rows >= 0, "rms_norm: bad shape rows=" << rows << " dim=" << dim);
  const auto fn = k_.rms_norm;
  for_rows(rows, dim, [&](int64_t r) { fn(x + r * dim, weight, out + r * dim, dim, eps); });
}

void CpuBackend::add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                              int64_t dim, float eps) {
  FANTAI_REQUIRE(dim > 0 && rows >= 0, "add_rms_norm: bad shape rows=" << rows << " dim=" << dim);
  const auto fn = k_.add_rms_norm;
  for_rows(rows, dim,
           [&](int64_t r) { fn(residual + r * dim, x + r * dim, weight, out + r * dim, dim, eps); });
}

void CpuBackend::rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads,
                                int32_t head_dim, const float* weight, float eps) {
  FANTAI_REQUIRE(head_dim > 0 && num_heads > 0 && num_tokens >= 0, "rms_norm_heads: bad shape");
  const auto fn = k_.rms_norm;
  for_rows(num_tokens, static_cast<int64_t>(num_heads) * head_dim, [&](int64_t t) {
    for (int32_t h = 0; h < num_heads; ++h) {
      float* row = x + t * stride + static_cast<int64_t>(h) * head_dim;
      fn(row, weight, row, head_dim, eps);
    }
  });
}

void CpuBackend::rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
                      int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                      int32_t rotary_dim, const float* cos_sin) {
  FANTAI_REQUIRE(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                 "rope: rotary_dim must be even and within head_dim " << head_dim << ", got " << rotary_dim);
  const auto fn = k_.rope;
  for_rows(num_tokens, static_cast<int64_t>(num_q_heads + num_kv_heads) * head_dim, [&](int64_t t) {
    const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * rotary_dim;
    fn(q + t * q_stride, num_q_heads, head_dim, rotary_dim, cs);
    fn(k + t * k_stride, num_kv_heads, head_dim, rotary_dim, cs);
  });
}

void CpuBackend::silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  const auto fn = k_.silu_mul;
  for_rows(rows, inter, [&](int64_t r) {
    fn(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
  });
}

void CpuBackend::gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  const auto fn = k_.gelu_tanh_mul;
  for_rows(rows, inter, [&](int64_t r) {
    fn(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
  });
}

void CpuBackend::embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim,
                           float* out) {
  FANTAI_REQUIRE(dtype != DType::kI8, "embedding: int8 is a KV-cache-only dtype");
  const size_t es = dtype_size(dtype);
  const auto fn = k_.to_f32;
  for (int64_t i = 0; i < n; ++i)  // checked here: a throw inside a pool task cannot propagate
    FANTAI_REQUIRE(ids[i] >= 0, "embedding: negative token id " << ids[i] << " at " << i);
  for_rows(n, dim, [&](int64_t i) {
    fn(static_cast<const char*>(table) + static_cast<size_t>(ids[i]) * dim * es, dtype, out + i * dim, dim);
  });
}

void CpuBackend::add(float* x, const float* y, int64_t n) {
  // Elementwise, so any split is invariant; 4096-float chunks keep tasks coarse.
  const int64_t chunk = 4096;
  const auto fn = k_.add;
  if (n < kParallelMinWork) {
    fn(x, y, n);
    return;
  }
  pool_.parallel_for(ceil_div(n, chunk), [&](int64_t c, int) {
    const int64_t i0 = c * chunk;
    fn(x + i0, y + i0, std::min(chunk, n - i0));
  });
}

// Elementwise with std:: maths, so any split is invariant; both run once per step on small
// arrays (the embedded rows, the sampled logits rows).
void CpuBackend::scale(float* x, float s, int64_t n) {
  pool_.parallel_for(ceil_div(n, 4096), [&](int64_t c, int) {
    for (int64_t i = c * 4096, e = std::min(n, i + 4096); i < e; ++i) x[i] *= s;
  });
}

void CpuBackend::softcap(float* x, float cap, int64_t n) {
  FANTAI_REQUIRE(cap > 0, "softcap: cap must be positive, got " << cap);
  pool_.parallel_for(ceil_div(n, 4096), [&](int64_t c, int) {
    for (int64_t i = c * 4096, e = std::min(n, i + 4096); i < e; ++i) x[i] = cap * std::tanh(x[i] / cap);
  });
}

}  // namespace fantai::cpu
