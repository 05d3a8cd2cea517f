// common: the plain data the model, the backends and the kernels hand each other across the seam
// (no behaviour beyond sizes): the paged KV layout, a step's attention metadata, a quantized
// matrix, a mixture-of-experts layer's expert matrices, and the sampler's row-reduction result.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace fantai {

// Shape of one layer's paged K (or V) cache. Layout: [num_blocks, num_kv_heads, block_size, head_dim],
// so one head's tokens of one block are contiguous (head_dim-wide rows, block_size of them).
// slot = block_id * block_size + offset_in_block.
//
// int8: the same layout of int8 values, then (at scales_offset(), in the same buffer) f32 scales
// [num_blocks, num_kv_heads, block_size]: one per (slot, kv head), x ~= q * scale.
// Why per token and not per block: a per-block scale must grow when a later token of the block
// has a larger max, which requantizes the earlier tokens; their cached values would then depend
// on how tokens were split into steps (chunked prefill, batching), and the engine promises that
// batching and chunking never change tokens. A per-token scale is fixed when the token is stored.
struct KVLayout {
  int32_t num_blocks = 0;
  int32_t block_size = 16;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kF32;

  int64_t slots() const { return static_cast<int64_t>(num_blocks) * block_size; }
  // Bytes of the values (all blocks), and where the int8 scales start (64-byte aligned).
  size_t data_bytes() const {
    return static_cast<size_t>(slots()) * num_kv_heads * head_dim * dtype_size(dtype);
  }
  size_t scales_offset() const { return (data_bytes() + 63) & ~size_t{63}; }
  size_t scale_bytes() const {
    return dtype == DType::kI8 ? static_cast<size_t>(slots()) * num_kv_heads * sizeof(float) : 0;
  }
  // Bytes of one layer's K (or V) buffer, scales included.
  size_t bytes() const { return dtype == DType::kI8 ? scales_offset() + scale_bytes() : data_bytes(); }
  // Per block: bytes of values and of scales (each contiguous within its region).
  size_t block_data_bytes() const {
    return static_cast<size_t>(num_kv_heads) * block_size * head_dim * dtype_size(dtype);
  }
  size_t block_scale_bytes() const {
    return dtype == DType::kI8 ? static_cast<size_t>(num_kv_heads) * block_size * sizeof(float) : 0;
  }
};

// Attention metadata, built once per step by the model runner and handed to every layer.
// The batch is flattened: sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]).
// Its KV after this step's store holds context_lens[s] tokens; query row j of sequence s sits at
// position context_lens[s] - q_len_s + j and attends causally to KV positions <= its own.
// With window W > 0 the query at position p sees only keys j with p - W < j <= p, and the
// blocks wholly before the window of a sequence's first query are never read: their entries in
// block_tables may be -1 (the block manager gave them back). A model whose layers differ in
// window has one AttentionParams per window (its own block tables) for the same queries.
struct AttentionParams {
  int32_t num_seqs = 0;
  int32_t num_tokens = 0;                 // cu_seqlens_q[num_seqs]
  int32_t max_query_len = 0;              // max over s of q_len_s
  int32_t max_context_len = 0;            // max over s of context_lens[s]
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs], tokens, >= q_len_s
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq] physical block ids
  int32_t max_blocks_per_seq = 0;
  int32_t window = 0;          // 0: full causal attention
  float logit_softcap = 0.0f;  // > 0: score = cap * tanh(score / cap) after the scale, before the mask
};

// Index of the first block a query at position `pos` reads (0 without a window).
inline int32_t first_visible_block(int32_t pos, int32_t window, int32_t block_size) {
  return window > 0 && pos - window + 1 > 0 ? (pos - window + 1) / block_size : 0;
}

