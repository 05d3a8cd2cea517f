// model: the paged K/V pool in backend memory, one K and one V region per layer.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "backend/buffer.h"
#include "model/model_config.h"

namespace fantai::model {

class KVCache {
 public:
  KVCache(const ModelConfig& config, int32_t num_blocks, int32_t block_size, DType dtype, Backend* backend);

  // Bytes one block takes over all layers, K and V (int8 scales included).
  static size_t bytes_per_block(const ModelConfig& config, int32_t block_size, DType dtype);

  const KVLayout& layout() const { return layout_; }
  void* k(int layer) const { return base(layer, 0); }  // [num_blocks, kv_heads, block_size, head_dim]
  void* v(int layer) const { return base(layer, 1); }
  size_t bytes() const { return buffer_.bytes(); }
  // Copies one block's K and V in every layer (copy-on-write after a fork).
  void copy_block(int32_t src, int32_t dst, Backend* backend);
  // Bytes of the pool backed by physical memory right now (mincore; 0 where unsupported).
  size_t resident_bytes() const;
  // Returns the pages of blocks [first, first + count) in every layer to the OS.
  void release_blocks(int32_t first, int32_t count, Backend* backend);

 private:
  void* base(int layer, int which) const {
    return buffer_.as<char>() + (static_cast<size_t>(layer) * 2 + which) * layer_bytes_;
  }

  KVLayout layout_;
  size_t layer_bytes_ = 0;        // one of K or V of one layer, 64-byte rounded (scales included)
  size_t block_bytes_ = 0;        // one block of K (or V) values of one layer
  size_t block_scale_bytes_ = 0;  // its int8 scales (0 for float types)
  int32_t num_layers_ = 0;
  Buffer buffer_;
};

}  // namespace fantai::model
