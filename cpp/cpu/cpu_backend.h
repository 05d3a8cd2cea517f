// cpu: factory of the CPU backend (always built).
#pragma once

#include <memory>

#include "backend/backend.h"

namespace fantai::cpu {

std::shared_ptr<Backend> create_cpu_backend(int num_threads);

// The instruction-set level chosen at run time ("avx512", "avx2", "scalar"); FANTAI_CPU_ISA
// (same names) forces a lower level for testing.
const char* selected_isa();

}  // namespace fantai::cpu
