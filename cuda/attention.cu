// cuda: paged attention over the [num_blocks, kv_heads, block_size, head_dim] cache.
//
// Decode (a sequence with one query token): one block per (partition of kAttnPartition tokens,
// KV head, sequence) that serves all the query heads of the group, so each K/V row is read once
// per group. Warps take tokens round-robin with an online softmax each, then the block merges its
// warps. A sequence whose context fits one partition writes its output directly (the "v1" single
// pass); longer ones write per-partition (max, sum, unnormalised output) and a reduction kernel
// merges them (the "v2" split-K that keeps the GPU busy at batch 1 x 32k).
// Prefill / mixed (query runs > 1 token): one block per (16-query tile, query head, sequence);
// K/V are staged in shared memory 32 tokens at a time, lane j scores token j, causal masking by
// absolute position, so cached prefix blocks and the new chunk are one range [0, pos].
// Whether a sequence takes the decode or the prefill kernel and how its partitions fall depend only
// on that sequence, never on the rest of the batch.
// Sliding window W: a decode's partitions start at its window ((pos - W, pos]), a prefill tile's
// chunks at its first row's, and each row masks the keys before its own window; blocks before
// them are never read (their table entries may be -1). The logit soft-cap maps each scaled score
// (cap * tanh(score / cap)) before the mask.
#include <cfloat>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

constexpr int kMaxHeadDim = 256;
// Head dims per lane (DPL) is a template parameter, 2, 4 or 8 (head_dim up to 64, 128, 256), so
// registers hold only what the head needs.
constexpr int kTokensPerLoad = 4;  // decode: K/V rows a warp loads before using any of them
constexpr int kMaxGroup = 8;       // query heads one decode block serves
constexpr int kDecodeWarps = 4;
constexpr int kPrefillRows = 16, kPrefillWarps = 4, kRowsPerWarp = kPrefillRows / kPrefillWarps;
constexpr int kChunk = 32;

struct DecodeArgs {
  const float* q;
  int64_t q_stride;
  const int32_t* cu_seqlens_q;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int32_t max_blocks_per_seq;
  int32_t block_size, num_kv_heads, head_dim, num_q_heads, group, head_chunks, max_parts;
  int32_t window;  // 0: full attention
  float scale, softcap;
  float* out;
  float* part_out;  // [num_seqs, num_q_heads, max_parts, head_dim]
  float* part_ml;   // [num_seqs, num_q_heads, max_parts, 2] (max, sum)
};

// The first key a query at `pos` sees.
__device__ __forceinline__ int window_start(const DecodeArgs& a, int pos) {
  return a.window > 0 ? max(0, pos - a.window + 1) : 0;
}

__device__ __forceinline__ float softcap(const DecodeArgs& a, float score) {
  return a.softcap > 0.f ? a.softcap * tanhf(score / a.softcap) : score;
}

