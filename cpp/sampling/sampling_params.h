// sampling: per-request sampling parameters (names follow vLLM's SamplingParams).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace fantai::sampling {

struct SamplingParams {
  float temperature = 1.0f;         // <= 1e-5 means greedy
  float top_p = 1.0f;               // (0, 1]
  int32_t top_k = 0;                // <= 0: off
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; HF semantics over prompt + output tokens
  float presence_penalty = 0.0f;    // OpenAI semantics over output tokens
  float frequency_penalty = 0.0f;   // OpenAI semantics over output tokens
  int64_t seed = -1;                // < 0: drawn from the engine's generator
  int32_t max_tokens = 16;          // >= 1
  int32_t min_tokens = 0;           // EOS and stop ids are masked until this many were generated
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;                // finish (reason stop) when sampled, like EOS
  int32_t logprobs = -1;                              // < 0: none; N >= 0: sampled token's logprob + top N
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits before sampling
  // A grammar constrains the output: the engine's token-mask provider decides each step's allowed
  // tokens (SampleRow::allowed). Needs Engine::set_mask_provider.
  bool constrained = false;

  bool greedy() const { return temperature <= 1e-5f; }
  void validate(int32_t vocab_size) const;  // throws InvalidArgument with a clear message
};

}  // namespace fantai::sampling
