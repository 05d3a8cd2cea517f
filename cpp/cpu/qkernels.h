// cpu: kernels on group-quantized weights (see QuantMatrix in backend/backend.h): the per-ISA
// table, the CPU packed layout, and the slow reference they are tested against.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/op_types.h"
#include "cpu/cpu_features.h"

namespace fantai::cpu {

// CPU packed layout (QuantMatrix::layout == kCpuQuantLayout), one allocation:
//   q      rows x ld bytes. 8-bit: one byte per element, ld = cols rounded up to 16.
//          4-bit: per 32 columns 16 bytes; byte i holds column 32b+i in its low nibble and column
//          32b+16+i in its high nibble (one 16-byte load gives two 16-lane vectors), ld =
//          ceil(cols / 32) * 16. Padding is zero, so whole-vector loads never leave the row.
//   scale  f32 [rows, ngroups]; zero u8 [rows, ngroups] unless every group has the same zero
//          (then zero == nullptr and zero_point holds it: GGUF Q8_0/Q4_0/Q5_0/Q3_K/Q6_K/IQ4,
//          symmetric RTN);
//          min f32 [rows, ngroups] or absent; perm i32 [cols] or absent.
// group must be a multiple of 16 or cover all columns, so no vector step straddles two groups.
constexpr int32_t kCpuQuantLayout = 1;
size_t cpu_quant_packed_bytes(const QuantMatrix& canonical);
QuantMatrix cpu_pack_quant(const QuantMatrix& canonical, void* dst);

struct QKernelTable {
  const char* name;
  // y[r, j] = x[r, :] . w[j, :] (+ bias[j]) for r < m, j in [j0, j1); x: [m, w.cols] already in
  // stored column order (perm applied by the caller); y row stride ldy. Every y element has one
  // accumulation chain: stored columns in W steps with one masked tail, then the ISA's fixed
  // horizontal sum — the dense linear's chain, so the result does not depend on m, tiles or
  // threads, and equals the dense f32 linear on the dequantized matrix bit for bit.
  void (*linear_q)(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy,
                   int64_t j0, int64_t j1);
  // out[c] = w[r, c] for stored columns c < w.cols, exactly the QuantMatrix formula.
  void (*dequant_row)(const QuantMatrix& w, int64_t r, float* out);
};

const QKernelTable* scalar_qkernels();
const QKernelTable* avx2_qkernels();
const QKernelTable* avx512_qkernels();
const QKernelTable& qkernels_for(Isa isa);

// ---- AVX-512 VNNI path ---------------------------------------------------------------------------
// Panel layout (QuantMatrix::layout == kCpuQuantPanelLayout): rows in panels of 16 (the last one
// zero-padded); panel p's bytes at data + p * ld, group by group; within a group, per step of 4
// columns (8-bit) or 8 columns (4-bit) 64 bytes: 4 consecutive bytes per row (row-major lanes),
// so one vpdpbusd multiplies 16 rows by 4 activations with no horizontal sum. 4-bit: the low
// nibbles hold columns c..c+3 and the high nibbles c+4..c+7. Groups are padded to whole steps.
// The packed matrix's `bits` is the value width kept: the narrowest of 2, 3, 4, 5, 6, 8 holding
// every value of the canonical one (GGUF Q5_0 / Q5_1 / Q5_K arrive as bytes < 32, Q6_K < 64, Q2_K
// and Q3_K as nibbles < 4, < 8), or 4 with
// a codebook when the values are at most 16 distinct bytes (GGUF IQ4_NL / IQ4_XS arrive as their
// non-linear int8 levels + 128, 1 .. 241): the nibbles are then indices into QuantMatrix::codebook
// (the distinct values ascending, 16 bytes in a 64-byte region after the others), and each
// kernel turns a vector of indices into the u8 values with one vpshufb against the table
// broadcast to every 128-bit lane (AVX2: into v - 128 in s8, for its sign trick), the portable
// one with a table load. The zero and the float epilogue are the byte form's, unchanged. 5- and
// 6-bit values keep the 4-bit steps for their low 4 bits and add, per step, one (5-bit) or two
// (6-bit) bit planes of 16 bytes: plane i holds bit 4 + i as two little-endian 64-bit words, the
// first for the step's low-nibble vector and the second for its high-nibble one, bit j of a word
// standing for byte j of that 64-byte vector (row lane j / 4, column c + j % 4, or c + 4 + j % 4).
// So AVX-512 rebuilds a vector with one masked byte add of 16 (or 32) per plane, the word as the
// mask. 2- and 3-bit values (GGUF Q2_K, Q3_K) take steps of 16 columns in the same 64 bytes:
// lane bytes i = 0..3 of a step hold columns c + 4s + i (s = 0..3) in bits 2s, 2s + 1, so
// (v >> 2s) & 3 is the 4-column vector s; 3-bit adds a 32-byte plane per step holding bit 2
// (added as 4): bit 4h + s of plane byte j is that bit of vector s's byte 32h + j, so each half
// of a step reads its four high bits from one nibble of the same 32 bytes (AVX2: a shift and a
// mask per vector; AVX-512: one vptestmb mask per vector). A group's planes follow its steps:
// group bytes = steps * panel_step_bytes(bits), i.e. 2 * bits bytes per column, and a group of
// 32 (or 16) stays a whole number of cache lines.
// scale / zero / min are panel-major: [panels, ngroups, 16]. When every scale and min is an f16
// value (GGUF Q4_0/Q4_1/Q8_0 store them so) they are kept as f16 (kCpuQuantPanelHalfLayout;
// the float pointers then point at uint16 data), which keeps the resident size at the file's.
// Activations are quantized per row in blocks of xq_block(w) columns to int8 (round to nearest,
// d = max|x| / 127), llama.cpp style; each block contributes
//   scale * d * float(sum q*qx - zero * sum qx) + min * (d * sum qx)
// in a fixed order (so the result is batch invariant, but not bit-equal to the f32 path).
//
// When the canonical matrix carries its file's factoring (QuantMatrix::fgroups: the K-quants and
// IQ4_XS) and every super-block factor is an f16 value, only the factors are kept
// (kCpuQuantPanelSubLayout): iscale / imin int8 [panels, ngroups, 16] (scale and min point at the
// same bytes), fscale / fmin f16 [panels, ngroups / fgroups, 16] (float pointers at uint16 data).
// The kernels form scale = fscale * float(iscale) per group and lane: the one f32 product ggml
// forms, so every result is bit-equal to the f32 layout's. 2-bit values with a min whose sub-scales
// and sub-mins all lie in 0 .. 15 (GGUF Q2_K) keep them as the file does, a byte per group and
// lane, sub-scale in the low nibble and sub-min in the high one (kCpuQuantPanelSubNibbleLayout:
// iscale, imin, scale and min all point at those bytes), so Q2_K sits at its file's size.
constexpr int32_t kCpuQuantPanelLayout = 2;
constexpr int32_t kCpuQuantPanelHalfLayout = 3;
constexpr int32_t kCpuQuantPanelSubLayout = 4;
constexpr int32_t kCpuQuantPanelSubNibbleLayout = 5;
// Columns of one 64-byte step at value width bits; bytes of its bit planes (3, 5 or 6 bits); the
// whole step's bytes; and where a group of len columns keeps its planes, after its steps.
constexpr int64_t panel_step_cols(int32_t bits) { return bits == 8 ? 4 : bits >= 4 ? 8 : 16; }
constexpr int64_t panel_plane_bytes(int32_t bits) {
  return bits == 3 ? 32 : bits > 4 && bits < 8 ? 16 * (bits - 4) : 0;
}
constexpr int64_t panel_step_bytes(int32_t bits) { return 64 + panel_plane_bytes(bits); }
constexpr int64_t panel_planes_at(int32_t bits, int64_t len) {
  return (len + panel_step_cols(bits) - 1) / panel_step_cols(bits) * 64;
}
inline bool is_panel_layout(int32_t layout) {
  return layout == kCpuQuantPanelLayout || layout == kCpuQuantPanelHalfLayout ||
         layout == kCpuQuantPanelSubLayout || layout == kCpuQuantPanelSubNibbleLayout;
}
// How a panel matrix keeps its scales and mins (the kernels' compile-time HS parameter).
constexpr int kScaleF32 = 0, kScaleF16 = 1, kScaleSub = 2, kScaleSubNibble = 3;
constexpr bool is_sub_scale_mode(int hs) { return hs == kScaleSub || hs == kScaleSubNibble; }
inline int panel_scale_mode(int32_t layout) {
  return layout == kCpuQuantPanelHalfLayout        ? kScaleF16
         : layout == kCpuQuantPanelSubLayout       ? kScaleSub
         : layout == kCpuQuantPanelSubNibbleLayout ? kScaleSubNibble
                                                   : kScaleF32;
}
bool cpu_has_avx512_vnni();
size_t cpu_quant_panel_bytes(const QuantMatrix& canonical);
QuantMatrix cpu_pack_quant_panel(const QuantMatrix& canonical, void* dst);
// Panel matrix row r, stored column order, exact QuantMatrix formula (for embedding_q).
void panel_dequant_row(const QuantMatrix& w, int64_t r, float* out);
// The scale (of_min: the min) of row r, group g of a panel matrix, as f32, in any scale mode.
float panel_scale_at(const QuantMatrix& w, bool of_min, int64_t r, int64_t g);

// Activation blocks: 16 when the weight group is not a multiple of 32, else 32 (blocks never
// straddle a group).
inline int32_t xq_block(const QuantMatrix& w) { return w.group % 32 == 0 ? 32 : 16; }
struct QuantizedRows {
  int64_t ld = 0;       // bytes per row of q (k rounded up to the block, zero-padded)
  int64_t nblocks = 0;  // per row
  const int8_t* q = nullptr;
  const float* d = nullptr;    // [m, nblocks]
  const int32_t* s = nullptr;  // [m, nblocks]: sum of q in the block
};
// qx: m * ld bytes; d, s: m * nblocks each.
void quantize_rows_int8(const float* x, int64_t m, int64_t k, int32_t block, int8_t* q, float* d, int32_t* s);
// y[r, 16 p + lane] for panels p in [p0, p1); nullptr when not built or not x86.
using LinearPanelFn = void (*)(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                               int64_t m, int64_t ldy, int64_t p0, int64_t p1);
LinearPanelFn avx512_vnni_linear_panel();
// The same function on AMX int8 tiles, bit-equal to the VNNI one (the integer block sums are
// exact, the float updates are the same operations in the same order); nullptr unless built with
// AMX and amx_int8_usable(). Tiles of 16 rows: worth it from a few rows up, not for decode.
LinearPanelFn amx_int8_linear_panel();
// quantize_rows_int8 on AVX-512, bit-equal to it (same max, same f32 product, same round to
// nearest even); nullptr when not built or not x86. Rows are independent: callers may split them.
using QuantizeRowsFn = void (*)(const float* x, int64_t m, int64_t k, int32_t block, int8_t* q, float* d,
                                int32_t* s);
QuantizeRowsFn avx512_quantize_rows_int8();
// The same two functions for CPUs without VNNI, bit-equal to the VNNI ones: AVX2 (vpmaddubsw +
// vpmaddwd; nullptr when not built or not x86) and portable C++ (the exact reference of every
// panel kernel; quantize_rows_int8 is its quantizer).
LinearPanelFn avx2_linear_panel();
QuantizeRowsFn avx2_quantize_rows_int8();
LinearPanelFn scalar_linear_panel();
// The AVX2 linear with AVX-VNNI's vpdpbusd on YMM, bit-equal to the others; nullptr when the
// compiler could not build it. Runs only where avx_vnni_panels() (its quantizer is AVX2's).
LinearPanelFn avx_vnni_linear_panel();

// The panel kernels an ISA level runs: every level has them, and all give the same bits.
struct PanelKernels {
  const char* name;  // "vnni", "avxvnni", "avx2", "scalar"
  LinearPanelFn linear;
  QuantizeRowsFn quantize;
  int decode_panels;  // panels one m = 1 tile covers side by side (its independent chains)
};
PanelKernels panel_kernels_for(Isa isa);

namespace ref {
// The panel path's arithmetic with double accumulation over the same int8 activations: w
// canonical, x already quantized (xq.q/d per block).
void linear_q_int8x(const QuantizedRows& xq, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy);
// On a canonical matrix (layout 0), double accumulation; y row stride ldy.
void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy);
// out: [rows, cols] in original column order (out[r, perm[c]] = w[r, c]).
void dequantize(const QuantMatrix& w, float* out);
}  // namespace ref

}  // namespace fantai::cpu
