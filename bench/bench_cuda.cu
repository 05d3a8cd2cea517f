// bench: CUDA kernel figures for bench/gpu_check.sh. Prints "name: value" lines:
//  - the device's copy bandwidth (cudaMemcpy device to device, read + write bytes),
//  - PagedAttention decode at batch 64 x 4k and batch 1 x 32k (Llama-3.2-1B heads: 32 query,
//    8 KV, head_dim 64; bf16 KV, block 16): K/V bytes read per second and that as a fraction of
//    the copy bandwidth,
//  - the bf16 GEMV (decode linear, m = 1) and weight-only INT4 GEMV weight bandwidth fractions and
//    the bf16 tensor-core GEMM throughput at a prefill shape, owned and (where linked) cuBLASLt.
// Exits 0 with a note when no GPU is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/gemm_impl.h"
#include "cuda/kernels.h"

namespace {

using namespace fantai;

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

void* dalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes));
  CK(cudaMemset(p, 0, bytes));
  return p;
}

// Mean seconds per call of f over `iters` calls after 3 warm-ups.
template <typename F>
double time_it(F&& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) f();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  return ms / 1e3 / iters;
}

double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void* src = dalloc(bytes);
  void* dst = dalloc(bytes);
  const double s = time_it([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * bytes / s;
}

// Decode attention over `seqs` sequences of `ctx` tokens each.
void bench_decode(int seqs, int ctx, double copy_bw) {
  const int hq = 32, hkv = 8, hd = 64, bs = 16;
  const int blocks_per_seq = (ctx + bs - 1) / bs, pool = seqs * blocks_per_seq;
  KVLayout L{pool, bs, hkv, hd, DType::kBF16};
  const size_t cache_bytes = size_t(pool) * hkv * bs * hd * 2;
  void* kc = dalloc(cache_bytes);
  void* vc = dalloc(cache_bytes);
  // Shuffled block tables: the kernel must not profit from adjacency a real pool lacks.
  std::vector<int32_t> tables(size_t(seqs) * blocks_per_seq);
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), std::mt19937(1));
  std::vector<int32_t> cu(seqs + 1), lens(seqs, ctx);
  for (int s = 0; s <= seqs; ++s) cu[s] = s;
  auto up = [](const std::vector<int32_t>& v) {
    void* p = dalloc(v.size() * 4);
    CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return static_cast<int32_t*>(p);
  };
  int32_t *dt = up(tables), *dcu = up(cu), *dl = up(lens);
  const int64_t q_stride = (hq + 2 * hkv) * hd;
  float* q = static_cast<float*>(dalloc(size_t(seqs) * q_stride * 4));
  float* out = static_cast<float*>(dalloc(size_t(seqs) * hq * hd * 4));
  void* ws = dalloc(std::max<size_t>(cuda::attention_workspace_bytes(seqs, hq, ctx, hd), 4));
  AttentionParams p{seqs, seqs, 1, ctx, dcu, dl, dt, blocks_per_seq};
  const double s = time_it([&] { cuda::attention(q, q_stride, kc, vc, L, p, hq, 0.125f, out, ws, nullptr); },
                           20);
  const double bytes = 2.0 * seqs * double(ctx) * hkv * hd * 2;
  std::printf("attention_decode_b%d_ctx%d_us: %.1f\n", seqs, ctx, s * 1e6);
  std::printf("attention_decode_b%d_ctx%d_GBps: %.1f\n", seqs, ctx, bytes / s / 1e9);
  std::printf("attention_decode_b%d_ctx%d_fraction_of_copy: %.3f\n", seqs, ctx, bytes / s / copy_bw);
  for (void* ptr : {kc, vc, static_cast<void*>(dt), static_cast<void*>(dcu), static_cast<void*>(dl),
                    static_cast<void*>(q), static_cast<void*>(out), ws})
    CK(cudaFree(ptr));
}

