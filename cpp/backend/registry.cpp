// backend: the registry that picks a backend by name (one of the three dispatch points).
#include <cstring>

#include "backend/backend.h"
#include "common/check.h"
#include "cpu/cpu_backend.h"

namespace fantai {

void Communicator::all_gather(const float* in, float* out, int64_t n) {
  if (in != out) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

std::vector<std::string> available_backends() { return {"cpu"}; }

std::shared_ptr<Backend> create_backend(const std::string& name, int num_threads) {
  if (name == "cpu" || name.empty()) return cpu::create_cpu_backend(num_threads);
  FANTAI_THROW("unknown or unavailable backend '" << name << "' (available: cpu)");
}

}  // namespace fantai
