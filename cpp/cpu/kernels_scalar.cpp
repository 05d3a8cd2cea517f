// cpu: portable kernels (any target) over the 8 plain-float lanes of vt_scalar.h.
#include <cstdint>

#include "cpu/kernels.h"
#include "cpu/vt_scalar.h"

namespace fantai::cpu {
namespace scalar_impl {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct VT : vt_scalar::VT {
  static constexpr int kTileRows = 2, kTileCols = 4, kDecodeCols = 4, kPairTileRows = 2, kPairTileCols = 4;
  static constexpr int kGroupTileRows = 2, kGroupTileCols = 4;
  static constexpr int kAttnQkRows = 2, kAttnRows = 4, kAttnChunks = 1;
  static constexpr int kAttnChunksFew = 1;
  static constexpr int kAttnPrefetchBlocks = 1;  // how far ahead attention prefetches K/V
};

#include "cpu/kernels_impl.h"

}  // namespace
}  // namespace scalar_impl

const KernelTable* scalar_kernels() { return &scalar_impl::kTable; }

}  // namespace fantai::cpu