void bench_linear(double copy_bw) {
  // Llama-3.2-1B's gate_up: n = 2 * 8192, k = 2048.
  const int64_t n = 16384, k = 2048;
  void* w = dalloc(size_t(n) * k * 2);
  float* x = static_cast<float*>(dalloc(size_t(4096) * k * 4));
  float* y = static_cast<float*>(dalloc(size_t(4096) * n * 4));
  const double s1 = time_it([&] { cuda::linear(x, w, DType::kBF16, nullptr, y, 1, n, k, nullptr); }, 50);
  const double wbytes = double(n) * k * 2;
  std::printf("gemv_bf16_m1_us: %.1f\n", s1 * 1e6);
  std::printf("gemv_bf16_m1_fraction_of_copy: %.3f\n", wbytes / s1 / copy_bw);
  const double s8 = time_it([&] { cuda::linear(x, w, DType::kBF16, nullptr, y, 8, n, k, nullptr); }, 50);
  std::printf("gemv_bf16_m8_fraction_of_copy: %.3f\n", wbytes / s8 / copy_bw);
  const int64_t m = 4096;
  // The owned tensor-core kernel, then cuBLASLt where this build links it (linear()'s default
  // for prefill rows there).
  const cuda::GemmImpl before = cuda::gemm_impl();
  cuda::set_gemm_impl(cuda::GemmImpl::kOwn);
  const double sg = time_it([&] { cuda::linear(x, w, DType::kBF16, nullptr, y, m, n, k, nullptr); }, 5);
  std::printf("gemm_bf16_m%ld_TFLOPs: %.1f\n", static_cast<long>(m), 2.0 * m * n * k / sg / 1e12);
  if (cuda::cublas_built()) {
    cuda::set_gemm_impl(cuda::GemmImpl::kCublas);
    const double sc = time_it([&] { cuda::linear(x, w, DType::kBF16, nullptr, y, m, n, k, nullptr); }, 5);
    std::printf("gemm_bf16_m%ld_cublas_TFLOPs: %.1f\n", static_cast<long>(m), 2.0 * m * n * k / sc / 1e12);
  } else {
    std::printf("gemm_bf16_cublas: not linked in this build\n");
  }
  cuda::set_gemm_impl(before);
  {  // weight-only INT4, group 128, zero per group: the packed bytes a decode GEMV must read
    const int32_t group = 128;
    const int64_t ng = k / group;
    std::vector<uint8_t> q(size_t(n) * k, 7), zero(size_t(n) * ng, 8);
    std::vector<float> scale(size_t(n) * ng, 0.01f);
    QuantMatrix c;
    c.bits = 4, c.group = group, c.rows = n, c.cols = k, c.ld = k;
    c.data = q.data(), c.scale = scale.data(), c.zero = zero.data();
    void* mem = dalloc(cuda::quant_packed_bytes(c));
    const QuantMatrix pw = cuda::pack_quant(c, mem, nullptr);
    const double sq = time_it([&] { cuda::linear_q(x, pw, nullptr, y, 1, n, nullptr); }, 50);
    const double qbytes = double(n) * k / 2 + double(n) * ng * 5;
    std::printf("gemv_int4_m1_us: %.1f\n", sq * 1e6);
    std::printf("gemv_int4_m1_fraction_of_copy: %.3f\n", qbytes / sq / copy_bw);
    CK(cudaFree(mem));
  }
  CK(cudaFree(w));
  CK(cudaFree(x));
  CK(cudaFree(y));
}

}  // namespace

int main() {
  const std::string why = cuda::device_unavailable_reason();
  if (!why.empty()) {
    std::printf("bench_cuda: skipped, %s\n", why.c_str());
    return 0;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %zu MiB)\n", prop.name, prop.major, prop.minor,
              prop.totalGlobalMem >> 20);
  const double bw = copy_bandwidth();
  std::printf("copy_bandwidth_GBps: %.1f\n", bw / 1e9);
  bench_decode(64, 4096, bw);
  bench_decode(1, 32768, bw);
  bench_linear(bw);
  return 0;
}
