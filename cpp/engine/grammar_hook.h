// engine: the token-mask hook of constrained rows — a provider computes each step's grammar masks
// on the hook's own thread while the forward pass runs; sampling joins it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fantai::engine {

// One constrained row of a step: the tokens its matcher has not seen yet, then a mask to fill.
struct MaskRow {
  uint64_t request_id = 0;
  int32_t num_fed = 0;              // output tokens handed to the provider before new_tokens
  std::vector<int32_t> new_tokens;  // output tokens sampled since the row's last mask
};

// Lives outside the core (the Python grammar engine, through the bindings). fill() runs on the
// hook's worker thread, never on the step's: it first feeds each row's new tokens to that row's
// matcher, then writes rows.size() masks of `words` uint32 words (the sampler's layout: bit t % 32
// of word t / 32 allows token t). A mask must allow at least one token (EOS once a grammar is done).
class TokenMaskProvider {
 public:
  virtual ~TokenMaskProvider() = default;
  virtual void fill(const std::vector<MaskRow>& rows, uint32_t* masks, int32_t words) = 0;
};

// One worker thread per engine, idle (asleep on a condition variable) while no row is constrained.
class GrammarHook {
 public:
  GrammarHook(std::shared_ptr<TokenMaskProvider> provider, int32_t vocab);
  ~GrammarHook();
  GrammarHook(const GrammarHook&) = delete;
  GrammarHook& operator=(const GrammarHook&) = delete;

  // Hands the step's rows to the worker and returns at once (waits first for a job still running).
  void begin(std::vector<MaskRow> rows);
  // Joins the job begin() started: its masks, row after row, or the provider's error rethrown.
  const uint32_t* wait();
  int32_t words() const { return words_; }

 private:
  void run();

  std::shared_ptr<TokenMaskProvider> provider_;
  int32_t words_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<MaskRow> rows_;
  std::vector<uint32_t> masks_;
  std::exception_ptr error_;
  bool pending_ = false;  // a job was handed over and not yet finished
  bool stop_ = false;
};

}  // namespace fantai::engine
