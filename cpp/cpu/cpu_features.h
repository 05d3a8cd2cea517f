// cpu: the one run-time CPU probe (CPUID, XGETBV and Linux's AMX tile permission, once per
// process) and the one parser of the FANTAI_* kernel switches. Everything else reads these.
#pragma once

namespace fantai::cpu {

// Ordered: a higher level implies the lower ones are usable too.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// What the CPU and the OS offer, probed once.
struct CpuFeatures {
  Isa isa = Isa::kScalar;    // highest level both the CPU and the OS (saved register state) support
  bool avx512_vnni = false;  // vpdpbusd (with isa == kAvx512)
  bool avx512_bf16 = false;  // vdpbf16ps, vcvtneps2bf16 (with isa == kAvx512)
  bool amx_bf16 = false;     // AMX-TILE + AMX-BF16 (+ AVX512-BF16), tile state granted by Linux
  bool amx_int8 = false;     // AMX-TILE + AMX-INT8, tile state granted by Linux
  // VEX vpdpbusd on YMM (with isa >= kAvx2): Alder Lake and later clients, the E-core Xeons
  // (Sierra Forest) that have no AVX-512, Sapphire Rapids and Zen 5 beside their AVX-512 VNNI.
  bool avx_vnni = false;
};
const CpuFeatures& cpu_features();

// The FANTAI_* kernel switches, read from the environment each time a CPU backend is made (so
// a test can flip one between backends). Throws InvalidArgument naming a value it cannot parse.
struct CpuSwitches {
  bool quant_f32 = false;  // FANTAI_QUANT_KERNEL=f32: f32-dequant kernels, exact activations
                           // (default / int8 / vnni: the int8-activation panel kernels)
  bool amx = true;         // FANTAI_AMX=0 turns AMX off (A/B runs)
  bool huge_pages = true;  // FANTAI_HUGEPAGES=0: weights without MADV_HUGEPAGE (A/B runs)
  // FANTAI_BF16_LAYOUT=rows|pairs|groups: bf16 matrices off AMX row-major, in the pair layout or
  // in the group layout (A/B runs); unset (kDefault): the ISA level's default (CpuBackend).
  enum class Bf16Layout { kDefault, kRows, kPairs, kGroups };
  Bf16Layout bf16_layout = Bf16Layout::kDefault;
};
CpuSwitches cpu_switches();

// cpu_features().isa, and that level lowered by FANTAI_CPU_ISA=avx512|avxvnni|avx2|scalar when
// set (never raised; read once per process, a bad value warns and is ignored). avxvnni is the
// avx2 level with the AVX-VNNI panel kernels; avx2 alone is what an AVX2-only CPU (Zen 2/3,
// Haswell to Cascade Lake without AVX-512) runs, whatever this one has.
Isa detected_isa();
Isa active_isa();
// Whether the avx2 level runs its int8 panels on AVX-VNNI: the CPU has it, and either
// FANTAI_CPU_ISA=avxvnni or no FANTAI_CPU_ISA on a CPU whose native level is avx2 (AVX-512 has
// its own VNNI kernels). Read once per process.
bool avx_vnni_panels();
const char* isa_name(Isa isa);
// Parses "avx512" / "avxvnni" / "avx2" / "scalar" (avxvnni is level avx2, see avx_vnni_panels);
// returns false for anything else.
bool parse_isa(const char* s, Isa* out);

}  // namespace fantai::cpu
