// engine: unit tests of the paged KV block pool (allocation, exhaustion, forks, invariants, window
// drops) and of the block manager over one pool per attention kind.
// Over 400 lines: one case per rule of the pool and of the manager, sharing the helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "common/check.h"
#include "engine/block_manager.h"
#include "engine/block_pool.h"

namespace fantai::engine {
namespace {

std::vector<const BlockTable*> tables(std::initializer_list<const BlockTable*> l) { return l; }

// Every block id in `t` is distinct and in range.
void expect_valid_ids(const BlockPool& bm, const BlockTable& t) {
  std::set<int32_t> ids(t.blocks.begin(), t.blocks.end());
  EXPECT_EQ(ids.size(), t.blocks.size());
  for (int32_t b : t.blocks) {
    EXPECT_GE(b, 0);
    EXPECT_LT(b, bm.num_blocks());
  }
}

TEST(BlockPool, ConstructorValidates) {
  EXPECT_THROW(BlockPool(-1, 16), InvalidArgument);
  EXPECT_THROW(BlockPool(4, 0), InvalidArgument);
  EXPECT_NO_THROW(BlockPool(0, 1));
}

TEST(BlockPool, FreshPoolIsAllFree) {
  BlockPool bm(8, 16);
  EXPECT_EQ(bm.num_blocks(), 8);
  EXPECT_EQ(bm.block_size(), 16);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(bm.num_used_blocks(), 0);
  EXPECT_EQ(bm.used_slots(), 0);
  EXPECT_EQ(bm.allocated_slots(), 0);
  for (int32_t b = 0; b < 8; ++b) EXPECT_EQ(bm.ref_count(b), 0);
  EXPECT_NO_THROW(bm.check_invariants({}));
}

TEST(BlockPool, BlocksForIsCeil) {
  BlockPool bm(1, 4);
  EXPECT_EQ(bm.blocks_for(0), 0);
  EXPECT_EQ(bm.blocks_for(1), 1);
  EXPECT_EQ(bm.blocks_for(4), 1);
  EXPECT_EQ(bm.blocks_for(5), 2);
  EXPECT_EQ(bm.blocks_for(8), 2);
  EXPECT_EQ(bm.blocks_for(9), 3);
}

TEST(BlockPool, AllocateGrowsToExactlyCeilBlocks) {
  BlockPool bm(8, 4);
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, 1));
  EXPECT_EQ(t.blocks.size(), 1u);
  EXPECT_EQ(t.num_tokens, 1);
  ASSERT_TRUE(bm.allocate(t, 4));  // same block still has room
  EXPECT_EQ(t.blocks.size(), 1u);
  ASSERT_TRUE(bm.allocate(t, 5));
  EXPECT_EQ(t.blocks.size(), 2u);
  ASSERT_TRUE(bm.allocate(t, 13));
  EXPECT_EQ(t.blocks.size(), 4u);
  EXPECT_EQ(t.num_tokens, 13);
  expect_valid_ids(bm, t);
  for (int32_t b : t.blocks) EXPECT_EQ(bm.ref_count(b), 1);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_EQ(bm.num_used_blocks(), 4);
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
}

TEST(BlockPool, AllocateNeverShrinks) {
  BlockPool bm(8, 4);
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, 9));
  const auto before = t.blocks;
  EXPECT_TRUE(bm.allocate(t, 2));
  EXPECT_EQ(t.blocks, before);
  EXPECT_EQ(t.num_tokens, 9);
  EXPECT_EQ(bm.used_slots(), 9);
  EXPECT_TRUE(bm.allocate(t, 0));
  EXPECT_EQ(t.num_tokens, 9);
  EXPECT_THROW(bm.allocate(t, -1), std::runtime_error);
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
}

