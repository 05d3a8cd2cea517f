// cuda: the Backend on one NVIDIA GPU. All work goes to one stream in call order, so the model's
// sequence of ops needs no other synchronisation; download() waits for the stream.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/logging.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace fantai::cuda {
namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    FANTAI_CUDA_CHECK(cudaSetDevice(device_));
    FANTAI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    FANTAI_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    name_ = std::string("cuda:") + std::to_string(device_) + " (" + prop.name + ", sm_" +
            std::to_string(prop.major) + std::to_string(prop.minor) + ")";
    FANTAI_REQUIRE(prop.major >= 8,
                   "the CUDA backend needs compute capability 8.0 or newer (bf16 tensor "
                   "cores); "
                       << prop.name << " is sm_" << prop.major << prop.minor);
    FANTAI_LOG(kInfo, "CUDA backend on " << name_ << ", " << prop.totalGlobalMem / (1 << 20) << " MiB");
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    if (workspace_) cudaFree(workspace_);
    if (sample_buf_) cudaFree(sample_buf_);
    if (moe_buf_) cudaFree(moe_buf_);
    cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const { return stream_; }
  std::string name() const override { return "cuda"; }
  int num_threads() const override { return 1; }
  bool is_device() const override { return true; }
  int64_t free_memory() const override {
    bind();
    size_t free_bytes = 0, total = 0;
    FANTAI_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    return static_cast<int64_t>(free_bytes);
  }

  void* alloc(size_t bytes) override {
    bind();
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess) cudaGetLastError();  // not sticky: clear it so later checks see their own
    FANTAI_REQUIRE(e == cudaSuccess, "CUDA out of memory allocating "
                                         << bytes / (1 << 20) << " MiB (" << cudaGetErrorString(e)
                                         << "); lower kv_cache_memory / memory_utilization");
    return p;
  }
  void free(void* ptr) override {
    bind();
    // The stream may still read this memory: finish it first (frees are rare: workspace growth).
    cudaStreamSynchronize(stream_);
    cudaFree(ptr);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void fill_zero(void* dst, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
  }
  // Pageable host memory: cudaMemcpyAsync stages it and returns once the source may be reused,
  // so the caller's host buffer is free to change after upload() returns.
  void upload(void* dst, const void* host_src, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void download(void* host_dst, const void* src, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    FANTAI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void* alloc_host(size_t bytes) override {
    bind();
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (e != cudaSuccess) cudaGetLastError();
    FANTAI_REQUIRE(e == cudaSuccess, "cannot pin " << bytes / (1 << 20)
                                                   << " MiB of host memory for swap space ("
                                                   << cudaGetErrorString(e) << "); lower swap_space");
    return p;
  }
  void free_host(void* ptr) override {
    bind();
    cudaStreamSynchronize(stream_);  // a swap copy may still be in flight
    cudaFreeHost(ptr);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    bind();
    FANTAI_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  }

  void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k) override {
    bind();
    cuda::linear(x, w, w_dtype, bias, y, m, n, k, stream_);
  }
  void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                float eps) override {
    bind();
    cuda::rms_norm(x, weight, out, rows, dim, eps, stream_);
  }
  void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                    int64_t dim, float eps) override {
    bind();
    cuda::add_rms_norm(residual, x, weight, out, rows, dim, eps, stream_);
  }
  void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                      const float* weight, float eps) override {
    bind();
    cuda::rms_norm_heads(x, stride, num_tokens, num_heads, head_dim, weight, eps, stream_);
  }
  void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
            int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
            int32_t rotary_dim, const float* cos_sin) override {
    bind();
    cuda::rope(q, q_stride, k, k_stride, positions, num_tokens, num_q_heads, num_kv_heads, head_dim,
               rotary_dim, cos_sin, stream_);
  }
  void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                int64_t num_tokens, void* k_cache, void* v_cache, const KVLayout& layout) override {
    bind();
    cuda::store_kv(k, v, stride, slot_mapping, num_tokens, k_cache, v_cache, layout, stream_);
  }
  void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                 const KVLayout& layout, const AttentionParams& p, int32_t num_q_heads, float scale,
                 float* out) override {
    bind();
    const size_t need = attention_workspace_bytes(p.num_seqs, num_q_heads, p.max_context_len,
                                                  layout.head_dim);
    cuda::attention(q, q_stride, k_cache, v_cache, layout, p, num_q_heads, scale, out, workspace(need),
                    stream_);
  }
  void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) override {
    bind();
    cuda::silu_mul(gate_up, out, rows, inter, stream_);
  }
  void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) override {
    bind();
    cuda::gelu_tanh_mul(gate_up, out, rows, inter, stream_);
  }
  void scale(float* x, float s, int64_t n) override {
    bind();
    cuda::scale(x, s, n, stream_);
  }
  void softcap(float* x, float cap, int64_t n) override {
    bind();
    cuda::softcap(x, cap, n, stream_);
  }
  void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim,
                 float* out) override {
    bind();
    cuda::embedding(ids, n, table, dtype, dim, out, stream_);
  }
  void add(float* x, const float* y, int64_t n) override {
    bind();
    cuda::add(x, y, n, stream_);
  }

  size_t quant_packed_bytes(const QuantMatrix& canonical) const override {
    return cuda::quant_packed_bytes(canonical);
  }
  QuantMatrix pack_quant(const QuantMatrix& canonical, void* dst) override {
    bind();
    return cuda::pack_quant(canonical, dst, stream_);
  }
  void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                int64_t ldy) override {
    bind();
    cuda::linear_q(x, w, bias, y, m, ldy, stream_);
  }
  void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out) override {
    bind();
    cuda::embedding_q(ids, n, table, out, stream_);
  }

  void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
                 int32_t* ids, float* weights) override {
    bind();
    cuda::moe_route(logits, rows, num_experts, top_k, renormalize, ids, weights, stream_);
  }
  // The grouping is done on the host: the chosen experts come back in one small download (which
  // waits for the stream), and each expert's row count sizes its linears. Experts then run in
  // ascending id on the stream: gather, gate|up, silu-mul, down, weighted scatter-add.
  void moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows, int32_t top_k,
                   const MoeExperts& ex, float* out) override {
    bind();
    const int32_t E = ex.num_experts;
    const int64_t H = ex.hidden, I = ex.inter, n = rows * top_k;
    FANTAI_REQUIRE(rows >= 0 && top_k > 0 && top_k <= E && H > 0 && I > 0 && ex.experts && !ex.packed,
                   "moe_experts: bad shape rows=" << rows << " top_k=" << top_k << " experts=" << E);
    if (rows == 0) return;
    moe_ids_.resize(static_cast<size_t>(n));
    download(moe_ids_.data(), ids, static_cast<size_t>(n) * sizeof(int32_t));
    moe_offsets_.resize(static_cast<size_t>(E) + 1);
    moe_slots_.resize(static_cast<size_t>(n));
    moe_group_slots(moe_ids_.data(), rows, top_k, E, moe_offsets_.data(), moe_slots_.data());
    int64_t max_m = 0;
    for (int32_t e = 0; e < E; ++e) max_m = std::max(max_m, moe_offsets_[e + 1] - moe_offsets_[e]);
    const size_t slot_bytes = (static_cast<size_t>(n) * sizeof(int64_t) + 255) / 256 * 256;
    const size_t x_floats = static_cast<size_t>(max_m * std::max(H, I));
    const size_t need = slot_bytes + (2 * x_floats + static_cast<size_t>(max_m * 2 * I)) * sizeof(float);
    if (need > moe_bytes_) {
      if (moe_buf_) free(moe_buf_);
      moe_bytes_ = std::max(need, 2 * moe_bytes_);
      moe_buf_ = alloc(moe_bytes_);
    }
    int64_t* slots = static_cast<int64_t*>(moe_buf_);
    float* xg = reinterpret_cast<float*>(static_cast<char*>(moe_buf_) + slot_bytes);
    float* yg = xg + x_floats;
    float* gu = yg + x_floats;
    upload(slots, moe_slots_.data(), static_cast<size_t>(n) * sizeof(int64_t));
    fill_zero(out, static_cast<size_t>(rows * H) * sizeof(float));
    auto run = [&](const float* in, const MoeLinear& L, float* y, int64_t m, int64_t cols, int64_t k) {
      if (L.dense) cuda::linear(in, L.dense, ex.dtype, nullptr, y, m, cols, k, stream_);
      for (int32_t i = 0; i < L.num_parts; ++i)
        cuda::linear_q(in, L.parts[i], nullptr, y + L.part_row0[i], m, cols, stream_);
    };
    for (int32_t e = 0; e < E; ++e) {
      const int64_t m = moe_offsets_[e + 1] - moe_offsets_[e];
      if (m == 0) continue;
      const int64_t* sl = slots + moe_offsets_[e];
      cuda::moe_gather(x, sl, m, top_k, H, xg, stream_);
      run(xg, ex.experts[e].gate_up, gu, m, 2 * I, H);
      cuda::silu_mul(gu, xg, m, I, stream_);
      run(xg, ex.experts[e].down, yg, m, H, I);
      cuda::moe_scatter_add(yg, sl, weights, m, top_k, H, out, stream_);
    }
  }

  bool sample_greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                     float* logprobs) override {
    bind();
    if (rows == 0) return true;
    const size_t bytes = static_cast<size_t>(rows) * (sizeof(int32_t) + sizeof(float));
    if (bytes > sample_bytes_) {
      if (sample_buf_) free(sample_buf_);
      sample_bytes_ = std::max(bytes, 2 * sample_bytes_);
      sample_buf_ = alloc(sample_bytes_);
    }
    int32_t* d_tokens = static_cast<int32_t*>(sample_buf_);
    float* d_logprobs = reinterpret_cast<float*>(d_tokens + rows);
    cuda::greedy(logits, rows, vocab, d_tokens, d_logprobs, stream_);
    FANTAI_CUDA_CHECK(
        cudaMemcpyAsync(tokens, d_tokens, rows * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    download(logprobs, d_logprobs, rows * sizeof(float));  // synchronizes
    return true;
  }

  bool sample_top_k_top_p(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                          const int32_t* top_k, const float* top_p, const float* uniform, int32_t* tokens,
                          float* logprobs) override {
    bind();
    if (rows == 0) return true;
    for (int64_t r = 0; r < rows; ++r) {
      FANTAI_REQUIRE(temperature[r] > 0.f && std::isfinite(temperature[r]),
                     "sample: row " << r << ": temperature must be > 0, got " << temperature[r]);
      FANTAI_REQUIRE(top_p[r] > 0.f && top_p[r] <= 1.f, "sample: row " << r << ": top_p must be in (0, 1]");
      FANTAI_REQUIRE(uniform[r] >= 0.f && uniform[r] < 1.f,
                     "sample: row " << r << ": uniform must be in [0, 1)");
    }
    // One upload of the four parameter arrays, behind the two result arrays.
    const size_t n = static_cast<size_t>(rows);
    const size_t bytes = 6 * n * 4;
    if (bytes > sample_bytes_) {
      if (sample_buf_) free(sample_buf_);
      sample_bytes_ = std::max(bytes, 2 * sample_bytes_);
      sample_buf_ = alloc(sample_bytes_);
    }
    sample_params_.resize(4 * n);
    std::memcpy(sample_params_.data(), temperature, n * 4);
    std::memcpy(sample_params_.data() + n, top_k, n * 4);
    std::memcpy(sample_params_.data() + 2 * n, top_p, n * 4);
    std::memcpy(sample_params_.data() + 3 * n, uniform, n * 4);
    int32_t* d_tokens = static_cast<int32_t*>(sample_buf_);
    float* d_logprobs = reinterpret_cast<float*>(d_tokens + n);
    uint32_t* d_params = reinterpret_cast<uint32_t*>(d_logprobs + n);
    upload(d_params, sample_params_.data(), 4 * n * 4);
    cuda::sample_top_k_top_p_rows(
        logits, rows, vocab, reinterpret_cast<const float*>(d_params),
        reinterpret_cast<const int32_t*>(d_params + n), reinterpret_cast<const float*>(d_params + 2 * n),
        reinterpret_cast<const float*>(d_params + 3 * n), d_tokens, d_logprobs, stream_);
    FANTAI_CUDA_CHECK(
        cudaMemcpyAsync(tokens, d_tokens, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    download(logprobs, d_logprobs, n * sizeof(float));  // synchronizes
    return true;
  }

 private:
  void bind() const { bind_device(device_); }

  // Grown geometrically, never shrunk; replacing it waits for the stream (free() above).
  void* workspace(size_t bytes) {
    if (bytes == 0) return workspace_;
    if (bytes > workspace_bytes_) {
      if (workspace_) free(workspace_);
      workspace_bytes_ = std::max(bytes, workspace_bytes_ * 2);
      workspace_ = alloc(workspace_bytes_);
    }
    return workspace_;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::string name_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void* sample_buf_ = nullptr;  // greedy tokens + logprobs of one step
  size_t sample_bytes_ = 0;
  std::vector<uint32_t> sample_params_;  // host side of the device sampler's parameter upload
  // moe_experts: the grouped slots and the gathered rows on the device (grown, never shrunk), and
  // the host copies of the chosen experts and of their grouping.
  void* moe_buf_ = nullptr;
  size_t moe_bytes_ = 0;
  std::vector<int32_t> moe_ids_;
  std::vector<int64_t> moe_offsets_, moe_slots_;
};

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later calls report their own
    return 0;
  }
  return n;
}

std::string device_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device (") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")";
  }
  return n > 0 ? "" : "no CUDA device found";
}

void* backend_stream(Backend& be) {
  auto* cuda = dynamic_cast<CudaBackend*>(&be);
  FANTAI_CHECK(cuda, "backend '" << be.name() << "' is not a CUDA backend");
  return cuda->stream();
}

std::shared_ptr<Backend> create_cuda_backend(int device) {
  const std::string why = device_unavailable_reason();
  FANTAI_REQUIRE(why.empty(), "backend 'cuda' is unavailable: " << why);
  FANTAI_REQUIRE(device >= 0 && device < device_count(),
                 "CUDA device " << device << " does not exist (" << device_count() << " visible)");
  return std::make_shared<CudaBackend>(device);
}

}  // namespace fantai::cuda
