// cpu: dense bf16 linear on AMX tiles (tdpbf16ps). Used only where amx_usable() holds; the
// backend then packs every layer matrix once at load and runs it here for every m (decode
// included), so a row never switches between this path and the AVX-512 one (batch invariance).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/kernels.h"

namespace fantai::cpu {

// CPUID AMX-TILE + AMX-BF16 + AVX512-BF16, and Linux granted this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM). Probed once; false on non-x86 builds.
bool amx_usable();
// CPUID AMX-TILE + AMX-INT8 and the tile state granted (the quantized panel linear's tiles).
bool amx_int8_usable();

// Packed layout of a bf16 [n, k] matrix: 16-column blocks, each ceil(k/32) consecutive 1 KiB
// tiles; tile row p holds k pairs (2p, 2p+1) of the block's 16 columns interleaved (VNNI),
// zero padded past n and k.
inline int64_t amx_k_pad(int64_t k) { return (k + 31) / 32 * 32; }
inline int64_t amx_m_pad(int64_t m) { return (m + 15) / 16 * 16; }
size_t amx_packed_bytes(int64_t n, int64_t k);
void amx_pack_bf16(const uint16_t* w, int64_t n, int64_t k, void* dst);

// Rows [r0, r1) of x [m, k] f32 into hi = bf16(x) and lo = bf16(x - hi), [*, amx_k_pad(k)]
// row-major with zero padding; rows in [r1, r_pad) are zeroed (the tail of a 16-row tile).
// lo null: bf16 activations (Backend::set_matmul_precision), hi only.
void amx_split_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int64_t r_pad, uint16_t* hi,
                    uint16_t* lo);

// y[r, j] = hi[r].w[j] + lo[r].w[j] (+ bias[j]) for r in [r0, min(r1, m)), r0 a multiple of 16,
// (lo null: hi[r].w[j] alone, the bf16-activation mode),
// and j in the 16-column blocks [b0, b1) (clipped to n). Per element the k tiles are visited in
// order, hi then lo, whatever m, r0 or the block range: rows are independent in a tile product.
// Configures the tiles on the calling thread and releases them before returning.
//
// With act set, the call is the MLP's gate|up with its activation fused: packed is [n = 2 * inter,
// k] (gate rows, then up rows; inter % 16 == 0), [b0, b1) are gate blocks (clipped to inter / 16),
// and for each, act->hi/lo[r, 16b .. 16b + 15] = the bf16 halves of silu(gate) * up, bit for bit
// what silu_mul (AVX-512 table) then amx_split_rows would give; y and bias are unused. Rows past
// r1 in the last tile are not written.
struct AmxActOut {
  uint16_t* hi;
  uint16_t* lo;  // null: bf16 activations, hi = bf16(silu(gate) * up) only
  int64_t ld;    // row stride in elements (the down projection's amx_k_pad(inter))
};
void amx_linear_bf16(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed,
                     int64_t n, const float* bias, float* y, int64_t ldy, int64_t r0, int64_t r1, int64_t b0,
                     int64_t b1, const AmxActOut* act = nullptr);

// Attention over a bf16 KV cache on AMX tiles (attention_amx.cpp): the AttnItem contract of
// KernelTable::attention, at f32 precision (Q and the softmax weights enter as three bf16 parts);
// the _act form rounds both to bf16 instead (bf16 activations, one part each).
// Needs head_dim % 32 == 0 and block_size % 16 == 0; the backend then runs every item of such a
// layout here, decode included, so no row switches kernels (batch invariance).
bool amx_attention_supported(int head_dim, int block_size);
int64_t amx_attn_scratch_floats(int head_dim);  // per item, 64-byte aligned by the caller
void amx_attention_bf16(const AttnItem& a, float* scratch);
void amx_attention_bf16_act(const AttnItem& a, float* scratch);

}  // namespace fantai::cpu
