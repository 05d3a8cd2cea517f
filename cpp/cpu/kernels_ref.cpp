// cpu: reference kernels — plain loops in double, no SIMD, no threads; the oracle the tests trust.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "common/check.h"
#include "cpu/kernels.h"

namespace fantai::cpu::ref {
namespace {

double elem(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::kI8: break;
  }
  FANTAI_THROW("ref: int8 elements need their scale (kv_elem)");
}

// Element i of a layer's K or V cache as a double; int8 values times their (slot, head) scale.
double kv_elem(const void* cache, const KVLayout& L, int64_t i) {
  if (L.dtype != DType::kI8) return elem(cache, L.dtype, i);
  const float* scales = reinterpret_cast<const float*>(static_cast<const char*>(cache) + L.scales_offset());
  return static_cast<double>(static_cast<const int8_t*>(cache)[i]) * scales[i / L.head_dim];
}

void put(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; return;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); return;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); return;
    case DType::kI8: break;
  }
  FANTAI_THROW("ref: int8 rows are stored with quantize_row_i8");
}

}  // namespace

void linear(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t i = 0; i < k; ++i) s += static_cast<double>(x[r * k + i]) * elem(w, wt, j * k + i);
      y[r * n + j] = static_cast<float>(s);
    }
}

void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = static_cast<float>(x[r * dim + i] * inv * weight[i]);
  }
}

void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps) {
  for (int64_t i = 0; i < rows * dim; ++i) residual[i] += x[i];
  rms_norm(residual, weight, out, rows, dim, eps);
}

void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
          int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
          const float* cos_sin) {
  const int half = rotary_dim / 2;
  auto rot = [&](float* x, const float* cs) {
    for (int i = 0; i < half; ++i) {
      const double a = x[i], b = x[i + half], c = cs[i], s = cs[half + i];
      x[i] = static_cast<float>(a * c - b * s);
      x[i + half] = static_cast<float>(b * c + a * s);
    }
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * rotary_dim;
    for (int h = 0; h < num_q_heads; ++h) rot(q + t * q_stride + h * head_dim, cs);
    for (int h = 0; h < num_kv_heads; ++h) rot(k + t * k_stride + h * head_dim, cs);
  }
}

void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping, int64_t num_tokens,
              void* k_cache, void* v_cache, const KVLayout& L) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int64_t blk = slot / L.block_size, off = slot % L.block_size;
    if (L.dtype == DType::kI8) {
      for (int h = 0; h < L.num_kv_heads; ++h) {
        const int64_t row = (blk * L.num_kv_heads + h) * L.block_size + off;
        for (auto [src, cache] : {std::pair<const float*, void*>{k, k_cache}, {v, v_cache}}) {
          float* scales = reinterpret_cast<float*>(static_cast<char*>(cache) + L.scales_offset());
          scales[row] = quantize_row_i8(src + t * stride + h * L.head_dim,
                                        static_cast<int8_t*>(cache) + row * L.head_dim, L.head_dim);
        }
      }
      continue;
    }
    for (int h = 0; h < L.num_kv_heads; ++h)
      for (int d = 0; d < L.head_dim; ++d) {
        const int64_t dst = ((blk * L.num_kv_heads + h) * L.block_size + off) * L.head_dim + d;
        put(k_cache, L.dtype, dst, k[t * stride + h * L.head_dim + d]);
        put(v_cache, L.dtype, dst, v[t * stride + h * L.head_dim + d]);
      }
  }
}

void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, const KVLayout& L,
               const AttentionParams& p, int32_t num_q_heads, float scale, float* out) {
  const int hd = L.head_dim, group = num_q_heads / L.num_kv_heads;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.cu_seqlens_q[s], qlen = p.cu_seqlens_q[s + 1] - q0, ctx = p.context_lens[s];
    const int32_t* bt = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
    for (int j = 0; j < qlen; ++j) {
      const int pos = ctx - qlen + j;
      for (int h = 0; h < num_q_heads; ++h) {
        const int g = h / group;
        const float* qv = q + static_cast<int64_t>(q0 + j) * q_stride + h * hd;
        auto at = [&](int t, int d) {
          return ((static_cast<int64_t>(bt[t / L.block_size]) * L.num_kv_heads + g) * L.block_size +
                  t % L.block_size) *
                     hd +
                 d;
        };
        // Keys [lo, pos]: the window's (p - W, p], or all of them.
        const int lo = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
        std::vector<double> sc(pos + 1);
        double mx = -std::numeric_limits<double>::infinity();
        for (int t = lo; t <= pos; ++t) {
          double d0 = 0;
          for (int d = 0; d < hd; ++d) d0 += static_cast<double>(qv[d]) * kv_elem(k_cache, L, at(t, d));
          sc[t] = d0 * scale;
          if (p.logit_softcap > 0) sc[t] = p.logit_softcap * std::tanh(sc[t] / p.logit_softcap);
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (int t = lo; t <= pos; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
        float* o = out + static_cast<int64_t>(q0 + j) * num_q_heads * hd + h * hd;
        for (int d = 0; d < hd; ++d) {
          double a = 0;
          for (int t = lo; t <= pos; ++t) a += sc[t] * kv_elem(v_cache, L, at(t, d));
          o[d] = static_cast<float>(a / sum);
        }
      }
    }
  }
}

void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const double g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
      out[r * inter + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
}

void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const double g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
      const double a = std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g);
      out[r * inter + i] = static_cast<float>(0.5 * g * (1.0 + std::tanh(a)) * u);
    }
}

void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                    const float* weight, float eps) {
  for (int64_t t = 0; t < num_tokens; ++t)
    rms_norm(x + t * stride, weight, x + t * stride, num_heads, head_dim, eps);
}

void scale(float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void softcap(float* x, float cap, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(cap * std::tanh(static_cast<double>(x[i]) / cap));
}

void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim, float* out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < dim; ++d)
      out[i * dim + d] = static_cast<float>(elem(table, dtype, static_cast<int64_t>(ids[i]) * dim + d));
}

void add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

MaxSumExp max_sum_exp(const float* l, int32_t n) {
  MaxSumExp r;
  r.max = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) r.max = std::max(r.max, l[i]);    // NaN never wins std::max here
  for (int32_t i = 0; i < n; ++i) r.sum += std::exp(l[i] - r.max);  // NaN / inf - inf poison it
  return r;
}

int32_t argmax(const float* l, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) {
    if (l[i] > l[best]) best = i;  // strict: ties keep the lowest id
  }
  return best;
}

}  // namespace fantai::cpu::ref