TEST(BlockPool, ExhaustionReturnsFalseAndChangesNothing) {
  BlockPool bm(3, 4);
  BlockTable a, b;
  ASSERT_TRUE(bm.allocate(a, 6));  // 2 blocks
  ASSERT_TRUE(bm.allocate(b, 1));  // 1 block: pool now empty
  EXPECT_EQ(bm.num_free_blocks(), 0);

  const BlockTable a_before = a, b_before = b;
  EXPECT_FALSE(bm.can_allocate(a, 9));
  EXPECT_FALSE(bm.allocate(a, 9));
  EXPECT_FALSE(bm.allocate(b, 100));
  EXPECT_EQ(a.blocks, a_before.blocks);
  EXPECT_EQ(a.num_tokens, a_before.num_tokens);
  EXPECT_EQ(b.blocks, b_before.blocks);
  EXPECT_EQ(b.num_tokens, b_before.num_tokens);
  EXPECT_EQ(bm.used_slots(), 7);
  EXPECT_EQ(bm.num_free_blocks(), 0);
  // Growth inside the last block needs no new block and still succeeds.
  EXPECT_TRUE(bm.can_allocate(a, 8));
  EXPECT_TRUE(bm.allocate(a, 8));
  EXPECT_EQ(bm.used_slots(), 9);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b})));
}

TEST(BlockPool, PartialShortageAllocatesNothing) {
  // Two blocks free, three needed: none may be taken (no half-grown table).
  BlockPool bm(2, 2);
  BlockTable t;
  EXPECT_FALSE(bm.allocate(t, 5));
  EXPECT_TRUE(t.blocks.empty());
  EXPECT_EQ(t.num_tokens, 0);
  EXPECT_EQ(bm.num_free_blocks(), 2);
  EXPECT_EQ(bm.used_slots(), 0);
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
}

TEST(BlockPool, EmptyPoolOnlyAllowsZeroTokens) {
  BlockPool bm(0, 4);
  BlockTable t;
  EXPECT_TRUE(bm.allocate(t, 0));
  EXPECT_FALSE(bm.allocate(t, 1));
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
}

TEST(BlockPool, CanAllocateAgreesWithAllocate) {
  BlockPool bm(5, 3);
  BlockTable t;
  for (int32_t n = 0; n <= 18; ++n) {
    const bool can = bm.can_allocate(t, n);
    EXPECT_EQ(can, n <= 15) << n;
  }
  for (int32_t n = 1; n <= 18; ++n) {
    const bool can = bm.can_allocate(t, n);
    EXPECT_EQ(bm.allocate(t, n), can) << n;
  }
  EXPECT_EQ(t.num_tokens, 15);
}

TEST(BlockPool, FreeReturnsBlocksAndIsIdempotent) {
  BlockPool bm(4, 4);
  BlockTable a, b;
  ASSERT_TRUE(bm.allocate(a, 7));
  ASSERT_TRUE(bm.allocate(b, 8));
  EXPECT_EQ(bm.num_free_blocks(), 0);
  const std::vector<int32_t> a_blocks = a.blocks;
  bm.free(a);
  EXPECT_TRUE(a.blocks.empty());
  EXPECT_EQ(a.num_tokens, 0);
  EXPECT_EQ(bm.num_free_blocks(), 2);
  EXPECT_EQ(bm.used_slots(), 8);
  for (int32_t blk : a_blocks) EXPECT_EQ(bm.ref_count(blk), 0);
  bm.free(a);  // second free is a no-op
  EXPECT_EQ(bm.num_free_blocks(), 2);
  EXPECT_EQ(bm.used_slots(), 8);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b})));
  // The freed blocks are reusable.
  BlockTable c;
  ASSERT_TRUE(bm.allocate(c, 8));
  EXPECT_EQ(std::set<int32_t>(c.blocks.begin(), c.blocks.end()),
            std::set<int32_t>(a_blocks.begin(), a_blocks.end()));
  bm.free(b);
  bm.free(c);
  EXPECT_EQ(bm.num_free_blocks(), 4);
  EXPECT_EQ(bm.used_slots(), 0);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b, &c})));
}

