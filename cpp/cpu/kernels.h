// cpu: the per-ISA kernel table, the attention work item, and the scalar reference (test oracle).
#pragma once

#include <cstdint>

#include "common/op_types.h"
#include "common/types.h"
#include "cpu/cpu_features.h"
#include "cpu/row_reduce.h"

namespace fantai::cpu {

// One unit of attention work: a tile of consecutive query rows of one sequence, against one KV
// head, for all query heads of that head's group. Results per (query row, head) do not depend on
// the tile: keys are visited block by block in position order with an online softmax.
struct AttnItem {
  const float* q = nullptr;  // first query row of the tile; row i at q + i * q_stride
  int64_t q_stride = 0;      // floats
  float* out = nullptr;      // [num_q, out_stride]; head h at out + h * head_dim
  int64_t out_stride = 0;
  const void* k_cache = nullptr;  // [num_blocks, num_kv_heads, block_size, head_dim] in kv_dtype
  const void* v_cache = nullptr;
  DType kv_dtype = DType::kF32;
  // int8 only: [num_blocks, num_kv_heads, block_size] f32 scales of k_cache / v_cache.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  const int32_t* block_table = nullptr;  // this sequence's physical block ids
  int32_t kv_head = 0;
  int32_t group = 1;      // query heads per KV head; heads kv_head*group .. +group-1
  int32_t num_q = 0;      // rows in the tile
  int32_t first_pos = 0;  // position of row 0; row i sits at first_pos + i
  float scale = 1.f;
  // Row i sees keys (first_pos + i - window, first_pos + i] (window 0: all up to its position);
  // blocks before the first row's window are never read (their table entries may be -1).
  int32_t window = 0;
  float softcap = 0.f;  // > 0: score = softcap * tanh(score / softcap), after the scale
  // A part of one row's keys (num_q 1; set by the backend when one sequence's decode has too few
  // items for its threads): only key partitions [part_begin, part_end) are visited, and each
  // partition's state is written, unmerged, to the attn_state_floats(head_dim) floats at
  // partial + h * partial_head_stride + (p - partial_part0) * attn_state_floats(head_dim) for
  // head h of the item; attention_merge then folds a row's partitions in order. nullptr: all keys.
  float* partial = nullptr;
  int64_t partial_head_stride = 0;
  int32_t partial_part0 = 0;
  int32_t part_begin = 0, part_end = 0;
};

// A row's keys are visited in partitions of this many keys (rounded down to whole blocks, at least
// one): each from a fresh online-softmax state, the states then folded in partition order. The
// partition is a function of the block size alone, so a row's bits are the same whether its
// partitions run in one item or are spread over threads.
constexpr int32_t kAttnPartitionKeys = 256;
inline int32_t attn_partition_blocks(int32_t block_size) {
  return block_size >= kAttnPartitionKeys ? 1 : kAttnPartitionKeys / block_size;
}
// One partition's state: max, sum, then head_dim unnormalised outputs.
inline int32_t attn_state_floats(int32_t head_dim) { return head_dim + 2; }

// Floats of scratch attention() needs for one item.
inline int64_t attn_scratch_floats(int32_t num_q, int32_t group, int32_t head_dim, int32_t block_size) {
  // Per (row, head): head_dim outputs + max + sum + one block's scores (padded to 16 lanes, plus
  // 16 of slack) + the block's softmax correction + the folded state of past partitions (head_dim
  // + 2); then one block of K and of V in f32; then the rows-in-lanes form's transposed queries
  // and scores (rows rounded up to 16 lanes, keys to a score tile of 8).
  const int64_t rows = static_cast<int64_t>(num_q) * group, lanes = rows + 16;
  return rows * (2 * head_dim + 5 + block_size + 32) + 2 * static_cast<int64_t>(block_size) * head_dim +
         lanes * (head_dim + block_size + 8) + 80;
}

// Row-level kernels; the backend splits work across threads and calls these per row / tile, so
// each row's arithmetic is the same whatever the batch and thread count (batch invariance).
struct KernelTable {
  const char* name;
  // y[r, j] = x[r, :] . w[j, :] (+ bias[j]) for r in [0, m), j in [j0, j1).
  // x: [m, k]; w: [n, k] in wt; y: [m, ldy]. Every y element uses one fixed k-order.
  void (*linear)(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m, int64_t ldy,
                 int64_t k, int64_t j0, int64_t j1);
  // linear on bf16 weights in the pair layout of this table's lanes (pack_bf16_pairs): the same
  // chains, so the same bits as linear on the row-major matrix.
  void (*linear_bf16_pairs)(const float* x, const void* w, const float* bias, float* y, int64_t m,
                            int64_t ldy, int64_t k, int64_t j0, int64_t j1);
  // linear on bf16 weights in the group layout of this table's lanes (pack_bf16_groups): the same
  // chains, so the same bits as linear on the row-major matrix.
  void (*linear_bf16_groups)(const float* x, const void* w, const float* bias, float* y, int64_t m,
                             int64_t ldy, int64_t k, int64_t j0, int64_t j1);
  // One row each. out may alias x.
  void (*rms_norm)(const float* x, const float* w, float* out, int64_t dim, float eps);
  void (*add_rms_norm)(float* residual, const float* x, const float* w, float* out, int64_t dim, float eps);
  // One token: x holds num_heads heads of head_dim at x + h * head_dim, the first rotary_dim of
  // each rotated; cs: [rotary_dim] cos|sin.
  void (*rope)(float* x, int32_t num_heads, int32_t head_dim, int32_t rotary_dim, const float* cs);
  // out[i] = silu(gate[i]) * up[i], i < n.
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // out[i] = gelu_pytorch_tanh(gate[i]) * up[i], i < n.
  void (*gelu_tanh_mul)(const float* gate, const float* up, float* out, int64_t n);
  void (*add)(float* x, const float* y, int64_t n);
  void (*to_f32)(const void* src, DType st, float* dst, int64_t n);
  // scratch: attn_scratch_floats(...) floats, 64-byte aligned.
  void (*attention)(const AttnItem& item, float* scratch);
  // One (row, head) of split items: its nparts partition states (attn_state_floats apart, in
  // partition order) folded in order and normalised into out[0, head_dim).
  void (*attention_merge)(const float* parts, int32_t nparts, int32_t head_dim, float* out);
  // The sampler's row reductions (row_reduce.h).
  MaxSumExp (*max_sum_exp)(const float* l, int32_t n);
  int32_t (*argmax)(const float* l, int32_t n);
  // Test hook for the fixed-order reductions: lanes = W; for the W vectors x[i*W .. (i+1)*W),
  // tree[i] = lane i of VT::hsum_w (all at once) and each[i] = VT::hsum of vector i alone.
  int lanes;
  void (*hsum_both)(const float* x, float* tree, float* each);
};

// w [n, k] bf16 into the pair layout for `lanes` lanes (KernelTable::lanes): in each row, every
// chunk of 2 * lanes elements below k - k % (2 * lanes) holds element i of its first half at 2i
// and of its second half at 2i + 1, so one 32-bit lane carries both and each half widens with one
// op; the rest of the row stays as it was. Same size as w.
void pack_bf16_pairs(const uint16_t* w, int64_t n, int64_t k, int lanes, uint16_t* dst);

// w [n, k] bf16 into the group layout for `lanes` lanes: rows in groups of kBf16GroupRows (the
// last one padded with zero rows), each group's rows interleaved chunk by chunk: chunk c (elements
// c * lanes .. + lanes - 1, below kv = k - k % lanes) of the group's row r at
// group_base + c * kBf16GroupRows * lanes + r * lanes, then each row's k - kv tail elements at
// group_base + kv * kBf16GroupRows + r * (k - kv). A decode reads a group as one stream, where
// row-major rows are kBf16GroupRows streams a few KiB long, too short for the hardware prefetcher.
// bf16_groups_bytes(n, k) bytes.
constexpr int kBf16GroupRows = 8;
inline int64_t bf16_groups_bytes(int64_t n, int64_t k) {
  return (n + kBf16GroupRows - 1) / kBf16GroupRows * kBf16GroupRows * k * 2;
}
void pack_bf16_groups(const uint16_t* w, int64_t n, int64_t k, int lanes, uint16_t* dst);

// nullptr where the file was not built for this target (non-x86).
const KernelTable* scalar_kernels();
const KernelTable* avx2_kernels();
const KernelTable* avx512_kernels();
// Table of a level; throws if the CPU cannot run it.
const KernelTable& kernels_for(Isa isa);

// Slow, obvious implementations of every Backend op (double accumulation): the test oracle.
namespace ref {
void linear(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k);
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps);
void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps);
void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
          int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t rotary_dim,
          const float* cos_sin);
void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                    const float* weight, float eps);
void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping, int64_t num_tokens,
              void* k_cache, void* v_cache, const KVLayout& layout);
void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
               const KVLayout& layout, const AttentionParams& p, int32_t num_q_heads, float scale,
               float* out);
void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter);
void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter);
void scale(float* x, float s, int64_t n);
void softcap(float* x, float cap, int64_t n);
void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim, float* out);
void add(float* x, const float* y, int64_t n);
// Mixture of experts (kernels_ref_moe.cpp): Backend::moe_route in double; Backend::moe_experts on
// dense matrices gate_up [num_experts, 2 * inter, hidden] and down [num_experts, hidden, inter]
// in dtype, each expert through ref::linear and ref::silu_mul, summed in double.
void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
               int32_t* ids, float* weights);
void moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows, int32_t top_k,
                 const void* gate_up, const void* down, DType dtype, int32_t num_experts, int64_t hidden,
                 int64_t inter, float* out);
// The sampler's row reductions in one lane, std::exp, summed in order.
MaxSumExp max_sum_exp(const float* l, int32_t n);
int32_t argmax(const float* l, int32_t n);
}  // namespace ref

}  // namespace fantai::cpu
