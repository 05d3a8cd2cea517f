// backend: the MPI communicator (all-reduce in a fixed rank order, all-gather, broadcast) with a
// watchdog on every collective, and how ranks find each other (mpirun's world or MPI_Comm_spawn).
#include "backend/mpi_communicator.h"

#include "common/check.h"
#include "common/logging.h"

#ifdef FANTAI_WITH_MPI
#include <dlfcn.h>
// OMPI_SKIP_MPICXX (CMake): the C API only, not Open MPI's deprecated C++ bindings.

#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>
#endif

namespace fantai {

#ifndef FANTAI_WITH_MPI

std::string mpi_unavailable_reason() {
#ifdef FANTAI_MPI_MISSING_REASON
  return FANTAI_MPI_MISSING_REASON;
#else
  return "this build of fantai has no MPI";
#endif
}
int mpi_world_rank() { return 0; }
std::shared_ptr<Communicator> mpi_connect(int, const std::vector<std::string>&, double) {
  FANTAI_THROW("tensor parallelism needs MPI, and " << mpi_unavailable_reason()
                                                    << " (install libopenmpi-dev openmpi-bin and rebuild)");
}
std::shared_ptr<Communicator> mpi_join(double) { return mpi_connect(2, {}, 0); }
bool mpi_finalize(double) { return false; }

#else

std::string mpi_unavailable_reason() { return ""; }

namespace {

using Clock = std::chrono::steady_clock;

void init_mpi() {
  int ready = 0;
  MPI_Initialized(&ready);
  if (ready) return;
  // Python loads this library RTLD_LOCAL; Open MPI's plugins look libmpi's symbols up globally.
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&MPI_Init), &info) && info.dli_fname)
    dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  // Open MPI refuses root unless told; a container's root is the usual case here.
  if (geteuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  // Spawned ranks may outnumber the cores (TP = 3 on two): slower, never refused.
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 0);
  int provided = 0;
  // Collectives come from one thread at a time (the engine loop), not always the main one.
  FANTAI_REQUIRE(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) == MPI_SUCCESS,
                 "MPI_Init_thread failed");
  FANTAI_REQUIRE(provided >= MPI_THREAD_SERIALIZED, "this MPI cannot be called from a second thread");
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout_s, bool spawned) : comm_(comm), timeout_s_(timeout_s) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
    // Every rank learns every pid: rank 0 ends the ranks it spawned when it gives up, and a
    // spawned rank watches rank 0 while idle (both on this host only).
    int64_t pid = getpid();
    pids_.resize(world_);
    FANTAI_REQUIRE(MPI_Allgather(&pid, 1, MPI_INT64_T, pids_.data(), 1, MPI_INT64_T, comm_) == MPI_SUCCESS,
                   "MPI_Allgather of the ranks' pids failed");
    spawned_ = spawned;
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  // Sum in rank order 0, 1, ..., N-1 on every rank: the partials are gathered, then added here.
  // Nothing rests on the MPI library's reduction algorithm (which may pick its order by message
  // size or topology): the bits depend only on the partials, so every rank holds the same
  // residual stream and a row's result never depends on the batch it came in.
  void all_reduce_sum(float* data, int64_t n) override {
    const auto t0 = Clock::now();
    gather_.resize(static_cast<size_t>(n) * world_);
    MPI_Request req;
    check(MPI_Iallgather(data, static_cast<int>(n), MPI_FLOAT, gather_.data(), static_cast<int>(n), MPI_FLOAT,
                         comm_, &req),
          "all_reduce_sum");
    wait(&req, "all_reduce_sum", false);
    const float* g = gather_.data();
    for (int64_t i = 0; i < n; ++i) {
      float s = g[i];
      for (int r = 1; r < world_; ++r) s += g[static_cast<int64_t>(r) * n + i];
      data[i] = s;
    }
    stats_.all_reduce_calls++;
    stats_.all_reduce_bytes += n * static_cast<int64_t>(sizeof(float));
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  void all_gather(const float* in, float* out, int64_t n) override {
    const auto t0 = Clock::now();
    MPI_Request req;
    check(
        MPI_Iallgather(in, static_cast<int>(n), MPI_FLOAT, out, static_cast<int>(n), MPI_FLOAT, comm_, &req),
        "all_gather");
    wait(&req, "all_gather", false);
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // The vocab-parallel logits: rank r's slice to `root` (MPI_Gatherv; the slices differ in size
  // when the ranks do not divide the vocab).
  void gather(const float* in, int64_t n, float* out, const int64_t* counts, int root) override {
    const auto t0 = Clock::now();
    std::vector<int> cnt, displs;
    if (rank_ == root) {
      cnt.resize(world_);
      displs.resize(world_);
      int64_t at = 0;
      for (int r = 0; r < world_; ++r) {
        cnt[r] = static_cast<int>(counts[r]);
        displs[r] = static_cast<int>(at);
        at += counts[r];
      }
    }
    MPI_Request req;
    check(MPI_Igatherv(in, static_cast<int>(n), MPI_FLOAT, out, cnt.data(), displs.data(), MPI_FLOAT, root,
                       comm_, &req),
          "gather");
    wait(&req, "gather", false);
    stats_.gather_calls++;
    stats_.gather_bytes += n * static_cast<int64_t>(sizeof(float));
    stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  void broadcast(void* data, int64_t bytes, int root, bool idle) override {
    const auto t0 = Clock::now();
    MPI_Request req;
    check(MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, comm_, &req), "broadcast");
    wait(&req, "broadcast", idle);
    if (!idle) stats_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  CommStats stats() const override { return stats_; }

  bool broken() const { return broken_; }
  bool spawned() const { return spawned_; }
  // mpirun's world: the dup is freed (nothing may use the group any more).
  void release() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
    broken_ = true;
  }

 private:
  void check(int rc, const char* what) {
    if (broken_)
      throw std::runtime_error(std::string("tensor parallelism is down after an earlier failure; ") + what);
    if (rc != MPI_SUCCESS) fail(std::string(what) + " failed in MPI (error " + std::to_string(rc) + ")");
  }

  // Polls instead of blocking in MPI: a blocking call cannot be timed out, and a rank that died
  // or stopped would hang the server. The first ~0.2 ms spin (a collective between balanced ranks
  // completes in microseconds), then the wait sleeps so an idle rank leaves the cores alone.
  void wait(MPI_Request* req, const char* what, bool idle) {
    const auto t0 = Clock::now();
    auto last_watch = t0;
    // An idle rank 0 is waiting for ranks still loading their shares: a longer deadline.
    const double deadline = idle ? start_timeout_s() : timeout_s_;
    for (int64_t spins = 0;; ++spins) {
      int done = 0;
      check(MPI_Test(req, &done, MPI_STATUS_IGNORE), what);
      if (done) return;
      const auto now = Clock::now();
      if ((!idle || rank_ == 0) && std::chrono::duration<double>(now - t0).count() > deadline) {
        fail(std::string(what) + " was not joined by every rank within " + std::to_string(deadline) +
             " s: a rank died or hangs");
      }
      if (spawned_ && now - last_watch > std::chrono::milliseconds(100)) {
        last_watch = now;
        watch_peers(what);
      }
      if (spins < 2000) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(idle && spins > 20000 ? 1000 : 20));
    }
  }

  static double start_timeout_s() {
    const char* s = std::getenv("FANTAI_TP_START_TIMEOUT_S");
    return s ? std::atof(s) : 300.0;
  }

  // Ranks on this host that this group spawned: rank 0 watches the others, they watch rank 0.
  void watch_peers(const char* what) {
    if (rank_ != 0) {
      if (kill(static_cast<pid_t>(pids_[0]), 0) != 0) {
        broken_ = true;
        throw std::runtime_error("tensor-parallel rank 0 (pid " + std::to_string(pids_[0]) + ") is gone");
      }
      return;
    }
    for (int r = 1; r < world_; ++r)
      if (kill(static_cast<pid_t>(pids_[r]), 0) != 0)
        fail(std::string(what) + ": rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) +
             ") is gone: a rank died or hangs");
  }

  // The group is unusable: say why, end the ranks this process spawned, and leave the process a
  // short grace (the engine fails the requests in flight with this error) before it exits.
  [[noreturn]] void fail(const std::string& why) {
    broken_ = true;
    const std::string msg = "tensor parallelism: rank " + std::to_string(rank_) + " of " +
                            std::to_string(world_) + ": " + why;
    FANTAI_LOG(kError, msg);
    const bool leader = rank_ == 0;
    std::vector<int64_t> victims;
    if (leader && spawned_) victims.assign(pids_.begin() + 1, pids_.end());
    std::thread([victims] {
      const char* g = std::getenv("FANTAI_TP_EXIT_GRACE_S");
      std::this_thread::sleep_for(std::chrono::duration<double>(g ? std::atof(g) : 2.0));
      for (int64_t p : victims) kill(static_cast<pid_t>(p), SIGKILL);
      std::_Exit(70);
    }).detach();
    throw std::runtime_error(msg);
  }

  MPI_Comm comm_;
  double timeout_s_;
  int rank_ = 0, world_ = 1;
  bool spawned_ = false;
  std::atomic<bool> broken_{false};
  std::vector<int64_t> pids_;
  std::vector<float> gather_;
  CommStats stats_;
};

