// cpu: CPU packing of quantized matrices, the kernel-table picker, and the slow reference
// (canonical layout, double accumulation) the kernels are tested against.
#include <cstring>
#include <vector>

#include "common/check.h"
#include "cpu/qkernels.h"

namespace fantai::cpu {
namespace {

size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

int64_t packed_ld(int32_t bits, int64_t cols) {
  return bits == 8 ? (cols + 15) / 16 * 16 : (cols + 31) / 32 * 16;
}

// Whether every group of the canonical matrix has the same zero (so one constant replaces the
// array); sets *value to it.
bool uniform_zero(const QuantMatrix& m, int32_t* value) {
  if (!m.zero) {
    *value = m.zero_point;
    return true;
  }
  const int64_t n = m.rows * m.ngroups();
  for (int64_t i = 1; i < n; ++i)
    if (m.zero[i] != m.zero[0]) return false;
  *value = m.zero[0];
  return true;
}

struct Offsets {
  size_t scale, zero, min, perm, total;
};

Offsets packed_offsets(const QuantMatrix& m) {
  const size_t ng = static_cast<size_t>(m.rows * m.ngroups());
  int32_t zp;
  Offsets o;
  size_t at = align64(static_cast<size_t>(m.rows * packed_ld(m.bits, m.cols)));
  o.scale = at;
  at = align64(at + ng * sizeof(float));
  o.zero = at;
  if (!uniform_zero(m, &zp)) at = align64(at + ng);
  o.min = at;
  if (m.min) at = align64(at + ng * sizeof(float));
  o.perm = at;
  if (m.perm) at = align64(at + static_cast<size_t>(m.cols) * sizeof(int32_t));
  o.total = at;
  return o;
}

}  // namespace

size_t cpu_quant_packed_bytes(const QuantMatrix& m) {
  check_quant_matrix(m);
  return packed_offsets(m).total;
}

QuantMatrix cpu_pack_quant(const QuantMatrix& m, void* dst) {
  check_quant_matrix(m);
  const Offsets o = packed_offsets(m);
  char* base = static_cast<char*>(dst);
  std::memset(base, 0, o.total);
  QuantMatrix p = m;
  p.layout = kCpuQuantLayout;
  p.ld = packed_ld(m.bits, m.cols);
  const uint8_t* q = static_cast<const uint8_t*>(m.data);
  uint8_t* out = reinterpret_cast<uint8_t*>(base);
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* src = q + r * m.ld;
    uint8_t* row = out + r * p.ld;
    if (m.bits == 8) {
      std::memcpy(row, src, static_cast<size_t>(m.cols));
    } else {
      for (int64_t c = 0; c < m.cols; ++c) {
        const int64_t b = c / 32, i = c % 32;
        row[b * 16 + (i & 15)] |= static_cast<uint8_t>(src[c] << (i < 16 ? 0 : 4));
      }
    }
  }
  const size_t ng = static_cast<size_t>(m.rows * m.ngroups());
  std::memcpy(base + o.scale, m.scale, ng * sizeof(float));
  p.scale = reinterpret_cast<const float*>(base + o.scale);
  int32_t zp = 0;
  if (uniform_zero(m, &zp)) {
    p.zero = nullptr;
    p.zero_point = zp;
  } else {
    std::memcpy(base + o.zero, m.zero, ng);
    p.zero = reinterpret_cast<const uint8_t*>(base + o.zero);
    p.zero_point = 0;
  }
  if (m.min) {
    std::memcpy(base + o.min, m.min, ng * sizeof(float));
    p.min = reinterpret_cast<const float*>(base + o.min);
  }
  if (m.perm) {
    std::memcpy(base + o.perm, m.perm, static_cast<size_t>(m.cols) * sizeof(int32_t));
    p.perm = reinterpret_cast<const int32_t*>(base + o.perm);
  }
  p.data = base;
  return p;
}

const QKernelTable& qkernels_for(Isa isa) {
  FANTAI_REQUIRE(static_cast<int>(isa) <= static_cast<int>(detected_isa()),
                 "cpu: ISA level " << isa_name(isa) << " is not supported by this CPU");
  const QKernelTable* t = isa == Isa::kAvx512 ? avx512_qkernels()
                          : isa == Isa::kAvx2 ? avx2_qkernels()
                                              : scalar_qkernels();
  FANTAI_REQUIRE(t != nullptr, "cpu: quantized kernels for " << isa_name(isa) << " were not built");
  return *t;
}

namespace ref {
namespace {
// One element, straight from the formula (product rounded to f32 before the add).
float element(const QuantMatrix& w, int64_t r, int64_t c) {
  const int64_t g = c / w.group, i = r * w.ngroups() + g;
  const int q = static_cast<const uint8_t*>(w.data)[r * w.ld + c];
  const int z = w.zero ? w.zero[i] : w.zero_point;
  volatile float v = w.scale[i] * static_cast<float>(q - z);
  return w.min ? v + w.min[i] : v;
}
}  // namespace

void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
              int64_t ldy) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < w.rows; ++j) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t c = 0; c < w.cols; ++c) {
        const int64_t src = w.perm ? w.perm[c] : c;
        s += static_cast<double>(x[r * w.cols + src]) * element(w, j, c);
      }
      y[r * ldy + j] = static_cast<float>(s);
    }
}

void dequantize(const QuantMatrix& w, float* out) {
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t c = 0; c < w.cols; ++c) out[r * w.cols + (w.perm ? w.perm[c] : c)] = element(w, r, c);
}

}  // namespace ref
}  // namespace fantai::cpu
