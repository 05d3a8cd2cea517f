// model: KV pool allocation.
#include "model/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include "common/check.h"

namespace fantai::model {

size_t KVCache::bytes_per_block(const ModelConfig& c, int32_t block_size, DType dtype) {
  const KVLayout one{1, block_size, c.num_kv_heads, c.head_dim, dtype};
  return static_cast<size_t>(c.num_layers) * 2 * (one.block_data_bytes() + one.block_scale_bytes());
}

KVCache::KVCache(const ModelConfig& c, int32_t num_blocks, int32_t block_size, DType dtype,
                 Backend* backend) {
  FANTAI_REQUIRE(num_blocks > 0, "the KV pool must hold at least one block");
  FANTAI_REQUIRE(block_size > 0 && block_size <= 1024, "block_size must be in [1, 1024]");
  FANTAI_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kI8,
                 "unsupported KV cache dtype " << dtype_name(dtype));
  layout_ = KVLayout{num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype};
  block_bytes_ = layout_.block_data_bytes();
  block_scale_bytes_ = layout_.block_scale_bytes();
  // Each layer buffer starts 64-byte aligned (the backend's alignment), for vector loads.
  layer_bytes_ = (layout_.bytes() + 63) & ~size_t{63};
  num_layers_ = c.num_layers;
  // Not zeroed: attention reads only slots written this or an earlier step, and untouched pages
  // cost no resident memory.
  buffer_ = Buffer(backend, layer_bytes_ * 2 * c.num_layers, /*zero=*/false);
}

void KVCache::copy_block(int32_t src, int32_t dst, Backend* backend) {
  for (int layer = 0; layer < num_layers_; ++layer) {
    for (int which = 0; which < 2; ++which) {
      char* base = static_cast<char*>(this->base(layer, which));
      backend->copy(base + dst * block_bytes_, base + src * block_bytes_, block_bytes_);
      if (block_scale_bytes_) {
        char* sc = base + layout_.scales_offset();
        backend->copy(sc + dst * block_scale_bytes_, sc + src * block_scale_bytes_, block_scale_bytes_);
      }
    }
  }
}

size_t KVCache::resident_bytes() const {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(buffer_.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(buffer_.data()) + buffer_.bytes();
  std::vector<unsigned char> vec((end - begin + page - 1) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()) != 0) return 0;
  size_t pages = 0;
  for (unsigned char v : vec) pages += v & 1;
  return pages * page;
}

void KVCache::release_blocks(int32_t first, int32_t count, Backend* backend) {
  for (int layer = 0; layer < num_layers_; ++layer) {
    for (int which = 0; which < 2; ++which) {
      char* base = static_cast<char*>(this->base(layer, which));
      backend->release_pages(base + first * block_bytes_, static_cast<size_t>(count) * block_bytes_);
      if (block_scale_bytes_)
        backend->release_pages(base + layout_.scales_offset() + first * block_scale_bytes_,
                               static_cast<size_t>(count) * block_scale_bytes_);
    }
  }
}

}  // namespace fantai::model
