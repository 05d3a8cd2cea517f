// engine: the KV blocks of every attention kind: one BlockPool per kind (full attention, each
// sliding window), and a sequence's tables in all of them moved together, all or nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/block_pool.h"

namespace fantai::engine {

// One attention kind's pool: its size and its layers' window (0: full attention).
struct BlockPoolSpec {
  int32_t num_blocks = 0;
  int32_t window = 0;
};

// A sequence's block tables, one per kind, all holding the same tokens. A window kind's table
// keeps only the blocks its next query can see (the rest are -1, see BlockTable).
struct BlockTables {
  std::vector<BlockTable> kinds;  // empty until the sequence first holds blocks
  bool empty() const {
    for (const BlockTable& t : kinds)
      if (!t.blocks.empty()) return false;
    return true;
  }
  int32_t num_tokens() const { return kinds.empty() ? 0 : kinds[0].num_tokens; }
  int32_t num_cached_blocks() const { return kinds.empty() ? 0 : kinds[0].num_cached_blocks; }
};

// KV of block src is copied to dst in the layers of `kind`: within the pool (copy-on-write), from
// a pool block to a host swap slot (a preempted sequence swapped out) or back (swapped in).
// A step's copies run in list order before its forward, so a block freed and reused within the
// step is read before it is written.
struct BlockCopy {
  enum Where : int32_t { kInPool = 0, kToSwap = 1, kFromSwap = 2 };
  int32_t kind = 0, src = -1, dst = -1;
  Where where = kInPool;
};

// A sequence's tables while its KV sits in host swap slots: per kind the slot of each live
// block (logical order) and what the table needs to be rebuilt around fresh blocks.
struct SwappedTables {
  struct Kind {
    std::vector<int32_t> slots;  // [live blocks]
    int32_t num_tokens = 0;
    int32_t num_dropped = 0;  // leading logical blocks a window had given back
    uint64_t dropped_uid = 0;
  };
  std::vector<Kind> kinds;  // empty: not swapped
  bool empty() const { return kinds.empty(); }
  int32_t num_tokens() const { return kinds.empty() ? 0 : kinds[0].num_tokens; }
  int32_t num_slots() const {
    int32_t n = 0;
    for (const Kind& k : kinds) n += static_cast<int32_t>(k.slots.size());
    return n;
  }
};

// The cached full blocks holding a prompt's first num_blocks * block_size tokens, in every kind.
struct PrefixHit {
  int32_t num_blocks = 0;
  std::vector<std::vector<int32_t>> blocks;  // [kind][num_blocks]
};

// Why one pool per kind (and not one pool for all layers): see model/kv_cache.h. Counts that the
// scheduler and the stats read without naming a kind (num_free_blocks, used_slots, ...) are sums
// over the kinds; a request fits only when it fits in every kind.
//
// Prefix caching with windows. A hit of k blocks needs the chain of blocks 0..k-1 cached in every
// kind (a block's cache key chains on its parent's identity, so the chain is what proves the
// content), and a window kind then takes only the blocks the next query (at k * block_size) can
// see; the others stay cached for other sequences. A window kind thus hits no longer than its own
// chain survives eviction, which is exact and, under memory pressure, shorter than possible.
class BlockManager {
 public:
  // One pool of full attention (a model without windows).
  BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching = false);
  BlockManager(const std::vector<BlockPoolSpec>& kinds, int32_t block_size,
               bool enable_prefix_caching = false);

  int num_kinds() const { return static_cast<int>(pools_.size()); }
  const BlockPool& pool(int kind) const { return pools_[kind]; }
  BlockPool& pool(int kind) { return pools_[kind]; }
  int32_t window(int kind) const { return windows_[kind]; }
  int32_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int32_t blocks_for(int32_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }

  // Sums over the kinds.
  int32_t num_blocks() const;
  int32_t num_free_blocks() const;
  int32_t num_cached_blocks() const;
  int32_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  int64_t used_slots() const;
  int64_t allocated_slots() const;
  BlockStats stats() const;

