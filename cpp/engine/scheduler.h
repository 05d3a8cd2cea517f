// engine: iteration-level (continuous) batching with chunked prefill and preemption by recompute
// or by swapping to host memory.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "engine/block_manager.h"
#include "engine/request.h"

namespace fantai::engine {

// How a preempted sequence gives its blocks back. kRecompute drops its KV (recomputed on
// re-admission); kSwap copies it to host swap slots when they have room (else recomputes);
// kAuto swaps when the cost model says copying out and back is cheaper than recomputing.
enum class PreemptionMode : uint8_t { kAuto = 0, kSwap = 1, kRecompute = 2 };

// "auto", "swap", "recompute"; anything else is an InvalidArgument naming the choices.
PreemptionMode preemption_mode_from_name(const std::string& name);

struct SchedulerConfig {
  int32_t max_num_seqs = 256;             // running sequences per step
  int32_t max_num_batched_tokens = 2048;  // token budget per step (decodes + prefill chunks)
  bool enable_chunked_prefill = true;     // false: a prompt is admitted only when it fits whole
  PreemptionMode preemption_mode = PreemptionMode::kAuto;  // swap needs BlockManager swap slots
};

// What kAuto weighs, in seconds; the engine keeps both current from measured steps. A swap costs
// a copy out and a copy back of each live block; a recompute, prefill of every computed token.
struct PreemptionCosts {
  double swap_s_per_block = 0.0;
  double recompute_s_per_token = 0.0;  // 0: not measured yet (recompute is then assumed free)
};

// One sequence's share of a step: tokens [start, start + num_new_tokens) of its token list.
struct ScheduledSeq {
  Request* request = nullptr;
  int32_t start = 0;           // == request->num_computed_tokens when scheduled
  int32_t num_new_tokens = 0;  // >= 1
  bool sample = false;         // true when this chunk reaches the last known token
};

struct ScheduledBatch {
  std::vector<ScheduledSeq> seqs;  // running decodes first, then prefill chunks
  int32_t num_tokens = 0;
  int32_t num_decode_tokens = 0;  // seqs that were already past their prompt
  int32_t num_prefill_tokens = 0;
  std::vector<Request*> preempted;  // moved back to the head of the waiting queue this step
  int32_t num_swapped_out = 0;      // of those, swapped out (the rest will recompute)
  int32_t num_swapped_in = 0;       // swapped requests admitted again this step
  // Running requests that could not grow even with every other request preempted (the pool is
  // smaller than one sequence): finished with FinishReason::kLength, blocks freed.
  std::vector<Request*> finished_out_of_blocks;
  // Blocks whose KV must be copied before this step's forward (copy-on-write of a block shared
  // after a fork, made private before the first write into it), in their kind's pool.
  std::vector<BlockCopy> block_copies;
  bool empty() const { return seqs.empty(); }
};

// FCFS. Each schedule(): (1) every running request gets its next tokens (decode: 1; a partial
// prefill: the rest of its prompt up to the budget), allocating blocks in every attention kind's
// pool (a window kind first gives back what the chunk cannot see); when a pool is short the
// most recently admitted running request is preempted (put at the head of the waiting queue,
// its blocks freed: by recompute, num_computed_tokens = 0; by swap, its KV copied to host swap
// slots first and num_computed_tokens kept) until the allocation fits; (2) waiting requests are
// admitted in order while budget, max_num_seqs and free blocks allow (chunked when the budget is
// short; a swapped one gets fresh blocks and its KV copied back).
// After the step, the engine calls on_step_done() to advance num_computed_tokens (registering
// full blocks in the prefix cache, dropping window kinds' blocks the next query cannot see) and
// finish().
class Scheduler {
 public:
  Scheduler(SchedulerConfig config, BlockManager* blocks);

  void add(Request* request);
  // Adds a request that already holds blocks and computed tokens (a child forked from a running
  // parent for n > 1); it joins the running set behind the requests admitted before it.
  void add_running(Request* request);
  ScheduledBatch schedule();
  // Advances num_computed_tokens of every scheduled sequence by its chunk.
  void on_step_done(const ScheduledBatch& batch);
  // Removes a running request, frees its blocks and marks it finished with `reason`.
  void finish(Request* request, FinishReason reason);
  // Removes a request from whichever queue holds it and frees its blocks. False if unknown.
  bool abort(Request* request);

  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  int64_t num_swap_outs() const { return num_swap_outs_; }
  int64_t num_swap_ins() const { return num_swap_ins_; }
  void set_preemption_costs(const PreemptionCosts& c) { costs_ = c; }
  const PreemptionCosts& preemption_costs() const { return costs_; }
  const std::deque<Request*>& waiting() const { return waiting_; }
  const std::vector<Request*>& running() const { return running_; }

 private:
  void preempt(Request* request, ScheduledBatch& batch);
  bool should_swap(const Request& request) const;
  void release(Request* request);  // frees device blocks and swap slots
  // Helpers of schedule(); each keeps queues, tables and batch counters consistent.
  void schedule_running(ScheduledBatch& batch);
  void admit_waiting(ScheduledBatch& batch);
  bool grow_or_preempt(Request* request, int32_t num_tokens, ScheduledBatch& batch);
  void finish_out_of_blocks(Request* request, ScheduledBatch& batch);
  void add_to_batch(Request* request, int32_t num_new_tokens, ScheduledBatch& batch) const;
  void remove_from_batch(Request* request, ScheduledBatch& batch) const;
  bool remove_from_queues(Request* request);
  int32_t budget_left(const ScheduledBatch& batch) const {
    return config_.max_num_batched_tokens - batch.num_tokens;
  }

  SchedulerConfig config_;
  BlockManager* blocks_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;  // admission order; the back is preempted first
  int64_t num_preemptions_ = 0, num_swap_outs_ = 0, num_swap_ins_ = 0;
  PreemptionCosts costs_;
  std::vector<int32_t> tokens_;  // scratch for cache keys
};

}  // namespace fantai::engine
