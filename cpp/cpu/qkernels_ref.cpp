// cpu: the slow reference of the quantized kernels (canonical layout, double accumulation) the
// kernels are tested against.
#include <cmath>
#include <vector>

#include "common/types.h"
#include "cpu/qkernels.h"

namespace fantai::cpu {

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

void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy) {
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

void linear_q_int8x(const QuantizedRows& xq, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy) {
  const int32_t B = xq_block(w);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < w.rows; ++j) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t c = 0; c < w.cols; ++c) {
        const double xv = static_cast<double>(xq.q[r * xq.ld + c]) * xq.d[r * xq.nblocks + c / B];
        s += xv * element(w, j, c);
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
