// cpu: thread pool (spin-then-park workers, dynamic task counter, caller participates).
#include "cpu/thread_pool.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "common/check.h"
#include "cpu/cpu_topology.h"

namespace fantai::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Ops of one forward pass follow each other within microseconds, so a worker that just finished
// spins this long before paying for a futex sleep and wake-up.
constexpr auto kSpin = std::chrono::microseconds(200);

thread_local bool t_in_pool_job = false;
// The bind epoch this thread was last pinned for (0: never).
thread_local uint64_t t_pinned_epoch = 0;
std::atomic<uint64_t> g_bind_epochs{0};

bool is_main_thread() { return static_cast<pid_t>(syscall(SYS_gettid)) == getpid(); }

}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    // "fantai-cpu-N" in top -H and /proc/<pid>/task/*/comm (15 characters at most). Named here,
    // not by the worker itself: on a loaded machine a new thread may not run for a while, and
    // until it does it would carry its creator's name.
    pthread_setname_np(workers_.back().native_handle(),
                       ("fantai-cpu-" + std::to_string(i)).substr(0, 15).c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(park_mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks(int thread_index) {
  const bool was = t_in_pool_job;
  t_in_pool_job = true;
  for (;;) {
    const int64_t t = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (t >= num_tasks_) break;
    (*fn_)(t, thread_index);
  }
  t_in_pool_job = was;
}

void ThreadPool::bind(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  FANTAI_REQUIRE(static_cast<int>(cpus.size()) >= num_threads_,
                 "thread pool: " << cpus.size() << " CPUs for " << num_threads_ << " threads");
  for (int i = 1; i < num_threads_; ++i) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[i], &set);
    const int rc = pthread_setaffinity_np(workers_[i - 1].native_handle(), sizeof(set), &set);
    FANTAI_REQUIRE(rc == 0,
                   "thread pool: pinning worker " << i << " to CPU " << cpus[i] << ": " << std::strerror(rc));
  }
  caller_cpu_.store(cpus[0], std::memory_order_relaxed);
  bind_epoch_.store(g_bind_epochs.fetch_add(1) + 1, std::memory_order_release);
}

void ThreadPool::pin_caller() {
  const uint64_t epoch = bind_epoch_.load(std::memory_order_acquire);
  if (epoch == 0 || t_pinned_epoch == epoch) return;
  t_pinned_epoch = epoch;
  // A refusal here (a mask narrowed since bind) leaves the caller where the OS puts it.
  if (!is_main_thread()) pin_this_thread(caller_cpu_.load(std::memory_order_relaxed));
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    uint64_t g;
    // The clock is read once per 32 pauses (a few µs): reading it every pause made clock_gettime
    // the top symbol of a decode profile.
    for (uint32_t spins = 0;; ++spins) {
      g = generation_.load(std::memory_order_acquire);
      if (g != seen) break;
      if ((spins & 31) == 31 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lk(park_mu_);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        g = generation_.load(std::memory_order_acquire);
        break;
      }
      cpu_relax();
    }
    seen = g;
    if (stop_) return;  // stop_ is written before the generation bump that woke us
    active_.fetch_add(1, std::memory_order_seq_cst);
    if (open_.load(std::memory_order_seq_cst)) run_tasks(index);
    active_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn) {
  if (num_tasks <= 0) return;
  // Inline when nested (checked before try_lock: re-locking run_mu_ on this thread would be UB)
  // or when another thread is using the pool.
  const bool inline_run = num_threads_ == 1 || num_tasks == 1 || t_in_pool_job;
  std::unique_lock<std::mutex> run_lk(run_mu_, std::defer_lock);
  if (inline_run || !run_lk.try_lock()) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  pin_caller();
  fn_ = &fn;
  num_tasks_ = num_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  open_.store(true, std::memory_order_seq_cst);  // publishes fn_, num_tasks_, next_task_
  {
    // Bumping under park_mu_ means a worker between its predicate check and wait() cannot miss it.
    std::lock_guard<std::mutex> lk(park_mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  run_tasks(0);
  // Every task is taken: close the job, then wait for the workers that joined it to leave
  // run_tasks before fn_ (on our caller's stack frame) goes away.
  open_.store(false, std::memory_order_seq_cst);
  for (int spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
    if (spins < 4096) cpu_relax();
    else std::this_thread::yield();  // oversubscribed: let a descheduled worker finish
  }
  fn_ = nullptr;
}

}  // namespace fantai::cpu
