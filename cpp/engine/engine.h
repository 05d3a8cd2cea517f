// engine: add / abort / step — the continuous-batching loop over scheduler, blocks, model, sampler.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/block_manager.h"
#include "engine/grammar_hook.h"
#include "engine/model_runner.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "sampling/sampler.h"
#include "sampling/sampling_params.h"

namespace fantai::engine {

struct EngineConfig {
  int32_t block_size = 16;
  int32_t num_blocks = 0;      // > 0 fixes the pool size in blocks (overrides kv_cache_bytes)
  int64_t kv_cache_bytes = 0;  // 0: a share of the available RAM (see default_kv_cache_bytes)
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 0;  // 0: max(2048, max_model_len) when not chunking
  int32_t max_model_len = 0;           // 0: the model's max_position_embeddings
  bool enable_chunked_prefill = true;
  uint64_t seed = 0;                   // engine generator for requests without a seed
  std::vector<int32_t> eos_token_ids;  // empty: the model config's
  std::string kv_cache_dtype = "float32";
  bool enable_prefix_caching = true;
  // On release_memory(): cached (unowned) blocks kept for future prefix hits; < 0 = pool / 8.
  int32_t release_keep_cached_blocks = -1;
  // Host memory for preempted sequences' KV (0: none, preemption always recomputes), and how a
  // preempted sequence gives its blocks back: "auto" (swap when the measured cost of copying out
  // and back is below that of recomputing), "swap" (whenever the swap space has room) or
  // "recompute".
  int64_t swap_space_bytes = 0;
  std::string preemption_mode = "auto";
};

struct TokenLogprob {
  float logprob = 0.0f;                        // of the sampled token
  std::vector<std::pair<int32_t, float>> top;  // top-N (token, logprob)
};

struct StepOutput {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;      // new tokens this step (0 or 1 today)
  std::vector<TokenLogprob> logprobs;  // one per new token
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_token_id = -1;  // the stop/eos id that finished it, else -1
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;
  double queue_seconds = -1.0;  // arrival to first scheduled, on the first token's output
};

// One attention kind's KV pool (full attention, or one sliding window).
struct KVKindStats {
  int32_t window = 0;  // 0: full attention
  int32_t num_layers = 0;
  int64_t num_total_blocks = 0, num_free_blocks = 0, num_cached_blocks = 0, used_slots = 0;
};

struct EngineStats {
  int64_t num_running = 0, num_waiting = 0;
  // Block counts are sums over the attention kinds' pools; kv_kinds has each.
  int64_t num_free_blocks = 0, num_total_blocks = 0, block_size = 0;
  std::vector<KVKindStats> kv_kinds;
  int64_t used_slots = 0, allocated_slots = 0;
  int64_t num_preemptions = 0, num_steps = 0;
  // Of the preemptions, those swapped out (the rest recomputed); swapped back in; swap slots
  // (one block of one kind each, summed over the kinds), free ones, and waiting requests swapped.
  int64_t num_swap_outs = 0, num_swap_ins = 0;
  int64_t num_swap_slots = 0, num_free_swap_slots = 0, num_swapped = 0;
  double time_swap_s = 0.0;  // wall seconds of swap copies (queued only, on a device backend)
  int64_t prompt_tokens = 0, generation_tokens = 0;  // computed so far (prefill incl. recompute)
  int64_t last_batch_tokens = 0, last_batch_decode = 0, last_batch_prefill = 0;
  int64_t num_cached_blocks = 0;                // unowned blocks holding reusable prefix KV
  int64_t prefix_queries = 0, prefix_hits = 0;  // tokens looked up / found in the prefix cache
  int64_t evictions = 0, copy_on_writes = 0;
  int64_t bytes_per_block = 0;
  int64_t num_releases = 0;  // release_memory() calls that returned pages
  // Wall seconds spent in each phase of step(), summed over all steps: the engine's own overhead
  // (everything but forward) as a share of step time, measured where it happens.
  double time_schedule_s = 0.0;     // scheduler: admission, preemption, block allocation
  double time_prepare_s = 0.0;      // model runner: token ids, positions, slots, block tables
  double time_forward_s = 0.0;      // backend forward incl. logits
  double time_sample_s = 0.0;       // sampler over the rows that sample
  double time_postprocess_s = 0.0;  // outputs, stop checks, finishing and freeing requests
  double time_step_s = 0.0;         // whole step() calls that ran a batch
  // Sampling waited this long for grammar masks past the forward (0 when they were ready first).
  double time_mask_wait_s = 0.0;
};

// One live request as an observer (the dashboard) sees it: where its KV lives, how far it got.
struct RequestSnapshot {
  uint64_t id = 0;
  bool running = false;  // false: waiting (not yet admitted, or preempted)
  // Its blocks in logical order, kind after kind, as EngineSnapshot numbers them (a window kind's
  // dropped blocks left out); one kind: [ceil(num_tokens / block_size)] logical i -> physical.
  std::vector<int32_t> block_table;
  int32_t num_tokens = 0;  // prompt + output so far
  int32_t num_prompt_tokens = 0;
  int32_t num_computed_tokens = 0;  // tokens whose K/V are in the cache
  int32_t num_preemptions = 0;
  bool swapped = false;  // waiting with its KV in swap slots
};

// A copy of the block pool and the queues at one instant. Built by the thread that steps.
// The attention kinds' pools side by side: kind k's block b is entry b + the sizes of kinds < k.
struct EngineSnapshot {
  enum BlockState : uint8_t { kClean = 0, kCached = 1, kUsed = 2 };
  std::vector<uint8_t> block_states;      // [num_blocks] BlockState
  std::vector<int32_t> ref_counts;        // [num_blocks] owners per block (> 1: shared)
  std::vector<RequestSnapshot> requests;  // running (admission order), then waiting (queue order)
  EngineStats stats;
};

// Not thread-safe: one thread drives it (LLM.generate directly, or EngineLoop's thread).
class Engine {
 public:
  Engine(std::shared_ptr<model::Model> model, EngineConfig config);
  ~Engine();  // under tensor parallelism, lets the other ranks leave their loop

