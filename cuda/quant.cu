// cuda: weight-only INT4 / INT8 group-quantized linear and embedding. Packing (pack_quant) keeps
// 4-bit q two per byte (even column in the low nibble) so a decode GEMV reads half a byte per
// weight; the kernels dequantize in registers as the seam defines it, w = scale * (q - zero)
// (+ min), one rounded multiply then one rounded add, and accumulate x . w in f32.
#include <cstring>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

constexpr int kQWarps = 8;
constexpr int kQRows = 8;  // activation rows per block: one weight read serves all of them

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

struct Sizes {
  int64_t ldq;
  size_t q, groups, scale, zero, min, perm, total;
};

Sizes sizes_of(const QuantMatrix& c) {
  Sizes s{};
  const int64_t packed_cols = c.bits == 4 ? (c.cols + 1) / 2 : c.cols;
  s.ldq = (packed_cols + 15) / 16 * 16;
  s.q = align256(static_cast<size_t>(c.rows * s.ldq));
  s.groups = static_cast<size_t>(c.rows * c.ngroups());
  s.scale = align256(s.groups * sizeof(float));
  s.zero = c.zero ? align256(s.groups) : 0;
  s.min = c.min ? align256(s.groups * sizeof(float)) : 0;
  s.perm = c.perm ? align256(static_cast<size_t>(c.cols) * sizeof(int32_t)) : 0;
  s.total = s.q + s.scale + s.zero + s.min + s.perm;
  return s;
}

// QuantMatrix::ngroups is host code (the seam header is plain C++).
__device__ __forceinline__ int64_t groups_of(const QuantMatrix& w) {
  return (w.cols + w.group - 1) / w.group;
}

__device__ __forceinline__ float dequant(int q, int z, float scale, const float* mn, int64_t gi) {
  const float w = __fmul_rn(scale, static_cast<float>(q - z));
  return mn ? __fadd_rn(w, mn[gi]) : w;
}

// q value of stored column c of row r.
__device__ __forceinline__ int q_at(const QuantMatrix& w, const uint8_t* row, int64_t c) {
  return w.bits == 4 ? (row[c >> 1] >> ((c & 1) * 4)) & 15 : row[c];
}

// One warp per output j; each lane walks 8-column chunks (one group: group % 16 == 0 or
// group >= cols), so the per-element order depends only on the column count, never on m.
__global__ void __launch_bounds__(kQWarps * 32)
    qgemv_kernel(const float* __restrict__ x, QuantMatrix w, const float* __restrict__ bias,
                 float* __restrict__ y, int64_t m, int64_t ldy) {
  const int lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kQWarps + (threadIdx.x >> 5);
  if (j >= w.rows) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kQRows;
  const int rows = static_cast<int>(m - r0 < kQRows ? m - r0 : kQRows);
  const uint8_t* qrow = static_cast<const uint8_t*>(w.data) + j * w.ld;
  const int64_t ng = groups_of(w);
  float acc[kQRows] = {};
  for (int64_t c0 = static_cast<int64_t>(lane) * 8; c0 < w.cols; c0 += 32 * 8) {
    const int64_t gi = j * ng + c0 / w.group;
    const float scale = w.scale[gi];
    const int z = w.zero ? w.zero[gi] : w.zero_point;
    float wf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
      wf[e] = c0 + e < w.cols ? dequant(q_at(w, qrow, c0 + e), z, scale, w.min, gi) : 0.f;
#pragma unroll
    for (int r = 0; r < kQRows; ++r) {
      if (r >= rows) break;
      const float* xr = x + (r0 + r) * w.cols;
      float s = acc[r];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (c0 + e < w.cols) s = fmaf(xr[w.perm ? w.perm[c0 + e] : c0 + e], wf[e], s);
      }
      acc[r] = s;
    }
  }
  const float b = bias ? bias[j] : 0.f;
#pragma unroll
  for (int r = 0; r < kQRows; ++r) {
    if (r >= rows) break;
    const float s = warp_sum(acc[r]);
    if (lane == 0) y[(r0 + r) * ldy + j] = s + b;
  }
}

