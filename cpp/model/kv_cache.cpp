// model: KV pool allocation, per attention kind.
#include "model/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "common/check.h"

namespace fantai::model {
namespace {

// The window of every layer (a config built in code may leave layer_window empty: all full).
int32_t window_of(const ModelConfig& c, int layer) {
  return layer < static_cast<int>(c.layer_window.size()) ? c.layer_window[layer] : 0;
}

}  // namespace

std::vector<int32_t> KVCache::kind_windows(const ModelConfig& c) {
  std::vector<int32_t> w;
  for (int layer = 0; layer < c.num_layers; ++layer) w.push_back(window_of(c, layer));
  std::sort(w.begin(), w.end());
  w.erase(std::unique(w.begin(), w.end()), w.end());
  if (w.empty()) w.push_back(0);
  return w;
}

size_t KVCache::kind_bytes_per_block(const ModelConfig& c, int32_t block_size, DType dtype, int kind) {
  const KVLayout one{1, block_size, c.num_kv_heads, c.head_dim, dtype};
  const int32_t window = kind_windows(c)[kind];
  size_t layers = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) layers += window_of(c, layer) == window;
  return layers * 2 * (one.block_data_bytes() + one.block_scale_bytes());
}

size_t KVCache::bytes_per_block(const ModelConfig& c, int32_t block_size, DType dtype) {
  const KVLayout one{1, block_size, c.num_kv_heads, c.head_dim, dtype};
  return static_cast<size_t>(c.num_layers) * 2 * (one.block_data_bytes() + one.block_scale_bytes());
}

KVCache::KVCache(const ModelConfig& c, int32_t num_blocks, int32_t block_size, DType dtype, Backend* backend)
    : KVCache(c, std::vector<int32_t>(kind_windows(c).size(), num_blocks), block_size, dtype, backend) {}

KVCache::KVCache(const ModelConfig& c, const std::vector<int32_t>& num_blocks, int32_t block_size,
                 DType dtype, Backend* backend) {
  windows_ = kind_windows(c);
  const int kinds = static_cast<int>(windows_.size());
  FANTAI_REQUIRE(kinds <= kMaxKvKinds, "the model's layers use " << kinds
                                                                 << " different attention windows; at most "
                                                                 << kMaxKvKinds);
  FANTAI_REQUIRE(static_cast<int>(num_blocks.size()) == kinds,
                 "the KV pool needs a block count for each of its " << kinds << " attention kinds");
  FANTAI_REQUIRE(block_size > 0 && block_size <= 1024, "block_size must be in [1, 1024]");
  FANTAI_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kI8,
                 "unsupported KV cache dtype " << dtype_name(dtype));
  kind_layers_.assign(kinds, 0);
  for (int k = 0; k < kinds; ++k) {
    FANTAI_REQUIRE(num_blocks[k] > 0, "the KV pool must hold at least one block");
    layouts_.push_back(KVLayout{num_blocks[k], block_size, c.num_kv_heads, c.head_dim, dtype});
    // Each layer buffer starts 64-byte aligned (the backend's alignment), for vector loads.
    layer_bytes_.push_back((layouts_.back().bytes() + 63) & ~size_t{63});
  }
  block_bytes_ = layouts_[0].block_data_bytes();
  block_scale_bytes_ = layouts_[0].block_scale_bytes();
  num_layers_ = c.num_layers;
  size_t total = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const int k = static_cast<int>(std::find(windows_.begin(), windows_.end(), window_of(c, layer)) -
                                   windows_.begin());
    layer_kind_.push_back(k);
    ++kind_layers_[k];
    layer_offset_.push_back(total);
    total += 2 * layer_bytes_[k];
  }
  // Not zeroed: attention reads only slots written this or an earlier step, and untouched pages
  // cost no resident memory.
  buffer_ = Buffer(backend, total, /*zero=*/false);
}

void KVCache::copy_block(int kind, int32_t src, int32_t dst, Backend* backend) {
  const KVLayout& L = layouts_[kind];
  for (int layer = 0; layer < num_layers_; ++layer) {
    if (layer_kind_[layer] != kind) continue;
    for (int which = 0; which < 2; ++which) {
      char* base = static_cast<char*>(this->base(layer, which));
      backend->copy(base + dst * block_bytes_, base + src * block_bytes_, block_bytes_);
      if (block_scale_bytes_) {
        char* sc = base + L.scales_offset();
        backend->copy(sc + dst * block_scale_bytes_, sc + src * block_scale_bytes_, block_scale_bytes_);
      }
    }
  }
}

