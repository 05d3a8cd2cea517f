// cuda: y = x * w^T (+ bias) with f32 activations.
//
// Compute modes, and why:
// - m >= kCublasMinRows (prefill) with cuBLASLt built and chosen (gemm_impl.h, the default where
//   built; FANTAI_CUDA_GEMM=own keeps the owned kernels below): cublas_gemm.cu, f32 accumulate,
//   f32 weights in full f32, 16-bit weights against activations rounded to their dtype (as the
//   tensor-core kernel below rounds them). Its algorithm may change with m, so there a row's
//   rounding can depend on the batch; the owned kernels below never do within one mode.
// - f32 weights: a SIMT tiled SGEMM with f32 FMA (no TF32), so f32 models match transformers'
//   f32 matmul closely (torch keeps TF32 off for matmul by default).
// - 16-bit weights, m <= kGemvMaxRows (decode): a GEMV that keeps the activations in f32 and
//   widens the weights in registers, the same numerics as the CPU kernels; decode is bound by
//   reading the weights, so tensor cores would buy nothing there.
// - 16-bit weights, larger m (prefill, big decode batches): tensor cores (WMMA, bf16/f16 inputs,
//   f32 accumulate).
//   Tensor cores need both operands in 16 bits, so the activations are rounded to the weight
//   dtype when staged in shared memory, which is what a bf16 transformers model does anyway.
// Every kernel accumulates one output element over k in a fixed order that does not depend on m,
// so a row's result does not change with the batch within one mode (see README: the GEMV/GEMM
// switch at kGemvMaxRows is the one place a row's rounding depends on the batch).
#include <mma.h>

#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/gemm_impl.h"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

// ---- f32 weights: 64x64 tiles, 16-deep k slabs, 256 threads with 4x4 outputs each -----------
constexpr int kSBM = 64, kSBN = 64, kSBK = 16;

__global__ void __launch_bounds__(256)
    sgemm_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                 float* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  __shared__ float as[kSBK][kSBM + 4];
  __shared__ float ws[kSBK][kSBN + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kSBM,
                col0 = static_cast<int64_t>(blockIdx.x) * kSBN;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kSBK) {
    for (int i = tid; i < kSBM * kSBK; i += 256) {
      const int r = i / kSBK, c = i % kSBK;
      const int64_t gr = row0 + r, gc = k0 + c;
      as[c][r] = gr < m && gc < k ? x[gr * k + gc] : 0.f;
      const int64_t gn = col0 + r;
      ws[c][r] = gn < n && gc < k ? w[gn * k + gc] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSBK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = as[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = row0 + ty * 4 + i;
    if (r >= m) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = col0 + tx * 4 + j;
      if (c < n) y[r * n + c] = acc[i][j] + (bias ? bias[c] : 0.f);
    }
  }
}

// ---- 16-bit weights, few rows: one warp per output column, all rows at once ------------------
constexpr int kGemvWarps = 8;

template <typename T>
__device__ __forceinline__ void widen8(const uint4& raw, float* out) {
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_f32(h[i]);
}

// Each lane sums the k indices it owns in increasing order, then the warp reduces with a fixed
// butterfly; which lane owns which k depends only on k, never on m.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(const float* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias,
                float* __restrict__ y, int m, int64_t n, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (col >= n) return;
  const T* wr = w + col * k;
  float acc[kGemvMaxRows] = {};
  if (kVec) {  // k % 8 == 0: 16-byte weight loads, 8 elements per lane per step
    for (int64_t i = static_cast<int64_t>(lane) * 8; i < k; i += 32 * 8) {
      float wf[8];
      widen8<T>(__ldg(reinterpret_cast<const uint4*>(wr + i)), wf);
#pragma unroll
      for (int r = 0; r < kGemvMaxRows; ++r) {
        if (r >= m) break;
        const float4 x0 = *reinterpret_cast<const float4*>(x + r * k + i);
        const float4 x1 = *reinterpret_cast<const float4*>(x + r * k + i + 4);
        float s = acc[r];
        s = fmaf(x0.x, wf[0], s);
        s = fmaf(x0.y, wf[1], s);
        s = fmaf(x0.z, wf[2], s);
        s = fmaf(x0.w, wf[3], s);
        s = fmaf(x1.x, wf[4], s);
        s = fmaf(x1.y, wf[5], s);
        s = fmaf(x1.z, wf[6], s);
        s = fmaf(x1.w, wf[7], s);
        acc[r] = s;
      }
    }
  } else {
    for (int64_t i = lane; i < k; i += 32) {
      const float wf = to_f32(wr[i]);
#pragma unroll
      for (int r = 0; r < kGemvMaxRows; ++r) {
        if (r >= m) break;
        acc[r] = fmaf(x[r * k + i], wf, acc[r]);
      }
    }
  }
  const float b = bias ? bias[col] : 0.f;
