// sampling: SamplingParams::validate — rejects bad parameters, naming the field and the value.
#include "sampling/sampling_params.h"

#include <cmath>

#include "common/check.h"

namespace fantai::sampling {

// Every range test is written as !(inside) so NaN fails it too (NaN compares false to everything).
void SamplingParams::validate(int32_t vocab_size) const {
  FANTAI_REQUIRE(vocab_size > 0, "vocab_size must be > 0, got " << vocab_size);
  FANTAI_REQUIRE(temperature >= 0.0f && std::isfinite(temperature),
                 "temperature must be a finite number >= 0, got " << temperature);
  FANTAI_REQUIRE(top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got " << top_p);
  FANTAI_REQUIRE(min_p >= 0.0f && min_p <= 1.0f, "min_p must be in [0, 1], got " << min_p);
  FANTAI_REQUIRE(repetition_penalty > 0.0f && std::isfinite(repetition_penalty),
                 "repetition_penalty must be > 0, got " << repetition_penalty);
  FANTAI_REQUIRE(presence_penalty >= -2.0f && presence_penalty <= 2.0f,
                 "presence_penalty must be in [-2, 2], got " << presence_penalty);
  FANTAI_REQUIRE(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
                 "frequency_penalty must be in [-2, 2], got " << frequency_penalty);
  FANTAI_REQUIRE(max_tokens >= 1, "max_tokens must be >= 1, got " << max_tokens);
  FANTAI_REQUIRE(min_tokens >= 0 && min_tokens <= max_tokens,
                 "min_tokens must be in [0, max_tokens=" << max_tokens << "], got " << min_tokens);
  FANTAI_REQUIRE(logprobs <= 20, "logprobs must be <= 20, got " << logprobs);
  for (int32_t id : stop_token_ids) {
    FANTAI_REQUIRE(id >= 0 && id < vocab_size,
                   "stop_token_ids entry must be in [0, " << vocab_size << "), got " << id);
  }
  for (const auto& [id, bias] : logit_bias) {
    FANTAI_REQUIRE(id >= 0 && id < vocab_size,
                   "logit_bias token id must be in [0, " << vocab_size << "), got " << id);
    FANTAI_REQUIRE(bias >= -100.0f && bias <= 100.0f,
                   "logit_bias value for token " << id << " must be in [-100, 100], got " << bias);
  }
}

}  // namespace fantai::sampling
