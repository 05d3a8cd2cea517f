// cuda: opening NCCL and cuBLASLt at run time (see lazy_library.h).
#include "cuda/lazy_library.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>

namespace fantai::cuda {
namespace {

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

}  // namespace

LazyLibrary::LazyLibrary(const char* label, const char* env, const char* build_dir, const char* soname)
    : label_(label) {
  constexpr int kFlags = RTLD_NOW | RTLD_LOCAL;
  const char* chosen = std::getenv(env);
  if (chosen && *chosen) {
    handle_ = dlopen(chosen, kFlags);
    if (handle_) status_.path = chosen;
    else
      status_.error = label_ + " could not be loaded from " + env + "=" + chosen + ": " + dl_error() +
                      " (point " + env + " at " + soname + ", or unset it)";
    return;
  }
  std::string tried;
  if (build_dir && *build_dir) {
    const std::string path = std::string(build_dir) + "/" + soname;
    handle_ = dlopen(path.c_str(), kFlags);
    if (handle_) {
      status_.path = path;
      return;
    }
    tried = path + " (" + dl_error() + "), then ";
  }
  handle_ = dlopen(soname, kFlags);
  if (!handle_) {
    status_.error = label_ + " could not be loaded: tried " + tried + soname + " on the loader's path (" +
                    dl_error() + "); set " + env + " to the path of " + soname;
    return;
  }
  // Which file the loader's search found, for the status and the log.
  link_map* map = nullptr;
  status_.path = dlinfo(handle_, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name
                     ? map->l_name
                     : soname;
}

void* LazyLibrary::symbol(const char* name) {
  if (!handle_) return nullptr;
  void* p = dlsym(handle_, name);
  if (!p && status_.error.empty())
    status_.error = label_ + " at " + status_.path + " lacks " + name + " (" + dl_error() +
                    "): an older or foreign build of it?";
  return p;
}

LibraryStatus LazyLibrary::finish() {
  if (!status_.error.empty() && handle_) {
    dlclose(handle_);
    handle_ = nullptr;
  }
  return status_;
}

}  // namespace fantai::cuda
