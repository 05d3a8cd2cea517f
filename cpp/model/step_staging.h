// model: the one place a step meets device memory. On a host backend (the CPU) every call passes
// the host pointers through; on a device backend it uploads the step's metadata in one transfer,
// gives the lm_head a device buffer and brings the logits back, or keeps them there when the
// backend samples greedily where they live (Backend::sample_greedy).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/buffer.h"
#include "common/op_types.h"

namespace fantai::model {

struct ForwardBatch;

class StepStaging {
 public:
  explicit StepStaging(Backend* backend) : backend_(backend) {}

  // The batch as the backend's ops read it: the host batch itself, or a copy pointing at device
  // copies of its arrays (logits_indices stays on the host, where the row gather reads it).
  ForwardBatch stage(const ForwardBatch& host);
  // Whether this backend takes greedy steps where the logits live (a device that samples).
  bool samples_greedy(int32_t vocab);
  // Where the lm_head writes rows x vocab logits: host_logits itself on a host backend.
  float* logits_target(float* host_logits, int32_t rows, int32_t vocab);
  // After the lm_head: the logits to host_logits, or (greedy_tokens set) the argmax token and
  // its logprob per row instead. Nothing to do on a host backend.
  void finish_logits(float* host_logits, int32_t rows, int32_t vocab, int32_t* greedy_tokens,
                     float* greedy_logprobs);

 private:
  Backend* backend_;
  std::vector<char> meta_host_;  // device backends: the step's metadata, packed for one upload
  Buffer meta_, logits_dev_;
};

}  // namespace fantai::model
