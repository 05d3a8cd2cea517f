// model: the paged K/V pool in backend memory, one K and one V region per layer, in one pool per
// attention kind (the layers that share a window: full attention, or each sliding window).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/buffer.h"
#include "model/model_config.h"

namespace fantai::model {

// Most kinds a model may have (full + sliding windows of different sizes).
constexpr int kMaxKvKinds = 4;

// Why a pool per kind: a window layer needs a sequence's last blocks only, a full layer all of
// them, so their block tables diverge once a sequence outgrows the window. With one pool, a block
// id would hold memory in every layer, and the window layers' share of a block only the full
// layers use (or the other way round) would be dead. Per kind, block b of kind k lives in the
// layers of kind k alone: freeing it frees exactly what no layer can see any more.
class KVCache {
 public:
  // num_blocks: per kind (KVCache::kind_windows order), or one count for every kind.
  KVCache(const ModelConfig& config, const std::vector<int32_t>& num_blocks, int32_t block_size, DType dtype,
          Backend* backend);
  KVCache(const ModelConfig& config, int32_t num_blocks, int32_t block_size, DType dtype, Backend* backend);
  ~KVCache();  // frees the swap space
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // The model's attention kinds: the distinct layer windows, full attention (0) first, then the
  // windows ascending. Kind k holds the layers whose window is kind_windows(config)[k].
  static std::vector<int32_t> kind_windows(const ModelConfig& config);
  // Bytes one block takes over all layers, K and V (int8 scales included): one block of each kind.
  static size_t bytes_per_block(const ModelConfig& config, int32_t block_size, DType dtype);
  // Bytes one block of kind k takes (its layers only).
  static size_t kind_bytes_per_block(const ModelConfig& config, int32_t block_size, DType dtype, int kind);

  int num_kinds() const { return static_cast<int>(layouts_.size()); }
  int kind(int layer) const { return layer_kind_[layer]; }
  int32_t kind_window(int kind) const { return windows_[kind]; }
  int32_t kind_num_layers(int kind) const { return kind_layers_[kind]; }
  const KVLayout& layout(int kind = 0) const { return layouts_[kind]; }
  void* k(int layer) const { return base(layer, 0); }  // [num_blocks, kv_heads, block_size, head_dim]
  void* v(int layer) const { return base(layer, 1); }
  size_t bytes() const { return buffer_.bytes(); }
  // Copies one block's K and V in every layer of `kind` (copy-on-write after a fork).
  void copy_block(int kind, int32_t src, int32_t dst, Backend* backend);
  // Host swap space: `slots` swap slots per kind, each holding one block of the kind's layers
  // (K, V and int8 scales, layer after layer). Set once; 0 slots: none.
  void reserve_swap(int32_t slots, Backend* backend);
  int32_t swap_slots() const { return swap_slots_; }
  size_t swap_bytes() const { return swap_bytes_; }
  // Block `block` of `kind` to swap slot `slot`, and back (into any block of the kind).
  void swap_out(int kind, int32_t block, int32_t slot, Backend* backend);
  void swap_in(int kind, int32_t slot, int32_t block, Backend* backend);
  // Returns the pages of swap slots [first, first + count) of `kind` to the OS (host backends).
  void release_swap_slots(int kind, int32_t first, int32_t count, Backend* backend);
  size_t swap_resident_bytes() const;  // mincore, as resident_bytes
  // Bytes of the pool backed by physical memory right now (mincore; 0 where unsupported).
  size_t resident_bytes() const;
  // Returns the pages of blocks [first, first + count) of `kind` in its layers to the OS.
  void release_blocks(int kind, int32_t first, int32_t count, Backend* backend);

 private:
  void* base(int layer, int which) const {
    return buffer_.as<char>() + layer_offset_[layer] + which * layer_bytes_[layer_kind_[layer]];
  }
  char* swap_slot(int kind, int32_t slot) const;
  // Calls f(device bytes, slot offset, bytes) for each piece of block `block` of `kind`.
  template <typename F>
  void for_each_piece(int kind, int32_t block, F&& f) const;

  std::vector<KVLayout> layouts_;     // per kind
  std::vector<int32_t> windows_;      // per kind
  std::vector<int32_t> kind_layers_;  // per kind: layers in it
  std::vector<size_t> layer_bytes_;   // per kind: one of K or V of one layer, 64-byte rounded
  std::vector<int> layer_kind_;       // per layer
  std::vector<size_t> layer_offset_;  // per layer: where its K region starts (V follows)
  size_t block_bytes_ = 0;            // one block of K (or V) values of one layer
  size_t block_scale_bytes_ = 0;      // its int8 scales (0 for float types)
  int32_t num_layers_ = 0;
  Buffer buffer_;
  int32_t swap_slots_ = 0;
  size_t swap_bytes_ = 0;
  std::vector<size_t> swap_offset_;  // per kind: where its slots start
  void* swap_ = nullptr;
  Backend* swap_backend_ = nullptr;
};

}  // namespace fantai::model
