// engine: the background step loop used by the server (GIL-free, one engine per loop).
#include "engine/engine_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>

#include "common/check.h"
#include "common/logging.h"

namespace fantai::engine {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// min_tokens bans EOS (unless ignore_eos) and the stop tokens until then: a request whose bans
// cover the whole vocabulary could never sample its first token. Refused here, a clean 400,
// rather than failing a step later (which would abort the whole batch).
void require_sampleable(const sampling::SamplingParams& p, const std::vector<int32_t>& eos, int32_t vocab) {
  if (p.min_tokens <= 0) return;
  std::vector<bool> banned(static_cast<size_t>(vocab), false);
  int32_t n = 0;
  auto ban = [&](int32_t t) {
    if (t >= 0 && t < vocab && !banned[t]) banned[t] = true, ++n;
  };
  for (int32_t t : p.stop_token_ids) ban(t);
  if (!p.ignore_eos) {
    for (int32_t t : eos) ban(t);
  }
  FANTAI_REQUIRE(n < vocab,
                 "min_tokens with these stop_token_ids (and EOS) bans every token of the vocabulary");
}

}  // namespace

EngineLoop::EngineLoop(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {
  stats_ = engine_->stats();
}

EngineLoop::~EngineLoop() { stop(); }

void EngineLoop::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (running_) return;
  stop_ = false;
  running_ = true;
  // Test hook, read once: FANTAI_FAULT_AFTER_STEPS=N makes step N+1 fail as an engine fault.
  if (const char* v = std::getenv("FANTAI_FAULT_AFTER_STEPS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end != nullptr && *end == '\0' && n >= 0) {
      fault_after_steps_ = n;
      FANTAI_LOG(kWarning, "test hook FANTAI_FAULT_AFTER_STEPS=" << n << ": step " << n + 1 << " will fail");
    }
  }
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

void EngineLoop::add_request(uint64_t id, std::vector<int32_t> prompt, const sampling::SamplingParams& params,
                             const std::vector<std::pair<uint64_t, sampling::SamplingParams>>& siblings) {
  engine_->validate_request(prompt, params);  // reads config only: safe from any thread
  const int32_t vocab = engine_->model_config().vocab_size;
  const std::vector<int32_t>& eos = engine_->config().eos_token_ids;
  require_sampleable(params, eos, vocab);
  for (const auto& sib : siblings) {
    sib.second.validate(vocab);
    require_sampleable(sib.second, eos, vocab);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fault_.empty()) throw std::runtime_error("the engine has failed: " + fault_);
    inbox_.push_back({id, std::move(prompt), params, siblings});
  }
  work_cv_.notify_one();
}

void EngineLoop::reset_prefix_cache() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    reset_cache_ = true;
  }
  work_cv_.notify_one();
}

void EngineLoop::release_memory() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    release_now_ = true;
  }
  work_cv_.notify_one();
}

void EngineLoop::set_idle_release(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_release_seconds_ = seconds;
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
                   [this] { return !outbox_.empty() || stop_ || !fault_.empty(); });
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

std::string EngineLoop::fault() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fault_;
}

