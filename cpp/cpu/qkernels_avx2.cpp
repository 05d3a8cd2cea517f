// cpu: quantized-weight kernels, AVX2 + FMA (8 lanes); per-file ISA flags, called only after the
// CPUID probe says so.
#include <cstdint>

#include "cpu/qkernels.h"
// Last: the rest of this file is AVX2 code (see the header).
#include "cpu/vt_avx2.h"

#ifdef FANTAI_VT_AVX2
namespace fantai::cpu {
namespace avx2_q {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct QT : vt_avx2::VT {
  static constexpr int kTileRows = 4, kTileCols = 2, kDecodeCols = 4;
};

#include "cpu/qkernels_impl.h"

}  // namespace
}  // namespace avx2_q

const QKernelTable* avx2_qkernels() { return &avx2_q::kQTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const QKernelTable* avx2_qkernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
