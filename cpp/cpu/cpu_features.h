// cpu: run-time instruction-set probe (CPUID once) and the FANTAI_CPU_ISA override.
#pragma once

namespace fantai::cpu {

// Ordered: a higher level implies the lower ones are usable too.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Highest level both the CPU and the OS (saved register state) support. Probed once.
Isa detected_isa();
// detected_isa(), lowered by FANTAI_CPU_ISA=avx512|avx2|scalar when set (never raised).
Isa active_isa();
const char* isa_name(Isa isa);
// Parses "avx512" / "avx2" / "scalar"; returns false for anything else.
bool parse_isa(const char* s, Isa* out);

}  // namespace fantai::cpu
