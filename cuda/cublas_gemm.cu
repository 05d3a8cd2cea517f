// cuda: linear() for prefill-sized row counts through cuBLASLt (see gemm_impl.h). Compiled in
// every CUDA build; its cuBLAS half only when CMake found cublasLt.h, so nothing else sees its
// headers. Not linked: libcublasLt is opened at the first prefill-sized GEMM (lazy_library.h), so
// a process without one never loads it; where it cannot be opened linear() keeps the owned
// kernels and says so once. Why cuBLAS there: its tuned kernels pick tiles, split-k and
// pipelining per shape and GPU, which the owned WMMA kernel does not. What it costs: its
// algorithm (so a row's reduction order) may change with the row count, so above kCublasMinRows
// a row's rounding can depend on the batch (the owned kernels keep one order per mode; FANTAI_CUDA_GEMM=own keeps them).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/logging.h"
#include "cuda/common.cuh"
#include "cuda/gemm_impl.h"
#include "cuda/lazy_library.h"

#ifdef FANTAI_WITH_CUBLAS
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#endif

namespace fantai::cuda {
namespace {

GemmImpl initial_impl() {
  const char* s = std::getenv("FANTAI_CUDA_GEMM");
  if (s && std::strcmp(s, "own") == 0) return GemmImpl::kOwn;
  return cublas_built() ? GemmImpl::kCublas : GemmImpl::kOwn;
}

std::atomic<int> g_impl{-1};

}  // namespace

bool cublas_built() {
#ifdef FANTAI_WITH_CUBLAS
  return true;
#else
  return false;
#endif
}

GemmImpl gemm_impl() {
  int v = g_impl.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(initial_impl());
    g_impl.store(v, std::memory_order_relaxed);
  }
  return static_cast<GemmImpl>(v);
}

void set_gemm_impl(GemmImpl impl) {
  if (!cublas_built()) impl = GemmImpl::kOwn;
  g_impl.store(static_cast<int>(impl), std::memory_order_relaxed);
}

#ifndef FANTAI_WITH_CUBLAS

#ifndef FANTAI_CUBLAS_MISSING_REASON
#define FANTAI_CUBLAS_MISSING_REASON "CMake found no cublasLt.h"
#endif

bool cublas_linear(const float*, const void*, DType, const float*, float*, int64_t, int64_t, int64_t,
                   cudaStream_t) {
  return false;
}

// Declared in cuda_backend.h, which this kernel file may not include (test_layering.py).
LibraryStatus cublaslt_library() {
  LibraryStatus s;
  s.error = std::string("this build has no cuBLASLt: ") + FANTAI_CUBLAS_MISSING_REASON;
  return s;
}

#else

// Where CMake found libcublasLt ("" when it found only the header).
#ifndef FANTAI_CUBLAS_LIBDIR
#define FANTAI_CUBLAS_LIBDIR ""
#endif
#define FANTAI_CUBLAS_STR2(x) #x
#define FANTAI_CUBLAS_STR(x) FANTAI_CUBLAS_STR2(x)

namespace {

// Every cuBLASLt function this file calls.
#define FANTAI_CUBLASLT_FUNCTIONS(X)      \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusString)              \
  X(cublasLtCreate)                       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmul)

struct CublasLtApi {
  FANTAI_CUBLASLT_FUNCTIONS(FANTAI_LAZY_MEMBER)
  LibraryStatus status;
};

// Opened once, on first use; never closed (backends freed during exit may still call it). The
// soname is the major version of the header compiled against.
const CublasLtApi& lt_api() {
  static const CublasLtApi* const loaded = [] {
    auto* api = new CublasLtApi;
    LazyLibrary lib("cuBLASLt", "FANTAI_CUBLASLT_LIBRARY", FANTAI_CUBLAS_LIBDIR,
                    "libcublasLt.so." FANTAI_CUBLAS_STR(CUBLAS_VER_MAJOR));
    FANTAI_CUBLASLT_FUNCTIONS(FANTAI_LAZY_RESOLVE)
    api->status = lib.finish();
    if (api->status.error.empty()) api->status.version = static_cast<int64_t>(api->cublasLtGetVersion());
    else FANTAI_LOG(kWarning, api->status.error << ": prefill GEMMs run on the owned kernels");
    return api;
  }();
  return *loaded;
}

#define FANTAI_CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                               \
    const cublasStatus_t fantai_st_ = (expr);                                                        \
    FANTAI_CHECK(fantai_st_ == CUBLAS_STATUS_SUCCESS,                                                \
                 "cuBLASLt error " << lt_api().cublasLtGetStatusString(fantai_st_) << " in " #expr); \
  } while (0)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Algorithms are cached per exact shape; a long run with many prefill lengths clears the cache
// rather than growing it without bound.
constexpr size_t kMaxCachedAlgos = 4096;

template <typename T>
__global__ void round_activations(const float* __restrict__ x, T* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f32<T>(x[i]);
}

// Per (device, stream): the workspace and the rounded activations, ordered by the stream.
struct StreamBuffers {
  void* workspace = nullptr;
  void* act = nullptr;
  size_t act_bytes = 0;
};

// The largest power of two up to 256 dividing the address. cuBLASLt's heuristic assumes
// 256-byte aligned operands unless told; a weight row range or an output column slice may be
// less aligned, and must not get an algorithm that needs more.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

