// cpu: kernel bodies written once over a vector-traits type VT; each kernels_<isa>.cpp defines VT
// (lane width, loads with dtype conversion, FMA, fixed-order horizontal reductions, exp) and
// includes this file inside its own namespace, so every ISA gets its own copy with its own flags.
//
// The bodies live by op in kernels_{linear,rows,attention,reduce}_impl.h, included below; this file
// holds what they share (element loads by dtype) and the table. Deliberately no other #include and
// no std:: templates in any of them: an inline std:: function instantiated in an AVX-512 TU is a
// weak symbol the linker may hand to a baseline caller.
//
// Batch invariance: every output element has exactly one accumulation sequence, fixed by the
// shapes of the op (k, dim, head_dim, block_size) and never by m, tiling or threads:
//  - linear: one W-lane accumulator per y element, k visited in W steps (+ one masked tail),
//    then VT::hsum. Tiles of R rows x C weight rows only change how many such chains run side by
//    side, not any chain.
//  - attention: per (query, head) the KV blocks are visited in order with an online softmax,
//    from a fresh state at each key partition (kernels.h), the partitions' states folded in
//    order; a block's scores, exps, sum and V update do not depend on other queries in the tile,
//    nor a fold on which item or thread ran a partition.

#ifndef FANTAI_KERNELS_IMPL_BODY
#define FANTAI_KERNELS_IMPL_BODY
#endif

using V = VT::V;
constexpr int W = VT::W;

#define FT_INLINE inline __attribute__((always_inline))

// Weight/cache element loads by dtype (DT is the DType value: 0 f32, 1 f16, 2 bf16, 3 int8; int8
// loads give the raw integers as floats, the caller applies the scale).
template <int DT>
FT_INLINE V loadw(const void* base, int64_t i) {
  if constexpr (DT == 0) return VT::load(static_cast<const float*>(base) + i);
  else if constexpr (DT == 1) return VT::load_f16(static_cast<const uint16_t*>(base) + i);
  else if constexpr (DT == 2) return VT::load_bf16(static_cast<const uint16_t*>(base) + i);
  else return VT::load_i8(static_cast<const int8_t*>(base) + i);
}
template <int DT>
FT_INLINE V loadw_n(const void* base, int64_t i, int n) {
  if constexpr (DT == 0) return VT::load_n(static_cast<const float*>(base) + i, n);
  else if constexpr (DT == 1) return VT::load_f16_n(static_cast<const uint16_t*>(base) + i, n);
  else if constexpr (DT == 2) return VT::load_bf16_n(static_cast<const uint16_t*>(base) + i, n);
  else return VT::load_i8_n(static_cast<const int8_t*>(base) + i, n);
}
template <int DT>
constexpr int elem_bytes() {
  return DT == 0 ? 4 : DT == 3 ? 1 : 2;
}

FT_INLINE float fmax_(float a, float b) { return a > b ? a : b; }
FT_INLINE constexpr int imin_(int a, int b) { return a < b ? a : b; }
FT_INLINE constexpr int imax_(int a, int b) { return a > b ? a : b; }

// clang-format off: the op bodies need the shared pieces above, in this order
#include "cpu/kernels_linear_impl.h"
#include "cpu/kernels_rows_impl.h"
#include "cpu/vt_softcap_impl.h"
#include "cpu/kernels_attention_impl.h"
#include "cpu/kernels_reduce_impl.h"
// clang-format on

void hsum_both(const float* x, float* tree, float* each) {
  V a[W];
  for (int i = 0; i < W; ++i) a[i] = VT::load(x + i * W);
  VT::store(tree, VT::hsum_w(a));
  for (int i = 0; i < W; ++i) each[i] = VT::hsum(a[i]);
}

const KernelTable kTable = {VT::kName,
                            linear,
                            linear_bf16_pairs,
                            linear_bf16_groups,
                            rms_norm,
                            add_rms_norm,
                            rope,
                            silu_mul,
                            gelu_tanh_mul,
                            add,
                            to_f32,
                            attention,
                            attention_merge,
                            row_max_sum_exp,
                            row_argmax,
                            W,
                            hsum_both};

#undef FT_INLINE