  // Throws InvalidArgument (the request is not added) for bad params or a prompt that can't fit.
  // `siblings` (n > 1): extra sequences that share this prompt's KV. They are forked from the
  // request when it samples its first token (same logits, own params and generator), and the
  // shared partial block is copied on write when they diverge.
  void add_request(uint64_t id, std::vector<int32_t> prompt, const sampling::SamplingParams& params,
                   const std::vector<std::pair<uint64_t, sampling::SamplingParams>>& siblings = {});
  void validate_request(const std::vector<int32_t>& prompt, const sampling::SamplingParams& params) const;
  // Frees everything the request held. Returns false for an unknown (or finished) id.
  bool abort_request(uint64_t id);
  // Aborts every live request (after a failed step, or at shutdown); returns their ids.
  std::vector<uint64_t> abort_all();
  // Drops the prefix cache (unowned cached blocks become clean). Returns blocks dropped.
  int32_t reset_prefix_cache();
  // Trims the prefix cache to release_keep_cached_blocks and gives the pages of every clean
  // block back to the OS (they are backed again on next use). Returns blocks released.
  int32_t release_memory();
  std::vector<StepOutput> step();
  bool has_unfinished() const { return scheduler_->has_unfinished(); }
  EngineStats stats() const;
  // O(num_blocks + live tokens' blocks): call it at a bounded rate (EngineLoop does).
  EngineSnapshot snapshot() const;
  // The grammar engine of constrained requests (SamplingParams::constrained). Set once, before the
  // first such request; steps without a constrained row never touch it.
  void set_mask_provider(std::shared_ptr<TokenMaskProvider> provider);

  const EngineConfig& config() const { return config_; }
  const model::ModelConfig& model_config() const { return model_->config(); }
  const BlockManager& block_manager() const { return *blocks_; }
  size_t kv_cache_bytes() const { return cache_->bytes(); }
  size_t swap_space_bytes() const { return cache_->swap_bytes(); }
  size_t swap_resident_bytes() const { return cache_->swap_resident_bytes(); }
  size_t kv_resident_bytes() const { return cache_->resident_bytes(); }

 private:
  void sample_and_postprocess(const ScheduledBatch& batch, const std::vector<float>& logits,
                              std::vector<StepOutput>* outs);
  FinishReason check_stop(const Request& r, int32_t token, int32_t* stop_id) const;
  StepOutput finish_output(Request& r, FinishReason reason);
  void postprocess(Request* r, const sampling::SampleResult& res, std::vector<StepOutput>* outs);
  // True when every row this step samples is plain (sampling::plain_row: no penalties, bias,
  // bans, logprobs, min_p or grammar mask) and no siblings are pending, so the backend may pick
  // the tokens where the logits live; *all_greedy tells whether every such row is greedy.
  bool plain_step(const ScheduledBatch& batch, bool* all_greedy) const;
  // Fills the device sampler's per-row parameters for a plain step, drawing each non-greedy row's
  // one uniform from its request's generator (sampling::draw_uniform), as sample() would.
  void device_sampling_rows(const ScheduledBatch& batch);
  const std::vector<float> empty_logits_;
  // A plain step's device sampling parameters (device_sampling_rows), reused across steps.
  std::vector<float> ds_temperature_, ds_top_p_, ds_uniform_;
  std::vector<int32_t> ds_top_k_;
  // Starts the masks of the step's constrained rows (false: none); mask_row_ maps each sampled
  // seq, in batch order, to its mask (-1: unconstrained).
  bool begin_masks(const ScheduledBatch& batch);
  void fork_siblings(Request* parent, std::vector<Request*>* children);
  void finish_pending_siblings(uint64_t parent, FinishReason reason, std::vector<StepOutput>* outs);

  std::shared_ptr<model::Model> model_;
  EngineConfig config_;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<model::KVCache> cache_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::unordered_map<uint64_t, std::vector<std::pair<uint64_t, sampling::SamplingParams>>> pending_siblings_;
  std::mt19937_64 rng_;
  EngineStats counters_;
  double last_sample_s_ = 0.0;  // the sampler's share of the current step
  // Keeps the scheduler's preemption costs current from this step's measured times.
  void update_preemption_costs(const ScheduledBatch& batch, double forward_s);
  std::unique_ptr<GrammarHook> grammar_;
  std::vector<int32_t> mask_row_;
  bool masking_ = false;  // this step's masks are being computed
};

// "full" or "sliding_window_<W>": an attention kind's name in stats and metrics.
std::string kv_kind_name(int32_t window);

// Bytes for the KV pool when none is given: 25% of MemAvailable, capped at 4 GiB, so the
// machine stays usable (PagedAttention needs no over-reservation; pages are touched lazily).
int64_t default_kv_cache_bytes();

}  // namespace fantai::engine
