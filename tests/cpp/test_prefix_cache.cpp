// engine: unit tests of automatic prefix caching (hits, LRU eviction, copy-on-write, invariants).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <vector>

#include "engine/block_pool.h"

namespace fantai::engine {
namespace {

std::vector<int32_t> seq(int32_t n, int32_t start = 100) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

// A table that computed `tokens` and registered its full blocks, then finished.
void compute_and_free(BlockPool& bm, const std::vector<int32_t>& tokens) {
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, static_cast<int32_t>(tokens.size())));
  bm.cache_full_blocks(t, tokens.data(), static_cast<int32_t>(tokens.size()));
  bm.free(t);
}

TEST(PrefixCache, FullBlocksAreFoundAgainAfterFree) {
  BlockPool bm(16, 4, true);
  const auto tokens = seq(10);  // 2 full blocks + 2 tokens
  compute_and_free(bm, tokens);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  EXPECT_EQ(bm.num_free_blocks(), 16);  // cached blocks are free (evictable)
  auto hit = bm.find_cached_prefix(tokens.data(), 9);
  ASSERT_EQ(hit.size(), 2u);
  EXPECT_EQ(bm.find_cached_prefix(tokens.data(), 7).size(), 1u);  // only whole blocks within limit
  BlockTable t;
  EXPECT_EQ(bm.num_evictable(hit), 2);
  bm.take_cached(t, hit);
  EXPECT_EQ(t.num_tokens, 8);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_EQ(bm.used_slots(), 8);
  ASSERT_TRUE(bm.allocate(t, 10));
  EXPECT_NO_THROW(bm.check_invariants({&t}));
  bm.free(t);
  EXPECT_NO_THROW(bm.check_invariants({}));
}

TEST(PrefixCache, DifferentPrefixOrTokensMiss) {
  BlockPool bm(16, 4, true);
  const auto tokens = seq(8);
  compute_and_free(bm, tokens);
  auto other = tokens;
  other[1] = 7;  // first block differs: the chain breaks at once
  EXPECT_TRUE(bm.find_cached_prefix(other.data(), 8).empty());
  other = tokens;
  other[6] = 7;  // second block differs: only the first matches
  EXPECT_EQ(bm.find_cached_prefix(other.data(), 8).size(), 1u);
  // The same second block after a different first block must not match (chained on the parent).
  std::vector<int32_t> shifted = {1, 2, 3, 4, 104, 105, 106, 107};
  EXPECT_TRUE(bm.find_cached_prefix(shifted.data(), 8).empty());
}

TEST(PrefixCache, DisabledCachesNothing) {
  BlockPool bm(8, 4, false);
  const auto tokens = seq(8);
  compute_and_free(bm, tokens);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_TRUE(bm.find_cached_prefix(tokens.data(), 8).empty());
}

TEST(PrefixCache, LeastRecentlyUsedIsEvictedFirstAndInUseNever) {
  BlockPool bm(4, 2, true);
  const auto a = seq(2, 10), b = seq(2, 20), c = seq(2, 30);
  compute_and_free(bm, a);  // oldest
  compute_and_free(bm, b);
  compute_and_free(bm, c);
  // Touch a: take and release it, so b becomes the least recently used.
  BlockTable ta;
  bm.take_cached(ta, bm.find_cached_prefix(a.data(), 2));
  bm.free(ta);
  BlockTable hold;  // c in use: never evicted
  bm.take_cached(hold, bm.find_cached_prefix(c.data(), 2));
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, 4));  // 1 clean block + 1 eviction
  EXPECT_EQ(bm.stats().evictions, 1);
  EXPECT_TRUE(bm.find_cached_prefix(b.data(), 2).empty());  // LRU went first
  EXPECT_EQ(bm.find_cached_prefix(a.data(), 2).size(), 1u);
  EXPECT_EQ(bm.find_cached_prefix(c.data(), 2).size(), 1u);
  ASSERT_TRUE(bm.allocate(t, 6));
  EXPECT_TRUE(bm.find_cached_prefix(a.data(), 2).empty());
  EXPECT_FALSE(bm.allocate(t, 8));  // only `hold` is left, and it is in use
  EXPECT_EQ(bm.find_cached_prefix(c.data(), 2).size(), 1u);
  EXPECT_NO_THROW(bm.check_invariants({&t, &hold}));
}

TEST(PrefixCache, CopyOnWriteOnlyForASharedPartialBlock) {
  BlockPool bm(8, 4, true);
  BlockTable parent, child;
  ASSERT_TRUE(bm.allocate(parent, 6));  // block 1 half full
  bm.fork(parent, child);
  EXPECT_EQ(bm.used_slots(), 6);  // the shared prompt is counted once
  auto cow = bm.copy_on_write(child, 6);
  ASSERT_GE(cow.first, 0);
  EXPECT_EQ(cow.first, parent.blocks[1]);
  EXPECT_EQ(child.blocks[1], cow.second);
  EXPECT_EQ(child.blocks[0], parent.blocks[0]);      // the full block stays shared
  EXPECT_EQ(bm.copy_on_write(parent, 6).first, -1);  // parent is alone in its block now
  EXPECT_EQ(bm.stats().copy_on_writes, 1);
  EXPECT_NO_THROW(bm.check_invariants({&parent, &child}));
  BlockTable aligned_parent, aligned_child;  // a block-aligned prompt never needs a copy
  ASSERT_TRUE(bm.allocate(aligned_parent, 4));
  bm.fork(aligned_parent, aligned_child);
  EXPECT_EQ(bm.copy_on_write(aligned_child, 4).first, -1);
  EXPECT_EQ(bm.stats().copy_on_writes, 1);
}

