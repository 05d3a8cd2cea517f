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

// Thread-safe front of an Engine. The loop thread owns the engine: requests and aborts queue in
// an inbox that the loop drains before each step, outputs queue in an outbox. The loop sleeps on a
// condition variable when idle (no busy polling).
class EngineLoop {
 public:
  explicit EngineLoop(std::shared_ptr<Engine> engine);
  ~EngineLoop();

  void start();
  // Stops the thread after the current step; unfinished requests are aborted.
  void stop();

  // Validates synchronously (throws InvalidArgument) and queues the request.
  void add_request(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params,
                   const std::vector<std::pair<uint64_t, SamplingParams>>& siblings = {});
  void reset_prefix_cache();
  // Calls Engine::release_memory() once the loop has been idle this long (<= 0: never).
  void set_idle_release(double seconds);
  // Asks the loop thread to release memory now (it owns the engine).
  void release_memory();
  void abort_request(uint64_t id);
  // Blocks up to timeout_ms for outputs; returns whatever is queued (possibly nothing).
  std::vector<StepOutput> wait_outputs(int timeout_ms);
  EngineStats stats() const;
  // Error text of a step that threw (the loop aborts that step's requests and keeps serving).
  std::string last_error() const;

 private:
  struct Pending {
    uint64_t id;
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::vector<std::pair<uint64_t, SamplingParams>> siblings;
  };
  void run();
  void drain_inbox();
  void abort_ids(const std::vector<uint64_t>& ids);

  std::shared_ptr<Engine> engine_;
  std::thread thread_;
  mutable std::mutex mu_;          // guards inbox, aborts, outbox, stats_, flags
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
  bool dirty_ = false;  // work ran since the last release
};

}  // namespace fantai::engine
