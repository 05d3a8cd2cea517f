// cuda: error checks, element conversions and warp/block reductions shared by the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "common/types.h"

#define FANTAI_CUDA_CHECK(expr)                                                                              \
  do {                                                                                                       \
    const cudaError_t fantai_err_ = (expr);                                                                  \
    FANTAI_CHECK(fantai_err_ == cudaSuccess,                                                                 \
                 "CUDA error " << cudaGetErrorName(fantai_err_) << ": " << cudaGetErrorString(fantai_err_)); \
  } while (0)

// After a launch: catches bad configurations at once (asynchronous faults surface at the next
// synchronizing call, which also checks).
#define FANTAI_CUDA_LAUNCHED() FANTAI_CUDA_CHECK(cudaGetLastError())

namespace fantai::cuda {

// The runtime's current device is per thread, and the engine loop runs ops on its own thread:
// every entry point of the backend and of its NCCL communicator makes its device current (a
// cheap query when it already is).
inline void bind_device(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) FANTAI_CUDA_CHECK(cudaSetDevice(device));
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// Fixed xor butterfly: every lane ends with the same value, in the same order every call.
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// scratch: 32 floats of shared memory. Warps are combined in index order (deterministic).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < nwarps; ++w) total += scratch[w];
  return total;
}

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Calls f with a typed null pointer naming the element type of t (one instantiation per dtype).
template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kF32: f(static_cast<float*>(nullptr)); return;
    case DType::kBF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    case DType::kF16: f(static_cast<__half*>(nullptr)); return;
  }
  // Hook: an int8 KV cache (DType value being added on the CPU side) needs a dequantizing load
  // here and a scale per block; until then it is refused with a clear message.
  FANTAI_THROW("the CUDA backend does not support dtype " << dtype_name(t) << " here");
}

}  // namespace fantai::cuda
