// model: the tensor-parallel split of a decoder: sizes that work, and each tensor's share.
#include "model/tp_shard.h"

#include <sstream>

#include "common/check.h"

namespace fantai::model {

namespace {
bool splits(const ModelConfig& c, int n) {
  const bool kv_ok = c.num_kv_heads % n == 0 || n % c.num_kv_heads == 0;
  // Mixture of experts: every expert is split like the dense MLP (1/N of its columns per rank).
  const bool experts_ok = c.num_experts == 0 || c.moe_intermediate_size % n == 0;
  return n >= 1 && c.num_heads % n == 0 && kv_ok && c.intermediate_size % n == 0 && experts_ok;
}

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }
}  // namespace

std::vector<int> valid_tp_sizes(const ModelConfig& c) {
  std::vector<int> sizes;
  for (int n = 1; n <= c.num_heads; ++n)
    if (splits(c, n)) sizes.push_back(n);
  return sizes;
}

ModelConfig shard_config(const ModelConfig& full, int rank, int world, TpShard* shard) {
  if (!splits(full, world)) {
    std::ostringstream sizes;
    for (int n : valid_tp_sizes(full)) sizes << (sizes.tellp() > 0 ? ", " : "") << n;
    FANTAI_THROW("tensor_parallel_size " << world << " cannot split this model (" << full.num_heads
                                         << " attention heads, " << full.num_kv_heads << " KV heads, "
                                         << full.intermediate_size
                                         << " MLP columns); valid sizes: " << sizes.str());
  }
  ModelConfig c = full;
  c.num_heads = full.num_heads / world;
  c.intermediate_size = full.intermediate_size / world;
  c.moe_intermediate_size = full.moe_intermediate_size / world;
  // KV heads: split when there are enough, else every rank holds the one its heads read.
  c.num_kv_heads = full.num_kv_heads >= world ? full.num_kv_heads / world : 1;
  const int32_t kv0 = full.num_kv_heads >= world ? rank * c.num_kv_heads : rank / (world / full.num_kv_heads);
  if (shard) *shard = TpShard{rank, world, full, kv0};
  return c;
}

ShardSelection select_shard(const TpShard& s, const std::string& name, int64_t rows, int64_t cols) {
  ShardSelection sel;
  if (!s.active()) return sel;
  const ModelConfig& f = s.full;
  const int64_t hd = f.head_dim, Q = f.q_dim(), KV = f.kv_dim(), I = f.intermediate_size;
  const int64_t q_loc = Q / s.world, i_loc = I / s.world;
  const int64_t kv_loc = (f.num_kv_heads >= s.world ? f.num_kv_heads / s.world : 1) * hd;
  const int64_t q0 = s.rank * q_loc, k0 = int64_t{s.kv_head0} * hd, i0 = s.rank * i_loc;
  sel.col0 = 0;
  sel.cols = cols;
  auto keep_rows = [&](std::vector<std::pair<int64_t, int64_t>> r) {
    sel.whole = false;
    sel.rows = std::move(r);
  };
  const bool bias = has(name, ".bias");
  // An expert's gate / up (Mixtral's w1 / w3) and down (w2), cut like the dense MLP's over the
  // expert's own width; the router (mlp.gate, block_sparse_moe.gate) is replicated.
  if (has(name, ".experts.")) {
    const int64_t e_loc = f.moe_intermediate_size / s.world, e0 = s.rank * e_loc;
    if (has(name, "gate_proj") || has(name, "up_proj") || has(name, ".w1.") || has(name, ".w3.")) {
      keep_rows({{e0, e_loc}});
    } else if (has(name, "down_proj") || has(name, ".w2.")) {
      sel.whole = false;
      sel.rows = {{0, rows}};
      sel.col0 = e0;
      sel.cols = e_loc;
    }
  } else if (name == "lm_head.weight") {
    keep_rows({{s.vocab0(), s.vocab_rows()}});  // whole rows: no quantization group is cut
  } else if (has(name, "self_attn.qkv_proj"))
    keep_rows({{q0, q_loc}, {Q + k0, kv_loc}, {Q + KV + k0, kv_loc}});
  else if (has(name, "self_attn.q_proj")) keep_rows({{q0, q_loc}});
  else if (has(name, "self_attn.k_proj") || has(name, "self_attn.v_proj")) keep_rows({{k0, kv_loc}});
  else if (has(name, "mlp.gate_up_proj")) keep_rows({{i0, i_loc}, {I + i0, i_loc}});
  else if (has(name, "mlp.gate_proj") || has(name, "mlp.up_proj")) keep_rows({{i0, i_loc}});
  else if ((has(name, "self_attn.o_proj") || has(name, "mlp.down_proj")) && !bias) {
    sel.whole = false;
    sel.rows = {{0, rows}};
    const bool o = has(name, "o_proj");
    sel.col0 = o ? q0 : i0;
    sel.cols = o ? q_loc : i_loc;
  } else if (has(name, "self_attn.o_proj") && bias) {
    // The row-parallel output is summed over ranks: its bias must enter the sum once.
    sel.zero = s.rank != 0;
    sel.whole = !sel.zero;
    sel.rows = {{0, rows}};
  }
  for (const auto& [r0, n] : sel.rows)
    FANTAI_REQUIRE(r0 >= 0 && r0 + n <= rows, "tensor " << name << " has " << rows << " rows, fewer than the "
                                                        << "tensor-parallel split of config.json needs");
  FANTAI_REQUIRE(sel.col0 + sel.cols <= cols, "tensor " << name << " has " << cols << " columns, fewer than "
                                                        << "the tensor-parallel split of config.json needs");
  return sel;
}

}  // namespace fantai::model