// A group-quantized matrix of `rows` (outputs) x `cols` (inputs), as plain pointers. Element
//   w[r, c] = scale[r, g] * float(q[r, c] - zero[r, g]) (+ min[r, g] when min != nullptr),
//   g = c / group,
// evaluated as one multiply and then one add, in f32, so every supported file format (GGUF
// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K, IQ4_NL/IQ4_XS, GPTQ, AWQ, online RTN)
// dequantizes bit-exactly. The last group
// may be partial; group == cols is per-channel. perm (GPTQ act-order): stored column c multiplies
// input x[perm[c]].
// Two layouts share the struct: canonical (host, layout == 0: q one byte per element, ld = cols
// bytes per row; zero nullptr means zero_point for every group) and a backend's packed layout
// (layout != 0, made by Backend::pack_quant; only that backend reads `data`).
struct QuantMatrix {
  int32_t bits = 8;   // 4 or 8: q values are < 2^bits
  int32_t group = 0;  // columns per group
  int64_t rows = 0;
  int64_t cols = 0;
  int32_t layout = 0;  // 0 canonical; otherwise owned by the backend that packed it
  int64_t ld = 0;      // bytes per row of data
  const void* data = nullptr;
  const float* scale = nullptr;   // [rows, ngroups()]
  const uint8_t* zero = nullptr;  // [rows, ngroups()] or nullptr
  int32_t zero_point = 0;         // the zero of every group when zero == nullptr
  const float* min = nullptr;     // [rows, ngroups()] or nullptr
  const int32_t* perm = nullptr;  // [cols] or nullptr
  // Optional factoring of scale and min, as GGUF K-quants and IQ4_XS store them (a super-block
  // scale times a small integer per group): when fgroups > 0,
  //   scale[r, g] == fscale[r, g / fgroups] * float(iscale[r, g])   (one f32 multiply, exactly)
  // and, when min, min[r, g] == fmin[r, g / fgroups] * float(imin[r, g]). A canonical matrix
  // carries it beside scale / min (which stay complete), so a backend may keep just the factors.
  int32_t fgroups = 0;             // groups per super-block (ngroups() is a multiple); 0: none
  const float* fscale = nullptr;   // [rows, ngroups() / fgroups]
  const int8_t* iscale = nullptr;  // [rows, ngroups()]
  const float* fmin = nullptr;     // [rows, ngroups() / fgroups] when min
  const int8_t* imin = nullptr;    // [rows, ngroups()] when min
  // A backend's packed layout only (canonical matrices leave it null): when set, the packed values
  // are 4-bit indices and value i stands for codebook[i], 16 bytes (GGUF IQ4's non-linear levels
  // are 16 bytes < 256, kept at the file's 4 bits per weight this way).
  const uint8_t* codebook = nullptr;
  int64_t ngroups() const { return group > 0 ? (cols + group - 1) / group : 0; }
};

// One linear of one expert for Backend::moe_experts: rows that came dense (`dense`, in
// MoeExperts::dtype, row-major or in the backend's packed layout when MoeExperts::packed; nullptr
// when none did) and up to two quantized row parts (packed by the backend's pack_quant), part i
// writing output columns [part_row0[i], part_row0[i] + parts[i].rows). Two, because a GGUF may
// store an expert's gate and up in different formats.
struct MoeLinear {
  const void* dense = nullptr;
  int32_t num_parts = 0;
  QuantMatrix parts[2];
  int64_t part_row0[2] = {0, 0};
};

// One expert's MLP: gate_up [2 * inter, hidden] with the gate rows first, down [hidden, inter].
struct MoeExpert {
  MoeLinear gate_up;
  MoeLinear down;
};

// The experts of one mixture-of-experts layer; `experts` is host memory (descriptors only: the
// matrices live in the backend's memory).
struct MoeExperts {
  int32_t num_experts = 0;
  int64_t hidden = 0;
  int64_t inter = 0;
  DType dtype = DType::kF32;  // of the dense matrices
  bool packed = false;        // the dense matrices are in the backend's packed layout
  const MoeExpert* experts = nullptr;
};

// The grouping every backend's moe_experts starts from (host memory): checks that each of the
// rows * top_k ids is in [0, num_experts) and that no row names an expert twice (InvalidArgument
// otherwise), then sorts the slots s = row * top_k + j by expert, stably: expert e's slots are
// slots[offsets[e] .. offsets[e + 1]), rows ascending. offsets: num_experts + 1 entries.
void moe_group_slots(const int32_t* ids, int64_t rows, int32_t top_k, int32_t num_experts, int64_t* offsets,
                     int64_t* slots);

// Throws InvalidArgument unless `m` is a well-formed canonical matrix: bits 4 or 8, q < 2^bits,
// group > 0 and a multiple of 16 or >= cols (no vector step straddles groups), scale present,
// perm a permutation of [0, cols).
void check_quant_matrix(const QuantMatrix& m);

// Largest non-NaN value of a logits row (-inf when all are -inf / NaN) and the sum of
// exp(l - max); the sum is NaN when the row holds a NaN or max is +inf.
struct MaxSumExp {
  float max = 0.0f;
  double sum = 0.0;
};

}  // namespace fantai
