// cpu: AVX2 + FMA + F16C kernels (8-wide); built with per-file -mavx2 -mfma -mf16c, called only
// after the CPUID probe says so.
#include <cstdint>

#include "cpu/kernels.h"
// Last: the rest of this file is AVX2 code (see the header).
#include "cpu/vt_avx2.h"

#ifdef FANTAI_VT_AVX2
namespace fantai::cpu {
namespace avx2_impl {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct VT : vt_avx2::VT {
  // 16 ymm registers: 4x3 accumulators + 4 x rows + 1 weight row (x may come as a memory
  // operand); measured ahead of 3x4 and 2x4. Decode streams 4 weight rows side by side, not 8:
  // on an AVX2-only EPYC (Zen 3) the bf16 decode step ran 85.6 against 73.5 tok/s (median of 7
  // alternated pairs, bench_kernels --only step), f32 47.5 against 44; a row's sum is the same
  // either way (one accumulator per row, in k order).
  static constexpr int kTileRows = 4, kTileCols = 3, kDecodeCols = 4;
  // The bf16 pair layout's tile: 4x2 accumulators + 4 x rows (held in registers, VT::pin) + 1
  // weight row + the 2 shuffle controls. Against the row-major 4x3 (bench_kernels --only linear
  // --isa avx2): m = 512 at 0.89-0.97 of its time on 1 thread, 0.78-0.93 on 2; a 3x3 pair tile
  // ran at 1.04-1.22.
  static constexpr int kPairTileRows = 4, kPairTileCols = 2;
  // The group layout's tile (kernels_linear_impl.h: it must not straddle a group's halves): 3x4
  // accumulators, the x rows as the FMAs' memory operands or in the 4 registers left.
  static constexpr int kGroupTileRows = 3, kGroupTileCols = 4;
  // Attention: 2 rows x 4 keys of score chains (8 accumulators, one VT::hsum_w); 4 rows x 2
  // head_dim chunks of output accumulators (8 of the 16 ymm).
  static constexpr int kAttnQkRows = 2, kAttnRows = 4, kAttnChunks = 2;
  // Tiles of up to 3 rows: 4 chunks, 12 accumulators; a 16-key block is then 2 passes over V, not 4.
  static constexpr int kAttnChunksFew = 4;
  static constexpr int kAttnPrefetchBlocks = 1;  // how far ahead attention prefetches K/V
};

#include "cpu/kernels_impl.h"

}  // namespace
}  // namespace avx2_impl

const KernelTable* avx2_kernels() { return &avx2_impl::kTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