// Called on the loop thread with mu_ held: the fault is published before the aborts it causes,
// so whoever sees those aborts in wait_outputs also sees fault().
void EngineLoop::fail(const std::string& why) {
  FANTAI_LOG(kError, "engine fault, the engine stops; every request is aborted: " << why);
  fault_ = why.empty() ? std::string("unknown engine fault") : why;
  last_error_ = fault_;
  for (const Pending& p : inbox_) {
    abort_ids({p.id});
    for (const auto& sib : p.siblings) abort_ids({sib.first});
  }
  inbox_.clear();
  aborts_.clear();
  try {
    abort_ids(engine_->abort_all());
  } catch (const std::exception& e) {  // the engine is broken: the callers learn it from fault()
    FANTAI_LOG(kError, "aborting after the fault failed too: " << e.what());
  }
  out_cv_.notify_all();
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
      engine_->add_request(p.id, std::move(p.prompt), p.params, p.siblings);
    } catch (const std::exception& e) {
      abort_ids({p.id});
      for (const auto& sib : p.siblings) abort_ids({sib.first});
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
    auto has_work = [this] {
      return stop_ || !inbox_.empty() || !aborts_.empty() || reset_cache_ || release_now_ ||
             snapshot_wanted_ || engine_->has_unfinished();
    };
    if (dirty_ && idle_release_seconds_ > 0) {
      // Idle with pages touched since the last release: wait at most the idle period.
      if (!work_cv_.wait_for(lock, std::chrono::duration<double>(idle_release_seconds_), has_work)) {
        engine_->release_memory();
        dirty_ = false;
        stats_ = engine_->stats();
        publish_snapshot(true);  // cached blocks trimmed: watchers see it
        continue;
      }
    } else {
      work_cv_.wait(lock, has_work);
    }
    if (stop_) break;
    drain_inbox();
    if (reset_cache_) engine_->reset_prefix_cache();
    if (release_now_) engine_->release_memory();
    reset_cache_ = release_now_ = false;
    stats_ = engine_->stats();
    if (!outbox_.empty()) out_cv_.notify_all();
    if (!engine_->has_unfinished()) {
      publish_snapshot(true);  // idle from here on: the last published state stays true
      continue;
    }
    dirty_ = true;
    lock.unlock();  // the step runs without the lock so producers never wait on the model
    std::vector<StepOutput> outs;
    std::string error;
    bool fatal = false;
    try {
      if (fault_after_steps_ >= 0 && steps_run_ >= fault_after_steps_) {
        throw std::runtime_error("injected engine fault (test hook FANTAI_FAULT_AFTER_STEPS=" +
                                 std::to_string(fault_after_steps_) + ")");
      }
      outs = engine_->step();
      ++steps_run_;
    } catch (const InvalidArgument& e) {
      error = e.what();  // the input of a request in the batch: not the engine's fault
    } catch (const std::exception& e) {
      error = e.what();
      fatal = true;
    } catch (...) {
      error = "a step threw a non-standard exception";
      fatal = true;
    }
    lock.lock();
    if (fatal) {
      fail(error);
      break;
    }
    if (!error.empty()) {
      // The batch can't be retried blindly (it would fail again): abort it and keep serving.
      FANTAI_LOG(kError, "engine step failed on a request's input, aborting its batch: " << error);
      last_error_ = error;
      abort_ids(engine_->abort_all());
    }
    stats_ = engine_->stats();
    observe_step(outs);
    for (auto& o : outs) outbox_.push_back(std::move(o));
    if (!outbox_.empty()) out_cv_.notify_all();
  }
  // Shutting down: abort everything still queued or running so nothing leaks.
  for (const Pending& p : inbox_) abort_ids({p.id});
  inbox_.clear();
  if (fault_.empty()) {
    abort_ids(engine_->abort_all());
    stats_ = engine_->stats();
  }
  out_cv_.notify_all();
}

std::shared_ptr<const EngineSnapshot> EngineLoop::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  const double now = now_seconds();
  if (!watched(now) || !snapshot_) {
    // A new watcher: wake the loop once so an idle engine publishes its current state.
    // NOTE: that wake restarts an idle-release wait once per new watcher (not per poll).
    snapshot_wanted_ = true;
    if (!watched(now)) steps_.clear();  // records from an earlier watch would leave a gap
    work_cv_.notify_one();
  }
  watched_at_ = now;
  return snapshot_;
}

std::vector<StepRecord> EngineLoop::steps_since(int64_t after) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StepRecord> out;
  for (const StepRecord& r : steps_) {
    if (r.step > after) out.push_back(r);
  }
  return out;
}

void EngineLoop::set_snapshot_interval(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_interval_ = seconds;
}

// Called on the loop thread with mu_ held, after a step and stats_ = engine_->stats().
void EngineLoop::observe_step(const std::vector<StepOutput>& outs) {
  const double now = now_seconds();
  if (!watched(now)) {
    preemptions_seen_ = stats_.num_preemptions;
    return;
  }
  StepRecord r;
  r.step = stats_.num_steps;
  r.time = now;
  r.decode_tokens = static_cast<int32_t>(stats_.last_batch_decode);
  r.prefill_tokens = static_cast<int32_t>(stats_.last_batch_prefill);
  r.num_running = static_cast<int32_t>(stats_.num_running);
  r.num_waiting = static_cast<int32_t>(stats_.num_waiting);
  for (const StepOutput& o : outs) r.num_finished += o.finished ? 1 : 0;
  if (!steps_.empty()) {
    const StepRecord& prev = steps_.back();
    r.num_preempted = static_cast<int32_t>(stats_.num_preemptions - preemptions_seen_);
    // running before - finished - preempted + joined = running after
    r.num_joined = std::max(0, r.num_running - prev.num_running + r.num_finished + r.num_preempted);
  }
  preemptions_seen_ = stats_.num_preemptions;
  steps_.push_back(r);
  if (steps_.size() > kStepHistory) steps_.pop_front();
  publish_snapshot(!engine_->has_unfinished());  // going idle: publish the final state
}

// Called on the loop thread with mu_ held. force: publish now regardless of the interval.
void EngineLoop::publish_snapshot(bool force) {
  const double now = now_seconds();
  if (!snapshot_wanted_ && !watched(now)) return;
  if (!force && !snapshot_wanted_ && now - published_at_ < snapshot_interval_) return;
  snapshot_ = std::make_shared<const EngineSnapshot>(engine_->snapshot());
  published_at_ = now;
  snapshot_wanted_ = false;
}

}  // namespace fantai::engine
