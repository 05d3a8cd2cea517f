// cuda: sampling on the device. Greedy (argmax + its log-softmax) serves plain-greedy steps;
// top-k / top-p with a caller-given uniform serves steps whose every row is plain sampling
// (sampling::plain_row). The CPU sampler's penalties, bias, bans, min_p and grammar masks are not
// mirrored: such steps sample on the host.
#include <climits>
#include <cmath>

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

// ---- top-k / top-p ------------------------------------------------------------------------------
constexpr int kSampleThreads = 1024;

// Order-preserving map of a float to an unsigned key (larger float, larger key). -0 maps to +0's
// key: the CPU sampler sees them as a tie, broken by id.
__device__ __forceinline__ uint32_t key_of(float f) {
  const uint32_t u = __float_as_uint(f == 0.f ? 0.f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < (blockDim.x >> 5); ++w) m = fmaxf(m, scratch[w]);
  return m;
}

__device__ int block_count(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < (blockDim.x >> 5); ++w) total += scratch[w];
  return total;
}

// Per-row parameters: each pointer, when set, overrides the scalar for its row.
struct SampleArgs {
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  float temperature0 = 1.f;
  int32_t top_k0 = 0;
  float top_p0 = 1.f;
};

// One block per row. Keeps the top_k tokens of the order (larger logit first, ties by lower id),
// then the shortest prefix of those whose mass reaches top_p of theirs; draws the
// first kept token (index order) whose cumulative probability exceeds u. Every sum runs in a fixed
// order. Each cut is a bisection over the 32-bit keys, then over the ids of the tokens tied at
// it: at most 32 + 31 passes over the row each, no sort. logprobs != nullptr adds the token's
// raw log-softmax and turns a row with NaN, +inf or only -inf into token -1.
__global__ void __launch_bounds__(kSampleThreads)
    top_k_top_p_kernel(const float* logits, int64_t vocab, SampleArgs args, const float* uniform,
                       int32_t* out, float* logprobs) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  __shared__ float wsum[32];
  __shared__ int found;
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const int tid = threadIdx.x;
  const float inv_temp = 1.f / (args.temperature ? args.temperature[blockIdx.x] : args.temperature0);
  const int top_k = args.top_k ? args.top_k[blockIdx.x] : args.top_k0;
  const float top_p = args.top_p ? args.top_p[blockIdx.x] : args.top_p0;
  float mx = -INFINITY;
  bool bad = false;
  for (int64_t i = tid; i < vocab; i += blockDim.x) {
    mx = fmaxf(mx, l[i]);  // fmaxf drops NaN
    bad |= l[i] != l[i] || l[i] == INFINITY;
  }
  mx = block_max(mx, fscratch);
  const bool bad_row = __syncthreads_or(bad) || mx == -INFINITY;
  auto weight = [&](float v) { return v == v ? __expf((v - mx) * inv_temp) : 0.f; };

  uint32_t cut = 0;  // keep key > cut, and key == cut up to index tie_end
  int tie_end = INT_MAX;
  auto keep = [&](int64_t i, float v) {
    if (v != v) return false;
    const uint32_t k = key_of(v);
    return k > cut || (k == cut && i <= tie_end);
  };
  if (top_k > 0 && top_k < vocab) {
    uint32_t lo = 0, hi = 0xffffffffu;  // largest key with count(key >= it) >= top_k
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2 + 1;
      int c = 0;
      for (int64_t i = tid; i < vocab; i += blockDim.x) c += l[i] == l[i] && key_of(l[i]) >= mid;
      if (block_count(c, iscratch) >= top_k) lo = mid;
      else hi = mid - 1;
    }
    cut = lo;
    // Tokens tied at the cut: the host sampler keeps only the lowest ids among them, exactly k in all.
    int above = 0, at = 0;
    for (int64_t i = tid; i < vocab; i += blockDim.x) {
      if (l[i] != l[i]) continue;
      above += key_of(l[i]) > cut;
      at += key_of(l[i]) == cut;
    }
    above = block_count(above, iscratch);
    at = block_count(at, iscratch);
    if (above + at > top_k) {
      const int need = top_k - above;              // >= 1
      int a = 0, b = static_cast<int>(vocab) - 1;  // smallest id with `need` tied tokens at or before it
      while (a < b) {
        const int mid = a + (b - a) / 2;
        int c = 0;
        for (int64_t i = tid; i <= mid; i += blockDim.x) c += l[i] == l[i] && key_of(l[i]) == cut;
        if (block_count(c, iscratch) >= need) b = mid;
        else a = mid + 1;
      }
      tie_end = a;
    }
  }
  if (top_p < 1.f) {
    float kept = 0.f;
    for (int64_t i = tid; i < vocab; i += blockDim.x) kept += keep(i, l[i]) ? weight(l[i]) : 0.f;
    const float want = top_p * block_sum(kept, fscratch);
    uint32_t lo = cut, hi = 0xffffffffu;  // largest cut whose kept mass reaches want
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2 + 1;
      float m = 0.f;
      for (int64_t i = tid; i < vocab; i += blockDim.x) m += key_of(l[i]) >= mid ? weight(l[i]) : 0.f;
      if (block_sum(m, fscratch) >= want) lo = mid;
      else hi = mid - 1;
    }
    if (lo != cut) cut = lo, tie_end = INT_MAX;
    // The host sampler's prefix may end inside the tie at the cut: keep its lowest ids only, as
    // many as the mass needs.
    float above = 0.f;
    for (int64_t i = tid; i < vocab; i += blockDim.x) above += key_of(l[i]) > cut ? weight(l[i]) : 0.f;
    above = block_sum(above, fscratch);
    if (above < want) {
      int a = 0, b = static_cast<int>(min(static_cast<int64_t>(tie_end), vocab - 1));
      while (a < b) {
        const int mid = a + (b - a) / 2;
        float m = 0.f;
        for (int64_t i = tid; i <= mid; i += blockDim.x)
          m += keep(i, l[i]) && key_of(l[i]) == cut ? weight(l[i]) : 0.f;
        if (above + block_sum(m, fscratch) >= want) b = mid;
        else a = mid + 1;
      }
      tie_end = a;
    }
  }
  float z = 0.f;
  int last = -1;
  for (int64_t i = tid; i < vocab; i += blockDim.x) {
    if (keep(i, l[i])) z += weight(l[i]), last = static_cast<int>(i);
  }
  const float target = uniform[blockIdx.x] * block_sum(z, fscratch);
  for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  __syncthreads();
  if ((tid & 31) == 0) iscratch[tid >> 5] = last;
  __syncthreads();
  int last_kept = -1;
  for (int w = 0; w < (blockDim.x >> 5); ++w) last_kept = max(last_kept, iscratch[w]);
  if (tid == 0) found = INT_MAX;
  // Inclusive scan in index order, one block-wide chunk at a time.
  const int lane = tid & 31, warp = tid >> 5;
  float carry = 0.f;
  for (int64_t c0 = 0; c0 < vocab; c0 += blockDim.x) {
    const int64_t i = c0 + tid;
    const bool kept_i = i < vocab && keep(i, l[i]);
    float v = kept_i ? weight(l[i]) : 0.f;
    for (int o = 1; o < 32; o <<= 1) {
      const float up = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += up;
    }
    __syncthreads();
    if (lane == 31) wsum[warp] = v;
    __syncthreads();
    if (warp == 0) {
      float t = lane < (blockDim.x >> 5) ? wsum[lane] : 0.f;
      for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, t, o);
        if (lane >= o) t += up;
      }
      wsum[lane] = t;
    }
    __syncthreads();
    const float prefix = carry + v + (warp > 0 ? wsum[warp - 1] : 0.f);
    if (kept_i && prefix > target) atomicMin(&found, static_cast<int>(i));
    carry += wsum[(blockDim.x >> 5) - 1];
    __syncthreads();
    if (found != INT_MAX) break;
  }
  const int token = found != INT_MAX ? found : (last_kept >= 0 ? last_kept : 0);
  if (logprobs == nullptr) {
    if (tid == 0) out[blockIdx.x] = token;
    return;
  }
  // The raw log-softmax (no temperature), summed in a fixed order like the greedy kernel's.
  float s = 0.f;
  for (int64_t i = tid; i < vocab; i += blockDim.x) s += __expf(l[i] - mx);
  const float total = block_sum(s, fscratch);
  if (tid == 0) {
    out[blockIdx.x] = bad_row ? -1 : token;
    logprobs[blockIdx.x] = bad_row ? 0.f : l[token] - mx - logf(total);
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

namespace fantai::cuda {

void sample_top_k_top_p(const float* logits, int64_t rows, int64_t vocab, float temperature, int32_t top_k,
                        float top_p, const float* uniform, int32_t* out, cudaStream_t stream) {
  if (rows == 0) return;
  FANTAI_REQUIRE(vocab > 0 && vocab < (int64_t{1} << 31), "sample: bad vocabulary size " << vocab);
  FANTAI_REQUIRE(temperature > 0.f && std::isfinite(temperature), "sample: temperature must be > 0");
  FANTAI_REQUIRE(top_p > 0.f && top_p <= 1.f, "sample: top_p must be in (0, 1]");
  SampleArgs args;
  args.temperature0 = temperature, args.top_k0 = top_k, args.top_p0 = top_p;
  top_k_top_p_kernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, stream>>>(logits, vocab, args, uniform,
                                                                                 out, nullptr);
  FANTAI_CUDA_LAUNCHED();
}

void sample_top_k_top_p_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                             const int32_t* top_k, const float* top_p, const float* uniform, int32_t* out,
                             float* logprobs, cudaStream_t stream) {
  if (rows == 0) return;
  FANTAI_REQUIRE(vocab > 0 && vocab < (int64_t{1} << 31), "sample: bad vocabulary size " << vocab);
  SampleArgs args;
  args.temperature = temperature, args.top_k = top_k, args.top_p = top_p;
  top_k_top_p_kernel<<<static_cast<unsigned>(rows), kSampleThreads, 0, stream>>>(logits, vocab, args, uniform,
                                                                                 out, logprobs);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
