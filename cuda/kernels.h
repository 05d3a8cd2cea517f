// cuda: host-side launchers of the CUDA kernels, one group per file (norm.cu, elementwise.cu,
// gemm.cu, attention.cu, sampling.cu, quant.cu, moe.cu). All pointers are device pointers; every launcher only
// enqueues on `stream`. The backend (cuda_backend.cu) and the tests call these.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/op_types.h"

namespace fantai::cuda {

// norm.cu
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
              cudaStream_t stream);
void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps, cudaStream_t stream);
void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                    const float* weight, float eps, cudaStream_t stream);

// elementwise.cu
void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
          int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
          const float* cos_sin, cudaStream_t stream);
void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping, int64_t num_tokens,
              void* k_cache, void* v_cache, const KVLayout& layout, cudaStream_t stream);
void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, cudaStream_t stream);
void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, cudaStream_t stream);
void scale(float* x, float s, int64_t n, cudaStream_t stream);
void softcap(float* x, float cap, int64_t n, cudaStream_t stream);
void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim, float* out,
               cudaStream_t stream);
void add(float* x, const float* y, int64_t n, cudaStream_t stream);
// out[i] = gathered[0 * n + i] + gathered[1 * n + i] + ... + gathered[(world - 1) * n + i], added
// in that order (the NCCL all-reduce: every rank sums the gathered partials alike, as the MPI
// one does on the host). out may alias gathered's first partial.
void sum_partials(const float* gathered, float* out, int64_t n, int32_t world, cudaStream_t stream);

// gemm.cu. y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]).
void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, cudaStream_t stream);
// Rows up to this many take the GEMV kernels (f32 activations, 16-bit weights widened in
// registers); more rows take the tensor-core GEMM (activations rounded to the weight dtype).
constexpr int64_t kGemvMaxRows = 8;

// attention.cu. Decode rows (a sequence with one query token) take the paged decode kernel,
// split into kAttnPartition-token partitions plus a reduction when the context is longer than one
// partition; longer query runs take the prefill kernel. Both are launched over the whole batch and
// each skips the sequences that are not its own. p.window and p.logit_softcap as on the CPU (a
// window's partitions start at it). workspace: attention_workspace_bytes(...) bytes.
constexpr int32_t kAttnPartition = 512;
size_t attention_workspace_bytes(int32_t num_seqs, int32_t num_q_heads, int32_t max_context_len,
                                 int32_t head_dim);
void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
               const KVLayout& layout, const AttentionParams& p, int32_t num_q_heads, float scale, float* out,
               void* workspace, cudaStream_t stream);

// sampling.cu. out[r] = the index of the largest logits[r, :] (lowest index on ties, NaN never
// wins), like the CPU sampler's greedy path.
void argmax(const float* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream);
// argmax plus logprobs[r] = log_softmax(logits[r])[token]; a row holding NaN gets token -1.
void greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens, float* logprobs,
            cudaStream_t stream);
// Top-k / top-p draw, one per row, with the caller's uniform[r] in [0, 1): softmax(logits / T);
// keep the top_k first tokens of the order (larger logit first, ties by lower id, as the CPU
// sampler ranks; top_k <= 0: all); then the shortest prefix of that order whose probability mass
// reaches top_p of the top-k mass (the mass is a float sum, not the CPU sampler's integer one, so
// the token at that boundary can differ from the CPU's);
// out[r] = the first kept token in index order whose cumulative kept mass exceeds uniform[r]
// times the total kept mass. Same temperature, top_k and top_p for every row of the call.
void sample_top_k_top_p(const float* logits, int64_t rows, int64_t vocab, float temperature, int32_t top_k,
                        float top_p, const float* uniform, int32_t* out, cudaStream_t stream);
// The same rule with each row's own temperature (> 0), top_k and top_p (device arrays, checked by
// the caller), plus logprobs[r] = the token's log-softmax under the raw logits and out[r] = -1
// for a row holding NaN or +inf or only -inf (Backend::sample_top_k_top_p).
void sample_top_k_top_p_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                             const int32_t* top_k, const float* top_p, const float* uniform, int32_t* out,
                             float* logprobs, cudaStream_t stream);

// quant.cu: weight-only INT4 / INT8 group-quantized weights (Backend::pack_quant and friends).
// pack_quant validates and uploads a canonical host matrix into dst (quant_packed_bytes bytes of
// device memory) and returns the device view; linear_q / embedding_q take only that view.
constexpr int32_t kCudaQuantLayout = 0x43;  // 'C': 4-bit q two per byte, even column low
size_t quant_packed_bytes(const QuantMatrix& canonical);
QuantMatrix pack_quant(const QuantMatrix& canonical, void* dst, cudaStream_t stream);
void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy,
              cudaStream_t stream);
void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out, cudaStream_t stream);

// moe.cu: mixture of experts (Backend::moe_route and the two ends of Backend::moe_experts).
// moe_route: the CPU backend's arithmetic, one block per row. moe_gather: xg[i] = x[slots[i] /
// top_k]. moe_scatter_add: out[slots[i] / top_k] += weights[slots[i]] * yg[i], for the m rows of
// one expert (distinct output rows).
void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
               int32_t* ids, float* weights, cudaStream_t stream);
void moe_gather(const float* x, const int64_t* slots, int64_t m, int32_t top_k, int64_t hidden, float* xg,
                cudaStream_t stream);
void moe_scatter_add(const float* yg, const int64_t* slots, const float* weights, int64_t m, int32_t top_k,
                     int64_t hidden, float* out, cudaStream_t stream);

}  // namespace fantai::cuda
