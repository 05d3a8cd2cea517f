// cuda: which GEMM serves linear() for prefill-sized row counts: the owned kernels (gemm.cu) or
// cuBLASLt (cublas_gemm.cu, built only when CMake found cublasLt.h; the library is opened at the
// first prefill-sized GEMM). Decode GEMVs stay owned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace fantai::cuda {

// Rows from which linear() hands dense f32 / 16-bit matrices to cuBLAS when it is chosen. Below,
// the owned GEMV (m <= kGemvMaxRows) and tensor-core kernels keep their own reduction order.
constexpr int64_t kCublasMinRows = 16;

enum class GemmImpl { kOwn, kCublas };
// FANTAI_CUDA_GEMM=own|cublas, read at first use: cublas (the default) where this build has it,
// own otherwise or when asked (a GPU check compares the two), and own from the first GEMM on when
// libcublasLt cannot be opened (one warning says why). set_gemm_impl overrides it.
GemmImpl gemm_impl();
void set_gemm_impl(GemmImpl impl);
// Whether this build was compiled against cuBLASLt (whether it loads: cublaslt_library()).
bool cublas_built();
// y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]) through cuBLASLt, on `stream`; 16-bit weights meet
// the activations rounded to the weight dtype (as the owned tensor-core kernel does), f32
// weights run in full f32 (no TF32). false when this build has no cuBLAS, libcublasLt cannot be
// opened, or cuBLASLt has no algorithm for the shape: the caller then runs its own kernel.
bool cublas_linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m,
                   int64_t n, int64_t k, cudaStream_t stream);

}  // namespace fantai::cuda
