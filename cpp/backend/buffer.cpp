// backend: Buffer's allocation, release and moves.
#include "backend/buffer.h"

namespace fantai {

Buffer::Buffer(Backend* backend, size_t bytes, bool zero)
    : Buffer(backend, bytes, backend->alloc(bytes), zero) {}
Buffer::Buffer(Backend* backend, size_t bytes, void* data, bool zero)
    : backend_(backend), data_(data), bytes_(bytes) {
  if (zero) backend_->fill_zero(data_, bytes);
}
Buffer Buffer::weights(Backend* backend, size_t bytes, bool zero) {
  return Buffer(backend, bytes, backend->alloc_weights(bytes), zero);
}
Buffer::~Buffer() {
  if (data_) backend_->free(data_);
}
Buffer::Buffer(Buffer&& o) noexcept : backend_(o.backend_), data_(o.data_), bytes_(o.bytes_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (data_) backend_->free(data_);
    backend_ = o.backend_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

}  // namespace fantai
