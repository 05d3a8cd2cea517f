// engine: the request a scheduler moves between queues, with its tokens and block table.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "engine/block_manager.h"
#include "sampling/sampling_params.h"

namespace fantai::engine {

enum class RequestStatus : uint8_t { kWaiting, kRunning, kFinished };
enum class FinishReason : uint8_t { kNone = 0, kStop = 1, kLength = 2, kAbort = 3 };
const char* finish_reason_name(FinishReason r);  // "", "stop", "length", "abort"

struct Request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;  // [num_prompt_tokens]
  std::vector<int32_t> output;  // [num_output_tokens] sampled so far
  sampling::SamplingParams params;
  RequestStatus status = RequestStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;

  // Tokens whose K/V are in the cache. A running decode has num_computed == num_tokens() - 1
  // (the last sampled token is fed next step). Preemption by recomputation resets it to 0;
  // preemption by swapping keeps it, the K/V then living in `swapped` until it is admitted again.
  int32_t num_computed_tokens = 0;
  BlockTables block_tables;  // one per attention kind
  SwappedTables swapped;     // non-empty while swapped out (block_tables then empty)
  int32_t num_preemptions = 0;
  std::mt19937_64 rng;        // per-request, so seeded output is batch independent
  double arrival_time = 0.0;  // seconds, steady clock
  double first_scheduled_time = -1.0;
  // Constrained rows: output tokens already handed to the mask provider. Preemption keeps the
  // output, so the provider's matcher stays in step with it.
  int32_t grammar_fed = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(prompt.size() + output.size()); }
  int32_t token_at(int32_t i) const {
    const int32_t np = static_cast<int32_t>(prompt.size());
    return i < np ? prompt[i] : output[i - np];
  }
  bool finished() const { return status == RequestStatus::kFinished; }
};

}  // namespace fantai::engine