  // The first logical block of kind k that queries from position `start` on read.
  int32_t first_needed_block(int kind, int32_t start) const;
  // The most blocks kind k holds at once for a sequence of num_tokens tokens computed in chunks
  // of at most `chunk` tokens (a window kind: the last chunk and the window before it).
  int32_t peak_blocks(int kind, int32_t num_tokens, int32_t chunk) const;
  // The same for a window of `window` tokens (0: full attention) in blocks of block_size.
  static int32_t window_peak_blocks(int32_t window, int32_t block_size, int32_t num_tokens, int32_t chunk);

  // Gives back, in every window kind, the blocks no query from position `start` on can see.
  void drop_invisible(BlockTables& tables, int32_t start);
  // Grows every kind's table to num_tokens for queries from position `start` on (dropping what
  // they cannot see first). All or nothing: false, changing no table, when a pool is short.
  bool allocate(BlockTables& tables, int32_t start, int32_t num_tokens);
  // Releases every table (idempotent).
  void free(BlockTables& tables);
  // dst shares all of src's blocks in every kind. dst must be empty.
  void fork(const BlockTables& src, BlockTables& dst);
  // Before writing the slot of token `pos`: a private copy of each kind's block where it is
  // shared, appended to copies. False when some pool had no free block (kinds copied before it
  // stay copied, so a retry after freeing memory does the rest).
  bool copy_on_write(BlockTables& tables, int32_t pos, std::vector<BlockCopy>* copies);

  // ---- prefix caching -----------------------------------------------------------------------
  // The longest run of full blocks holding tokens[0, k * block_size), k * block_size <= max_tokens,
  // cached in every kind. Takes no references.
  PrefixHit find_cached_prefix(const int32_t* tokens, int32_t max_tokens) const;
  // Puts the hit's blocks each kind needs into the empty tables and grows them to num_tokens.
  // All or nothing, as allocate.
  bool take_cached_and_allocate(BlockTables& tables, const PrefixHit& hit, int32_t num_tokens);
  // Registers every kind's full blocks covering tokens[0, num_computed).
  void cache_full_blocks(BlockTables& tables, const int32_t* tokens, int32_t num_computed);
  void record_lookup(int32_t queried, int32_t hit);
  int32_t reset_prefix_cache();

  // ---- host swap space ----------------------------------------------------------------------
  // Swap slots per kind (the same count in every kind; 0: no swap space). Set once, up front.
  void set_swap_slots(int32_t slots_per_kind);
  int32_t num_swap_slots() const;  // sums over the kinds
  int32_t num_free_swap_slots() const;
  // Whether every kind has a free slot for each of the tables' live blocks.
  bool can_swap_out(const BlockTables& tables) const;
  // Moves the tables' live blocks to swap slots (a kToSwap copy each, appended to copies), frees
  // the tables and describes them in *out. Requires can_swap_out.
  void swap_out(BlockTables& tables, SwappedTables* out, std::vector<BlockCopy>* copies);
  // Rebuilds empty tables from swapped ones around fresh blocks (a kFromSwap copy each, appended
  // to copies), grows them to num_tokens and frees the slots. All or nothing, as allocate: false,
  // changing nothing, when a pool is short.
  bool swap_in(SwappedTables& swapped, BlockTables& tables, int32_t num_tokens,
               std::vector<BlockCopy>* copies);
  // Gives the slots back without copying (the request was aborted or finished). Idempotent.
  void free_swapped(SwappedTables& swapped);
  // Kind k's free swap slots, ascending (memory the backend may release).
  std::vector<int32_t> free_swap_slots(int kind) const;

  // All invariants of every pool against the live tables (tests and debug builds); with
  // `swapped`, also that the swap slots they hold are exactly the ones not free.
  void check_invariants(const std::vector<const BlockTables*>& live,
                        const std::vector<const SwappedTables*>* swapped = nullptr) const;

 private:
  void ensure_kinds(BlockTables& tables) const;

  int32_t block_size_;
  bool prefix_caching_;
  std::vector<BlockPool> pools_;
  std::vector<int32_t> windows_;
  int32_t swap_slots_ = 0;                       // per kind
  std::vector<std::vector<int32_t>> swap_free_;  // per kind, a stack: lowest slot on top
};

}  // namespace fantai::engine
