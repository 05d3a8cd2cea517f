// engine: the paged KV block pool (free list, per-sequence block tables, reference counts).
#include "engine/block_manager.h"

#include <algorithm>

#include "common/check.h"

namespace fantai::engine {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  FANTAI_REQUIRE(num_blocks >= 0, "num_blocks must be >= 0, got " << num_blocks);
  FANTAI_REQUIRE(block_size >= 1, "block_size must be >= 1, got " << block_size);
  ref_counts_.assign(num_blocks_, 0);
  free_list_.reserve(num_blocks_);
  // Pushed in reverse so block 0 is handed out first: allocation order is deterministic and easy
  // to read in tests and logs.
  for (int32_t b = num_blocks_ - 1; b >= 0; --b) free_list_.push_back(b);
}

int32_t BlockManager::num_free_blocks() const { return static_cast<int32_t>(free_list_.size()); }

bool BlockManager::can_allocate(const BlockTable& table, int32_t num_tokens) const {
  const int32_t have = static_cast<int32_t>(table.blocks.size());
  const int32_t need = blocks_for(num_tokens) - have;
  return need <= num_free_blocks();
}

bool BlockManager::allocate(BlockTable& table, int32_t num_tokens) {
  FANTAI_CHECK(num_tokens >= 0, "allocate: negative token count " << num_tokens);
  if (num_tokens <= table.num_tokens) return true;  // tables never shrink here; free() empties
  // Check first so a short pool leaves the table and the pool exactly as they were.
  if (!can_allocate(table, num_tokens)) return false;
  const int32_t target = blocks_for(num_tokens);
  while (static_cast<int32_t>(table.blocks.size()) < target) {
    const int32_t b = free_list_.back();
    free_list_.pop_back();
    ref_counts_[b] = 1;
    table.blocks.push_back(b);
  }
  used_slots_ += num_tokens - table.num_tokens;
  table.num_tokens = num_tokens;
  return true;
}

void BlockManager::free(BlockTable& table) {
  for (int32_t b : table.blocks) {
    FANTAI_CHECK(b >= 0 && b < num_blocks_ && ref_counts_[b] > 0,
                 "free: block " << b << " is not owned (double free or foreign table)");
    if (--ref_counts_[b] == 0) free_list_.push_back(b);
  }
  used_slots_ -= table.num_tokens;
  table.blocks.clear();
  table.num_tokens = 0;
}

void BlockManager::fork(const BlockTable& src, BlockTable& dst) {
  FANTAI_CHECK(dst.blocks.empty() && dst.num_tokens == 0, "fork: destination table is not empty");
  for (int32_t b : src.blocks) {
    FANTAI_CHECK(b >= 0 && b < num_blocks_ && ref_counts_[b] > 0, "fork: block " << b << " is not owned");
    ++ref_counts_[b];
  }
  dst.blocks = src.blocks;
  dst.num_tokens = src.num_tokens;
  // Each sequence counts its own slots: a shared block is used by both sequences.
  used_slots_ += src.num_tokens;
}

void BlockManager::check_invariants(const std::vector<const BlockTable*>& live) const {
  std::vector<const BlockTable*> sorted = live;
  std::sort(sorted.begin(), sorted.end());
  FANTAI_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
               "check_invariants: a table is listed twice");

  // Expected ref counts and slot usage, derived from the live tables alone.
  std::vector<int32_t> refs(num_blocks_, 0);
  int64_t used = 0;
  for (const BlockTable* t : live) {
    FANTAI_CHECK(t != nullptr, "check_invariants: null table");
    FANTAI_CHECK(t->num_tokens >= 0, "table has negative num_tokens " << t->num_tokens);
    FANTAI_CHECK(static_cast<int32_t>(t->blocks.size()) == blocks_for(t->num_tokens),
                 "table holds " << t->blocks.size() << " blocks for " << t->num_tokens
                                << " tokens (block_size " << block_size_ << ")");
    std::vector<int32_t> mine = t->blocks;
    std::sort(mine.begin(), mine.end());
    FANTAI_CHECK(std::adjacent_find(mine.begin(), mine.end()) == mine.end(),
                 "a table references the same block twice");
    for (int32_t b : t->blocks) {
      FANTAI_CHECK(b >= 0 && b < num_blocks_, "table references block " << b << " out of range");
      ++refs[b];
    }
    used += t->num_tokens;
  }

  std::vector<char> in_free(num_blocks_, 0);
  for (int32_t b : free_list_) {
    FANTAI_CHECK(b >= 0 && b < num_blocks_, "free list holds block " << b << " out of range");
    FANTAI_CHECK(!in_free[b], "block " << b << " is in the free list twice");
    in_free[b] = 1;
  }
  for (int32_t b = 0; b < num_blocks_; ++b) {
    FANTAI_CHECK(ref_counts_[b] == refs[b], "block " << b << " has ref_count " << ref_counts_[b]
                                                    << " but " << refs[b] << " live references");
    FANTAI_CHECK((ref_counts_[b] == 0) == (in_free[b] != 0),
                 "block " << b << " must be free xor owned (ref_count " << ref_counts_[b] << ")");
  }
  FANTAI_CHECK(used == used_slots_, "used_slots is " << used_slots_ << " but live tables hold " << used);
}

}  // namespace fantai::engine
