// sampling: turns logits rows into tokens (greedy, temperature, top-k/p, min-p, penalties, logprobs).
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "sampling/sampling_params.h"

namespace fantai::sampling {

struct SampleRow {
  const sampling::SamplingParams* params = nullptr;
  const std::vector<int32_t>* prompt = nullptr;  // for repetition_penalty
  const std::vector<int32_t>* output = nullptr;  // for all three penalties
  std::mt19937_64* rng = nullptr;                // per request; one draw per sampled token
  // Tokens that must not be sampled now (EOS and stop ids while output < min_tokens).
  const std::vector<int32_t>* banned = nullptr;
  // Token mask of a constrained row (a grammar's allowed tokens this step): bit t % 32 of word
  // t / 32 set means token t may be sampled; (vocab + 31) / 32 words. nullptr: every token. The
  // mask applies after penalties, bias and bans, before temperature and the filters; logprobs
  // stay those of the raw distribution.
  const uint32_t* allowed = nullptr;
};

struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;                        // of `token` under the raw model distribution
  std::vector<std::pair<int32_t, float>> top;  // top-N (token, logprob), N = params->logprobs
};

// logits: [rows.size(), vocab] f32, modified in place. Logprobs are log_softmax of the raw logits
// (before penalties, bias and temperature), as vLLM reports them by default.
void sample(float* logits, int32_t vocab, const std::vector<SampleRow>& rows,
            std::vector<SampleResult>* results);

}  // namespace fantai::sampling
