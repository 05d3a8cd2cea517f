// cuda: greedy sampling on the device (argmax per row), so a greedy step can return token ids
// instead of the full logits rows.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

constexpr int kThreads = 256;

// (value, index) with the CPU sampler's order: larger value wins, ties go to the lower index and
// NaN never wins (every comparison with NaN is false).
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi) || (bi < 0 && v == v);
}

// logprobs != nullptr adds the token's log-softmax and turns a row holding NaN into token -1
// (the CPU sampler refuses such a row too).
__global__ void argmax_kernel(const float* logits, int64_t vocab, int32_t* out, float* logprobs) {
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float bv = -INFINITY;
  int bi = -1;
  bool nan = false;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = l[i];
    nan |= v != v;
    if (better(v, static_cast<int>(i), bv, bi)) bv = v, bi = static_cast<int>(i);
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  __shared__ float best_value;
  __shared__ int best_index;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (si[w] >= 0 && better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    best_value = bv;
    best_index = bi < 0 ? 0 : bi;  // all NaN: token 0, as the CPU loop starting at 0 returns
    out[blockIdx.x] = best_index;
  }
  if (logprobs == nullptr) return;
  __syncthreads();
  // log-softmax of the winner: -log(sum(exp(l - max))), summed in a fixed order.
  __shared__ float scratch[32];
  const float mx = best_value;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) s += __expf(l[i] - mx);
  const float total = block_sum(s, scratch);
  const bool any_nan = __syncthreads_or(nan);
  if (threadIdx.x == 0) {
    logprobs[blockIdx.x] = -logf(total);
    if (any_nan) out[blockIdx.x] = -1;
  }
}

}  // namespace

void argmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  FANTAI_REQUIRE(vocab > 0 && vocab < (int64_t{1} << 31), "argmax: bad vocabulary size " << vocab);
  argmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, out, nullptr);
  FANTAI_CUDA_LAUNCHED();
}

void greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens, float* logprobs,
            cudaStream_t stream) {
  if (rows == 0) return;
  FANTAI_REQUIRE(vocab > 0 && vocab < (int64_t{1} << 31), "greedy: bad vocabulary size " << vocab);
  argmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, tokens, logprobs);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