// device, dtype, m, n, k, bias, and the alignments of w, x (or its rounded copy) and y.
using AlgoKey = std::tuple<int, int, int64_t, int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t>;
struct CachedAlgo {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

struct LtState {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, StreamBuffers> buffers;
  std::map<AlgoKey, CachedAlgo> algos;
};
// Never destroyed: backends freed during exit may still reach it.
LtState& lt() {
  static LtState* s = new LtState;
  return *s;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// Host-side descriptors (no device memory), made per call.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~Descs() {
    if (d) lt_api().cublasLtMatrixLayoutDestroy(d);
    if (b) lt_api().cublasLtMatrixLayoutDestroy(b);
    if (a) lt_api().cublasLtMatrixLayoutDestroy(a);
    if (op) lt_api().cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

// Declared in cuda_backend.h, which this kernel file may not include (test_layering.py).
LibraryStatus cublaslt_library() { return lt_api().status; }

bool cublas_linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m,
                   int64_t n, int64_t k, cudaStream_t stream) {
  if (w_dtype != DType::kF32 && w_dtype != DType::kBF16 && w_dtype != DType::kF16) return false;
  const CublasLtApi& api = lt_api();
  if (!api.status.error.empty()) {
    // Logged once by lt_api(); later GEMMs go straight to the owned kernels.
    g_impl.store(static_cast<int>(GemmImpl::kOwn), std::memory_order_relaxed);
    return false;
  }
  int device = 0;
  FANTAI_CUDA_CHECK(cudaGetDevice(&device));
  LtState& s = lt();
  std::lock_guard<std::mutex> lock(s.mu);
  auto h = s.handles.find(device);
  if (h == s.handles.end()) {
    cublasLtHandle_t handle = nullptr;
    FANTAI_CUBLAS_CHECK(api.cublasLtCreate(&handle));
    h = s.handles.emplace(device, handle).first;
  }
  StreamBuffers& buf = s.buffers[{device, stream}];
  if (!buf.workspace) FANTAI_CUDA_CHECK(cudaMalloc(&buf.workspace, kWorkspaceBytes));

  // Row-major y[m, n] = x w^T is column-major D[n, m] = op(A)[n, k] * B[k, m] with A the
  // row-major w read as column-major [k, n] (transposed) and B the row-major x as [k, m].
  const cudaDataType_t wt = cuda_type(w_dtype);
  Descs d;
  FANTAI_CUBLAS_CHECK(api.cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  FANTAI_CUBLAS_CHECK(api.cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  FANTAI_CUBLAS_CHECK(api.cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = CUDA_R_32F;
    FANTAI_CUBLAS_CHECK(
        api.cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    FANTAI_CUBLAS_CHECK(
        api.cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    FANTAI_CUBLAS_CHECK(
        api.cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
  }
  FANTAI_CUBLAS_CHECK(api.cublasLtMatrixLayoutCreate(&d.a, wt, k, n, k));
  FANTAI_CUBLAS_CHECK(api.cublasLtMatrixLayoutCreate(&d.b, wt, k, m, k));
  FANTAI_CUBLAS_CHECK(api.cublasLtMatrixLayoutCreate(&d.d, CUDA_R_32F, n, m, n));

  // The rounded activations live in their own cudaMalloc buffer: 256-byte aligned.
  const uint32_t al_a = alignment(w), al_b = w_dtype == DType::kF32 ? alignment(x) : 256, al_d = alignment(y);
  const AlgoKey key{device, static_cast<int>(w_dtype), m, n, k, bias != nullptr, al_a, al_b, al_d};
  auto found = s.algos.find(key);
  if (found == s.algos.end()) {
    if (s.algos.size() >= kMaxCachedAlgos) s.algos.clear();
    CachedAlgo c;
    cublasLtMatmulPreference_t pref = nullptr;
    FANTAI_CUBLAS_CHECK(api.cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspaceBytes;
    api.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    api.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                             sizeof al_a);
    api.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                             sizeof al_b);
    api.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d,
                                             sizeof al_d);
    api.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d,
                                             sizeof al_d);
    cublasLtMatmulHeuristicResult_t r{};
    int count = 0;
    const cublasStatus_t st = api.cublasLtMatmulAlgoGetHeuristic(h->second, d.op, d.a, d.b, d.d, d.d, pref, 1,
                                                                 &r, &count);
    api.cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_SUCCESS && count > 0 && r.state == CUBLAS_STATUS_SUCCESS) {
      c.found = true;
      c.algo = r.algo;
    }
    found = s.algos.emplace(key, c).first;
  }
  if (!found->second.found) return false;

  const void* b_ptr = x;
  if (w_dtype != DType::kF32) {
    // Both operands in the weight dtype (cuBLASLt takes no f32 x bf16 product): the activations
    // are rounded as the owned tensor-core kernel rounds them when staging.
    const size_t bytes = static_cast<size_t>(m * k) * dtype_size(w_dtype);
    if (bytes > buf.act_bytes) {
      if (buf.act) {
        FANTAI_CUDA_CHECK(cudaStreamSynchronize(stream));  // the previous call may still read it
        cudaFree(buf.act);
      }
      buf.act = nullptr;
      buf.act_bytes = 0;
      FANTAI_CUDA_CHECK(cudaMalloc(&buf.act, bytes));
      buf.act_bytes = bytes;
    }
    const int64_t total = m * k;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65535));
    if (w_dtype == DType::kBF16)
      round_activations<<<grid, 256, 0, stream>>>(x, static_cast<__nv_bfloat16*>(buf.act), total);
    else round_activations<<<grid, 256, 0, stream>>>(x, static_cast<__half*>(buf.act), total);
    FANTAI_CUDA_LAUNCHED();
    b_ptr = buf.act;
  }
  const float alpha = 1.f, beta = 0.f;
  FANTAI_CUBLAS_CHECK(api.cublasLtMatmul(h->second, d.op, &alpha, w, d.a, b_ptr, d.b, &beta, y, d.d, y, d.d,
                                         &found->second.algo, buf.workspace, kWorkspaceBytes, stream));
  return true;
}

#endif  // FANTAI_WITH_CUBLAS

}  // namespace fantai::cuda
