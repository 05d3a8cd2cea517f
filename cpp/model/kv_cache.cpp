// model: KV pool allocation.
#include "model/kv_cache.h"

#include "common/check.h"

namespace fantai::model {

size_t KVCache::bytes_per_block(const ModelConfig& c, int32_t block_size, DType dtype) {
  return static_cast<size_t>(c.num_layers) * 2 * c.num_kv_heads * block_size * c.head_dim *
         dtype_size(dtype);
}

KVCache::KVCache(const ModelConfig& c, int32_t num_blocks, int32_t block_size, DType dtype,
                 Backend* backend) {
  FANTAI_REQUIRE(num_blocks > 0, "the KV pool must hold at least one block");
  FANTAI_REQUIRE(block_size > 0 && block_size <= 1024, "block_size must be in [1, 1024]");
  layout_ = KVLayout{num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype};
  layer_bytes_ = static_cast<size_t>(num_blocks) * c.num_kv_heads * block_size * c.head_dim *
                 dtype_size(dtype);
  // Not zeroed: attention reads only slots written this or an earlier step, and untouched pages
  // cost no resident memory.
  buffer_ = Buffer(backend, layer_bytes_ * 2 * c.num_layers, /*zero=*/false);
}

}  // namespace fantai::model
