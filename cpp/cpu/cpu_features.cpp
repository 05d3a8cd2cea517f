// cpu: the CPUID/XGETBV probe and the FANTAI_* switches (see cpu_features.h); the kernels compiled
// with -mavx2/-mavx512*/-mamx-* are only called when it says so.
#include "cpu/cpu_features.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/logging.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
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

// Tile state granted by Linux (arch_prctl ARCH_REQ_XCOMP_PERM); AMX instructions fault without it.
bool tile_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
#else
  return false;
#endif
}

CpuFeatures probe() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6) return f;  // OS must save XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  if (!(avx2 && fma && f16c)) return f;
  f.isa = Isa::kAvx2;
  unsigned a1 = 0, b1, c1, d1;
  const bool leaf71 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  f.avx_vnni = leaf71 && ((a1 >> 4) & 1);  // leaf 7.1 EAX bit 4: AVX-VNNI
  const bool avx512f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
  const bool zmm_state = (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM0-15 high halves, ZMM16-31
  if (!(avx512f && dq && bw && vl && zmm_state)) return f;
  f.isa = Isa::kAvx512;
  f.avx512_vnni = c & (1u << 11);
  // Leaf 7.0 EDX: bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8; leaf 7.1 EAX bit 5: AVX512-BF16.
  const bool amx_tile = (d >> 24) & 1, amx_bf16 = (d >> 22) & 1, amx_int8 = (d >> 25) & 1;
  f.avx512_bf16 = leaf71 && ((a1 >> 5) & 1);
  const bool tiles = amx_tile && (amx_bf16 || amx_int8) && tile_permission();
  f.amx_bf16 = tiles && amx_bf16 && f.avx512_bf16;
  f.amx_int8 = tiles && amx_int8;
  return f;
}
#else
CpuFeatures probe() { return {}; }
#endif

Isa choose() {
  const Isa hw = cpu_features().isa;
  const char* env = std::getenv("FANTAI_CPU_ISA");
  if (!env || !*env) return hw;
  Isa want;
  if (!parse_isa(env, &want)) {
    FANTAI_LOG(kWarning, "FANTAI_CPU_ISA='" << env << "' not understood (avx512|avxvnni|avx2|scalar); using "
                                            << isa_name(hw));
    return hw;
  }
  if (static_cast<int>(want) > static_cast<int>(hw) ||
      (!std::strcmp(env, "avxvnni") && !cpu_features().avx_vnni)) {
    FANTAI_LOG(kWarning, "FANTAI_CPU_ISA=" << env << " not supported by this CPU; using " << isa_name(hw));
    return hw;
  }
  return want;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

namespace {
// A 0|1 switch: 0 or 1 as set, unset_value when unset or empty; anything else is refused.
int zero_one(const char* name, int unset_value) {
  const char* v = std::getenv(name);
  if (!v || !*v) return unset_value;
  FANTAI_REQUIRE(!std::strcmp(v, "0") || !std::strcmp(v, "1"), name << "='" << v << "' not understood (0|1)");
  return v[0] == '1';
}
}  // namespace

CpuSwitches cpu_switches() {
  CpuSwitches s;
  const char* qk = std::getenv("FANTAI_QUANT_KERNEL");
  FANTAI_REQUIRE(!qk || !*qk || !std::strcmp(qk, "f32") || !std::strcmp(qk, "int8") ||
                     !std::strcmp(qk, "vnni"),
                 "FANTAI_QUANT_KERNEL='" << qk << "' not understood (int8|f32)");
  s.quant_f32 = qk && !std::strcmp(qk, "f32");
  s.amx = zero_one("FANTAI_AMX", 1) == 1;
  s.huge_pages = zero_one("FANTAI_HUGEPAGES", 1) == 1;
  if (const char* v = std::getenv("FANTAI_BF16_LAYOUT"); v && *v) {
    using L = CpuSwitches::Bf16Layout;
    s.bf16_layout = !std::strcmp(v, "rows")     ? L::kRows
                    : !std::strcmp(v, "pairs")  ? L::kPairs
                    : !std::strcmp(v, "groups") ? L::kGroups
                                                : L::kDefault;
    FANTAI_REQUIRE(s.bf16_layout != L::kDefault,
                   "FANTAI_BF16_LAYOUT='" << v << "' not understood (rows|pairs|groups)");
  }
  return s;
}

Isa detected_isa() { return cpu_features().isa; }

bool avx_vnni_panels() {
  static const bool on = [] {
    if (!cpu_features().avx_vnni) return false;
    const char* env = std::getenv("FANTAI_CPU_ISA");
    if (!env || !*env) return cpu_features().isa == Isa::kAvx2;
    return !std::strcmp(env, "avxvnni");
  }();
  return on;
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
  if (!std::strcmp(s, "avx512")) {
    *out = Isa::kAvx512;
    return true;
  }
  if (!std::strcmp(s, "avx2") || !std::strcmp(s, "avxvnni")) {
    *out = Isa::kAvx2;
    return true;
  }
  if (!std::strcmp(s, "scalar")) {
    *out = Isa::kScalar;
    return true;
  }
  return false;
}

}  // namespace fantai::cpu
