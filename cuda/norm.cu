// cuda: RMSNorm, the fused residual-add + RMSNorm (one block per row) and per-head RMSNorm.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

constexpr int kThreads = 256;

// Each thread owns the columns i = tid + j * blockDim.x for both passes, so `out` may alias `x`:
// a thread overwrites only what it alone read.
template <bool kAdd>
__global__ void rms_norm_kernel(float* residual, const float* x, const float* weight, float* out, int64_t dim,
                                float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* rr = kAdd ? residual + row * dim : nullptr;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = xr[i];
    if (kAdd) {
      v += rr[i];
      rr[i] = v;
    }
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(dim) + eps);
  const float* src = kAdd ? rr : xr;
  float* o = out + row * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = src[i] * inv * weight[i];
}

// One block per (token, head): Qwen3's / Gemma 3's q_norm and k_norm, in place.
__global__ void rms_norm_heads_kernel(float* x, int64_t stride, int32_t num_heads, int32_t head_dim,
                                      const float* weight, float eps) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
  float* row = x + t * stride + h * head_dim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) ss += row[i] * row[i];
  const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(head_dim) + eps);
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) row[i] = row[i] * inv * weight[i];
}

}  // namespace

void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                    const float* weight, float eps, cudaStream_t stream) {
  if (num_tokens == 0) return;
  rms_norm_heads_kernel<<<static_cast<unsigned>(num_tokens * num_heads), 64, 0, stream>>>(
      x, stride, num_heads, head_dim, weight, eps);
  FANTAI_CUDA_LAUNCHED();
}

void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream) {
  if (rows == 0) return;
  rms_norm_kernel<false>
      <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(nullptr, x, weight, out, dim, eps);
  FANTAI_CUDA_LAUNCHED();
}

void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rms_norm_kernel<true>
      <<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(residual, x, weight, out, dim, eps);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
