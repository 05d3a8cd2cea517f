// engine: per-step metadata build (the paging vocabulary: block_table, slot_mapping, context_lens,
// cu_seqlens_q; tables and slots once per KV kind) and the forward call.
#include "engine/model_runner.h"

#include <algorithm>
#include <chrono>

#include "common/check.h"
#include "engine/tp_worker.h"

namespace fantai::engine {

ModelRunner::ModelRunner(std::shared_ptr<model::Model> model, model::KVCache* cache)
    : model_(std::move(model)), cache_(cache) {}

void ModelRunner::prepare(const ScheduledBatch& batch) {
  const int32_t bs = cache_->layout().block_size;
  const int32_t num_seqs = static_cast<int32_t>(batch.seqs.size());
  const int kinds = cache_->num_kinds();
  token_ids_.clear();
  positions_.clear();
  logits_indices_.clear();
  cu_seqlens_q_.assign(1, 0);
  context_lens_.clear();
  int32_t max_blocks = 1, max_q = 0, max_ctx = 0;
  for (const ScheduledSeq& s : batch.seqs) {
    FANTAI_CHECK(static_cast<int>(s.request->block_tables.kinds.size()) == kinds,
                 "request " << s.request->id << " has tables for " << s.request->block_tables.kinds.size()
                            << " KV kinds, the cache " << kinds);
    max_blocks = std::max<int32_t>(max_blocks,
                                   static_cast<int32_t>(s.request->block_tables.kinds[0].blocks.size()));
  }
  for (int k = 0; k < kinds; ++k) {
    slot_mapping_[k].clear();
    // -1 past a sequence's blocks (and where a window kind dropped them): never read.
    block_tables_[k].assign(static_cast<size_t>(num_seqs) * max_blocks, -1);
  }
  for (int32_t i = 0; i < num_seqs; ++i) {
    const ScheduledSeq& s = batch.seqs[i];
    const Request& r = *s.request;
    for (int k = 0; k < kinds; ++k) {
      const auto& blocks = r.block_tables.kinds[k].blocks;
      FANTAI_CHECK(static_cast<int32_t>(blocks.size()) * bs >= s.start + s.num_new_tokens,
                   "request " << r.id << " scheduled without KV slots");
      for (int32_t p = s.start; p < s.start + s.num_new_tokens; ++p) {
        FANTAI_CHECK(blocks[p / bs] >= 0,
                     "request " << r.id << " writes position " << p << " into a dropped block");
        slot_mapping_[k].push_back(static_cast<int64_t>(blocks[p / bs]) * bs + p % bs);
      }
      std::copy(blocks.begin(), blocks.end(), block_tables_[k].begin() + static_cast<size_t>(i) * max_blocks);
    }
    for (int32_t p = s.start; p < s.start + s.num_new_tokens; ++p) {
      token_ids_.push_back(r.token_at(p));
      positions_.push_back(p);
    }
    cu_seqlens_q_.push_back(static_cast<int32_t>(token_ids_.size()));
    context_lens_.push_back(s.start + s.num_new_tokens);
    if (s.sample) logits_indices_.push_back(static_cast<int32_t>(token_ids_.size()) - 1);
    max_q = std::max(max_q, s.num_new_tokens);
    max_ctx = std::max(max_ctx, s.start + s.num_new_tokens);
  }
  fb_.num_tokens = static_cast<int32_t>(token_ids_.size());
  fb_.token_ids = token_ids_.data();
  fb_.positions = positions_.data();
  fb_.logits_indices = logits_indices_.data();
  fb_.num_logits = static_cast<int32_t>(logits_indices_.size());
  fb_.num_kv_kinds = kinds;
  for (int k = 0; k < kinds; ++k) {
    fb_.slot_mapping[k] = slot_mapping_[k].data();
    AttentionParams& a = fb_.attn[k];
    a.num_seqs = num_seqs;
    a.num_tokens = fb_.num_tokens;
    a.max_query_len = max_q;
    a.max_context_len = max_ctx;
    a.cu_seqlens_q = cu_seqlens_q_.data();
    a.context_lens = context_lens_.data();
    a.block_tables = block_tables_[k].data();
    a.max_blocks_per_seq = max_blocks;
  }
}

double apply_block_copies(model::KVCache& cache, const std::vector<BlockCopy>& copies, Backend* backend) {
  double swap_s = 0.0;
  for (const BlockCopy& c : copies) {
    if (c.where == BlockCopy::kInPool) {
      cache.copy_block(c.kind, c.src, c.dst, backend);
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (c.where == BlockCopy::kToSwap) {
      cache.swap_out(c.kind, c.src, c.dst, backend);
    } else {
      FANTAI_CHECK(c.where == BlockCopy::kFromSwap, "bad block copy kind " << c.where);
      cache.swap_in(c.kind, c.src, c.dst, backend);
    }
    swap_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return swap_s;
}

void ModelRunner::copy_blocks(const std::vector<BlockCopy>& copies) {
  last_swap_s_ = apply_block_copies(*cache_, copies, model_->backend());
  last_swap_blocks_ = 0;
  for (const BlockCopy& c : copies) last_swap_blocks_ += c.where != BlockCopy::kInPool;
}

void ModelRunner::run_copies(const std::vector<BlockCopy>& copies) {
  if (model_->tp_shard().active()) tp_send_copies(*model_, copies);
  copy_blocks(copies);
}

void ModelRunner::begin_step(const ScheduledBatch& batch) {
  const auto t0 = std::chrono::steady_clock::now();
  prepare(batch);
  if (model_->tp_shard().active()) tp_send_step(*model_, fb_, batch.block_copies);
  copy_blocks(batch.block_copies);
  last_prepare_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const std::vector<float>& ModelRunner::run(const ScheduledBatch& batch) {
  begin_step(batch);
  logits_.resize(static_cast<size_t>(fb_.num_logits) * model_->config().vocab_size);
  model_->forward(fb_, *cache_, logits_.data());
  return logits_;
}

bool ModelRunner::run_greedy(const ScheduledBatch& batch, std::vector<int32_t>* tokens,
                             std::vector<float>* logprobs) {
  if (!model_->samples_greedy_on_backend()) return false;
  begin_step(batch);
  tokens->assign(fb_.num_logits, -1);
  logprobs->assign(fb_.num_logits, 0.0f);
  return model_->forward_greedy(fb_, *cache_, tokens->data(), logprobs->data());
}

bool ModelRunner::run_sampled(const ScheduledBatch& batch, const model::DeviceSampling& sampling,
                              std::vector<int32_t>* tokens, std::vector<float>* logprobs) {
  if (!model_->samples_top_k_top_p_on_backend()) return false;
  begin_step(batch);
  tokens->assign(fb_.num_logits, -1);
  logprobs->assign(fb_.num_logits, 0.0f);
  return model_->forward_sampled(fb_, *cache_, sampling, tokens->data(), logprobs->data());
}

}  // namespace fantai::engine
