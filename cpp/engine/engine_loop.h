// engine: runs Engine::step in its own thread; other threads add/abort and wait for outputs.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/engine.h"

namespace fantai::engine {

// What went into one step's batch, recorded only while an observer watches (see snapshot()).
struct StepRecord {
  int64_t step = 0;   // EngineStats::num_steps after the step
  double time = 0.0;  // seconds, steady clock (CLOCK_MONOTONIC: Python's monotonic())
  int32_t decode_tokens = 0, prefill_tokens = 0;
  int32_t num_running = 0, num_waiting = 0;  // after the step
  int32_t num_preempted = 0;                 // preempted in this step
  int32_t num_finished = 0;                  // finished in this step
  int32_t num_joined = 0;                    // entered the running set in this step (admitted or forked)
};

// Thread-safe front of an Engine. The loop thread owns the engine: requests and aborts queue in
// an inbox that the loop drains before each step, outputs queue in an outbox. The loop sleeps on a
// condition variable when idle (no busy polling).
class EngineLoop {
 public:
  explicit EngineLoop(std::shared_ptr<Engine> engine);
  ~EngineLoop();

  // Starts the loop thread. Reads the test hook FANTAI_FAULT_AFTER_STEPS=N once here: after N
  // steps the next one fails as an engine fault would (tests of the server's crash handling).
  void start();
  // Stops the thread after the current step; unfinished requests are aborted.
  void stop();

  // Validates synchronously (throws InvalidArgument) and queues the request. Throws
  // std::runtime_error once the loop has failed (see fault()).
  void add_request(uint64_t id, std::vector<int32_t> prompt, const sampling::SamplingParams& params,
                   const std::vector<std::pair<uint64_t, sampling::SamplingParams>>& siblings = {});
  void reset_prefix_cache();
  // Calls Engine::release_memory() once the loop has been idle this long (<= 0: never).
  void set_idle_release(double seconds);
  // Asks the loop thread to release memory now (it owns the engine).
  void release_memory();
  void abort_request(uint64_t id);
  // Blocks up to timeout_ms for outputs; returns whatever is queued (possibly nothing).
  std::vector<StepOutput> wait_outputs(int timeout_ms);
  EngineStats stats() const;
  // mincore over the pool: read-only, safe beside the loop thread.
  size_t kv_resident_bytes() const { return engine_->kv_resident_bytes(); }
  // Error text of the last step or request that threw.
  std::string last_error() const;
  // Empty while the loop is healthy; else why it failed. A step that throws InvalidArgument
  // (bad input that got past validation, e.g. a request whose bans leave no token to sample)
  // aborts that step's requests and the loop keeps serving. Any other exception from a step is
  // an engine fault: every request is aborted, the thread ends, and add_request refuses from
  // then on. The engine's state after a fault is unknown, so nothing is retried; the process
  // is expected to exit (the server does, non-zero) and be restarted.
  std::string fault() const;

  // ---- observing (the dashboard) ---------------------------------------------------------
  // The latest snapshot the loop thread published (nullptr before the first). Calling it
  // subscribes for kWatchSeconds: while subscribed the loop records every step and publishes a
  // snapshot at most every snapshot interval while busy, plus one whenever it goes idle.
  // Unsubscribed, the loop pays one comparison per step.
  std::shared_ptr<const EngineSnapshot> snapshot();
  // Recorded steps with step > after, oldest first (at most the last kStepHistory).
  std::vector<StepRecord> steps_since(int64_t after) const;
  void set_snapshot_interval(double seconds);
  static constexpr double kWatchSeconds = 3.0;
  static constexpr size_t kStepHistory = 1024;

 private:
  struct Pending {
    uint64_t id;
    std::vector<int32_t> prompt;
    sampling::SamplingParams params;
    std::vector<std::pair<uint64_t, sampling::SamplingParams>> siblings;
  };
  void run();
  void drain_inbox();
  void abort_ids(const std::vector<uint64_t>& ids);

  std::shared_ptr<Engine> engine_;
  std::thread thread_;
  mutable std::mutex mu_;  // guards inbox, aborts, outbox, stats_, flags
  std::condition_variable work_cv_, out_cv_;
  std::deque<Pending> inbox_;
  std::vector<uint64_t> aborts_;
  std::vector<StepOutput> outbox_;
  EngineStats stats_;
  std::string last_error_;
  bool stop_ = false;
  bool running_ = false;
  bool reset_cache_ = false, release_now_ = false;
  double idle_release_seconds_ = 0.0;
  bool dirty_ = false;              // work ran since the last release
  std::string fault_;               // set once, by the loop thread, when a step fails as an engine fault
  int64_t fault_after_steps_ = -1;  // FANTAI_FAULT_AFTER_STEPS (test hook); -1: off
  int64_t steps_run_ = 0;
  void fail(const std::string& why);  // with mu_ held

  // Observing; all guarded by mu_. The loop thread builds snapshots (it owns the engine).
  void observe_step(const std::vector<StepOutput>& outs);
  void publish_snapshot(bool force);
  bool watched(double now) const { return now - watched_at_ < kWatchSeconds; }
  std::shared_ptr<const EngineSnapshot> snapshot_;
  std::deque<StepRecord> steps_;
  double watched_at_ = -1e30;       // last snapshot() call
  double published_at_ = -1e30;     // last snapshot built
  double snapshot_interval_ = 0.2;  // seconds between snapshots while busy (the dashboard: 5 Hz)
  int64_t preemptions_seen_ = 0;    // num_preemptions at the last recorded step
  bool snapshot_wanted_ = false;    // a new watcher waits for a first snapshot
};

}  // namespace fantai::engine