template <typename T, int DPL>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_kernel(DecodeArgs a, const T* __restrict__ kc, const T* __restrict__ vc) {
  const int s = blockIdx.z;
  const int q_row = a.cu_seqlens_q[s];
  if (a.cu_seqlens_q[s + 1] - q_row != 1) return;  // prefill_kernel's sequence
  const int ctx = a.context_lens[s];
  const int lo = window_start(a, ctx - 1);
  const int part = blockIdx.x, start = lo + part * kAttnPartition;
  if (start >= ctx) return;
  const int end = min(ctx, start + kAttnPartition);
  const int nparts = (ctx - lo + kAttnPartition - 1) / kAttnPartition;
  const int kvh = blockIdx.y / a.head_chunks, chunk = blockIdx.y % a.head_chunks;
  const int h0 = kvh * a.group + chunk * kMaxGroup;
  const int nh = min(kMaxGroup, a.group - chunk * kMaxGroup);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hd = a.head_dim;

  float qr[kMaxGroup][DPL];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g)
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      qr[g][i] = g < nh && d < hd ? a.q[q_row * a.q_stride + (h0 + g) * hd + d] * a.scale : 0.f;
    }
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][DPL];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
  // Each warp takes kTokensPerLoad consecutive tokens at a time and issues all their loads
  // before the first use, so several rows are in flight per warp (decode is load-latency bound).
  for (int t0 = start + warp * kTokensPerLoad; t0 < end; t0 += kDecodeWarps * kTokensPerLoad) {
    float kr[kTokensPerLoad][DPL], vr[kTokensPerLoad][DPL];
#pragma unroll
    for (int u = 0; u < kTokensPerLoad; ++u) {
      const int t = t0 + u;
      const int64_t row = t < end ? ((static_cast<int64_t>(table[t / a.block_size]) * a.num_kv_heads + kvh) *
                                         a.block_size +
                                     t % a.block_size) *
                                        hd
                                  : 0;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        kr[u][i] = t < end && d < hd ? to_f32(kc[row + d]) : 0.f;
        vr[u][i] = t < end && d < hd ? to_f32(vc[row + d]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kTokensPerLoad; ++u) {
      if (t0 + u >= end) break;
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= nh) break;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dot = fmaf(qr[g][i], kr[u][i], dot);
        const float score = softcap(a, warp_sum(dot));
        const float m_new = fmaxf(m[g], score);
        const float c = __expf(m[g] - m_new), p = __expf(score - m_new);
        l[g] = l[g] * c + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = fmaf(p, vr[u][i], acc[g][i] * c);
        m[g] = m_new;
      }
    }
  }
  // Merge the warps in index order.
  __shared__ float sm[kDecodeWarps][kMaxGroup], sl[kDecodeWarps][kMaxGroup];
  __shared__ float sacc[kDecodeWarps][kMaxGroup][kMaxHeadDim];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= nh) break;
    if (lane == 0) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) sacc[warp][g][d] = acc[g][i];
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < nh * hd; j += blockDim.x) {
    const int g = j / hd, d = j % hd;
    float mx = -FLT_MAX;
    for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, sm[w][g]);
    float sum = 0.f, o = 0.f;
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float c = __expf(sm[w][g] - mx);
      sum = fmaf(sl[w][g], c, sum);
      o = fmaf(sacc[w][g][d], c, o);
    }
    const int h = h0 + g;
    if (nparts == 1) {
      a.out[(static_cast<int64_t>(q_row) * a.num_q_heads + h) * hd + d] = o / sum;
    } else {
      const int64_t slot = (static_cast<int64_t>(s) * a.num_q_heads + h) * a.max_parts + part;
      a.part_out[slot * hd + d] = o;
      if (d == 0) {
        a.part_ml[slot * 2] = mx;
        a.part_ml[slot * 2 + 1] = sum;
      }
    }
  }
}

// One block per (query head, sequence) with more than one partition: merges them in order.
__global__ void decode_reduce_kernel(DecodeArgs a) {
  const int s = blockIdx.y, h = blockIdx.x;
  const int q_row = a.cu_seqlens_q[s];
  if (a.cu_seqlens_q[s + 1] - q_row != 1) return;
  const int ctx = a.context_lens[s];
  const int nparts = (ctx - window_start(a, ctx - 1) + kAttnPartition - 1) / kAttnPartition;
  if (nparts <= 1) return;
  const int64_t base = (static_cast<int64_t>(s) * a.num_q_heads + h) * a.max_parts;
  float mx = -FLT_MAX;
  for (int p = 0; p < nparts; ++p) mx = fmaxf(mx, a.part_ml[(base + p) * 2]);
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float sum = 0.f, o = 0.f;
    for (int p = 0; p < nparts; ++p) {
      const float c = __expf(a.part_ml[(base + p) * 2] - mx);
      sum = fmaf(a.part_ml[(base + p) * 2 + 1], c, sum);
      o = fmaf(a.part_out[(base + p) * a.head_dim + d], c, o);
    }
    a.out[(static_cast<int64_t>(q_row) * a.num_q_heads + h) * a.head_dim + d] = o / sum;
  }
}

