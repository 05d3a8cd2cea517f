// engine: every attention kind's blocks, moved together (see block_manager.h).
#include "engine/block_manager.h"

#include <algorithm>

#include "common/check.h"
#include "common/op_types.h"

namespace fantai::engine {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : BlockManager(std::vector<BlockPoolSpec>{{num_blocks, 0}}, block_size, enable_prefix_caching) {}

BlockManager::BlockManager(const std::vector<BlockPoolSpec>& kinds, int32_t block_size,
                           bool enable_prefix_caching)
    : block_size_(block_size), prefix_caching_(enable_prefix_caching) {
  FANTAI_REQUIRE(!kinds.empty(), "the block manager needs at least one pool");
  for (const BlockPoolSpec& k : kinds) {
    FANTAI_REQUIRE(k.window >= 0, "a pool's window must be >= 0, got " << k.window);
    pools_.emplace_back(k.num_blocks, block_size, enable_prefix_caching);
    windows_.push_back(k.window);
  }
}

int32_t BlockManager::num_blocks() const {
  int32_t n = 0;
  for (const BlockPool& p : pools_) n += p.num_blocks();
  return n;
}

int32_t BlockManager::num_free_blocks() const {
  int32_t n = 0;
  for (const BlockPool& p : pools_) n += p.num_free_blocks();
  return n;
}

int32_t BlockManager::num_cached_blocks() const {
  int32_t n = 0;
  for (const BlockPool& p : pools_) n += p.num_cached_blocks();
  return n;
}

int64_t BlockManager::used_slots() const {
  int64_t n = 0;
  for (const BlockPool& p : pools_) n += p.used_slots();
  return n;
}

int64_t BlockManager::allocated_slots() const {
  int64_t n = 0;
  for (const BlockPool& p : pools_) n += p.allocated_slots();
  return n;
}

BlockStats BlockManager::stats() const {
  BlockStats s;
  for (const BlockPool& p : pools_) {
    s.prefix_queries += p.stats().prefix_queries;
    s.prefix_hits += p.stats().prefix_hits;
    s.evictions += p.stats().evictions;
    s.copy_on_writes += p.stats().copy_on_writes;
  }
  return s;
}

int32_t BlockManager::first_needed_block(int kind, int32_t start) const {
  return first_visible_block(start, windows_[kind], block_size_);
}

int32_t BlockManager::window_peak_blocks(int32_t window, int32_t block_size, int32_t num_tokens,
                                         int32_t chunk) {
  const int64_t all = (int64_t{num_tokens} + block_size - 1) / block_size;
  if (window == 0) return static_cast<int32_t>(all);
  // A chunk's queries and the window before its first: a span of W + chunk - 1 positions, over
  // one more block than it fills when it starts mid-block.
  const int64_t span = int64_t{window} + std::max(chunk, 1) - 1;
  return static_cast<int32_t>(std::min<int64_t>(all, (span + block_size - 2) / block_size + 1));
}

int32_t BlockManager::peak_blocks(int kind, int32_t num_tokens, int32_t chunk) const {
  return window_peak_blocks(windows_[kind], block_size_, num_tokens, chunk);
}

void BlockManager::ensure_kinds(BlockTables& tables) const {
  if (tables.kinds.size() != pools_.size()) {
    FANTAI_CHECK(tables.empty(), "a sequence's tables do not match the block manager's kinds");
    tables.kinds.assign(pools_.size(), BlockTable{});
  }
}

void BlockManager::drop_invisible(BlockTables& tables, int32_t start) {
  if (tables.kinds.size() != pools_.size()) return;
  for (int k = 0; k < num_kinds(); ++k)
    if (windows_[k] > 0) pools_[k].drop_before(tables.kinds[k], first_needed_block(k, start));
}

bool BlockManager::allocate(BlockTables& tables, int32_t start, int32_t num_tokens) {
  ensure_kinds(tables);
  // Dropping first is always right (those blocks are past for good) and leaves more room.
  drop_invisible(tables, start);
  for (int k = 0; k < num_kinds(); ++k)
    if (!pools_[k].can_allocate(tables.kinds[k], num_tokens)) return false;
  for (int k = 0; k < num_kinds(); ++k)
    FANTAI_CHECK(pools_[k].allocate(tables.kinds[k], num_tokens), "allocate: pool " << k << " refused");
  return true;
}

void BlockManager::free(BlockTables& tables) {
  for (size_t k = 0; k < tables.kinds.size(); ++k) pools_[k].free(tables.kinds[k]);
}

void BlockManager::fork(const BlockTables& src, BlockTables& dst) {
  FANTAI_CHECK(src.kinds.size() == pools_.size(), "fork: the source holds no blocks");
  ensure_kinds(dst);
  for (int k = 0; k < num_kinds(); ++k) pools_[k].fork(src.kinds[k], dst.kinds[k]);
}

bool BlockManager::copy_on_write(BlockTables& tables, int32_t pos, std::vector<BlockCopy>* copies) {
  if (tables.kinds.size() != pools_.size()) return true;  // holds nothing: nothing shared
  for (int k = 0; k < num_kinds(); ++k) {
    const auto [src, dst] = pools_[k].copy_on_write(tables.kinds[k], pos);
    if (src == -2) return false;
    if (src >= 0) copies->push_back({k, src, dst});
  }
  return true;
}

PrefixHit BlockManager::find_cached_prefix(const int32_t* tokens, int32_t max_tokens) const {
  PrefixHit hit;
  if (!prefix_caching_) return hit;
  size_t shortest = SIZE_MAX;
  for (const BlockPool& p : pools_) {
    hit.blocks.push_back(p.find_cached_prefix(tokens, max_tokens));
    shortest = std::min(shortest, hit.blocks.back().size());
  }
  for (auto& b : hit.blocks) b.resize(shortest);
  hit.num_blocks = static_cast<int32_t>(shortest);
  return hit;
}

bool BlockManager::take_cached_and_allocate(BlockTables& tables, const PrefixHit& hit, int32_t num_tokens) {
  ensure_kinds(tables);
  FANTAI_CHECK(tables.empty(), "take_cached_and_allocate: the tables already hold blocks");
  const int32_t h = static_cast<int32_t>(hit.blocks.size()) == num_kinds() ? hit.num_blocks : 0;
  if (h == 0) return allocate(tables, 0, num_tokens);
  const int32_t start = h * block_size_;
  std::vector<int32_t> taken;
  for (int k = 0; k < num_kinds(); ++k) {
    const int32_t first = first_needed_block(k, start);
    taken.assign(hit.blocks[k].begin() + first, hit.blocks[k].end());
    // Taking an unowned cached block uses up a free one, as a fresh block would.
    const int32_t need = pools_[k].num_evictable(taken) + std::max(blocks_for(num_tokens) - h, 0);
    if (need > pools_[k].num_free_blocks()) return false;
  }
  for (int k = 0; k < num_kinds(); ++k) {
    pools_[k].take_cached(tables.kinds[k], hit.blocks[k], first_needed_block(k, start));
    FANTAI_CHECK(pools_[k].allocate(tables.kinds[k], num_tokens), "take_cached_and_allocate: pool " << k);
  }
  return true;
}

void BlockManager::cache_full_blocks(BlockTables& tables, const int32_t* tokens, int32_t num_computed) {
  for (size_t k = 0; k < tables.kinds.size(); ++k)
    pools_[k].cache_full_blocks(tables.kinds[k], tokens, num_computed);
}

void BlockManager::record_lookup(int32_t queried, int32_t hit) { pools_[0].record_lookup(queried, hit); }

int32_t BlockManager::reset_prefix_cache() {
  int32_t n = 0;
  for (BlockPool& p : pools_) n += p.reset_prefix_cache();
  return n;
}

void BlockManager::set_swap_slots(int32_t slots_per_kind) {
  FANTAI_REQUIRE(slots_per_kind >= 0, "swap slots must be >= 0, got " << slots_per_kind);
  FANTAI_CHECK(swap_slots_ == 0 || num_free_swap_slots() == num_swap_slots(), "set_swap_slots: slots in use");
  swap_slots_ = slots_per_kind;
  swap_free_.assign(pools_.size(), {});
  for (auto& f : swap_free_)
    for (int32_t s = slots_per_kind - 1; s >= 0; --s) f.push_back(s);
}

int32_t BlockManager::num_swap_slots() const { return swap_slots_ * num_kinds(); }

int32_t BlockManager::num_free_swap_slots() const {
  int32_t n = 0;
  for (const auto& f : swap_free_) n += static_cast<int32_t>(f.size());
  return n;
}

bool BlockManager::can_swap_out(const BlockTables& tables) const {
  if (swap_slots_ == 0 || tables.kinds.size() != pools_.size()) return false;
  for (int k = 0; k < num_kinds(); ++k)
    if (tables.kinds[k].num_live() > static_cast<int32_t>(swap_free_[k].size())) return false;
  return true;
}

void BlockManager::swap_out(BlockTables& tables, SwappedTables* out, std::vector<BlockCopy>* copies) {
  FANTAI_CHECK(can_swap_out(tables), "swap_out: not enough free swap slots");
  FANTAI_CHECK(out->empty(), "swap_out: the request is already swapped");
  out->kinds.resize(pools_.size());
  for (int k = 0; k < num_kinds(); ++k) {
    const BlockTable& t = tables.kinds[k];
    SwappedTables::Kind& s = out->kinds[k];
    s.num_tokens = t.num_tokens;
    s.num_dropped = t.num_dropped;
    s.dropped_uid = t.dropped_uid;
    for (size_t i = t.num_dropped; i < t.blocks.size(); ++i) {
      const int32_t slot = swap_free_[k].back();
      swap_free_[k].pop_back();
      s.slots.push_back(slot);
      copies->push_back({k, t.blocks[i], slot, BlockCopy::kToSwap});
    }
  }
  free(tables);
}

bool BlockManager::swap_in(SwappedTables& swapped, BlockTables& tables, int32_t num_tokens,
                           std::vector<BlockCopy>* copies) {
  FANTAI_CHECK(swapped.kinds.size() == pools_.size() && tables.empty(), "swap_in: not a swapped sequence");
  ensure_kinds(tables);
  for (int k = 0; k < num_kinds(); ++k) {
    const SwappedTables::Kind& s = swapped.kinds[k];
    const int32_t live = static_cast<int32_t>(s.slots.size());
    const int32_t grow = std::max(blocks_for(num_tokens) - blocks_for(s.num_tokens), 0);
    if (live + grow > pools_[k].num_free_blocks()) return false;
  }
  std::vector<int32_t> fresh;
  for (int k = 0; k < num_kinds(); ++k) {
    SwappedTables::Kind& s = swapped.kinds[k];
    fresh.clear();
    const int32_t n = blocks_for(s.num_tokens);
    FANTAI_CHECK(pools_[k].restore(tables.kinds[k], n, s.num_dropped, s.dropped_uid, s.num_tokens, &fresh),
                 "swap_in: pool " << k << " refused");
    for (size_t i = 0; i < fresh.size(); ++i)
      copies->push_back({k, s.slots[i], fresh[i], BlockCopy::kFromSwap});
  }
  FANTAI_CHECK(allocate(tables, swapped.num_tokens(), num_tokens), "swap_in: growth refused");
  free_swapped(swapped);
  return true;
}

std::vector<int32_t> BlockManager::free_swap_slots(int kind) const {
  std::vector<int32_t> f = swap_free_.empty() ? std::vector<int32_t>{} : swap_free_[kind];
  std::sort(f.begin(), f.end());
  return f;
}

void BlockManager::free_swapped(SwappedTables& swapped) {
  for (size_t k = 0; k < swapped.kinds.size(); ++k)
    for (auto it = swapped.kinds[k].slots.rbegin(); it != swapped.kinds[k].slots.rend(); ++it)
      swap_free_[k].push_back(*it);
  swapped.kinds.clear();
}

void BlockManager::check_invariants(const std::vector<const BlockTables*>& live,
                                    const std::vector<const SwappedTables*>* swapped) const {
  if (swapped != nullptr) {
    for (int k = 0; k < static_cast<int>(swap_free_.size()); ++k) {
      std::vector<int32_t> held(swap_free_[k]);
      for (const SwappedTables* s : *swapped)
        if (!s->empty()) held.insert(held.end(), s->kinds[k].slots.begin(), s->kinds[k].slots.end());
      std::sort(held.begin(), held.end());
      for (int32_t i = 0; i < static_cast<int32_t>(held.size()); ++i)
        FANTAI_CHECK(held[i] == i, "swap slots of kind " << k << ": slot " << i << " is lost or held twice");
      FANTAI_CHECK(static_cast<int32_t>(held.size()) == swap_slots_,
                   "swap slots of kind " << k << ": " << held.size() << " accounted for, " << swap_slots_);
    }
  }
  for (int k = 0; k < num_kinds(); ++k) {
    std::vector<const BlockTable*> tables;
    for (const BlockTables* t : live) {
      FANTAI_CHECK(t != nullptr, "check_invariants: null tables");
      if (t->kinds.empty()) continue;
      FANTAI_CHECK(t->kinds.size() == pools_.size(),
                   "a sequence has " << t->kinds.size() << " tables for " << pools_.size() << " kinds");
      FANTAI_CHECK(t->kinds[k].num_tokens == t->kinds[0].num_tokens,
                   "kind " << k << " holds " << t->kinds[k].num_tokens << " tokens, kind 0 "
                           << t->kinds[0].num_tokens);
      tables.push_back(&t->kinds[k]);
    }
    pools_[k].check_invariants(tables);
  }
}

}  // namespace fantai::engine
