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

// The one uniform sample() draws per non-greedy token (greedy rows draw none). A device sampler
// fed this value, drawn from the same request's generator at the same step, sees the draw the
// host sampler would have made.
inline double draw_uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// draw_uniform's value as the float a device sampler takes, rounded toward zero so it stays < 1.
float device_uniform(double u);

// Whether a row's token depends only on its raw logits, temperature, top_k, top_p and (when not
// greedy) the one draw_uniform: no logprobs, penalties, logit_bias, bans (has_bans: min_tokens
// masks EOS / stop ids this step), min_p (on a sampled row) or grammar mask. Only such rows may
// be sampled on a device (Backend::sample_top_k_top_p); any other row needs the host logits.
bool plain_row(const SamplingParams& p, bool has_bans);

}  // namespace fantai::sampling
