// engine: turns a ScheduledBatch into the model's ForwardBatch (token ids, positions, and per KV
// kind the slots and block tables) once per step, runs the forward pass and returns the logits
// rows to sample.
// NOTE: it lives in engine/ (not model/) so that model/ never depends on scheduler types.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/scheduler.h"
#include "model/kv_cache.h"
#include "model/model.h"

namespace fantai::engine {

// Runs a step's block copies in list order (see BlockCopy): within the pool, to and from swap.
// Returns the swap copies' wall seconds (a device backend only queues them: ~0 there).
double apply_block_copies(model::KVCache& cache, const std::vector<BlockCopy>& copies, Backend* backend);

class ModelRunner {
 public:
  ModelRunner(std::shared_ptr<model::Model> model, model::KVCache* cache);

  // Runs one step; returns logits [number of seqs with sample == true, vocab] in batch order.
  const std::vector<float>& run(const ScheduledBatch& batch);
  // Wall seconds of the last run()'s batch preparation (the rest of run() is the forward).
  double last_prepare_seconds() const { return last_prepare_s_; }
  // Wall seconds and blocks of the last step's swap copies (in and out), for the cost model.
  double last_swap_seconds() const { return last_swap_s_; }
  int32_t last_swap_blocks() const { return last_swap_blocks_; }
  // The block copies of a step that runs no forward (every scheduled sequence left the batch,
  // after some were swapped out): done now, on every rank.
  void run_copies(const std::vector<BlockCopy>& copies);
  // Runs one step with greedy sampling on the backend (Model::forward_greedy): tokens and logprobs
  // per sampled seq, in batch order. Returns false, running nothing, where the backend cannot.
  bool run_greedy(const ScheduledBatch& batch, std::vector<int32_t>* tokens, std::vector<float>* logprobs);
  // The same with top-k / top-p sampling on the backend (Model::forward_sampled): `sampling` holds
  // one entry per sampled seq, in batch order.
  bool run_sampled(const ScheduledBatch& batch, const model::DeviceSampling& sampling,
                   std::vector<int32_t>* tokens, std::vector<float>* logprobs);

 private:
  void prepare(const ScheduledBatch& batch);
  // prepare() plus the step's tensor-parallel send and block copies: all but the forward.
  void begin_step(const ScheduledBatch& batch);
  void copy_blocks(const std::vector<BlockCopy>& copies);

  std::shared_ptr<model::Model> model_;
  model::KVCache* cache_;
  // Host staging reused across steps; tables and slots per KV kind.
  std::vector<int32_t> token_ids_, positions_, cu_seqlens_q_, context_lens_;
  std::vector<int32_t> block_tables_[model::kMaxKvKinds];
  std::vector<int32_t> logits_indices_;
  std::vector<int64_t> slot_mapping_[model::kMaxKvKinds];
  std::vector<float> logits_;
  model::ForwardBatch fb_;
  double last_prepare_s_ = 0.0;
  double last_swap_s_ = 0.0;
  int32_t last_swap_blocks_ = 0;
};

}  // namespace fantai::engine