TEST(PrefixCache, TrimAndResetDropContent) {
  BlockPool bm(8, 2, true);
  for (int i = 0; i < 4; ++i) compute_and_free(bm, seq(2, 10 * i));
  EXPECT_EQ(bm.num_cached_blocks(), 4);
  EXPECT_EQ(bm.trim_cache(1), 3);
  EXPECT_EQ(bm.num_cached_blocks(), 1);
  EXPECT_EQ(bm.find_cached_prefix(seq(2, 30).data(), 2).size(), 1u);  // the most recent stays
  EXPECT_EQ(bm.reset_prefix_cache(), 1);
  EXPECT_EQ(bm.num_cached_blocks(), 0);
  EXPECT_EQ(static_cast<int32_t>(bm.clean_blocks().size()), 8);
  EXPECT_NO_THROW(bm.check_invariants({}));
}

// Random admit (with prefix lookup) / grow (with CoW) / register / fork / free / trim over a small
// token alphabet so prefixes repeat; every hit must return blocks holding exactly those tokens.
TEST(PrefixCache, RandomizedKeepsInvariantsAndServesOnlyExactContent) {
  int64_t hits = 0;  // over all seeds: some tiny pools rarely keep anything cached
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(seed);
    const int32_t bs = 1 + static_cast<int32_t>(rng() % 4);
    BlockPool bm(4 + static_cast<int32_t>(rng() % 24), bs, true);
    struct Seq {
      BlockTable t;
      std::vector<int32_t> tokens;
    };
    std::vector<std::unique_ptr<Seq>> live;
    std::map<int32_t, std::vector<int32_t>> content;  // block -> tokens its KV holds
    for (int step = 0; step < 1500; ++step) {
      const int op = static_cast<int>(rng() % 6);
      if (op == 0 || live.empty()) {
        auto s = std::make_unique<Seq>();
        const int32_t n = 1 + static_cast<int32_t>(rng() % (4 * bs));
        for (int32_t i = 0; i < n; ++i) s->tokens.push_back(static_cast<int32_t>(rng() % 2));
        auto hit = bm.find_cached_prefix(s->tokens.data(), n - 1);
        for (size_t i = 0; i < hit.size(); ++i) {
          std::vector<int32_t> want(s->tokens.begin() + i * bs, s->tokens.begin() + (i + 1) * bs);
          ASSERT_EQ(content[hit[i]], want) << "seed " << seed << " step " << step;
        }
        const int32_t need = bm.num_evictable(hit) + bm.blocks_for(n) - static_cast<int32_t>(hit.size());
        if (need > bm.num_free_blocks()) continue;
        bm.take_cached(s->t, hit);
        hits += static_cast<int64_t>(hit.size());
        ASSERT_TRUE(bm.allocate(s->t, n));
        live.push_back(std::move(s));
      } else {
        Seq& s = *live[rng() % live.size()];
        if (op == 1) {  // decode one token: private copy first, then grow
          if (bm.copy_on_write(s.t, static_cast<int32_t>(s.tokens.size())).first == -2) continue;
          if (!bm.allocate(s.t, static_cast<int32_t>(s.tokens.size()) + 1)) continue;
          s.tokens.push_back(static_cast<int32_t>(rng() % 2));
        } else if (op == 2) {  // the step computed everything: register the full blocks
          const int32_t full = static_cast<int32_t>(s.tokens.size()) / bs;
          for (int32_t i = s.t.num_cached_blocks; i < full; ++i) {
            content[s.t.blocks[i]].assign(s.tokens.begin() + i * bs, s.tokens.begin() + (i + 1) * bs);
          }
          bm.cache_full_blocks(s.t, s.tokens.data(), static_cast<int32_t>(s.tokens.size()));
        } else if (op == 3) {
          auto c = std::make_unique<Seq>();
          bm.fork(s.t, c->t);
          c->tokens = s.tokens;
          live.push_back(std::move(c));
        } else if (op == 4) {
          bm.free(s.t);
          live.erase(std::find_if(live.begin(), live.end(), [&](auto& p) { return p.get() == &s; }));
        } else {
          bm.trim_cache(static_cast<int32_t>(rng() % 4));
        }
      }
      std::vector<const BlockTable*> ptrs;
      for (auto& p : live) ptrs.push_back(&p->t);
      ASSERT_NO_THROW(bm.check_invariants(ptrs)) << "seed " << seed << " step " << step;
    }
    for (auto& p : live) bm.free(p->t);
    EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
    EXPECT_EQ(bm.used_slots(), 0);
  }
  EXPECT_GT(hits, 200);  // 358 with these seeds: the content check above really ran
}

}  // namespace
}  // namespace fantai::engine
