// tests: the tensor-parallel split (model/tp_shard): sizes, each tensor's share, refusals.
#include <gtest/gtest.h>

#include <string>

#include "common/check.h"
#include "model/tp_shard.h"

using fantai::model::ModelConfig;
using fantai::model::select_shard;
using fantai::model::shard_config;
using fantai::model::TpShard;

namespace {
ModelConfig config(int heads, int kv_heads, int inter) {
  ModelConfig c;
  c.hidden_size = 64;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 16;
  c.intermediate_size = inter;
  return c;
}
}  // namespace

TEST(TpShard, SplitsHeadsAndColumns) {
  TpShard s;
  const ModelConfig c = shard_config(config(4, 2, 160), 1, 2, &s);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.num_kv_heads, 1);
  EXPECT_EQ(c.intermediate_size, 80);
  auto q = select_shard(s, "model.layers.0.self_attn.q_proj.weight", 64, 64);
  ASSERT_EQ(q.rows.size(), 1u);
  EXPECT_EQ(q.rows[0], std::make_pair(int64_t{32}, int64_t{32}));
  auto k = select_shard(s, "model.layers.0.self_attn.k_proj.bias", 32, 1);
  EXPECT_EQ(k.rows[0], std::make_pair(int64_t{16}, int64_t{16}));
  auto o = select_shard(s, "model.layers.0.self_attn.o_proj.weight", 64, 64);
  EXPECT_EQ(o.col0, 32);
  EXPECT_EQ(o.cols, 32);
  auto up = select_shard(s, "model.layers.0.mlp.gate_up_proj.weight", 320, 64);  // Phi-3's fused
  ASSERT_EQ(up.rows.size(), 2u);
  EXPECT_EQ(up.rows[1], std::make_pair(int64_t{160 + 80}, int64_t{80}));
  EXPECT_TRUE(select_shard(s, "model.layers.0.self_attn.o_proj.bias", 64, 1).zero);  // rank 0 adds it
  EXPECT_TRUE(select_shard(s, "model.embed_tokens.weight", 320, 64).whole);
}

TEST(TpShard, ReplicatesKvHeadsWhenFewerThanRanks) {
  TpShard s;
  const ModelConfig c = shard_config(config(4, 1, 160), 1, 2, &s);
  EXPECT_EQ(c.num_kv_heads, 1);
  EXPECT_EQ(s.kv_head0, 0);
  auto v = select_shard(s, "model.layers.1.self_attn.v_proj.weight", 16, 64);
  EXPECT_EQ(v.rows[0], std::make_pair(int64_t{0}, int64_t{16}));
  shard_config(config(8, 2, 160), 3, 4, &s);  // ranks 2 and 3 read KV head 1
  EXPECT_EQ(s.kv_head0, 1);
}

TEST(TpShard, RefusesNamingValidSizes) {
  try {
    shard_config(config(9, 3, 1536), 0, 2, nullptr);
    FAIL() << "9 heads split 2 ways";
  } catch (const fantai::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("valid sizes: 1, 3"), std::string::npos) << e.what();
  }
}
