// engine: one attention kind's paged KV block pool (free list, per-sequence block tables,
// reference counts) with automatic prefix caching (content-addressed full blocks, LRU eviction),
// copy-on-write, and the dropping of blocks a sliding window has left behind.
#pragma once

#include <cstdint>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fantai::engine {

// Logical block i of a sequence lives in physical block blocks[i]; the table holds exactly
// ceil(num_tokens / block_size) entries, so waste is under one block per sequence. In a sliding
// window's pool the leading blocks no query can see any more are given back: their entries are
// -1 (the table keeps its logical indexing, so slot = blocks[pos / block_size] still holds).
struct BlockTable {
  std::vector<int32_t> blocks;
  int32_t num_tokens = 0;         // token slots this sequence uses
  int32_t num_cached_blocks = 0;  // leading full blocks registered in (or taken from) the cache
  int32_t num_dropped = 0;        // blocks[0, num_dropped) are -1
  uint64_t dropped_uid = 0;       // cache identity of the last dropped block (its child's key)
  int32_t num_live() const { return static_cast<int32_t>(blocks.size()) - num_dropped; }
};

struct BlockStats {
  int64_t prefix_queries = 0;  // tokens looked up
  int64_t prefix_hits = 0;     // tokens found cached
  int64_t evictions = 0;       // cached blocks reused for new content
  int64_t copy_on_writes = 0;
};

// Pure host logic: no device memory is touched here. Blocks are ids in [0, num_blocks).
// A block is in exactly one state: owned (ref_count >= 1), cached (ref_count 0, content hash
// registered, evictable, on the LRU list) or clean (ref_count 0, no content). Free = cached +
// clean. Clean blocks are handed out lowest id first (keeps touched memory compact, so idle
// release returns whole ranges); only when none is left is the least recently used cached block
// evicted.
//
// Cache keys chain on the parent block's identity (a uid never reused), not on a hash of the
// parent's content: a hit compares the block's tokens and its parent's uid exactly, so no hash
// collision can ever serve wrong KV.
class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching = false);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(clean_.size()) + lru_size_; }
  int32_t num_cached_blocks() const { return lru_size_; }  // evictable, ref_count 0
  int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
  bool prefix_caching() const { return prefix_caching_; }

  // Can `table` grow to hold `num_tokens` tokens (new blocks needed <= free blocks)?
  bool can_allocate(const BlockTable& table, int32_t num_tokens) const;
  // Grows `table` to hold `num_tokens` tokens (never shrinks). Returns false and changes
  // nothing when the pool is short; the scheduler decides what to do then.
  bool allocate(BlockTable& table, int32_t num_tokens);
  // Releases every block of `table` (decrements ref counts) and empties it. Idempotent. Cached
  // blocks go to the LRU tail, the table's last blocks first (a sequence's tail is least shared).
  void free(BlockTable& table);
  // Releases the table's blocks before logical block `first` (they become -1), oldest first: a
  // window has passed them. Returns how many it released.
  int32_t drop_before(BlockTable& table, int32_t first);
  // Fills the empty `table` with num_blocks logical blocks for num_tokens tokens, the first
  // num_dropped of them dropped (-1) and the rest fresh, appended to *fresh in logical order (a
  // swapped-out sequence coming back). False, changing nothing, when the pool is short.
  bool restore(BlockTable& table, int32_t num_blocks, int32_t num_dropped, uint64_t dropped_uid,
               int32_t num_tokens, std::vector<int32_t>* fresh);
  // Makes `dst` share all of `src`'s blocks (ref counts +1). dst must be empty.
  void fork(const BlockTable& src, BlockTable& dst);
  int32_t ref_count(int32_t block) const { return ref_counts_[block]; }

  // ---- prefix caching -----------------------------------------------------------------------
  // Longest run of cached full blocks holding tokens[0, k * block_size) with k * block_size <=
  // max_tokens. Takes no references.
  std::vector<int32_t> find_cached_prefix(const int32_t* tokens, int32_t max_tokens) const;
  // Free blocks that taking `blocks` would consume (those sitting evictable in the cache).
  int32_t num_evictable(const std::vector<int32_t>& blocks) const;
  // Puts cached `blocks` (from find_cached_prefix) into the empty `table`, a reference each to
  // blocks[first, size): the first `first` ones (before a window) enter as dropped.
  void take_cached(BlockTable& table, const std::vector<int32_t>& blocks, int32_t first = 0);
  // Registers the table's full blocks covering tokens[0, num_computed) in the cache.
  void cache_full_blocks(BlockTable& table, const int32_t* tokens, int32_t num_computed);
  // Counts a lookup of `queried` tokens of which `hit` were cached (stats only).
  void record_lookup(int32_t queried, int32_t hit);
  // Drops every cached (unowned) block's content: they become clean. Returns how many.
  int32_t reset_prefix_cache();
  // Evicts least recently used cached blocks until at most `keep` remain. Returns how many.
  int32_t trim_cache(int32_t keep);

  // ---- copy-on-write ------------------------------------------------------------------------
  // Before writing the slot of token `pos`: if its block is shared, the table gets a private
  // copy. Returns {src, dst} when the caller must copy the block's KV, else {-1, -1}. Requires one
  // free block (check num_free_blocks() first); returns {-2, -2} when there is none.
  std::pair<int32_t, int32_t> copy_on_write(BlockTable& table, int32_t pos);

  // KV utilization: used = token slots holding some sequence's token (a shared block counted
  // once), allocated = owned blocks * block_size.
  int64_t used_slots() const { return used_slots_; }
  int64_t allocated_slots() const { return static_cast<int64_t>(num_used_blocks()) * block_size_; }
  const BlockStats& stats() const { return stats_; }
  // Clean blocks (no content, ref_count 0), ascending: memory the backend may release.
  const std::set<int32_t>& clean_blocks() const { return clean_; }

  // Checks all invariants against a set of live tables (tests and debug builds). Throws on error.
  void check_invariants(const std::vector<const BlockTable*>& live) const;

 private:
  int32_t take_free_block();
  void release(int32_t block);
  void make_clean(int32_t block);
  void lru_push_back(int32_t block);
  void lru_remove(int32_t block);
  uint64_t key_of(uint64_t parent_uid, const int32_t* tokens) const;
  int32_t lookup(uint64_t parent_uid, const int32_t* tokens) const;
  void set_fill(int32_t block, int32_t fill);

  int32_t num_blocks_;
  int32_t block_size_;
  bool prefix_caching_;
  std::vector<int32_t> ref_counts_;  // [num_blocks]
  std::vector<int32_t> fill_;        // [num_blocks] slots written by some owner
  std::set<int32_t> clean_;
  // Cached blocks: content and chain identity, and an intrusive LRU list (head = oldest).
  std::vector<uint64_t> uid_, parent_uid_, key_;  // key_ 0: not registered
  std::vector<int32_t> tokens_;                   // [num_blocks, block_size]
  std::vector<int32_t> lru_prev_, lru_next_;
  std::vector<char> in_lru_;
  int32_t lru_head_ = -1, lru_tail_ = -1, lru_size_ = 0;
  std::unordered_map<uint64_t, int32_t> cache_;  // key -> block
  uint64_t next_uid_ = 1;
  int64_t used_slots_ = 0;
  BlockStats stats_;
};

}  // namespace fantai::engine