template <typename T, int DPL>
__global__ void __launch_bounds__(kPrefillWarps * 32)
    prefill_kernel(DecodeArgs a, const T* __restrict__ kc, const T* __restrict__ vc) {
  extern __shared__ float smem[];
  const int s = blockIdx.z, h = blockIdx.y;
  const int q0 = a.cu_seqlens_q[s], qlen = a.cu_seqlens_q[s + 1] - q0;
  if (qlen <= 1) return;  // decode_kernel's sequence
  const int r0 = blockIdx.x * kPrefillRows;
  if (r0 >= qlen) return;
  const int hd = a.head_dim, kvh = h / a.group, ctx = a.context_lens[s];
  const int rows = min(kPrefillRows, qlen - r0);
  const int max_pos = ctx - qlen + r0 + rows - 1;
  const int min_key = window_start(a, ctx - qlen + r0);  // the first row's window
  float* qs = smem;                                      // [kPrefillRows][hd], scaled
  float* ks = qs + kPrefillRows * hd;  // [kChunk][hd + 1]: lane j reads row j, no bank clash
  float* vs = ks + kChunk * (hd + 1);  // [kChunk][hd]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kPrefillRows * hd; i += blockDim.x) {
    const int r = i / hd, d = i % hd;
    qs[i] = r < rows ? a.q[static_cast<int64_t>(q0 + r0 + r) * a.q_stride + h * hd + d] * a.scale : 0.f;
  }
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -FLT_MAX;
    l[rr] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[rr][i] = 0.f;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
  for (int c0 = min_key / kChunk * kChunk; c0 <= max_pos; c0 += kChunk) {
    __syncthreads();  // the previous chunk (and q on the first pass) is fully consumed / written
    for (int i = threadIdx.x; i < kChunk * hd; i += blockDim.x) {
      const int t = i / hd, d = i % hd, pos = c0 + t;
      float kv = 0.f, vv = 0.f;
      if (pos <= max_pos && pos >= min_key) {
        const int64_t row = ((static_cast<int64_t>(table[pos / a.block_size]) * a.num_kv_heads + kvh) *
                                 a.block_size +
                             pos % a.block_size) *
                            hd;
        kv = to_f32(kc[row + d]);
        vv = to_f32(vc[row + d]);
      }
      ks[t * (hd + 1) + d] = kv;
      vs[t * hd + d] = vv;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      if (r >= rows) break;
      const int pos = ctx - qlen + r0 + r;
      if (c0 > pos) continue;  // this row is done; later rows of the warp sit further on
      const int row_lo = window_start(a, pos);
      if (c0 + kChunk <= row_lo) continue;  // before this row's window
      const float* qv = qs + r * hd;
      const float* kv = ks + lane * (hd + 1);
      const bool see = c0 + lane <= pos && c0 + lane >= row_lo;
      float score = -FLT_MAX;
      if (see) {
        float dot = 0.f;
        for (int d = 0; d < hd; ++d) dot = fmaf(qv[d], kv[d], dot);
        score = softcap(a, dot);
      }
      const float m_new = fmaxf(m[rr], warp_max(score));
      const float p = see ? __expf(score - m_new) : 0.f;
      const float c = __expf(m[rr] - m_new);
      l[rr] = l[rr] * c + warp_sum(p);
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[rr][i] *= c;
      for (int t = 0; t < kChunk; ++t) {
        const float pt = __shfl_sync(0xffffffffu, p, t);
        const float* vrow = vs + t * hd;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          const int d = lane + 32 * i;
          if (d < hd) acc[rr][i] = fmaf(pt, vrow[d], acc[rr][i]);
        }
      }
      m[rr] = m_new;
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = warp * kRowsPerWarp + rr;
    if (r >= rows) break;
    float* o = a.out + (static_cast<int64_t>(q0 + r0 + r) * a.num_q_heads + h) * hd;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) o[d] = acc[rr][i] / l[rr];
    }
  }
}

int max_parts_for(int32_t max_context_len) {
  return std::max(1, (max_context_len + kAttnPartition - 1) / kAttnPartition);
}

