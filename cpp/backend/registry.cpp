// backend: the registry that picks a backend by name (one of the three dispatch points).
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/mpi_communicator.h"
#include "common/check.h"
#include "cpu/cpu_backend.h"
#ifdef FANTAI_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace fantai {

void Communicator::all_gather(const float* in, float* out, int64_t n) {
  if (in != out) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

void Communicator::gather(const float* in, int64_t n, float* out, const int64_t* /*counts*/, int /*root*/) {
  if (in != out) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

// Quantized ops are optional per backend: the defaults say so plainly.
size_t Backend::quant_packed_bytes(const QuantMatrix&) const {
  FANTAI_THROW("quantized weights are not supported on the " << name() << " backend");
}
QuantMatrix Backend::pack_quant(const QuantMatrix&, void*) {
  FANTAI_THROW("quantized weights are not supported on the " << name() << " backend");
}
void Backend::linear_q(const float*, const QuantMatrix&, const float*, float*, int64_t, int64_t) {
  FANTAI_THROW("quantized linear is not supported on the " << name() << " backend");
}
void Backend::linear_q_parts(const float* x, const QuantMatrix* const* parts, const int64_t* row0,
                             int n_parts, const float* bias, float* y, int64_t m, int64_t ldy) {
  for (int i = 0; i < n_parts; ++i)
    linear_q(x, *parts[i], bias ? bias + row0[i] : nullptr, y + row0[i], m, ldy);
}
size_t Backend::dense_packed_bytes(DType, int64_t, int64_t) const { return 0; }
void Backend::pack_dense(const void*, DType, int64_t, int64_t, void*) {
  FANTAI_THROW("packed dense weights are not supported on the " << name() << " backend");
}
void Backend::linear_packed(const float*, const void*, DType, const float*, float*, int64_t, int64_t,
                            int64_t) {
  FANTAI_THROW("packed dense weights are not supported on the " << name() << " backend");
}
bool Backend::mlp_packed(const float*, const void*, const void*, DType, float*, int64_t, int64_t, int64_t) {
  return false;
}
void Backend::embedding_q(const int32_t*, int64_t, const QuantMatrix&, float*) {
  FANTAI_THROW("quantized embedding is not supported on the " << name() << " backend");
}

void Backend::moe_route(const float*, int64_t, int32_t, int32_t, bool, int32_t*, float*) {
  FANTAI_THROW("mixture-of-experts routing is not supported on the " << name() << " backend");
}
void Backend::moe_experts(const float*, const int32_t*, const float*, int64_t, int32_t, const MoeExperts&,
                          float*) {
  FANTAI_THROW("mixture-of-experts layers are not supported on the " << name() << " backend");
}

bool Backend::set_matmul_precision(DType precision) {
  FANTAI_REQUIRE(precision == DType::kF32 || precision == DType::kBF16,
                 "matmul precision must be float32 or bfloat16, got " << dtype_name(precision));
  return false;
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef FANTAI_WITH_CUDA
  if (cuda::device_count() > 0) names.push_back("cuda");
#endif
  return names;
}

const RowReductions& host_row_reductions() { return cpu::row_reductions(); }
const char* host_cpu_isa() { return cpu::selected_isa(); }
std::vector<std::string> host_cpu_isa_levels() { return cpu::runnable_isas(); }
int host_default_threads() { return cpu::default_threads(); }

namespace {
std::shared_ptr<Communicator>& process_comm() {
  static std::shared_ptr<Communicator> comm = std::make_shared<Communicator>();
  return comm;
}

std::shared_ptr<Backend> with_communicator(std::shared_ptr<Backend> be) {
  be->set_communicator(process_comm());
  return be;
}
}  // namespace

std::string nccl_unavailable_reason() {
#if defined(FANTAI_WITH_CUDA) && defined(FANTAI_WITH_NCCL)
  return cuda::nccl_library().error;
#elif defined(FANTAI_NCCL_MISSING_REASON)
  return FANTAI_NCCL_MISSING_REASON;
#else
  return "this build of fantai has no CUDA backend";
#endif
}

std::vector<RuntimeLibrary> cuda_runtime_libraries() {
  std::vector<RuntimeLibrary> out(2);
  out[0].name = "nccl";
  out[1].name = "cublaslt";
#ifdef FANTAI_WITH_CUDA
  const auto take = [](RuntimeLibrary& r, const cuda::LibraryStatus& s) {
    r.path = s.path;
    r.version = s.version;
    r.error = s.error;
  };
#ifdef FANTAI_WITH_NCCL
  take(out[0], cuda::nccl_library());
#else
  out[0].error = "this build has no NCCL: " + nccl_unavailable_reason();
#endif
  take(out[1], cuda::cublaslt_library());
#else
  out[0].error = out[1].error = "this build of fantai has no CUDA backend";
#endif
  return out;
}

#ifdef FANTAI_WITH_CUDA
namespace {
// A backend of a tensor-parallel group's rank: the GPU of its index among the ranks on its host,
// with NCCL for the collectives. FANTAI_NCCL_ONE_RANK=1 gives a one-rank process the NCCL
// communicator too (a GPU check runs NCCL's path against the plain one with a single GPU).
std::shared_ptr<Backend> create_cuda_rank(const std::string& name, int device) {
  std::shared_ptr<Communicator> host = process_comm();
  const bool group = host->world_size() > 1;
  const char* one = std::getenv("FANTAI_NCCL_ONE_RANK");
  if (!group && !(one && std::strcmp(one, "1") == 0))
    return with_communicator(cuda::create_cuda_backend(device));
  const std::string nccl = nccl_unavailable_reason();
  // The reason carries its own remedy: a rebuild when CMake found no NCCL, a path when it did
  // but libnccl does not open.
  FANTAI_REQUIRE(nccl.empty(), "tensor parallelism on CUDA devices needs NCCL, and " << nccl);
  // Checked before the collectives below, so every rank of a group without GPUs refuses alike.
  const std::string why = cuda::device_unavailable_reason();
  FANTAI_REQUIRE(why.empty(), "backend 'cuda' is unavailable: " << why);
  if (group) {
    FANTAI_REQUIRE(name.size() <= 5, "with tensor_parallel_size > 1 each rank takes the GPU of its index "
                                         << "among the ranks on its host: ask for device 'cuda', not '"
                                         << name << "' (CUDA_VISIBLE_DEVICES picks the GPUs)");
#ifdef FANTAI_WITH_NCCL  // without NCCL the require above has refused already
    device = cuda::nccl_local_rank(*host);
#endif
    FANTAI_REQUIRE(device < cuda::device_count(), "tensor-parallel rank "
                                                      << host->rank() << " is rank " << device
                                                      << " on its host and takes GPU " << device
                                                      << ", but this process sees " << cuda::device_count()
                                                      << " CUDA device(s): one GPU per rank");
  }
  std::shared_ptr<Backend> be = cuda::create_cuda_backend(device);
#ifdef FANTAI_WITH_NCCL
  be->set_communicator(cuda::create_nccl_communicator(host, device, cuda::backend_stream(*be)));
#endif
  return be;
}
}  // namespace
#endif

void set_process_communicator(std::shared_ptr<Communicator> comm) {
  process_comm() = comm ? std::move(comm) : std::make_shared<Communicator>();
}
std::shared_ptr<Communicator> process_communicator() { return process_comm(); }

std::shared_ptr<Backend> create_backend(const std::string& name, int num_threads) {
  if (name == "cpu" || name.empty()) return with_communicator(cpu::create_cpu_backend(num_threads));
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifdef FANTAI_WITH_CUDA
    int device = 0;
    if (name.size() > 5) {
      const std::string idx = name.substr(5);
      FANTAI_REQUIRE(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
                     "bad CUDA device '" << name << "' (use cuda or cuda:N)");
      device = std::stoi(idx);
    }
    return create_cuda_rank(name, device);
#else
    FANTAI_THROW(
        "backend '" << name
                    << "' is unavailable: this fantai was built without CUDA "
                       "(rebuild with nvcc on PATH, or -C cmake.define.FANTAI_CUDA=ON to require it)");
#endif
  }
  FANTAI_THROW("unknown backend '" << name << "' (known: cpu, cuda)");
}

}  // namespace fantai
