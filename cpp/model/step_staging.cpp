// model: StepStaging (see step_staging.h).
#include "model/step_staging.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "model/model.h"

namespace fantai::model {

ForwardBatch StepStaging::stage(const ForwardBatch& b) {
  if (!backend_->is_device()) return b;
  const AttentionParams& a = b.attn[0];
  const size_t n = static_cast<size_t>(b.num_tokens), seqs = static_cast<size_t>(a.num_seqs);
  const int kinds = b.num_kv_kinds;
  size_t tables = 0;
  for (int k = 0; k < kinds; ++k) tables += seqs * static_cast<size_t>(b.attn[k].max_blocks_per_seq);
  // int64 slot mappings first keep them 8-byte aligned; the int32 arrays follow.
  const size_t bytes = kinds * n * 8 + (2 * n + (seqs + 1) + seqs + tables) * 4;
  meta_host_.resize(bytes);
  if (meta_.bytes() < bytes) meta_ = Buffer(backend_, std::max(bytes, 2 * meta_.bytes()), false);
  char* h = meta_host_.data();
  char* d = meta_.as<char>();
  size_t off = 0;
  auto put = [&](const void* src, size_t len) -> const void* {
    std::memcpy(h + off, src, len);
    const void* dev = d + off;
    off += len;
    return dev;
  };
  ForwardBatch out = b;
  for (int k = 0; k < kinds; ++k)
    out.slot_mapping[k] = static_cast<const int64_t*>(put(b.slot_mapping[k], n * 8));
  out.token_ids = static_cast<const int32_t*>(put(b.token_ids, n * 4));
  out.positions = static_cast<const int32_t*>(put(b.positions, n * 4));
  // Every kind shares the queries and contexts (the same host arrays), each has its own tables.
  const int32_t* cu = static_cast<const int32_t*>(put(a.cu_seqlens_q, (seqs + 1) * 4));
  const int32_t* ctx = static_cast<const int32_t*>(put(a.context_lens, seqs * 4));
  for (int k = 0; k < kinds; ++k) {
    out.attn[k].cu_seqlens_q = cu;
    out.attn[k].context_lens = ctx;
    out.attn[k].block_tables = static_cast<const int32_t*>(
        put(b.attn[k].block_tables, seqs * static_cast<size_t>(b.attn[k].max_blocks_per_seq) * 4));
  }
  backend_->upload(d, h, off);
  return out;
}

bool StepStaging::samples_greedy(int32_t vocab) {
  // Probe with zero rows: a declining backend costs nothing. The host sampler is as cheap as it
  // gets on a host backend.
  return backend_->is_device() && backend_->sample_greedy(nullptr, 0, vocab, nullptr, nullptr);
}

bool StepStaging::samples_top_k_top_p(int32_t vocab) {
  return backend_->is_device() && backend_->sample_top_k_top_p(nullptr, 0, vocab, nullptr, nullptr, nullptr,
                                                               nullptr, nullptr, nullptr);
}

float* StepStaging::logits_target(float* host_logits, int32_t rows, int32_t vocab) {
  if (!backend_->is_device()) return host_logits;
  const size_t bytes = static_cast<size_t>(rows) * vocab * sizeof(float);
  if (logits_dev_.bytes() < bytes) logits_dev_ = Buffer(backend_, bytes, false);
  return logits_dev_.as<float>();
}

void StepStaging::finish_logits(float* host_logits, int32_t rows, int32_t vocab, int32_t* tokens,
                                float* logprobs, const DeviceSampling* sampling) {
  if (!backend_->is_device()) return;
  if (tokens != nullptr && sampling != nullptr) {
    FANTAI_CHECK(
        backend_->sample_top_k_top_p(logits_dev_.as<float>(), rows, vocab, sampling->temperature,
                                     sampling->top_k, sampling->top_p, sampling->uniform, tokens, logprobs),
        "backend " << backend_->name() << " accepted top-k / top-p sampling, then declined it");
    return;
  }
  if (tokens != nullptr) {
    FANTAI_CHECK(backend_->sample_greedy(logits_dev_.as<float>(), rows, vocab, tokens, logprobs),
                 "backend " << backend_->name() << " accepted greedy sampling, then declined it");
    return;
  }
  backend_->download(host_logits, logits_dev_.data(), static_cast<size_t>(rows) * vocab * sizeof(float));
}

}  // namespace fantai::model