namespace {

size_t resident_bytes_of(const void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return 0;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  std::vector<unsigned char> vec((end - begin + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()) != 0) return 0;
  size_t pages = 0;
  for (unsigned char v : vec) pages += v & 1;
  return pages * page;
}

}  // namespace

size_t KVCache::resident_bytes() const { return resident_bytes_of(buffer_.data(), buffer_.bytes()); }

size_t KVCache::swap_resident_bytes() const { return resident_bytes_of(swap_, swap_bytes_); }

void KVCache::release_swap_slots(int kind, int32_t first, int32_t count, Backend* backend) {
  if (count <= 0) return;
  const size_t slot_bytes = static_cast<size_t>(kind_layers_[kind]) * 2 * (block_bytes_ + block_scale_bytes_);
  backend->release_pages(swap_slot(kind, first), static_cast<size_t>(count) * slot_bytes);
}

KVCache::~KVCache() {
  if (swap_ != nullptr) swap_backend_->free_host(swap_);
}

void KVCache::reserve_swap(int32_t slots, Backend* backend) {
  FANTAI_REQUIRE(slots >= 0, "swap slots must be >= 0, got " << slots);
  FANTAI_CHECK(swap_ == nullptr, "reserve_swap: swap space is already reserved");
  swap_slots_ = slots;
  swap_offset_.assign(layouts_.size(), 0);
  size_t total = 0;
  for (int k = 0; k < num_kinds(); ++k) {
    swap_offset_[k] = total;
    total += static_cast<size_t>(slots) * kind_layers_[k] * 2 * (block_bytes_ + block_scale_bytes_);
  }
  swap_bytes_ = total;
  if (total == 0) return;
  swap_ = backend->alloc_host(total);
  swap_backend_ = backend;
}

char* KVCache::swap_slot(int kind, int32_t slot) const {
  FANTAI_CHECK(slot >= 0 && slot < swap_slots_,
               "swap slot " << slot << " outside [0, " << swap_slots_ << ")");
  const size_t slot_bytes = static_cast<size_t>(kind_layers_[kind]) * 2 * (block_bytes_ + block_scale_bytes_);
  return static_cast<char*>(swap_) + swap_offset_[kind] + static_cast<size_t>(slot) * slot_bytes;
}

template <typename F>
void KVCache::for_each_piece(int kind, int32_t block, F&& f) const {
  FANTAI_CHECK(block >= 0 && block < layouts_[kind].num_blocks, "KV block " << block << " outside the pool");
  const KVLayout& L = layouts_[kind];
  size_t at = 0;
  for (int layer = 0; layer < num_layers_; ++layer) {
    if (layer_kind_[layer] != kind) continue;
    for (int which = 0; which < 2; ++which) {
      char* base = static_cast<char*>(this->base(layer, which));
      f(base + block * block_bytes_, at, block_bytes_);
      at += block_bytes_;
      if (block_scale_bytes_) {
        f(base + L.scales_offset() + block * block_scale_bytes_, at, block_scale_bytes_);
        at += block_scale_bytes_;
      }
    }
  }
}

void KVCache::swap_out(int kind, int32_t block, int32_t slot, Backend* backend) {
  char* host = swap_slot(kind, slot);
  for_each_piece(kind, block,
                 [&](char* dev, size_t at, size_t n) { backend->copy_to_host(host + at, dev, n); });
}

void KVCache::swap_in(int kind, int32_t slot, int32_t block, Backend* backend) {
  const char* host = swap_slot(kind, slot);
  for_each_piece(kind, block,
                 [&](char* dev, size_t at, size_t n) { backend->copy_from_host(dev, host + at, n); });
}

void KVCache::release_blocks(int kind, int32_t first, int32_t count, Backend* backend) {
  const KVLayout& L = layouts_[kind];
  for (int layer = 0; layer < num_layers_; ++layer) {
    if (layer_kind_[layer] != kind) continue;
    for (int which = 0; which < 2; ++which) {
      char* base = static_cast<char*>(this->base(layer, which));
      backend->release_pages(base + first * block_bytes_, static_cast<size_t>(count) * block_bytes_);
      if (block_scale_bytes_)
        backend->release_pages(base + L.scales_offset() + first * block_scale_bytes_,
                               static_cast<size_t>(count) * block_scale_bytes_);
    }
  }
}

}  // namespace fantai::model
