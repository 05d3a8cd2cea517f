// cpu: persistent worker pool; ops hand it an index space and the calling thread joins in.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fantai::cpu {

class ThreadPool {
 public:
  // num_threads counts the caller: num_threads - 1 workers are started (once, here).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // Runs fn(task, thread_index) for every task in [0, num_tasks) and returns when all are done.
  // thread_index is in [0, size()) and stable for the call (for per-thread scratch). Tasks are
  // handed out dynamically, so callers must make results independent of which thread runs what
  // (every op here is). A nested or concurrent call runs serially on its own thread rather
  // than deadlocking.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t, int)>& fn);

  // Pins worker i to cpus[i] (1 <= i < size()) now, and a caller to cpus[0] at its next
  // parallel_for, unless the caller is the process's main thread: threads it starts later
  // (a tokenizer's pool, a server's) would inherit a one-CPU mask. Empty cpus unpins nothing
  // and pins nothing new. Throws when the OS refuses a CPU.
  void bind(const std::vector<int>& cpus);

 private:
  void worker_loop(int index);
  void run_tasks(int thread_index);

  void pin_caller();

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::atomic<int> caller_cpu_{-1};
  std::atomic<uint64_t> bind_epoch_{0};  // unique per bind() over all pools
  std::mutex run_mu_;                    // one parallel_for at a time

  // Current job (valid while a generation is in flight).
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  // A worker joins a job only while it is open: it counts itself in active_, then checks open_
  // (both seq_cst, so the caller's close-then-read of active_ and the worker's
  // increment-then-read of open_ cannot both miss each other). The caller closes the job once
  // every task is taken and waits only for workers that joined: a worker the OS has not run yet
  // (a loaded machine) no longer holds up the op.
  std::atomic<bool> open_{false};
  std::atomic<int> active_{0};

  // Workers spin on generation_ for a short while, then park on cv_.
  std::atomic<uint64_t> generation_{0};
  std::mutex park_mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

}  // namespace fantai::cpu
