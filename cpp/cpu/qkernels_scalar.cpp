// cpu: quantized-weight kernels, portable: the 8 plain-float lanes of vt_scalar.h, the same fixed
// accumulation pattern as the SIMD files and as the dense scalar kernels.
#include <cstdint>

#include "cpu/qkernels.h"
#include "cpu/vt_scalar.h"

namespace fantai::cpu {
namespace scalar_q {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct QT : vt_scalar::VT {
  static constexpr int kTileRows = 2, kTileCols = 4, kDecodeCols = 4;
};

#include "cpu/qkernels_impl.h"

}  // namespace
}  // namespace scalar_q

const QKernelTable* scalar_qkernels() { return &scalar_q::kQTable; }

}  // namespace fantai::cpu
