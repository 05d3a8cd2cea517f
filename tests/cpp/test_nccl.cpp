// tests: GPU tensor parallelism's pieces that one process can check. The build's report of NCCL,
// NCCL and cuBLASLt opened at run time with their versions, and a CUDA backend asked for in a
// group of two ranks where NCCL or a GPU is missing (a clear error, before any collective) run
// everywhere; the rank-order sum kernel and the one-rank NCCL communicator (a real
// ncclCommInitRankConfig, all-reduce and all-gather) skip without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/mpi_communicator.h"
#include "common/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernels.h"
#include "test_support.h"

namespace fantai {
namespace {

bool nccl_built() {
#ifdef FANTAI_WITH_NCCL
  return true;
#else
  return false;
#endif
}

#define SKIP_WITHOUT_GPU()                                         \
  do {                                                             \
    const std::string why = cuda::device_unavailable_reason();     \
    if (!why.empty()) GTEST_SKIP() << "needs a CUDA GPU: " << why; \
  } while (0)

#define SKIP_WITHOUT_NCCL()                                                                     \
  do {                                                                                          \
    if (!nccl_built()) GTEST_SKIP() << "this build has no NCCL: " << nccl_unavailable_reason(); \
  } while (0)

// Rank 0 of a pretend group of two whose collectives do nothing: enough for the registry to
// take the tensor-parallel path, which must refuse before it reaches a collective.
class TwoRanks final : public Communicator {
 public:
  int world_size() const override { return 2; }
};

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = d(g) * (i % 7 == 0 ? 1e4f : 1.f);  // mixed magnitudes
  return v;
}

float* to_device(const std::vector<float>& v) {
  void* p = nullptr;
  FANTAI_CHECK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(float)) == cudaSuccess, "cudaMalloc");
  FANTAI_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess,
               "copy");
  return static_cast<float*>(p);
}
std::vector<float> to_host(const float* p, size_t n) {
  std::vector<float> v(n);
  FANTAI_CHECK(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess, "copy");
  return v;
}

TEST(NcclBuild, ReasonSaysWhetherNcclWasBuilt) {
  const std::string why = nccl_unavailable_reason();
  EXPECT_EQ(why.empty(), nccl_built()) << why;
  if (!why.empty()) {
    EXPECT_NE(why.find_first_not_of(' '), std::string::npos);
  }
}

// Opened at run time, not linked (cuda/lazy_library.h): where the build has the header, the
// library opens, every function of the table resolves and ncclGetVersion answers (no GPU needed).
TEST(NcclBuild, LibraryOpensWithEveryFunctionAndItsVersion) {
  SKIP_WITHOUT_NCCL();
#ifdef FANTAI_WITH_NCCL  // nccl_library() is defined only then
  const cuda::LibraryStatus s = cuda::nccl_library();
  ASSERT_EQ(s.error, "");
  EXPECT_NE(s.path.find("libnccl"), std::string::npos) << s.path;
  EXPECT_GE(s.version, 21800) << "2.18: non-blocking communicators";
#endif
}

TEST(CublasBuild, LibraryOpensWithEveryFunctionAndItsVersion) {
  const cuda::LibraryStatus s = cuda::cublaslt_library();
  if (s.error.rfind("this build has no", 0) == 0) GTEST_SKIP() << s.error;
  ASSERT_EQ(s.error, "");
  EXPECT_NE(s.path.find("libcublasLt"), std::string::npos) << s.path;
  EXPECT_GE(s.version, 120000);
}

TEST(NcclBuild, CudaInAGroupWithoutNcclOrGpuIsAClearError) {
  if (nccl_built() && cuda::device_unavailable_reason().empty())
    GTEST_SKIP() << "NCCL and a GPU are here: a pretend group of two would start a real NCCL init";
  set_process_communicator(std::make_shared<TwoRanks>());
  try {
    create_backend("cuda");
    ADD_FAILURE() << "a CUDA backend in a group of two was made without NCCL or a GPU";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find(nccl_built() ? "unavailable" : "needs NCCL") != std::string::npos) << msg;
  }
  set_process_communicator(nullptr);
}

