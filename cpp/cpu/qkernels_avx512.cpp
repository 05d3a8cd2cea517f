// cpu: quantized-weight kernels, AVX-512 (16 lanes, mask-register tails); per-file ISA flags,
// called only after the CPUID probe says so.
#include <cstdint>

#include "cpu/qkernels.h"
// Last: the rest of this file is AVX-512 code (see the header).
#include "cpu/vt_avx512.h"

#ifdef FANTAI_VT_AVX512
namespace fantai::cpu {
namespace avx512_q {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct QT : vt_avx512::VT {
  static constexpr int kTileRows = 4, kTileCols = 4, kDecodeCols = 8;
};

#include "cpu/qkernels_impl.h"

}  // namespace
}  // namespace avx512_q

const QKernelTable* avx512_qkernels() { return &avx512_q::kQTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const QKernelTable* avx512_qkernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
