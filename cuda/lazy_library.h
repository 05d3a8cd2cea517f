// cuda: shared libraries the CUDA backend opens on first use instead of linking them (NCCL,
// cuBLASLt). A linked one is loaded with libengine, and its CUDA code registered, in every process
// that imports fantai: about 170 MiB of RSS for the two, on the CPU backend too. Plain C++ (no
// CUDA headers), so the registry can read the loaders' status.
#pragma once

#include <cstdint>
#include <string>

namespace fantai::cuda {

// What opening a library gave: the file, the version it reports, or why it is unusable.
struct LibraryStatus {
  std::string path;  // the file opened; "" when none opened
  int64_t version = 0;
  std::string error;  // "" when it was opened and every function of its table resolved
};

// One library, opened RTLD_NOW | RTLD_LOCAL: a missing symbol fails here rather than at a call
// deep in a step, and its symbols cannot clash with another copy in the process (a PyTorch's).
// Tried in order: the path in environment variable `env` when set (that alone: a path a user
// chose that fails is an error, not a cue to load another copy), `build_dir`/`soname` (where
// CMake found it; "" for none), then `soname` through the loader's search path.
class LazyLibrary {
 public:
  LazyLibrary(const char* label, const char* env, const char* build_dir, const char* soname);
  LazyLibrary(const LazyLibrary&) = delete;
  LazyLibrary& operator=(const LazyLibrary&) = delete;

  // Looks `name` up into `fn`; a missing one turns the status into an error naming it.
  template <typename F>
  void resolve(F& fn, const char* name) {
    fn = reinterpret_cast<F>(symbol(name));
  }
  // Once every function is resolved: the status, and the library closed again if it failed (a
  // half-usable copy would hold its memory for nothing).
  LibraryStatus finish();

 private:
  void* symbol(const char* name);

  std::string label_;
  void* handle_ = nullptr;
  LibraryStatus status_;
};

// Function tables, one per library, from an X-macro list of the header's function names: each
// member is typed from the header's own declaration, so a changed signature fails to compile.
#define FANTAI_LAZY_MEMBER(f) decltype(&::f) f = nullptr;
#define FANTAI_LAZY_RESOLVE(f) lib.resolve(api->f, #f);

}  // namespace fantai::cuda