TEST(NcclSum, SumPartialsAddsInRankOrderBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 4099;
  for (int world : {1, 2, 3, 8}) {
    const std::vector<float> g = randn(static_cast<size_t>(n) * world, 7 + world);
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) {
      float s = g[i];
      for (int r = 1; r < world; ++r) s += g[r * n + i];
      want[i] = s;
    }
    float* d = to_device(g);
    float* out = to_device(std::vector<float>(n, -1.f));
    cuda::sum_partials(d, out, n, world, nullptr);
    const std::vector<float> got = to_host(out, n);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << "world " << world;
    // In place over the first partial, as the communicator runs it.
    cuda::sum_partials(d, d, n, world, nullptr);
    const std::vector<float> alias = to_host(d, n);
    EXPECT_EQ(std::memcmp(alias.data(), want.data(), n * sizeof(float)), 0)
        << "world " << world << " in place";
    cudaFree(d);
    cudaFree(out);
  }
}

#ifdef FANTAI_WITH_NCCL
TEST(NcclComm, OneRankAllReduceAndAllGatherRunOverNccl) {
  SKIP_WITHOUT_GPU();
  std::shared_ptr<Backend> be = cuda::create_cuda_backend(0);
  auto host = std::make_shared<Communicator>();
  std::shared_ptr<Communicator> comm = cuda::create_nccl_communicator(host, 0, cuda::backend_stream(*be));
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(&comm->steps_owner(), host.get());
  for (int64_t n : {int64_t{1}, int64_t{1000}, (int64_t{1} << 22) + 5}) {  // the last in two pieces
    const std::vector<float> x = randn(n, 11);
    float* d = static_cast<float*>(be->alloc(n * sizeof(float)));
    be->upload(d, x.data(), n * sizeof(float));
    comm->all_reduce_sum(d, n);
    std::vector<float> got(n);
    be->download(got.data(), d, n * sizeof(float));
    EXPECT_EQ(std::memcmp(got.data(), x.data(), n * sizeof(float)), 0) << "all_reduce_sum of " << n;
    float* o = static_cast<float*>(be->alloc(n * sizeof(float)));
    comm->all_gather(d, o, n);
    be->download(got.data(), o, n * sizeof(float));
    EXPECT_EQ(std::memcmp(got.data(), x.data(), n * sizeof(float)), 0) << "all_gather of " << n;
    be->free(d);
    be->free(o);
  }
  // Host memory (the step loop's agreement flag) goes to the host communicator.
  float flag = 3.f;
  comm->all_reduce_sum(&flag, 1);
  EXPECT_EQ(flag, 3.f);
  EXPECT_EQ(comm->stats().all_reduce_calls, 3);
}

TEST(NcclComm, RegistryGivesAOneRankCudaBackendNcclWhenAsked) {
  SKIP_WITHOUT_GPU();
  std::shared_ptr<Backend> be;
  {
    const test::ScopedEnv one_rank("FANTAI_NCCL_ONE_RANK", "1");
    be = create_backend("cuda");
  }
  EXPECT_NE(&be->communicator(), process_communicator().get());
  const std::vector<float> x = randn(333, 5);
  float* d = static_cast<float*>(be->alloc(x.size() * sizeof(float)));
  be->upload(d, x.data(), x.size() * sizeof(float));
  be->communicator().all_reduce_sum(d, static_cast<int64_t>(x.size()));
  std::vector<float> got(x.size());
  be->download(got.data(), d, x.size() * sizeof(float));
  EXPECT_EQ(got, x);
  EXPECT_EQ(be->communicator().stats().all_reduce_calls, 1);
  be->free(d);
  // Without the variable a one-rank backend keeps the process's (no-op) communicator.
  EXPECT_EQ(&create_backend("cuda")->communicator(), process_communicator().get());
}
#endif

}  // namespace
}  // namespace fantai
