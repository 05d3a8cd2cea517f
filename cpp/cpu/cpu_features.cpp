// cpu: CPUID/XGETBV probe; the kernels compiled with -mavx2/-mavx512* are only called when it says so.
#include "cpu/cpu_features.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/logging.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace fantai::cpu {
namespace {

#if defined(__x86_64__) || defined(__i386__)
uint64_t xgetbv0() {
  uint32_t lo, hi;
  // Raw opcode so this file needs no -mxsave.
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

Isa probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::kScalar;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!osxsave || !avx) return Isa::kScalar;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return Isa::kScalar;  // OS must save XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::kScalar;
  const bool avx2 = b & (1u << 5);
  if (!(avx2 && fma && f16c)) return Isa::kScalar;
  const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool zmm_state = (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM0-15 high halves, ZMM16-31
  if (f && dq && bw && vl && zmm_state) return Isa::kAvx512;
  return Isa::kAvx2;
}
#else
Isa probe() { return Isa::kScalar; }
#endif

Isa choose() {
  const Isa hw = probe();
  const char* env = std::getenv("FANTAI_CPU_ISA");
  if (!env || !*env) return hw;
  Isa want;
  if (!parse_isa(env, &want)) {
    FANTAI_LOG(kWarning, "FANTAI_CPU_ISA='" << env << "' not understood (avx512|avx2|scalar); using "
                                            << isa_name(hw));
    return hw;
  }
  if (static_cast<int>(want) > static_cast<int>(hw)) {
    FANTAI_LOG(kWarning, "FANTAI_CPU_ISA=" << env << " not supported by this CPU; using "
                                           << isa_name(hw));
    return hw;
  }
  return want;
}

}  // namespace

Isa detected_isa() {
  static const Isa isa = probe();
  return isa;
}

Isa active_isa() {
  static const Isa isa = choose();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
  }
  return "?";
}

bool parse_isa(const char* s, Isa* out) {
  if (!std::strcmp(s, "avx512")) { *out = Isa::kAvx512; return true; }
  if (!std::strcmp(s, "avx2")) { *out = Isa::kAvx2; return true; }
  if (!std::strcmp(s, "scalar")) { *out = Isa::kScalar; return true; }
  return false;
}

}  // namespace fantai::cpu