TEST(BlockPool, ForkSharesBlocksWithRefCounts) {
  BlockPool bm(6, 4);
  BlockTable src, dst;
  ASSERT_TRUE(bm.allocate(src, 6));
  bm.fork(src, dst);
  EXPECT_EQ(dst.blocks, src.blocks);
  EXPECT_EQ(dst.num_tokens, 6);
  for (int32_t b : src.blocks) EXPECT_EQ(bm.ref_count(b), 2);
  EXPECT_EQ(bm.num_used_blocks(), 2);  // shared blocks are counted once
  EXPECT_EQ(bm.used_slots(), 6);       // and so are their slots (KV utilization counts memory)
  EXPECT_EQ(bm.allocated_slots(), 8);
  EXPECT_NO_THROW(bm.check_invariants(tables({&src, &dst})));
  // Listing only one of the two sharers is a ref-count violation.
  EXPECT_THROW(bm.check_invariants(tables({&src})), std::runtime_error);

  // The fork grows on its own: a new private block, the shared ones untouched.
  ASSERT_TRUE(bm.allocate(dst, 9));
  EXPECT_EQ(dst.blocks.size(), 3u);
  EXPECT_EQ(bm.ref_count(dst.blocks[2]), 1);
  EXPECT_NO_THROW(bm.check_invariants(tables({&src, &dst})));

  bm.free(src);
  for (int32_t i = 0; i < 2; ++i) EXPECT_EQ(bm.ref_count(dst.blocks[i]), 1);
  EXPECT_EQ(bm.num_free_blocks(), 3);
  EXPECT_NO_THROW(bm.check_invariants(tables({&src, &dst})));
  bm.free(dst);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_EQ(bm.used_slots(), 0);
  EXPECT_NO_THROW(bm.check_invariants(tables({&src, &dst})));
}

TEST(BlockPool, ForkIntoNonEmptyTableThrows) {
  BlockPool bm(4, 4);
  BlockTable a, b;
  ASSERT_TRUE(bm.allocate(a, 4));
  ASSERT_TRUE(bm.allocate(b, 4));
  EXPECT_THROW(bm.fork(a, b), std::runtime_error);
  EXPECT_EQ(bm.ref_count(a.blocks[0]), 1);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b})));
}

TEST(BlockPool, UtilizationMath) {
  BlockPool bm(10, 8);
  BlockTable a, b, c;
  ASSERT_TRUE(bm.allocate(a, 1));   // 1 block, 7 slots wasted
  ASSERT_TRUE(bm.allocate(b, 16));  // 2 blocks, no waste
  ASSERT_TRUE(bm.allocate(c, 17));  // 3 blocks, 7 wasted
  EXPECT_EQ(bm.used_slots(), 34);
  EXPECT_EQ(bm.allocated_slots(), 6 * 8);
  ASSERT_TRUE(bm.allocate(a, 8));
  EXPECT_EQ(bm.used_slots(), 41);
  EXPECT_EQ(bm.allocated_slots(), 48);
  for (const BlockTable* t : {&a, &b, &c}) {
    const int64_t alloc = static_cast<int64_t>(t->blocks.size()) * bm.block_size();
    EXPECT_LE(t->num_tokens, alloc);
    EXPECT_LT(alloc, t->num_tokens + bm.block_size());
  }
  bm.free(b);
  EXPECT_EQ(bm.used_slots(), 25);
  EXPECT_EQ(bm.allocated_slots(), 32);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b, &c})));
}

TEST(BlockPool, CheckInvariantsCatchesViolations) {
  BlockPool bm(4, 4);
  BlockTable a, b;
  ASSERT_TRUE(bm.allocate(a, 5));
  ASSERT_TRUE(bm.allocate(b, 2));
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b})));
  // A live table left out: its blocks look owned by nobody.
  EXPECT_THROW(bm.check_invariants(tables({&a})), std::runtime_error);
  // The same table listed twice.
  EXPECT_THROW(bm.check_invariants(tables({&a, &a, &b})), std::runtime_error);
  // A table whose length disagrees with its block count.
  BlockTable wrong = a;
  wrong.num_tokens = 9;
  EXPECT_THROW(bm.check_invariants(tables({&wrong, &b})), std::runtime_error);
  wrong.num_tokens = 4;  // 4 tokens need 1 block, it holds 2
  EXPECT_THROW(bm.check_invariants(tables({&wrong, &b})), std::runtime_error);
  // A table referencing a free block, an out-of-range block or one block twice.
  BlockTable stray;
  stray.blocks = {3};
  stray.num_tokens = 1;
  EXPECT_THROW(bm.check_invariants(tables({&a, &b, &stray})), std::runtime_error);
  stray.blocks = {42};
  EXPECT_THROW(bm.check_invariants(tables({&a, &b, &stray})), std::runtime_error);
  BlockTable twice;
  twice.blocks = {a.blocks[0], a.blocks[0]};
  twice.num_tokens = 8;
  EXPECT_THROW(bm.check_invariants(tables({&twice, &b})), std::runtime_error);
  EXPECT_THROW(bm.check_invariants(tables({&a, &b, nullptr})), std::runtime_error);
}

