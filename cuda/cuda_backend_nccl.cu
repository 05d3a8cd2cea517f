// cuda: the NCCL communicator of GPU ranks (declared in cuda_backend.h). Compiled in every CUDA
// build; its body only when CMake found nccl.h, so nothing else in the engine sees it. NCCL is not
// linked: libnccl is opened when the first communicator is made (or its status asked for), so a
// process that never joins GPUs never loads it (see lazy_library.h).
#include "cuda/cuda_backend.h"

#ifdef FANTAI_WITH_NCCL
#include <nccl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/check.h"
#include "common/logging.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/lazy_library.h"

// Where CMake found libnccl.so.2 ("" when it found only the header).
#ifndef FANTAI_NCCL_LIBDIR
#define FANTAI_NCCL_LIBDIR ""
#endif

namespace fantai::cuda {
namespace {

// Every NCCL function this file calls; NCCL_CONFIG_INITIALIZER is a plain initializer, no call.
#define FANTAI_NCCL_FUNCTIONS(X) \
  X(ncclGetVersion)              \
  X(ncclGetUniqueId)             \
  X(ncclGetErrorString)          \
  X(ncclGetLastError)            \
  X(ncclCommInitRankConfig)      \
  X(ncclCommGetAsyncError)       \
  X(ncclCommAbort)               \
  X(ncclAllGather)               \
  X(ncclGroupStart)              \
  X(ncclGroupEnd)                \
  X(ncclSend)                    \
  X(ncclRecv)

struct NcclApi {
  FANTAI_NCCL_FUNCTIONS(FANTAI_LAZY_MEMBER)
  LibraryStatus status;
};

// Opened once, on first use; never closed (communicators may be torn down during exit).
const NcclApi& nccl_api() {
  static const NcclApi* const loaded = [] {
    auto* api = new NcclApi;
    LazyLibrary lib("NCCL", "FANTAI_NCCL_LIBRARY", FANTAI_NCCL_LIBDIR, "libnccl.so.2");
    FANTAI_NCCL_FUNCTIONS(FANTAI_LAZY_RESOLVE)
    api->status = lib.finish();
    int version = 0;
    if (api->status.error.empty() && api->ncclGetVersion(&version) == ncclSuccess)
      api->status.version = version;
    return api;
  }();
  return *loaded;
}

using Clock = std::chrono::steady_clock;

// Floats per rank that one all-reduce gathers at a time. The gather buffer (this times the
// world size) is allocated with the communicator, before the KV pool takes the GPU's free
// memory, and a prefill's all-reduce runs through it in pieces (the sum is elementwise, so the
// bits are the same); 16 MiB per rank keeps each piece far past NCCL's latency-bound sizes.
constexpr int64_t kChunkFloats = int64_t{1} << 22;

double env_seconds(const char* name, double fallback) {
  const char* s = std::getenv(name);
  return s && *s ? std::atof(s) : fallback;
}

// The step loop's host buffers (the ranks' agreement flag) reach all_reduce_sum too: those stay
// on MPI, device memory goes over NCCL.
bool is_device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not sticky: plain host memory may report an error on older drivers
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> host, int device, cudaStream_t stream)
      : host_(std::move(host)),
        device_(device),
        stream_(stream),
        rank_(host_->rank()),
        world_(host_->world_size()),
        timeout_s_(env_seconds("FANTAI_TP_TIMEOUT_S", 5.0)) {
    bind();
    // Before the collectives below: a rank that cannot have them fails before its peers wait.
    const cudaError_t e = cudaMalloc(&scratch_, static_cast<size_t>(kChunkFloats) * world_ * sizeof(float));
    if (e != cudaSuccess) {
      cudaGetLastError();
      FANTAI_THROW("CUDA out of memory allocating the all-reduce's gather buffer ("
                   << kChunkFloats * world_ * sizeof(float) / (1 << 20)
                   << " MiB): " << cudaGetErrorString(e));
    }
    FANTAI_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    ncclUniqueId id{};
    if (rank_ == 0) {
      const ncclResult_t rc = nccl_.ncclGetUniqueId(&id);
      if (rc != ncclSuccess)
        fail(std::string("ncclGetUniqueId failed in NCCL: ") + nccl_.ncclGetErrorString(rc));
    }
    // idle: the ranks come here from their own model loads, which may end seconds apart.
    host_->broadcast(&id, sizeof id, 0, true);
    // Non-blocking: every NCCL call returns at once and is polled below, so a rank that died or
    // hangs costs the watchdog's deadline, never a process stuck inside NCCL.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    enqueue(nccl_.ncclCommInitRankConfig(&comm_, world_, id, rank_, &config), "ncclCommInitRankConfig",
            env_seconds("FANTAI_TP_START_TIMEOUT_S", 300.0));
    int version = 0;
    nccl_.ncclGetVersion(&version);
    FANTAI_LOG(kInfo, "tensor-parallel rank " << rank_ << " of " << world_ << ": NCCL " << version
                                              << " on cuda:" << device_);
  }

  ~NcclCommunicator() override {
    bind();
    // Abort rather than finalize: it is local, so a destructor never waits on a peer that is
    // gone; the backend's stream has been drained by then (every collective waits for its end).
    if (comm_) nccl_.ncclCommAbort(comm_);
    if (done_) cudaEventDestroy(done_);
    if (scratch_) cudaFree(scratch_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Communicator& steps_owner() override { return host_->steps_owner(); }

  // The MPI path's sum, on the GPU: the N partials are gathered (ncclAllGather, which moves
  // bytes and adds nothing), then every rank adds them in rank order 0, 1, ..., N-1
  // (sum_partials). The bits depend only on the partials, never on NCCL's choice of ring or
  // tree, so every rank holds the same residual stream and a row never depends on its batch.
  void all_reduce_sum(float* data, int64_t n) override {
    if (!is_device_memory(data)) return host_->all_reduce_sum(data, n);
    const auto t0 = Clock::now();
    usable("all_reduce_sum");
    bind();
    float* g = static_cast<float*>(scratch_);
    // The pieces follow each other on the stream: a piece's gather overwrites the buffer only
    // after the previous piece's sum has read it.
    for (int64_t off = 0; off < n; off += kChunkFloats) {
      const int64_t len = std::min(kChunkFloats, n - off);
      enqueue(nccl_.ncclAllGather(data + off, g, static_cast<size_t>(len), ncclFloat, comm_, stream_),
              "all_reduce_sum", timeout_s_);
      sum_partials(g, data + off, len, world_, stream_);
    }
    wait_stream("all_reduce_sum", t0);
    stats_.all_reduce_calls++;
    stats_.all_reduce_bytes += n * static_cast<int64_t>(sizeof(float));
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  void all_gather(const float* in, float* out, int64_t n) override {
    if (!is_device_memory(in)) return host_->all_gather(in, out, n);
    const auto t0 = Clock::now();
    usable("all_gather");
    bind();
    enqueue(nccl_.ncclAllGather(in, out, static_cast<size_t>(n), ncclFloat, comm_, stream_), "all_gather",
            timeout_s_);
    wait_stream("all_gather", t0);
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // The vocab-parallel logits: each rank's slice to `root`, as grouped sends and receives (NCCL
  // has no gatherv; the slices differ in size when the ranks do not divide the vocabulary).
  void gather(const float* in, int64_t n, float* out, const int64_t* counts, int root) override {
    if (!is_device_memory(in)) return host_->gather(in, n, out, counts, root);
    const auto t0 = Clock::now();
    usable("gather");
    bind();
    enqueue(nccl_.ncclGroupStart(), "gather", timeout_s_);
    if (rank_ == root) {
      int64_t at = 0;
      for (int r = 0; r < world_; ++r) {
        if (r == rank_) {
          FANTAI_CUDA_CHECK(cudaMemcpyAsync(out + at, in, static_cast<size_t>(n) * sizeof(float),
                                            cudaMemcpyDeviceToDevice, stream_));
        } else {
          enqueue(nccl_.ncclRecv(out + at, static_cast<size_t>(counts[r]), ncclFloat, r, comm_, stream_),
                  "gather", timeout_s_);
        }
        at += counts[r];
      }
    } else {
      enqueue(nccl_.ncclSend(in, static_cast<size_t>(n), ncclFloat, root, comm_, stream_), "gather",
              timeout_s_);
    }
    enqueue(nccl_.ncclGroupEnd(), "gather", timeout_s_);
    wait_stream("gather", t0);
    stats_.gather_calls++;
    stats_.gather_bytes += n * static_cast<int64_t>(sizeof(float));
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // The step header and payload are host data: MPI carries them, as on CPU ranks.
  void broadcast(void* data, int64_t bytes, int root, bool idle) override {
    host_->broadcast(data, bytes, root, idle);
  }

  CommStats stats() const override {
    CommStats s = host_->stats();
    s.all_reduce_calls += stats_.all_reduce_calls;
    s.all_reduce_bytes += stats_.all_reduce_bytes;
    s.gather_calls += stats_.gather_calls;
    s.gather_bytes += stats_.gather_bytes;
    s.seconds += stats_.seconds;
    return s;
  }

 private:
  void bind() const { bind_device(device_); }

  void usable(const char* what) const {
    if (broken_)
      throw std::runtime_error(std::string("tensor parallelism is down after an earlier failure; ") + what);
  }

  // A non-blocking NCCL call returns ncclInProgress until its host side is done (for a
  // collective: enqueued on the stream); the communicator's state says when, or what failed.
  void enqueue(ncclResult_t rc, const char* what, double deadline) {
    const auto t0 = Clock::now();
    for (int64_t spins = 0; rc == ncclInProgress; ++spins) {
      if (nccl_.ncclCommGetAsyncError(comm_, &rc) != ncclSuccess) break;
      if (rc != ncclInProgress) break;
      if (std::chrono::duration<double>(Clock::now() - t0).count() > deadline)
        fail(std::string(what) + " was not joined by every rank within " + std::to_string(deadline) +
             " s: a rank died or hangs");
      pause(spins);
    }
    if (rc != ncclSuccess) fail(std::string(what) + " failed in NCCL: " + nccl_error(rc));
  }

  // Polls the end of the collective (an event after it on the backend's stream) against the
  // watchdog's deadline: a kernel waiting for a peer that never comes would otherwise block the
  // next download forever. The NCCL state is read too, so a peer's abort fails this rank at once.
  void wait_stream(const char* what, Clock::time_point t0) {
    FANTAI_CUDA_CHECK(cudaEventRecord(done_, stream_));
    for (int64_t spins = 0;; ++spins) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        cudaGetLastError();
        fail(std::string(what) + " failed on the GPU: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
      }
      ncclResult_t state = ncclSuccess;
      nccl_.ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress)
        fail(std::string(what) + " failed in NCCL: " + nccl_error(state));
      if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s_)
        fail(std::string(what) + " was not joined by every rank within " + std::to_string(timeout_s_) +
             " s: a rank died or hangs");
      pause(spins);
    }
  }

  // As the MPI communicator waits: a short spin (a collective between balanced GPUs completes in
  // tens of microseconds), then short sleeps so a waiting rank leaves the cores alone.
  static void pause(int64_t spins) {
    if (spins < 2000) sched_yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

  std::string nccl_error(ncclResult_t rc) const {
    std::string s = nccl_.ncclGetErrorString(rc);
    const char* last = comm_ ? nccl_.ncclGetLastError(comm_) : nullptr;
    if (last && *last) s += std::string(" (") + last + ")";
    return s;
  }

  // The group is unusable: abort the NCCL communicator (its kernels stop waiting for peers), say
  // why, and leave the process a short grace (the engine fails the requests in flight with this
  // error) before it exits with status 70, as the MPI communicator's failures do. Each rank has
  // its own deadline, so the other ranks of a dead group leave the same way.
  [[noreturn]] void fail(const std::string& why) {
    broken_ = true;
    if (comm_) nccl_.ncclCommAbort(comm_);
    comm_ = nullptr;
    const std::string msg = "tensor parallelism: rank " + std::to_string(rank_) + " of " +
                            std::to_string(world_) + ": " + why;
    FANTAI_LOG(kError, msg);
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::duration<double>(env_seconds("FANTAI_TP_EXIT_GRACE_S", 2.0)));
      std::_Exit(70);
    }).detach();
    throw std::runtime_error(msg);
  }

  const NcclApi& nccl_ = nccl_api();  // loaded: create_nccl_communicator checked
  std::shared_ptr<Communicator> host_;
  int device_;
  cudaStream_t stream_;
  int rank_, world_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaEvent_t done_ = nullptr;
  void* scratch_ = nullptr;  // kChunkFloats per rank
  bool broken_ = false;
  CommStats stats_;
};

}  // namespace

LibraryStatus nccl_library() { return nccl_api().status; }

int nccl_local_rank(Communicator& host) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  const uint64_t mine = std::hash<std::string>{}(name);
  int local = 0;
  // Each rank in turn says which host it is on; the ranks before this one on the same host
  // count. idle: the first ranks may still be starting.
  for (int r = 0; r < host.world_size(); ++r) {
    uint64_t h = mine;
    host.broadcast(&h, sizeof h, r, true);
    if (r < host.rank() && h == mine) ++local;
  }
  return local;
}

std::shared_ptr<Communicator> create_nccl_communicator(std::shared_ptr<Communicator> host, int device,
                                                       void* stream) {
  FANTAI_CHECK(host, "no host communicator to bootstrap NCCL with");
  const std::string& why = nccl_api().status.error;
  FANTAI_REQUIRE(why.empty(), "tensor parallelism on CUDA devices needs NCCL, and " << why);
  return std::make_shared<NcclCommunicator>(std::move(host), device, static_cast<cudaStream_t>(stream));
}

}  // namespace fantai::cuda

#endif  // FANTAI_WITH_NCCL
