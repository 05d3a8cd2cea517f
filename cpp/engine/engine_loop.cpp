// engine: the background step loop used by the server (GIL-free, one engine per loop).
#include "engine/engine_loop.h"

#include <chrono>

#include "common/check.h"
#include "common/logging.h"

namespace fantai::engine {

EngineLoop::EngineLoop(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {
  stats_ = engine_->stats();
}

EngineLoop::~EngineLoop() { stop(); }

void EngineLoop::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_) return;
  stop_ = false;
  running_ = true;
  thread_ = std::thread([this] { run(); });
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_) return;
    stop_ = true;
  }
  work_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  running_ = false;
  out_cv_.notify_all();
}

void EngineLoop::add_request(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params) {
  engine_->validate_request(prompt, params);  // reads config only: safe from any thread
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.push_back({id, std::move(prompt), params});
  }
  work_cv_.notify_one();
}

void EngineLoop::abort_request(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(id);
  }
  work_cv_.notify_one();
}

std::vector<StepOutput> EngineLoop::wait_outputs(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  out_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                   [this] { return !outbox_.empty() || stop_; });
  std::vector<StepOutput> out;
  out.swap(outbox_);
  return out;
}

EngineStats EngineLoop::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::string EngineLoop::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

// Called with mu_ held.
void EngineLoop::abort_ids(const std::vector<uint64_t>& ids) {
  for (uint64_t id : ids) {
    StepOutput o;
    o.request_id = id;
    o.finished = true;
    o.finish_reason = FinishReason::kAbort;
    outbox_.push_back(o);
  }
}

// Called with mu_ held.
void EngineLoop::drain_inbox() {
  std::vector<StepOutput> rejected;
  while (!inbox_.empty()) {
    Pending p = std::move(inbox_.front());
    inbox_.pop_front();
    try {
      engine_->add_request(p.id, std::move(p.prompt), p.params);
    } catch (const std::exception& e) {
      abort_ids({p.id});
      last_error_ = e.what();
    }
  }
  for (uint64_t id : aborts_) {
    if (engine_->abort_request(id)) abort_ids({id});
  }
  aborts_.clear();
}

void EngineLoop::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !inbox_.empty() || !aborts_.empty() || engine_->has_unfinished(); });
    if (stop_) break;
    drain_inbox();
    stats_ = engine_->stats();
    if (!outbox_.empty()) out_cv_.notify_all();
    if (!engine_->has_unfinished()) continue;
    lock.unlock();  // the step runs without the lock so producers never wait on the model
    std::vector<StepOutput> outs;
    std::string error;
    try {
      outs = engine_->step();
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    if (!error.empty()) {
      // The batch can't be retried blindly (it would fail again): abort it and keep serving.
      FANTAI_LOG(kError, "engine step failed, aborting its requests: " << error);
      last_error_ = error;
      abort_ids(engine_->abort_all());
    }
    for (auto& o : outs) outbox_.push_back(std::move(o));
    stats_ = engine_->stats();
    if (!outbox_.empty()) out_cv_.notify_all();
  }
  // Shutting down: abort everything still queued or running so nothing leaks.
  for (const Pending& p : inbox_) abort_ids({p.id});
  inbox_.clear();
  abort_ids(engine_->abort_all());
  stats_ = engine_->stats();
  out_cv_.notify_all();
}

}  // namespace fantai::engine
