// model: how one tensor-parallel rank's share of the model is cut (heads, KV heads, MLP columns).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/model_config.h"

namespace fantai::model {

// Rank `rank` of `world` holds heads [rank * H/N, (rank + 1) * H/N), the KV heads those heads
// read (KV heads are replicated when N exceeds them, as vLLM does), 1/N of the MLP's intermediate
// columns, the vocab rows [rank * V/N, (rank + 1) * V/N) of the lm_head (integer division: the
// shards differ by at most one row when N does not divide V), and the whole embedding and norms.
struct TpShard {
  int rank = 0;
  int world = 1;
  ModelConfig full;      // the checkpoint's dims
  int32_t kv_head0 = 0;  // the first KV head of this rank (of the full model)
  bool active() const { return world > 1; }
  // This rank's lm_head rows (the vocab-parallel logits slice): [vocab0(), vocab0() + vocab_rows()).
  int64_t vocab0() const { return vocab_begin(rank); }
  int64_t vocab_rows() const { return vocab_begin(rank + 1) - vocab_begin(rank); }
  int64_t vocab_begin(int r) const { return static_cast<int64_t>(r) * full.vocab_size / world; }
};

// The tensor-parallel sizes this model can be split into (1 always).
std::vector<int> valid_tp_sizes(const ModelConfig& c);
// This rank's config: num_heads, num_kv_heads and intermediate_size of its share. Throws naming
// the valid sizes when the model cannot be split N ways.
ModelConfig shard_config(const ModelConfig& full, int rank, int world, TpShard* shard);

// Which part of checkpoint tensor `name` ([rows, cols] of the full model; cols 1 for vectors)
// this rank keeps: row ranges (first, count) in order, and one column range. zero: this rank
// holds zeros instead (o_proj's bias must enter the all-reduce sum once: rank 0 keeps it).
struct ShardSelection {
  bool whole = true;
  bool zero = false;
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t col0 = 0, cols = 0;
  int64_t num_rows() const {
    int64_t n = 0;
    for (const auto& r : rows) n += r.second;
    return n;
  }
};
ShardSelection select_shard(const TpShard& s, const std::string& name, int64_t rows, int64_t cols);

}  // namespace fantai::model