TEST(BlockPool, FreeOfForeignTableThrows) {
  BlockPool bm(2, 4);
  BlockTable bogus;
  bogus.blocks = {1};
  bogus.num_tokens = 1;
  EXPECT_THROW(bm.free(bogus), std::runtime_error);
}

// Random allocate / grow / fork / free, checking the invariants and the accounting every step.
TEST(BlockPool, RandomizedOpsKeepInvariants) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    const int32_t num_blocks = static_cast<int32_t>(rng() % 24);
    const int32_t block_size = 1 + static_cast<int32_t>(rng() % 8);
    BlockPool bm(num_blocks, block_size);
    std::vector<std::unique_ptr<BlockTable>> live;
    for (int step = 0; step < 2000; ++step) {
      const int op = static_cast<int>(rng() % 4);
      if (op == 0 || live.empty()) {
        live.push_back(std::make_unique<BlockTable>());
      } else {
        BlockTable& t = *live[rng() % live.size()];
        if (op == 1) {
          // As the scheduler does: a shared block gets a private copy before it is written.
          if (bm.copy_on_write(t, t.num_tokens).first == -2) continue;
          const int32_t want = t.num_tokens + static_cast<int32_t>(rng() % (2 * block_size + 1));
          const BlockTable before = t;
          const int32_t free_before = bm.num_free_blocks();
          const bool ok = bm.allocate(t, want);
          const int32_t need = bm.blocks_for(want) - static_cast<int32_t>(before.blocks.size());
          ASSERT_EQ(ok, need <= free_before);
          if (!ok) {
            ASSERT_EQ(t.blocks, before.blocks);
            ASSERT_EQ(t.num_tokens, before.num_tokens);
            ASSERT_EQ(bm.num_free_blocks(), free_before);
          }
        } else if (op == 2 && t.num_tokens > 0) {
          live.push_back(std::make_unique<BlockTable>());
          bm.fork(t, *live.back());
        } else {
          bm.free(t);
          live.erase(std::find_if(live.begin(), live.end(), [&](auto& p) { return p.get() == &t; }));
        }
      }
      std::vector<const BlockTable*> ptrs;
      std::map<int32_t, int32_t> fill;  // a shared block's slots count once
      for (auto& p : live) {
        ptrs.push_back(p.get());
        for (size_t i = 0; i < p->blocks.size(); ++i) {
          int32_t& f = fill[p->blocks[i]];
          f = std::max(f, std::min(block_size, p->num_tokens - static_cast<int32_t>(i) * block_size));
        }
      }
      int64_t used = 0;
      for (auto& [b, f] : fill) used += f;
      ASSERT_NO_THROW(bm.check_invariants(ptrs)) << "seed " << seed << " step " << step;
      ASSERT_EQ(bm.used_slots(), used);
    }
    for (auto& p : live) bm.free(*p);
    EXPECT_EQ(bm.num_free_blocks(), num_blocks);
    EXPECT_EQ(bm.used_slots(), 0);
  }
}

// ---- sliding windows: one pool's drops, then the manager over a full and a window pool ----------

TEST(BlockPool, DropBeforeReleasesLeadingBlocksOnce) {
  BlockPool bm(8, 4);
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, 18));  // 5 blocks
  const std::vector<int32_t> before = t.blocks;
  EXPECT_EQ(bm.drop_before(t, 3), 3);
  EXPECT_EQ(t.num_dropped, 3);
  EXPECT_EQ(t.num_live(), 2);
  EXPECT_EQ(std::vector<int32_t>(t.blocks.begin(), t.blocks.begin() + 3), std::vector<int32_t>(3, -1));
  EXPECT_EQ(t.blocks[3], before[3]);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  EXPECT_EQ(bm.used_slots(), 6);  // the two live blocks: 4 + 2 slots
  EXPECT_EQ(bm.drop_before(t, 2), 0);
  EXPECT_EQ(bm.drop_before(t, 99), 2);  // clamped to the table
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
  ASSERT_TRUE(bm.allocate(t, 23));  // keeps its logical indexing: grows at index 5
  EXPECT_EQ(t.blocks.size(), 6u);
  EXPECT_GE(t.blocks[5], 0);
  EXPECT_NO_THROW(bm.check_invariants(tables({&t})));
  bm.free(t);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_EQ(t.num_dropped, 0);
  EXPECT_NO_THROW(bm.check_invariants({}));
}

