// backend: Buffer, memory of one backend that frees itself (weights, KV pool, activations).
#pragma once

#include <cstddef>

#include "backend/backend.h"

namespace fantai {

// A buffer in backend memory that frees itself.
class Buffer {
 public:
  Buffer() = default;
  // zero=false leaves the pages untouched (the OS maps them lazily): the KV pool relies on it.
  Buffer(Backend* backend, size_t bytes, bool zero = true);
  // Weight memory (Backend::alloc_weights).
  static Buffer weights(Backend* backend, size_t bytes, bool zero);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  Buffer(Backend* backend, size_t bytes, void* data, bool zero);  // takes data, from backend
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace fantai
