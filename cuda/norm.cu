// cuda: RMSNorm and the fused residual-add + RMSNorm, one block per row.
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

}  // namespace

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
