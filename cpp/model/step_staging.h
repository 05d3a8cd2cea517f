// model: the one place a step meets device memory. On a host backend (the CPU) every call passes
// the host pointers through; on a device backend it uploads the step's metadata in one transfer,
// gives the lm_head a device buffer and brings the logits back, or keeps them there when the
// backend samples where they live (Backend::sample_greedy, Backend::sample_top_k_top_p).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/buffer.h"
#include "common/op_types.h"

namespace fantai::model {

struct ForwardBatch;

// One step's device sampling parameters, one entry per logits row, host arrays
// (Backend::sample_top_k_top_p).
struct DeviceSampling {
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* uniform = nullptr;
};

class StepStaging {
 public:
  explicit StepStaging(Backend* backend) : backend_(backend) {}

  // The batch as the backend's ops read it: the host batch itself, or a copy pointing at device
  // copies of its arrays (logits_indices stays on the host, where the row gather reads it).
  ForwardBatch stage(const ForwardBatch& host);
  // Whether this backend takes greedy steps where the logits live (a device that samples).
  bool samples_greedy(int32_t vocab);
  // Whether this backend takes top-k / top-p steps where the logits live.
  bool samples_top_k_top_p(int32_t vocab);
  // Where the lm_head writes rows x vocab logits: host_logits itself on a host backend.
  float* logits_target(float* host_logits, int32_t rows, int32_t vocab);
  // After the lm_head: the logits to host_logits, or (tokens set) the sampled token and its
  // logprob per row instead: greedy, or with `sampling` set drawn by its parameters. Nothing to do
  // on a host backend.
  void finish_logits(float* host_logits, int32_t rows, int32_t vocab, int32_t* tokens, float* logprobs,
                     const DeviceSampling* sampling);

 private:
  Backend* backend_;
  std::vector<char> meta_host_;  // device backends: the step's metadata, packed for one upload
  Buffer meta_, logits_dev_;
};

}  // namespace fantai::model