#pragma unroll
  for (int r = 0; r < kGemvMaxRows; ++r) {
    if (r >= m) break;
    const float s = warp_sum(acc[r]);
    if (lane == 0) y[r * n + col] = s + b;
  }
}

// ---- 16-bit weights, many rows: WMMA, 128x128 tiles, 32-deep k slabs, 8 warps of 32x64 --------
// Two shared-memory stages: the next slab is fetched into registers while the tensor cores work
// on the current one, then stored to the other stage, so there is one barrier per slab.
constexpr int kTBM = 128, kTBN = 128, kTBK = 32, kTPad = 8, kTLd = kTBK + kTPad;
constexpr int kTThreads = 256;
constexpr int kARegs = kTBM * kTBK / 4 / kTThreads;  // float4 chunks of x per thread per slab (4)
constexpr int kWRegs = kTBN * kTBK / 8 / kTThreads;  // 8-element chunks of w per thread per slab (2)

template <typename T, bool kVec>
struct WmmaTiles {
  float4 a[kARegs];
  uint4 w[kWRegs];

  // kVec: k % 8 == 0 and 16-byte aligned bases, so a chunk is wholly inside k or wholly outside.
  __device__ void fetch(const float* x, const T* wt, int64_t m, int64_t n, int64_t k, int64_t row0,
                        int64_t col0, int64_t k0) {
#pragma unroll
    for (int i = 0; i < kARegs; ++i) {
      const int f = threadIdx.x + i * kTThreads, r = f / (kTBK / 4), c = (f % (kTBK / 4)) * 4;
      const int64_t gr = row0 + r, gc = k0 + c;
      if (kVec) {
        a[i] = gr < m && gc < k ? *reinterpret_cast<const float4*>(x + gr * k + gc)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = gr < m && gc + e < k ? x[gr * k + gc + e] : 0.f;
        a[i] = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < kWRegs; ++i) {
      const int f = threadIdx.x + i * kTThreads, r = f / (kTBK / 8), c = (f % (kTBK / 8)) * 8;
      const int64_t gn = col0 + r, gc = k0 + c;
      if (kVec) {
        w[i] = gn < n && gc < k ? __ldg(reinterpret_cast<const uint4*>(wt + gn * k + gc))
                                : make_uint4(0, 0, 0, 0);
      } else {
        uint4 packed;  // written through T* so the 16-byte value stays aligned
        T* v = reinterpret_cast<T*>(&packed);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = gn < n && gc + e < k ? wt[gn * k + gc + e] : from_f32<T>(0.f);
        w[i] = packed;
      }
    }
  }

  __device__ void store(T (*as)[kTLd], T (*ws)[kTLd]) const {
#pragma unroll
    for (int i = 0; i < kARegs; ++i) {
      const int f = threadIdx.x + i * kTThreads, r = f / (kTBK / 4), c = (f % (kTBK / 4)) * 4;
      as[r][c] = from_f32<T>(a[i].x);
      as[r][c + 1] = from_f32<T>(a[i].y);
      as[r][c + 2] = from_f32<T>(a[i].z);
      as[r][c + 3] = from_f32<T>(a[i].w);
    }
#pragma unroll
    for (int i = 0; i < kWRegs; ++i) {
      const int f = threadIdx.x + i * kTThreads, r = f / (kTBK / 8), c = (f % (kTBK / 8)) * 8;
      *reinterpret_cast<uint4*>(&ws[r][c]) = w[i];
    }
  }
};

template <typename T, bool kVec>
__global__ void __launch_bounds__(kTThreads)
    wmma_gemm_kernel(const float* __restrict__ x, const T* __restrict__ w, const float* __restrict__ bias,
                     float* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(128) T as[2][kTBM][kTLd];
  __shared__ __align__(128) T ws[2][kTBN][kTLd];
  __shared__ __align__(128) float stage[kTThreads / 32][16 * 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wr = warp / 2, wc = warp % 2;  // 4 x 2 warps of 32 rows x 64 columns
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTBM,
                col0 = static_cast<int64_t>(blockIdx.x) * kTBN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  WmmaTiles<T, kVec> tiles;
  tiles.fetch(x, w, m, n, k, row0, col0, 0);
  tiles.store(as[0], ws[0]);
  __syncthreads();
  int cur = 0;
  for (int64_t k0 = 0; k0 < k; k0 += kTBK) {
    const bool next = k0 + kTBK < k;
    if (next) tiles.fetch(x, w, m, n, k, row0, col0, k0 + kTBK);
#pragma unroll
    for (int kk = 0; kk < kTBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &as[cur][wr * 32 + i * 16][kk], kTLd);
#pragma unroll
      for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(b[j], &ws[cur][wc * 64 + j * 16][kk], kTLd);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
    // The other stage was last read before the previous barrier: safe to overwrite now.
    if (next) tiles.store(as[cur ^ 1], ws[cur ^ 1]);
    __syncthreads();
    cur ^= 1;
  }
  // Epilogue through a per-warp 16x16 staging tile: bounds and bias for edge tiles.
  float* st = stage[warp];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wmma::store_matrix_sync(st, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int64_t r_base = row0 + wr * 32 + i * 16, c_base = col0 + wc * 64 + j * 16;
#pragma unroll
      for (int e = lane; e < 256; e += 32) {
        const int64_t gr = r_base + e / 16, gc = c_base + e % 16;
        if (gr < m && gc < n) y[gr * n + gc] = st[e] + (bias ? bias[gc] : 0.f);
      }
      __syncwarp();
    }
}

}  // namespace

void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, cudaStream_t stream) {
  if (m == 0 || n == 0) return;
  if (m >= kCublasMinRows && gemm_impl() == GemmImpl::kCublas &&
      cublas_linear(x, w, w_dtype, bias, y, m, n, k, stream))
    return;
  FANTAI_REQUIRE(m <= int64_t{65535} * std::min(kSBM, kTBM), "linear: too many rows (" << m << ")");
  if (w_dtype == DType::kF32) {
    const dim3 grid(ceil_div(n, kSBN), ceil_div(m, kSBM));
    sgemm_kernel<<<grid, 256, 0, stream>>>(x, static_cast<const float*>(w), bias, y, m, n, k);
    FANTAI_CUDA_LAUNCHED();
    return;
  }
  dispatch_dtype(w_dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (!std::is_same_v<T, float>) {
      const T* wt = static_cast<const T*>(w);
      if (m <= kGemvMaxRows) {
        // Vector loads need 16-byte aligned rows of x and w: k % 8 == 0 and aligned bases.
        const bool vec = k % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(x) % 16 == 0;
        const unsigned grid = ceil_div(n, kGemvWarps);
        if (vec) {
          gemv_kernel<T, true>
              <<<grid, kGemvWarps * 32, 0, stream>>>(x, wt, bias, y, static_cast<int>(m), n, k);
        } else {
          gemv_kernel<T, false>
              <<<grid, kGemvWarps * 32, 0, stream>>>(x, wt, bias, y, static_cast<int>(m), n, k);
        }
      } else {
        const dim3 grid(ceil_div(n, kTBN), ceil_div(m, kTBM));
        const bool vec = k % 8 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(x) % 16 == 0;
        if (vec) {
          wmma_gemm_kernel<T, true><<<grid, kTThreads, 0, stream>>>(x, wt, bias, y, m, n, k);
        } else {
          wmma_gemm_kernel<T, false><<<grid, kTThreads, 0, stream>>>(x, wt, bias, y, m, n, k);
        }
      }
    }
  });
  FANTAI_CUDA_LAUNCHED();
}

}  // namespace fantai::cuda
