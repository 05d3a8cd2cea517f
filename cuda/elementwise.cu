// cuda: rotary embedding, KV scatter, SiLU / GeGLU and mul, embedding gather, add, scale, soft-capping.
#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

// One block per token; threads walk (head, i) pairs over q heads then k heads.
__global__ void rope_kernel(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
                            int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
                            const float* cos_sin) {
  const int64_t t = blockIdx.x;
  const int half = rotary_dim / 2;
  const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * rotary_dim;
  const int total = (num_q_heads + num_kv_heads) * half;
  for (int j = threadIdx.x; j < total; j += blockDim.x) {
    const int h = j / half, i = j % half;
    float* x = h < num_q_heads ? q + t * q_stride + h * head_dim
                               : k + t * k_stride + (h - num_q_heads) * head_dim;
    const float a = x[i], b = x[i + half], c = cs[i], s = cs[half + i];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

template <typename T>
__global__ void store_kv_kernel(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                                T* k_cache, T* v_cache, int32_t block_size, int32_t num_kv_heads,
                                int32_t head_dim) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const int64_t blk = slot / block_size, off = slot % block_size;
  const int width = num_kv_heads * head_dim;
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    const int h = j / head_dim, d = j % head_dim;
    const int64_t dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim + d;
    k_cache[dst] = from_f32<T>(k[t * stride + j]);
    v_cache[dst] = from_f32<T>(v[t * stride + j]);
  }
}

__global__ void silu_mul_kernel(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = gate_up[r * 2 * inter + c], u = gate_up[r * 2 * inter + inter + c];
    out[i] = g / (1.f + expf(-g)) * u;
  }
}

// gelu_pytorch_tanh(g) * u as the CPU kernels write it: g / (1 + exp(-2a)).
__global__ void gelu_tanh_mul_kernel(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i % inter;
    const float g = gate_up[r * 2 * inter + c], u = gate_up[r * 2 * inter + inter + c];
    const float a = -2.f * 0.7978845608028654f * fmaf(0.044715f, g * g * g, g);
    out[i] = g / (1.f + expf(a)) * u;
  }
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] *= s;
}

__global__ void softcap_kernel(float* x, float cap, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = cap * tanhf(x[i] / cap);
}

template <typename T>
__global__ void embedding_kernel(const int32_t* ids, const T* table, int64_t dim, float* out) {
  const int64_t i = blockIdx.x;
  const T* row = table + static_cast<int64_t>(ids[i]) * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = to_f32(row[d]);
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

__global__ void sum_partials_kernel(const float* gathered, float* out, int64_t n, int32_t world) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = gathered[i];
    for (int32_t r = 1; r < world; ++r) s += gathered[static_cast<int64_t>(r) * n + i];
    out[i] = s;
  }
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65535));
}

}  // namespace

void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
          int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
          const float* cos_sin, cudaStream_t stream) {
  if (num_tokens == 0) return;
  rope_kernel<<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(
      q, q_stride, k, k_stride, positions, num_q_heads, num_kv_heads, head_dim, rotary_dim, cos_sin);
  FANTAI_CUDA_LAUNCHED();
}

void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping, int64_t num_tokens,
              void* k_cache, void* v_cache, const KVLayout& L, cudaStream_t stream) {
  if (num_tokens == 0) return;
  dispatch_dtype(L.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    store_kv_kernel<T><<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(
        k, v, stride, slot_mapping, static_cast<T*>(k_cache), static_cast<T*>(v_cache), L.block_size,
        L.num_kv_heads, L.head_dim);
  });
  FANTAI_CUDA_LAUNCHED();
}

void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, cudaStream_t stream) {
  if (rows * inter == 0) return;
  silu_mul_kernel<<<grid_for(rows * inter, 256), 256, 0, stream>>>(gate_up, out, rows, inter);
  FANTAI_CUDA_LAUNCHED();
}

void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, cudaStream_t stream) {
  if (rows * inter == 0) return;
  gelu_tanh_mul_kernel<<<grid_for(rows * inter, 256), 256, 0, stream>>>(gate_up, out, rows, inter);
  FANTAI_CUDA_LAUNCHED();
}

void scale(float* x, float s, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, s, n);
  FANTAI_CUDA_LAUNCHED();
}

void softcap(float* x, float cap, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  softcap_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, cap, n);
  FANTAI_CUDA_LAUNCHED();
}

void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim, float* out,
               cudaStream_t stream) {
  if (n == 0) return;
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_kernel<T>
        <<<static_cast<unsigned>(n), 256, 0, stream>>>(ids, static_cast<const T*>(table), dim, out);
  });
  FANTAI_CUDA_LAUNCHED();
}

void add(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, y, n);
  FANTAI_CUDA_LAUNCHED();
}

void sum_partials(const float* gathered, float* out, int64_t n, int32_t world, cudaStream_t stream) {
  if (n == 0) return;
  sum_partials_kernel<<<grid_for(n, 256), 256, 0, stream>>>(gathered, out, n, world);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