TEST(BlockPool, ForkedDropsKeepSharedBlocks) {
  BlockPool bm(8, 4);
  BlockTable a, b;
  ASSERT_TRUE(bm.allocate(a, 12));
  bm.fork(a, b);
  EXPECT_EQ(bm.drop_before(a, 2), 2);
  EXPECT_EQ(bm.num_free_blocks(), 5);  // b still holds them
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b})));
  BlockTable c;
  bm.fork(a, c);  // a fork of a table with drops shares only its live blocks
  EXPECT_EQ(c.num_dropped, 2);
  EXPECT_NO_THROW(bm.check_invariants(tables({&a, &b, &c})));
  bm.free(a);
  bm.free(b);
  bm.free(c);
  EXPECT_EQ(bm.num_free_blocks(), 8);
}

// A dropped, registered block stays cached, and the blocks registered after it chain on it, so the
// whole sequence is found again once it is freed.
TEST(BlockPool, DroppedBlocksStayCachedAndKeepTheChain) {
  BlockPool bm(8, 4, true);
  std::vector<int32_t> tok(20);
  for (int i = 0; i < 20; ++i) tok[i] = 100 + i;
  BlockTable t;
  ASSERT_TRUE(bm.allocate(t, 9));
  bm.cache_full_blocks(t, tok.data(), 9);  // blocks 0, 1
  EXPECT_EQ(bm.drop_before(t, 2), 2);
  EXPECT_EQ(bm.num_cached_blocks(), 2);
  ASSERT_TRUE(bm.allocate(t, 17));
  bm.cache_full_blocks(t, tok.data(), 17);  // blocks 2, 3: parent of 2 is the dropped block 1
  bm.free(t);
  EXPECT_EQ(bm.find_cached_prefix(tok.data(), 20).size(), 4u);
  EXPECT_NO_THROW(bm.check_invariants({}));
}

TEST(BlockManager, PeakBlocksOfAWindow) {
  // Full attention: every block. A window of W positions spans up to ceil(W / bs) + 1 blocks, and a
  // chunk of c queries adds its own c - 1.
  EXPECT_EQ(BlockManager::window_peak_blocks(0, 16, 2000, 1), 125);
  EXPECT_EQ(BlockManager::window_peak_blocks(24, 16, 2000, 1), 3);
  EXPECT_EQ(BlockManager::window_peak_blocks(16, 16, 2000, 1), 2);
  EXPECT_EQ(BlockManager::window_peak_blocks(1, 16, 2000, 1), 1);
  EXPECT_EQ(BlockManager::window_peak_blocks(24, 16, 2000, 32), 5);
  EXPECT_EQ(BlockManager::window_peak_blocks(4096, 16, 100, 32), 7);  // capped by the sequence
}

// Decode one token at a time: the window pool never holds more than the window needs, the full
// pool holds every block, and the peak bound is reached.
TEST(BlockManager, WindowKindKeepsOnlyWhatTheNextQuerySees) {
  BlockManager bm({{16, 0}, {6, 6}}, 4);
  BlockTables t;
  int32_t peak = 0;
  for (int32_t pos = 0; pos < 60; ++pos) {
    ASSERT_TRUE(bm.allocate(t, pos, pos + 1)) << pos;
    ASSERT_NO_THROW(bm.check_invariants({&t}));
    EXPECT_EQ(t.kinds[1].num_dropped, bm.first_needed_block(1, pos));
    peak = std::max(peak, t.kinds[1].num_live());
  }
  EXPECT_EQ(peak, bm.peak_blocks(1, 60, 1));
  EXPECT_EQ(peak, 3);
  EXPECT_EQ(t.kinds[0].num_live(), 15);
  EXPECT_EQ(bm.pool(0).num_free_blocks(), 1);
  EXPECT_EQ(bm.num_free_blocks(), 1 + 6 - t.kinds[1].num_live());
  bm.free(t);
  EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
}

