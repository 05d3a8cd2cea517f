// cpu: kernels on group-quantized weights (see QuantMatrix in backend/backend.h): the per-ISA
// table, the CPU packed layout, and the slow reference they are tested against.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend.h"
#include "cpu/cpu_features.h"

namespace fantai::cpu {

// CPU packed layout (QuantMatrix::layout == kCpuQuantLayout), one allocation:
//   q      rows x ld bytes. 8-bit: one byte per element, ld = cols rounded up to 16.
//          4-bit: per 32 columns 16 bytes; byte i holds column 32b+i in its low nibble and column
//          32b+16+i in its high nibble (one 16-byte load gives two 16-lane vectors), ld =
//          ceil(cols / 32) * 16. Padding is zero, so whole-vector loads never leave the row.
//   scale  f32 [rows, ngroups]; zero u8 [rows, ngroups] unless every group has the same zero
//          (then zero == nullptr and zero_point holds it: GGUF Q8_0/Q4_0/Q6_K, symmetric RTN);
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
  void (*linear_q)(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                   int64_t ldy, int64_t j0, int64_t j1);
  // out[c] = w[r, c] for stored columns c < w.cols, exactly the QuantMatrix formula.
  void (*dequant_row)(const QuantMatrix& w, int64_t r, float* out);
};

const QKernelTable* scalar_qkernels();
const QKernelTable* avx2_qkernels();
const QKernelTable* avx512_qkernels();
const QKernelTable& qkernels_for(Isa isa);

namespace ref {
// On a canonical matrix (layout 0), double accumulation; y row stride ldy.
void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
              int64_t ldy);
// out: [rows, cols] in original column order (out[r, perm[c]] = w[r, c]).
void dequantize(const QuantMatrix& w, float* out);
}  // namespace ref

}  // namespace fantai::cpu
