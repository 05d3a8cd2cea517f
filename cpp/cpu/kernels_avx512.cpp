// cpu: AVX-512 (F/BW/VL/DQ) kernels, 16-wide with mask-register tails; built with per-file
// -mavx512* flags, called only after the CPUID probe says so.
#include <cstdint>

#include "cpu/kernels.h"
// Last: the rest of this file is AVX-512 code (see the header).
#include "cpu/vt_avx512.h"

#ifdef FANTAI_VT_AVX512
namespace fantai::cpu {
namespace avx512_impl {
namespace {  // internal linkage: no symbol of one ISA can stand in for another

struct VT : vt_avx512::VT {
  // 32 zmm registers: 6x4 accumulators + 6 x rows + 1 weight row (measured best of 4x4, 4x6,
  // 6x4, 8x3 for k=576 bf16/f32); the bf16 pair layout keeps that tile (+ its mask register).
  static constexpr int kTileRows = 6, kTileCols = 4, kDecodeCols = 8, kPairTileRows = 6, kPairTileCols = 4;
  static constexpr int kGroupTileRows = 6, kGroupTileCols = 4;  // the row-major tile, group-aligned
  // Attention: 4 rows x 4 keys of score chains (16 accumulators, one VT::hsum_w); 6 rows x 4
  // head_dim chunks of output accumulators (24) while V rows stream.
  static constexpr int kAttnQkRows = 4, kAttnRows = 6, kAttnChunks = 4;
  static constexpr int kAttnChunksFew = 4;       // as kAttnChunks: AVX-512 keeps its measured tiles
  static constexpr int kAttnPrefetchBlocks = 1;  // how far ahead attention prefetches K/V
};

#include "cpu/kernels_impl.h"

}  // namespace
}  // namespace avx512_impl

const KernelTable* avx512_kernels() { return &avx512_impl::kTable; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
const KernelTable* avx512_kernels() { return nullptr; }
}  // namespace fantai::cpu
#endif