TEST(BlockManager, AllocateIsAllOrNothingAcrossKinds) {
  BlockManager bm({{8, 0}, {3, 4}}, 4);
  BlockTables t;
  // A 16-token chunk from position 0: the window pool needs 4 blocks and has 3.
  EXPECT_FALSE(bm.allocate(t, 0, 16));
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(bm.num_free_blocks(), 11);
  ASSERT_TRUE(bm.allocate(t, 0, 8));
  // From position 8 (keys 5..): the window drops block 0 first.
  EXPECT_TRUE(bm.allocate(t, 8, 12));
  EXPECT_EQ(t.kinds[0].num_live(), 3);
  EXPECT_EQ(t.kinds[1].num_live(), 2);
  ASSERT_NO_THROW(bm.check_invariants({&t}));
  // The full pool short: nothing changes in the window pool either.
  BlockTables u;
  ASSERT_TRUE(bm.allocate(u, 0, 4));
  EXPECT_FALSE(bm.allocate(u, 4, 24));
  EXPECT_EQ(u.kinds[0].blocks.size(), 1u);
  EXPECT_EQ(u.kinds[1].blocks.size(), 1u);
  bm.free(t);
  bm.free(u);
  EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
}

TEST(BlockManager, PrefixHitTakesOnlyTheBlocksTheNextQuerySees) {
  BlockManager bm({{16, 0}, {16, 5}}, 4, true);
  std::vector<int32_t> tok(24);
  for (int i = 0; i < 24; ++i) tok[i] = 7 * i + 1;
  BlockTables a;
  ASSERT_TRUE(bm.allocate(a, 0, 20));
  bm.cache_full_blocks(a, tok.data(), 20);
  bm.drop_invisible(a, 20);
  bm.free(a);
  const PrefixHit hit = bm.find_cached_prefix(tok.data(), 23);
  ASSERT_EQ(hit.num_blocks, 5);
  BlockTables b;
  ASSERT_TRUE(bm.take_cached_and_allocate(b, hit, 21));
  EXPECT_EQ(b.kinds[0].num_live(), 6);  // the 5 hit blocks and one new
  // The query at 20 sees keys 16..20: block 4 of the hit and the new block 5.
  EXPECT_EQ(b.kinds[1].num_dropped, 4);
  EXPECT_EQ(b.kinds[1].blocks[4], hit.blocks[1][4]);
  EXPECT_EQ(b.num_cached_blocks(), 5);
  ASSERT_NO_THROW(bm.check_invariants({&b}));
  bm.free(b);
  // Once the window pool's chain is evicted, there is no hit (the full pool alone is not enough).
  bm.pool(1).reset_prefix_cache();
  EXPECT_EQ(bm.find_cached_prefix(tok.data(), 23).num_blocks, 0);
  EXPECT_EQ(bm.find_cached_prefix(tok.data(), 23).blocks[0].size(), 0u);
}

TEST(BlockManager, TakeCachedIsAllOrNothing) {
  BlockManager bm({{16, 0}, {3, 5}}, 4, true);
  std::vector<int32_t> tok(24, 3);
  BlockTables a;
  ASSERT_TRUE(bm.allocate(a, 0, 8));
  bm.cache_full_blocks(a, tok.data(), 8);
  BlockTables hold;  // takes the window pool's free blocks
  ASSERT_TRUE(bm.allocate(hold, 0, 1));
  const PrefixHit hit = bm.find_cached_prefix(tok.data(), 8);
  ASSERT_EQ(hit.num_blocks, 2);
  BlockTables b;
  // From position 8 the window pool needs block 1 (shared) and 3 new: it has 0 free.
  EXPECT_FALSE(bm.take_cached_and_allocate(b, hit, 20));
  EXPECT_TRUE(b.empty());
  ASSERT_NO_THROW(bm.check_invariants({&a, &hold}));
  bm.free(a);
  bm.free(hold);
  EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
}

TEST(BlockManager, ForkAndCopyOnWriteInEveryKind) {
  BlockManager bm({{8, 0}, {8, 3}}, 4);
  BlockTables a, b;
  ASSERT_TRUE(bm.allocate(a, 0, 6));
  bm.fork(a, b);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(bm.copy_on_write(b, 6, &copies));
  ASSERT_EQ(copies.size(), 2u);  // the shared partial block 1 of each kind
  EXPECT_EQ(copies[0].kind, 0);
  EXPECT_EQ(copies[1].kind, 1);
  EXPECT_EQ(copies[1].src, a.kinds[1].blocks[1]);
  EXPECT_EQ(copies[1].dst, b.kinds[1].blocks[1]);
  ASSERT_NO_THROW(bm.check_invariants({&a, &b}));
  bm.free(a);
  bm.free(b);
  EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
  EXPECT_EQ(bm.stats().copy_on_writes, 2);
}

}  // namespace
}  // namespace fantai::engine
