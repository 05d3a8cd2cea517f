// engine: GrammarHook — the worker thread that asks the mask provider while the forward runs.
#include "engine/grammar_hook.h"

#include "common/check.h"

namespace fantai::engine {

GrammarHook::GrammarHook(std::shared_ptr<TokenMaskProvider> provider, int32_t vocab)
    : provider_(std::move(provider)), words_((vocab + 31) / 32) {
  FANTAI_REQUIRE(provider_ != nullptr, "GrammarHook: the mask provider is null");
  thread_ = std::thread([this] { run(); });
}

GrammarHook::~GrammarHook() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !pending_; });  // a running job writes into masks_
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GrammarHook::begin(std::vector<MaskRow> rows) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // A step that threw between begin() and wait() leaves its job behind: let it finish first.
    cv_.wait(lock, [this] { return !pending_; });
    rows_ = std::move(rows);
    masks_.assign(rows_.size() * static_cast<size_t>(words_), 0u);
    error_ = nullptr;
    pending_ = true;
  }
  cv_.notify_all();
}

const uint32_t* GrammarHook::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !pending_; });
  if (error_) std::rethrow_exception(error_);
  return masks_.data();
}

void GrammarHook::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || pending_; });
    if (stop_) return;
    // The job's buffers are only touched here until pending_ drops, so the lock can go.
    lock.unlock();
    std::exception_ptr error;
    try {
      provider_->fill(rows_, masks_.data(), words_);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    pending_ = false;
    cv_.notify_all();
  }
}

}  // namespace fantai::engine