__global__ void qembedding_kernel(const int32_t* ids, QuantMatrix w, float* out) {
  const int64_t i = blockIdx.x, row = ids[i];
  const uint8_t* qrow = static_cast<const uint8_t*>(w.data) + row * w.ld;
  const int64_t ng = groups_of(w);
  for (int64_t c = threadIdx.x; c < w.cols; c += blockDim.x) {
    const int64_t gi = row * ng + c / w.group;
    const int z = w.zero ? w.zero[gi] : w.zero_point;
    out[i * w.cols + (w.perm ? w.perm[c] : c)] = dequant(q_at(w, qrow, c), z, w.scale[gi], w.min, gi);
  }
}

}  // namespace

size_t quant_packed_bytes(const QuantMatrix& canonical) { return sizes_of(canonical).total; }

QuantMatrix pack_quant(const QuantMatrix& c, void* dst, cudaStream_t stream) {
  check_quant_matrix(c);
  const Sizes s = sizes_of(c);
  std::vector<uint8_t> img(s.total, 0);
  const uint8_t* q = static_cast<const uint8_t*>(c.data);
  for (int64_t r = 0; r < c.rows; ++r) {
    uint8_t* out = img.data() + r * s.ldq;
    for (int64_t col = 0; col < c.cols; ++col) {
      const uint8_t v = q[r * c.ld + col];
      if (c.bits == 4) {
        out[col >> 1] |= static_cast<uint8_t>(v << ((col & 1) * 4));
      } else {
        out[col] = v;
      }
    }
  }
  size_t off = s.q;
  auto put = [&](const void* src, size_t bytes, size_t span) {
    std::memcpy(img.data() + off, src, bytes);
    const size_t at = off;
    off += span;
    return at;
  };
  const size_t scale_at = put(c.scale, s.groups * sizeof(float), s.scale);
  const size_t zero_at = c.zero ? put(c.zero, s.groups, s.zero) : 0;
  const size_t min_at = c.min ? put(c.min, s.groups * sizeof(float), s.min) : 0;
  const size_t perm_at = c.perm ? put(c.perm, static_cast<size_t>(c.cols) * sizeof(int32_t), s.perm) : 0;
  FANTAI_CUDA_CHECK(cudaMemcpyAsync(dst, img.data(), s.total, cudaMemcpyHostToDevice, stream));
  FANTAI_CUDA_CHECK(cudaStreamSynchronize(stream));  // img dies here
  char* base = static_cast<char*>(dst);
  QuantMatrix p = c;
  p.layout = kCudaQuantLayout;
  p.ld = s.ldq;
  p.data = base;
  p.scale = reinterpret_cast<const float*>(base + scale_at);
  p.zero = c.zero ? reinterpret_cast<const uint8_t*>(base + zero_at) : nullptr;
  p.min = c.min ? reinterpret_cast<const float*>(base + min_at) : nullptr;
  p.perm = c.perm ? reinterpret_cast<const int32_t*>(base + perm_at) : nullptr;
  // The scale factoring (K-quants) is host memory of the canonical form; this layout keeps the
  // f32 products only.
  p.fgroups = 0;
  p.fscale = p.fmin = nullptr;
  p.iscale = p.imin = nullptr;
  return p;
}

void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy,
              cudaStream_t stream) {
  FANTAI_REQUIRE(w.layout == kCudaQuantLayout, "linear_q: the matrix was not packed by the CUDA backend");
  if (m == 0 || w.rows == 0) return;
  FANTAI_REQUIRE((m + kQRows - 1) / kQRows <= 65535, "linear_q: too many rows (" << m << ")");
  const dim3 grid(ceil_div(w.rows, kQWarps), ceil_div(m, kQRows));
  qgemv_kernel<<<grid, kQWarps * 32, 0, stream>>>(x, w, bias, y, m, ldy);
  FANTAI_CUDA_LAUNCHED();
}

void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out, cudaStream_t stream) {
  FANTAI_REQUIRE(table.layout == kCudaQuantLayout,
                 "embedding_q: the table was not packed by the CUDA backend");
  if (n == 0) return;
  qembedding_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(ids, table, out);
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