template <typename T, int DPL>
void launch_attention(const DecodeArgs& a, const AttentionParams& p, const KVLayout& L, int32_t num_q_heads,
                      const void* k_cache, const void* v_cache, cudaStream_t stream) {
  const T* kc = static_cast<const T*>(k_cache);
  const T* vc = static_cast<const T*>(v_cache);
  // Decode rows: always launched (it returns at once for prefill sequences); the planner does
  // not read device metadata, so it cannot know which sequences are which.
  const dim3 dgrid(a.max_parts, L.num_kv_heads * a.head_chunks, p.num_seqs);
  decode_kernel<T, DPL><<<dgrid, kDecodeWarps * 32, 0, stream>>>(a, kc, vc);
  FANTAI_CUDA_LAUNCHED();
  if (a.max_parts > 1) {
    decode_reduce_kernel<<<dim3(num_q_heads, p.num_seqs), 128, 0, stream>>>(a);
    FANTAI_CUDA_LAUNCHED();
  }
  if (p.max_query_len > 1) {
    const int smem = (kPrefillRows * L.head_dim + kChunk * (L.head_dim + 1) + kChunk * L.head_dim) *
                     static_cast<int>(sizeof(float));
    FANTAI_CUDA_CHECK(
        cudaFuncSetAttribute(prefill_kernel<T, DPL>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 pgrid((p.max_query_len + kPrefillRows - 1) / kPrefillRows, num_q_heads, p.num_seqs);
    prefill_kernel<T, DPL><<<pgrid, kPrefillWarps * 32, smem, stream>>>(a, kc, vc);
    FANTAI_CUDA_LAUNCHED();
  }
}

}  // namespace

size_t attention_workspace_bytes(int32_t num_seqs, int32_t num_q_heads, int32_t max_context_len,
                                 int32_t head_dim) {
  const int parts = max_parts_for(max_context_len);
  if (parts <= 1) return 0;
  return static_cast<size_t>(num_seqs) * num_q_heads * parts * (head_dim + 2) * sizeof(float);
}

void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache, const KVLayout& L,
               const AttentionParams& p, int32_t num_q_heads, float scale, float* out, void* workspace,
               cudaStream_t stream) {
  if (p.num_seqs == 0 || p.num_tokens == 0) return;
  FANTAI_REQUIRE(L.head_dim <= kMaxHeadDim && L.head_dim % 2 == 0,
                 "CUDA attention supports even head_dim up to " << kMaxHeadDim << ", got " << L.head_dim);
  FANTAI_REQUIRE(L.num_kv_heads > 0 && num_q_heads % L.num_kv_heads == 0,
                 "num_q_heads " << num_q_heads << " is not a multiple of num_kv_heads " << L.num_kv_heads);
  FANTAI_REQUIRE(p.num_seqs <= 65535, "CUDA attention takes at most 65535 sequences per step");
  DecodeArgs a{};
  a.q = q;
  a.q_stride = q_stride;
  a.cu_seqlens_q = p.cu_seqlens_q;
  a.context_lens = p.context_lens;
  a.block_tables = p.block_tables;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.block_size = L.block_size;
  a.num_kv_heads = L.num_kv_heads;
  a.head_dim = L.head_dim;
  a.num_q_heads = num_q_heads;
  a.group = num_q_heads / L.num_kv_heads;
  a.head_chunks = (a.group + kMaxGroup - 1) / kMaxGroup;
  a.max_parts = max_parts_for(p.max_context_len);
  a.window = p.window;
  a.scale = scale;
  a.softcap = p.logit_softcap;
  a.out = out;
  a.part_out = static_cast<float*>(workspace);
  a.part_ml = a.part_out + static_cast<size_t>(p.num_seqs) * num_q_heads * a.max_parts * L.head_dim;
  FANTAI_CHECK(a.max_parts == 1 || workspace != nullptr, "attention workspace missing");
  const int dpl = L.head_dim <= 64 ? 2 : L.head_dim <= 128 ? 4 : 8;
  dispatch_dtype(L.dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (dpl == 2) {
      launch_attention<T, 2>(a, p, L, num_q_heads, k_cache, v_cache, stream);
    } else if (dpl == 4) {
      launch_attention<T, 4>(a, p, L, num_q_heads, k_cache, v_cache, stream);
    } else {
      launch_attention<T, 8>(a, p, L, num_q_heads, k_cache, v_cache, stream);
    }
  });
}

}  // namespace fantai::cuda
