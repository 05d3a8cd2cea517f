// engine: one kind's paged KV block pool: allocation, sharing, prefix cache with LRU eviction,
// CoW, window drops.
#include "engine/block_pool.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"

namespace fantai::engine {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : num_blocks_(num_blocks), block_size_(block_size), prefix_caching_(enable_prefix_caching) {
  FANTAI_REQUIRE(num_blocks >= 0, "num_blocks must be >= 0, got " << num_blocks);
  FANTAI_REQUIRE(block_size >= 1, "block_size must be >= 1, got " << block_size);
  const size_t n = static_cast<size_t>(num_blocks_);
  ref_counts_.assign(n, 0);
  fill_.assign(n, 0);
  uid_.assign(n, 0);
  parent_uid_.assign(n, 0);
  key_.assign(n, 0);
  tokens_.assign(prefix_caching_ ? n * block_size_ : 0, 0);
  lru_prev_.assign(n, -1);
  lru_next_.assign(n, -1);
  in_lru_.assign(n, 0);
  // Lowest id first: allocation order is deterministic, and touched memory stays compact.
  for (int32_t b = 0; b < num_blocks_; ++b) clean_.insert(clean_.end(), b);
}

bool BlockPool::can_allocate(const BlockTable& table, int32_t num_tokens) const {
  const int32_t need = blocks_for(num_tokens) - static_cast<int32_t>(table.blocks.size());
  return need <= num_free_blocks();
}

void BlockPool::set_fill(int32_t block, int32_t fill) {
  if (fill > fill_[block]) {
    used_slots_ += fill - fill_[block];
    fill_[block] = fill;
  }
}

bool BlockPool::allocate(BlockTable& table, int32_t num_tokens) {
  FANTAI_CHECK(num_tokens >= 0, "allocate: negative token count " << num_tokens);
  if (num_tokens <= table.num_tokens) return true;  // tables never shrink here; free() empties
  // Check first so a short pool leaves the table and the pool exactly as they were.
  if (!can_allocate(table, num_tokens)) return false;
  const int32_t target = blocks_for(num_tokens);
  while (static_cast<int32_t>(table.blocks.size()) < target) table.blocks.push_back(take_free_block());
  const int32_t first = std::max(table.num_tokens / block_size_, table.num_dropped);
  for (int32_t i = first; i < target; ++i) {
    set_fill(table.blocks[i], std::min(block_size_, num_tokens - i * block_size_));
  }
  table.num_tokens = num_tokens;
  return true;
}

int32_t BlockPool::take_free_block() {
  int32_t b;
  if (!clean_.empty()) {
    b = *clean_.begin();
    clean_.erase(clean_.begin());
  } else {
    FANTAI_CHECK(lru_head_ >= 0, "take_free_block: the pool is empty");
    b = lru_head_;  // least recently used cached block: evict its content
    lru_remove(b);
    auto it = cache_.find(key_[b]);
    if (it != cache_.end() && it->second == b) cache_.erase(it);
    key_[b] = 0;
    ++stats_.evictions;
  }
  ref_counts_[b] = 1;
  fill_[b] = 0;
  uid_[b] = next_uid_++;  // new content: children keyed on the old uid can never match it
  return b;
}

void BlockPool::release(int32_t b) {
  used_slots_ -= fill_[b];
  if (key_[b] != 0) {
    lru_push_back(b);  // keeps its content (fill stays, the block is full) until evicted
  } else {
    make_clean(b);
  }
}

void BlockPool::make_clean(int32_t b) {
  fill_[b] = 0;
  key_[b] = 0;
  clean_.insert(b);
}

void BlockPool::free(BlockTable& table) {
  // Tail first: a sequence's last blocks are the least likely to be shared, so evict them first.
  for (auto it = table.blocks.rbegin(); it != table.blocks.rend() - table.num_dropped; ++it) {
    const int32_t b = *it;
    FANTAI_CHECK(b >= 0 && b < num_blocks_ && ref_counts_[b] > 0,
                 "free: block " << b << " is not owned (double free or foreign table)");
    if (--ref_counts_[b] == 0) release(b);
  }
  table.blocks.clear();
  table.num_tokens = 0;
  table.num_cached_blocks = 0;
  table.num_dropped = 0;
  table.dropped_uid = 0;
}

int32_t BlockPool::drop_before(BlockTable& table, int32_t first) {
  first = std::min<int32_t>(first, static_cast<int32_t>(table.blocks.size()));
  int32_t n = 0;
  for (; table.num_dropped < first; ++table.num_dropped, ++n) {
    int32_t& b = table.blocks[table.num_dropped];
    FANTAI_CHECK(b >= 0 && b < num_blocks_ && ref_counts_[b] > 0,
                 "drop_before: block " << b << " is not owned");
    table.dropped_uid = uid_[b];
    if (--ref_counts_[b] == 0) release(b);
    b = -1;
  }
  return n;
}

bool BlockPool::restore(BlockTable& table, int32_t num_blocks, int32_t num_dropped, uint64_t dropped_uid,
                        int32_t num_tokens, std::vector<int32_t>* fresh) {
  FANTAI_CHECK(table.blocks.empty(), "restore: the table already holds blocks");
  FANTAI_CHECK(num_dropped >= 0 && num_dropped <= num_blocks && num_blocks == blocks_for(num_tokens),
               "restore: " << num_blocks << " blocks (" << num_dropped << " dropped) for " << num_tokens
                           << " tokens");
  if (num_blocks - num_dropped > num_free_blocks()) return false;
  table.blocks.assign(num_dropped, -1);
  for (int32_t i = num_dropped; i < num_blocks; ++i) {
    const int32_t b = take_free_block();
    table.blocks.push_back(b);
    set_fill(b, std::min(block_size_, num_tokens - i * block_size_));
    fresh->push_back(b);
  }
  table.num_tokens = num_tokens;
  table.num_dropped = num_dropped;
  table.dropped_uid = dropped_uid;
  // Fresh blocks are not in the cache: cache_full_blocks registers them where no other block
  // holds their content.
  table.num_cached_blocks = 0;
  return true;
}

void BlockPool::fork(const BlockTable& src, BlockTable& dst) {
  FANTAI_CHECK(dst.blocks.empty() && dst.num_tokens == 0, "fork: destination table is not empty");
  for (size_t i = src.num_dropped; i < src.blocks.size(); ++i) {
    const int32_t b = src.blocks[i];
    FANTAI_CHECK(b >= 0 && b < num_blocks_ && ref_counts_[b] > 0, "fork: block " << b << " is not owned");
    ++ref_counts_[b];
  }
  dst = src;  // shared slots are counted once: used_slots does not change
}

// ---- LRU list of cached, unowned blocks ----------------------------------------------------------
void BlockPool::lru_push_back(int32_t b) {
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = -1;
  if (lru_tail_ >= 0) lru_next_[lru_tail_] = b;
  else lru_head_ = b;
  lru_tail_ = b;
  in_lru_[b] = 1;
  ++lru_size_;
}

void BlockPool::lru_remove(int32_t b) {
  const int32_t p = lru_prev_[b], n = lru_next_[b];
  if (p >= 0) lru_next_[p] = n;
  else lru_head_ = n;
  if (n >= 0) lru_prev_[n] = p;
  else lru_tail_ = p;
  lru_prev_[b] = lru_next_[b] = -1;
  in_lru_[b] = 0;
  --lru_size_;
}

// ---- prefix cache ---------------------------------------------------------------------------------
uint64_t BlockPool::key_of(uint64_t parent_uid, const int32_t* tokens) const {
  uint64_t h = parent_uid * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (int32_t i = 0; i < block_size_; ++i) {
    h ^= static_cast<uint32_t>(tokens[i]);
    h *= 0x100000001B3ull;
    h ^= h >> 29;
  }
  return h ? h : 1;  // 0 means "not registered"
}

int32_t BlockPool::lookup(uint64_t parent_uid, const int32_t* tokens) const {
  auto it = cache_.find(key_of(parent_uid, tokens));
  if (it == cache_.end()) return -1;
  const int32_t b = it->second;
  const bool same = parent_uid_[b] == parent_uid &&
                    std::memcmp(&tokens_[static_cast<size_t>(b) * block_size_], tokens,
                                sizeof(int32_t) * block_size_) == 0;
  return same ? b : -1;  // a key collision is a miss, never wrong KV
}

std::vector<int32_t> BlockPool::find_cached_prefix(const int32_t* tokens, int32_t max_tokens) const {
  std::vector<int32_t> out;
  if (!prefix_caching_) return out;
  uint64_t parent = 0;
  for (int32_t i = 0; (i + 1) * block_size_ <= max_tokens; ++i) {
    const int32_t b = lookup(parent, tokens + static_cast<size_t>(i) * block_size_);
    if (b < 0) break;
    out.push_back(b);
    parent = uid_[b];
  }
  return out;
}

int32_t BlockPool::num_evictable(const std::vector<int32_t>& blocks) const {
  int32_t n = 0;
  for (int32_t b : blocks) n += ref_counts_[b] == 0;
  return n;
}

void BlockPool::take_cached(BlockTable& table, const std::vector<int32_t>& blocks, int32_t first) {
  FANTAI_CHECK(table.blocks.empty(), "take_cached: table is not empty");
  first = std::min<int32_t>(std::max(first, 0), static_cast<int32_t>(blocks.size()));
  for (size_t i = first; i < blocks.size(); ++i) {
    const int32_t b = blocks[i];
    FANTAI_CHECK(key_[b] != 0, "take_cached: block " << b << " is not cached");
    if (ref_counts_[b]++ == 0) {
      lru_remove(b);
      used_slots_ += fill_[b];
    }
  }
  table.blocks = blocks;
  std::fill(table.blocks.begin(), table.blocks.begin() + first, -1);
  table.num_tokens = static_cast<int32_t>(blocks.size()) * block_size_;
  table.num_cached_blocks = static_cast<int32_t>(blocks.size());
  table.num_dropped = first;
  table.dropped_uid = first > 0 ? uid_[blocks[first - 1]] : 0;
}

void BlockPool::cache_full_blocks(BlockTable& table, const int32_t* tokens, int32_t num_computed) {
  if (!prefix_caching_) return;
  const int32_t full = std::min<int32_t>(num_computed / block_size_,
                                         static_cast<int32_t>(table.blocks.size()));
  for (int32_t i = table.num_cached_blocks; i < full; ++i) {
    const int32_t b = table.blocks[i];
    if (b < 0 || key_[b] != 0) continue;  // dropped, or registered already (shared through a fork)
    const uint64_t parent = i == 0                     ? 0
                            : table.blocks[i - 1] >= 0 ? uid_[table.blocks[i - 1]]
                                                       : table.dropped_uid;
    const int32_t* t = tokens + static_cast<size_t>(i) * block_size_;
    const uint64_t key = key_of(parent, t);
    if (cache_.count(key)) continue;  // same content cached elsewhere (or a collision): keep one
    parent_uid_[b] = parent;
    std::memcpy(&tokens_[static_cast<size_t>(b) * block_size_], t, sizeof(int32_t) * block_size_);
    key_[b] = key;
    cache_.emplace(key, b);
  }
  table.num_cached_blocks = std::max(table.num_cached_blocks, full);
}

void BlockPool::record_lookup(int32_t queried, int32_t hit) {
  stats_.prefix_queries += queried;
  stats_.prefix_hits += hit;
}

int32_t BlockPool::trim_cache(int32_t keep) {
  int32_t n = 0;
  while (lru_size_ > std::max(keep, 0)) {
    const int32_t b = lru_head_;
    lru_remove(b);
    cache_.erase(key_[b]);
    make_clean(b);
    ++stats_.evictions;
    ++n;
  }
  return n;
}

int32_t BlockPool::reset_prefix_cache() {
  const int32_t n = trim_cache(0);
  cache_.clear();  // owned blocks keep their KV but are no longer found by lookups
  std::fill(key_.begin(), key_.end(), 0);
  return n;
}

std::pair<int32_t, int32_t> BlockPool::copy_on_write(BlockTable& table, int32_t pos) {
  const int32_t i = pos / block_size_;
  if (i >= static_cast<int32_t>(table.blocks.size())) return {-1, -1};
  const int32_t src = table.blocks[i];
  FANTAI_CHECK(src >= 0, "copy_on_write: block " << i << " of the table was dropped");
  if (ref_counts_[src] <= 1) return {-1, -1};
  if (num_free_blocks() == 0) return {-2, -2};
  const int32_t dst = take_free_block();
  --ref_counts_[src];  // still owned by the other sharers
  table.blocks[i] = dst;
  set_fill(dst, std::min(block_size_, table.num_tokens - i * block_size_));
  table.num_cached_blocks = std::min(table.num_cached_blocks, i);
  ++stats_.copy_on_writes;
  return {src, dst};
}

void BlockPool::check_invariants(const std::vector<const BlockTable*>& live) const {
  std::vector<const BlockTable*> sorted = live;
  std::sort(sorted.begin(), sorted.end());
  FANTAI_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
               "check_invariants: a table is listed twice");
  // Expected ref counts and slot usage, derived from the live tables alone.
  std::vector<int32_t> refs(num_blocks_, 0), fill(num_blocks_, 0);
  for (const BlockTable* t : live) {
    FANTAI_CHECK(t != nullptr, "check_invariants: null table");
    FANTAI_CHECK(static_cast<int32_t>(t->blocks.size()) == blocks_for(t->num_tokens),
                 "table holds " << t->blocks.size() << " blocks for " << t->num_tokens
                                << " tokens (block_size " << block_size_ << ")");
    FANTAI_CHECK(t->num_dropped >= 0 && t->num_dropped <= static_cast<int32_t>(t->blocks.size()),
                 "table drops " << t->num_dropped << " of its " << t->blocks.size() << " blocks");
    for (int32_t i = 0; i < t->num_dropped; ++i)
      FANTAI_CHECK(t->blocks[i] == -1, "dropped block " << i << " of a table is " << t->blocks[i]);
    std::vector<int32_t> mine(t->blocks.begin() + t->num_dropped, t->blocks.end());
    std::sort(mine.begin(), mine.end());
    FANTAI_CHECK(std::adjacent_find(mine.begin(), mine.end()) == mine.end(),
                 "a table references the same block twice");
    for (size_t i = t->num_dropped; i < t->blocks.size(); ++i) {
      const int32_t b = t->blocks[i];
      FANTAI_CHECK(b >= 0 && b < num_blocks_, "table references block " << b << " out of range");
      ++refs[b];
      fill[b] = std::max(fill[b],
                         std::min(block_size_, t->num_tokens - static_cast<int32_t>(i) * block_size_));
    }
  }
  int64_t used = 0, lru_count = 0;
  for (int32_t b = lru_head_; b >= 0; b = lru_next_[b]) {
    FANTAI_CHECK(in_lru_[b] && ++lru_count <= num_blocks_, "the LRU list is corrupt at block " << b);
  }
  FANTAI_CHECK(lru_count == lru_size_, "LRU list holds " << lru_count << " blocks, size says " << lru_size_);
  for (int32_t b = 0; b < num_blocks_; ++b) {
    FANTAI_CHECK(ref_counts_[b] == refs[b], "block " << b << " has ref_count " << ref_counts_[b] << " but "
                                                     << refs[b] << " live references");
    const bool clean = clean_.count(b) != 0, cached = in_lru_[b] != 0;
    if (ref_counts_[b] > 0) {
      FANTAI_CHECK(!clean && !cached, "owned block " << b << " is also free");
      FANTAI_CHECK(fill_[b] == fill[b],
                   "block " << b << " fill " << fill_[b] << " but tables use " << fill[b]);
      used += fill[b];
    } else {
      FANTAI_CHECK(clean != cached, "free block " << b << " must be clean xor cached");
      FANTAI_CHECK(cached == (key_[b] != 0), "block " << b << " cached state and key disagree");
    }
    if (key_[b] != 0) {
      auto it = cache_.find(key_[b]);
      FANTAI_CHECK(it != cache_.end() && it->second == b,
                   "registered block " << b << " missing from the cache map");
    }
  }
  for (const auto& [key, b] : cache_) {
    FANTAI_CHECK(key_[b] == key, "cache map entry for block " << b << " is stale");
  }
  FANTAI_CHECK(used == used_slots_, "used_slots is " << used_slots_ << " but live tables hold " << used);
}

}  // namespace fantai::engine
