// cpu: factory of the CPU backend (always built).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cpu/cpu_features.h"

namespace fantai::cpu {

std::shared_ptr<Backend> create_cpu_backend(int num_threads);
// The CPU backend on a given ISA level (tests and benches compare levels; the registry uses
// active_isa()).
std::shared_ptr<Backend> make_cpu_backend(Isa isa, int num_threads);

// The instruction-set level chosen at run time ("avx512", "avxvnni", "avx2", "scalar");
// FANTAI_CPU_ISA (same names) forces a lower level for testing. "avxvnni" is level avx2 with the
// AVX-VNNI int8 panels (avx_vnni_panels).
const char* selected_isa();

// Every level this CPU can run, lowest first ("scalar", "avx2", "avxvnni" where the CPU has it,
// ...): what FANTAI_CPU_ISA may name.
std::vector<std::string> runnable_isas();

// Threads a backend gets when none are asked for: the affinity mask capped by the cgroup quota.
int default_threads();

// The sampler's row reductions from the kernel table of active_isa() (the registry hands them out
// as host_row_reductions).
const RowReductions& row_reductions();

}  // namespace fantai::cpu
