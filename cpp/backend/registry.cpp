// backend: the registry that picks a backend by name (one of the three dispatch points).
#include <cstring>

#include "backend/backend.h"
#include "common/check.h"
#include "cpu/cpu_backend.h"
#ifdef FANTAI_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace fantai {

void Communicator::all_gather(const float* in, float* out, int64_t n) {
  if (in != out) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef FANTAI_WITH_CUDA
  if (cuda::device_count() > 0) names.push_back("cuda");
#endif
  return names;
}

std::shared_ptr<Backend> create_backend(const std::string& name, int num_threads) {
  if (name == "cpu" || name.empty()) return cpu::create_cpu_backend(num_threads);
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifdef FANTAI_WITH_CUDA
    int device = 0;
    if (name.size() > 5) {
      const std::string idx = name.substr(5);
      FANTAI_REQUIRE(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
                     "bad CUDA device '" << name << "' (use cuda or cuda:N)");
      device = std::stoi(idx);
    }
    return cuda::create_cuda_backend(device);
#else
    FANTAI_THROW("backend '" << name << "' is unavailable: this fantai was built without CUDA "
                             "(rebuild with nvcc on PATH, or -C cmake.define.FANTAI_CUDA=ON to require it)");
#endif
  }
  FANTAI_THROW("unknown backend '" << name << "' (known: cpu, cuda)");
}

}  // namespace fantai
