// cuda: mixture-of-experts kernels — routing (softmax, top-k), and the gather / weighted
// scatter-add around each expert's linears (the backend runs those expert by expert).
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

// One block per row, the row's probabilities in shared memory; one thread does the arithmetic in
// the CPU backend's order (max, exp, the sum in expert order, p / sum, k selection passes with
// ties to the lower id), so the two backends route alike. Routing is a sliver of a layer's work.
__global__ void moe_route_kernel(const float* logits, int32_t num_experts, int32_t top_k, bool renormalize,
                                 int32_t* ids, float* weights) {
  extern __shared__ float p[];
  if (threadIdx.x != 0) return;
  const int64_t r = blockIdx.x;
  const float* l = logits + r * num_experts;
  float mx = l[0];
  for (int32_t e = 1; e < num_experts; ++e) mx = fmaxf(mx, l[e]);
  float sum = 0.f;
  for (int32_t e = 0; e < num_experts; ++e) {
    p[e] = expf(l[e] - mx);
    sum += p[e];
  }
  for (int32_t e = 0; e < num_experts; ++e) p[e] /= sum;
  const float taken = -INFINITY;
  int32_t* id = ids + r * top_k;
  float* w = weights + r * top_k;
  for (int32_t j = 0; j < top_k; ++j) {
    int32_t best = -1;
    for (int32_t e = 0; e < num_experts; ++e)
      if (p[e] != taken && (best < 0 || p[e] > p[best])) best = e;
    id[j] = best;
    w[j] = p[best];
    p[best] = taken;
  }
  if (renormalize) {
    float chosen = 0.f;
    for (int32_t j = 0; j < top_k; ++j) chosen += w[j];
    for (int32_t j = 0; j < top_k; ++j) w[j] /= chosen;
  }
}

// Block i copies the row of slot slots[i] (row slots[i] / top_k of x).
__global__ void moe_gather_kernel(const float* x, const int64_t* slots, int32_t top_k, int64_t hidden,
                                  float* xg) {
  const int64_t i = blockIdx.x;
  const float* src = x + slots[i] / top_k * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) xg[i * hidden + h] = src[h];
}

// Block i adds weights[s] * yg[i] into row s / top_k of out (s = slots[i]); the rows of one
// expert are distinct, and experts are launched in ascending id, so each row's sum has one order.
__global__ void moe_scatter_add_kernel(const float* yg, const int64_t* slots, const float* weights,
                                       int32_t top_k, int64_t hidden, float* out) {
  const int64_t i = blockIdx.x, s = slots[i];
  const float w = weights[s];
  float* dst = out + s / top_k * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
    dst[h] = __fadd_rn(dst[h], __fmul_rn(w, yg[i * hidden + h]));
}

}  // namespace

void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
               int32_t* ids, float* weights, cudaStream_t stream) {
  FANTAI_REQUIRE(rows >= 0 && num_experts > 0 && top_k > 0 && top_k <= num_experts && num_experts <= 8192,
                 "moe_route: bad shape rows=" << rows << " experts=" << num_experts << " top_k=" << top_k);
  if (rows == 0) return;
  FANTAI_REQUIRE(rows <= 2147483647, "moe_route: too many rows (" << rows << ")");
  moe_route_kernel<<<static_cast<unsigned>(rows), 32, num_experts * sizeof(float), stream>>>(
      logits, num_experts, top_k, renormalize, ids, weights);
  FANTAI_CUDA_LAUNCHED();
}

void moe_gather(const float* x, const int64_t* slots, int64_t m, int32_t top_k, int64_t hidden, float* xg,
                cudaStream_t stream) {
  if (m == 0) return;
  moe_gather_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(x, slots, top_k, hidden, xg);
  FANTAI_CUDA_LAUNCHED();
}

void moe_scatter_add(const float* yg, const int64_t* slots, const float* weights, int64_t m, int32_t top_k,
                     int64_t hidden, float* out, cudaStream_t stream) {
  if (m == 0) return;
  moe_scatter_add_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(yg, slots, weights, top_k, hidden,
                                                                       out);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