// Every group this process made or joined, for mpi_finalize.
std::mutex groups_mu;
std::vector<std::shared_ptr<MpiCommunicator>> groups;

std::shared_ptr<Communicator> keep(std::shared_ptr<MpiCommunicator> c) {
  std::lock_guard<std::mutex> lock(groups_mu);
  groups.push_back(c);
  return c;
}

}  // namespace

bool mpi_finalize(double timeout_s) {
  int ready = 0, done = 0;
  MPI_Initialized(&ready);
  MPI_Finalized(&done);
  if (!ready || done) return false;
  std::lock_guard<std::mutex> lock(groups_mu);
  // Spawned groups (MPI_Comm_spawn from a singleton) are left as before: their ranks' exit
  // status reaches no one, and MPI_Comm_disconnect + MPI_Finalize of one hung in our runs (4.1).
  for (const auto& g : groups)
    if (g->broken() || g->spawned() || g->steps_state != Communicator::kStepsStopped) return false;
  // Finalize waits for every rank of the job: bounded like a collective.
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread([finished, timeout_s] {
    const auto until = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (!*finished && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (*finished) return;
    FANTAI_LOG(kError, "tensor parallelism: MPI_Finalize was not joined by every rank within "
                           << timeout_s << " s: a rank died or hangs");
    std::_Exit(70);
  }).detach();
  for (const auto& g : groups) g->release();
  groups.clear();
  MPI_Finalize();
  *finished = true;
  return true;
}

int mpi_world_rank() {
  if (!std::getenv("OMPI_COMM_WORLD_SIZE") && !std::getenv("PMIX_RANK")) return 0;
  init_mpi();
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

std::shared_ptr<Communicator> mpi_connect(int world_size, const std::vector<std::string>& worker_argv,
                                          double timeout_s) {
  FANTAI_REQUIRE(world_size >= 2, "tensor_parallel_size must be at least 2 to need MPI");
  init_mpi();
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm comm;
  if (size > 1) {
    FANTAI_REQUIRE(size == world_size, "mpirun started " << size << " ranks but tensor_parallel_size is "
                                                         << world_size << "; they must agree");
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    return keep(std::make_shared<MpiCommunicator>(comm, timeout_s, false));
  }
  FANTAI_REQUIRE(!worker_argv.empty(), "no worker command to spawn the tensor-parallel ranks with");
  std::vector<std::string> args(worker_argv.begin() + 1, worker_argv.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<int> errcodes(world_size - 1);
  MPI_Comm inter;
  std::string program = worker_argv[0];
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);  // a failed spawn is an error, not an abort
  FANTAI_REQUIRE(MPI_Comm_spawn(program.data(), argv.data(), world_size - 1, MPI_INFO_NULL, 0, MPI_COMM_SELF,
                                &inter, errcodes.data()) == MPI_SUCCESS,
                 "MPI_Comm_spawn of " << world_size - 1 << " tensor-parallel rank(s) failed");
  FANTAI_REQUIRE(MPI_Intercomm_merge(inter, 0, &comm) == MPI_SUCCESS, "MPI_Intercomm_merge failed");
  return keep(std::make_shared<MpiCommunicator>(comm, timeout_s, true));
}

std::shared_ptr<Communicator> mpi_join(double timeout_s) {
  init_mpi();
  MPI_Comm parent, comm;
  MPI_Comm_get_parent(&parent);
  if (parent == MPI_COMM_NULL) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    return keep(std::make_shared<MpiCommunicator>(comm, timeout_s, false));
  }
  FANTAI_REQUIRE(MPI_Intercomm_merge(parent, 1, &comm) == MPI_SUCCESS, "MPI_Intercomm_merge failed");
  return keep(std::make_shared<MpiCommunicator>(comm, timeout_s, true));
}

#endif

}  // namespace fantai
