// engine: the paged KV block pool (free list, per-sequence block tables, reference counts).
#pragma once

#include <cstdint>
#include <vector>

namespace fantai::engine {

// Logical block i of a sequence lives in physical block blocks[i]; the table holds exactly
// ceil(num_tokens / block_size) blocks, so waste is under one block per sequence.
struct BlockTable {
  std::vector<int32_t> blocks;
  int32_t num_tokens = 0;  // token slots this sequence uses
};

// Pure host logic: no device memory is touched here. Blocks are ids in [0, num_blocks).
// Invariants: every block is either in the free pool (ref_count 0) or owned (ref_count >= 1);
// sum of ref_counts equals the total length of all live tables.
class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free_blocks() const;
  int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }

  // Can `table` grow to hold `num_tokens` tokens (new blocks needed <= free blocks)?
  bool can_allocate(const BlockTable& table, int32_t num_tokens) const;
  // Grows `table` to hold `num_tokens` tokens (never shrinks). Returns false and changes
  // nothing when the pool is short; the scheduler decides what to do then.
  bool allocate(BlockTable& table, int32_t num_tokens);
  // Releases every block of `table` (decrements ref counts) and empties it. Idempotent.
  void free(BlockTable& table);
  // Makes `dst` share all of `src`'s blocks (ref counts +1). dst must be empty. For n > 1 and
  // prefix sharing; a block with ref_count > 1 must be copied before it is written.
  void fork(const BlockTable& src, BlockTable& dst);
  int32_t ref_count(int32_t block) const { return ref_counts_[block]; }

  // KV utilization accounting: used = sum of num_tokens of live tables, allocated = used blocks *
  // block_size (shared blocks counted once).
  int64_t used_slots() const { return used_slots_; }
  int64_t allocated_slots() const { return static_cast<int64_t>(num_used_blocks()) * block_size_; }

  // Checks all invariants against a set of live tables (tests and debug builds). Throws on error.
  void check_invariants(const std::vector<const BlockTable*>& live) const;

 private:
  int32_t num_blocks_;
  int32_t block_size_;
  std::vector<int32_t> free_list_;   // stack of free block ids
  std::vector<int32_t> ref_counts_;  // [num_blocks]
  int64_t used_slots_ = 0;
};

}  // namespace fantai::engine
