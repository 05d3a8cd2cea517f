// engine: iteration-level (continuous) batching with chunked prefill and preemption by recompute
// or swap.
#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>

#include "common/check.h"

namespace fantai::engine {
namespace {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// A chunk that starts past the prompt only (re)computes generated tokens: counted as decode.
bool is_decode(const ScheduledSeq& s) { return s.start >= static_cast<int32_t>(s.request->prompt.size()); }

}  // namespace

PreemptionMode preemption_mode_from_name(const std::string& name) {
  if (name == "auto") return PreemptionMode::kAuto;
  if (name == "swap") return PreemptionMode::kSwap;
  FANTAI_REQUIRE(name == "recompute",
                 "preemption_mode must be one of auto, swap, recompute; got '" << name << "'");
  return PreemptionMode::kRecompute;
}

Scheduler::Scheduler(SchedulerConfig config, BlockManager* blocks) : config_(config), blocks_(blocks) {
  FANTAI_REQUIRE(blocks_ != nullptr, "Scheduler needs a BlockManager");
  FANTAI_REQUIRE(config_.max_num_seqs >= 1, "max_num_seqs must be >= 1, got " << config_.max_num_seqs);
  FANTAI_REQUIRE(config_.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens must be >= 1, got " << config_.max_num_batched_tokens);
}

// The first n known tokens (prompt then output) of `r`, contiguous, for cache keys.
void gather_tokens(const Request& r, int32_t n, std::vector<int32_t>* out) {
  out->clear();
  const int32_t np = static_cast<int32_t>(r.prompt.size());
  out->insert(out->end(), r.prompt.begin(), r.prompt.begin() + std::min(n, np));
  if (n > np) out->insert(out->end(), r.output.begin(), r.output.begin() + (n - np));
}

void Scheduler::add_running(Request* request) {
  FANTAI_CHECK(request != nullptr && !request->block_tables.empty(), "add_running: request holds no blocks");
  request->status = RequestStatus::kRunning;
  running_.push_back(request);
}

void Scheduler::add(Request* request) {
  FANTAI_REQUIRE(request != nullptr, "Scheduler::add: null request");
  // An empty prompt would give a zero-token chunk, which no step can make progress on.
  FANTAI_REQUIRE(!request->prompt.empty(), "request " << request->id << " has an empty prompt");
  FANTAI_CHECK(request->block_tables.empty() && request->swapped.empty() && request->num_computed_tokens == 0,
               "request " << request->id << " is added with cache state");
  request->status = RequestStatus::kWaiting;
  request->finish_reason = FinishReason::kNone;
  waiting_.push_back(request);
}

ScheduledBatch Scheduler::schedule() {
  ScheduledBatch batch;
  schedule_running(batch);
  // A preemption means the pool is already too tight for the running set: admitting now would
  // only evict the newcomer (or a victim) again next step.
  if (batch.preempted.empty()) admit_waiting(batch);
  // Running order already puts decodes first in practice; the partition makes it a guarantee.
  std::stable_partition(batch.seqs.begin(), batch.seqs.end(), is_decode);
  return batch;
}

// Step (1): every running request, in admission order, gets its next tokens while budget lasts.
void Scheduler::schedule_running(ScheduledBatch& batch) {
  size_t i = 0;
  while (i < running_.size()) {
    Request* r = running_[i];
    const int32_t want = r->num_tokens() - r->num_computed_tokens;
    if (want <= 0) {  // nothing new to feed (the engine has not appended a token): skip it
      ++i;
      continue;
    }
    const int32_t n = std::min(want, budget_left(batch));
    if (n <= 0) break;
    // On failure r itself left running_ (preempted or finished); it was the back, so the loop
    // ends without skipping anyone.
    if (!grow_or_preempt(r, r->num_computed_tokens + n, batch)) continue;
    add_to_batch(r, n, batch);
    ++i;
  }
}

// Allocates slots for `num_tokens` tokens of running `request`, preempting the most recently
// admitted running requests until it fits. False when `request` itself had to leave running_.
bool Scheduler::grow_or_preempt(Request* request, int32_t num_tokens, ScheduledBatch& batch) {
  for (;;) {
    // A block shared since a fork gets a private copy before this step writes into it.
    const int32_t start = request->num_computed_tokens;
    if (blocks_->copy_on_write(request->block_tables, start, &batch.block_copies) &&
        blocks_->allocate(request->block_tables, start, num_tokens))
      break;
    Request* victim = running_.back();
    if (victim != request) {
      preempt(victim, batch);
      continue;
    }
    // Alone it still does not fit: the pool is smaller than this sequence, so waiting cannot
    // help; finishing it is the only way to keep the engine from spinning.
    if (running_.size() == 1) {
      finish_out_of_blocks(request, batch);
    } else {
      preempt(request, batch);
    }
    return false;
  }
  return true;
}

// Step (2): FCFS admission from the head of the waiting queue; never skips ahead.
void Scheduler::admit_waiting(ScheduledBatch& batch) {
  while (!waiting_.empty() && budget_left(batch) > 0 &&
         static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Request* r = waiting_.front();
    // Longest cached prefix of full blocks; at least the last token is always computed, since
    // its logits are needed.
    PrefixHit hit;
    const bool swapped = !r->swapped.empty();
    const bool fresh = r->block_tables.empty() && !swapped && blocks_->prefix_caching();
    if (fresh) {
      gather_tokens(*r, r->num_tokens(), &tokens_);
      hit = blocks_->find_cached_prefix(tokens_.data(), r->num_tokens() - 1);
    }
    const int32_t computed = fresh ? hit.num_blocks * blocks_->block_size() : r->num_computed_tokens;
    const int32_t remaining = r->num_tokens() - computed;
    const int32_t n = std::min(remaining, budget_left(batch));
    // Without chunked prefill the remainder must fit whole, unless it is longer than any budget
    // (a long prompt or a preempted sequence that outgrew it): waiting would then never end.
    if (!config_.enable_chunked_prefill && n < remaining && remaining <= config_.max_num_batched_tokens) {
      break;
    }
    // Every kind must fit (all or nothing): the hit's blocks each kind still needs, and the chunk.
    const bool fits = swapped
                          ? blocks_->swap_in(r->swapped, r->block_tables, computed + n, &batch.block_copies)
                      : fresh ? blocks_->take_cached_and_allocate(r->block_tables, hit, computed + n)
                              : blocks_->allocate(r->block_tables, computed, computed + n);
    if (fits && swapped) {
      ++batch.num_swapped_in;
      ++num_swap_ins_;
    }
    if (fits && fresh) {
      r->num_computed_tokens = computed;
      blocks_->record_lookup(r->num_tokens(), computed);
    }
    if (!fits) {
      if (!running_.empty()) break;  // blocks come back as running requests finish
      // Nothing holds blocks that could come back and the full budget was offered: this
      // sequence can never start, so finish it rather than block the queue forever.
      waiting_.pop_front();
      finish_out_of_blocks(r, batch);
      continue;
    }
    waiting_.pop_front();
    running_.push_back(r);
    r->status = RequestStatus::kRunning;
    if (r->first_scheduled_time < 0.0) r->first_scheduled_time = now_seconds();
    add_to_batch(r, n, batch);
  }
}

void Scheduler::add_to_batch(Request* request, int32_t num_new_tokens, ScheduledBatch& batch) const {
  ScheduledSeq s;
  s.request = request;
  s.start = request->num_computed_tokens;
  s.num_new_tokens = num_new_tokens;
  s.sample = s.start + num_new_tokens == request->num_tokens();
  batch.seqs.push_back(s);
  batch.num_tokens += num_new_tokens;
  (is_decode(s) ? batch.num_decode_tokens : batch.num_prefill_tokens) += num_new_tokens;
}

// Drops `request` from this step's batch (if scheduled) and gives its tokens back to the budget.
void Scheduler::remove_from_batch(Request* request, ScheduledBatch& batch) const {
  auto it = std::find_if(batch.seqs.begin(), batch.seqs.end(),
                         [request](const ScheduledSeq& s) { return s.request == request; });
  if (it == batch.seqs.end()) return;
  batch.num_tokens -= it->num_new_tokens;
  (is_decode(*it) ? batch.num_decode_tokens : batch.num_prefill_tokens) -= it->num_new_tokens;
  batch.seqs.erase(it);
}

bool Scheduler::should_swap(const Request& r) const {
  if (config_.preemption_mode == PreemptionMode::kRecompute || r.num_computed_tokens == 0 ||
      !blocks_->can_swap_out(r.block_tables))
    return false;
  if (config_.preemption_mode == PreemptionMode::kSwap) return true;
  int32_t live = 0;
  for (const BlockTable& t : r.block_tables.kinds) live += t.num_live();
  return 2.0 * live * costs_.swap_s_per_block < r.num_computed_tokens * costs_.recompute_s_per_token;
}

void Scheduler::preempt(Request* request, ScheduledBatch& batch) {
  remove_from_queues(request);
  remove_from_batch(request, batch);
  if (should_swap(*request)) {
    // The copies run before this step's forward, so the freed blocks are read before reuse.
    blocks_->swap_out(request->block_tables, &request->swapped, &batch.block_copies);
    ++batch.num_swapped_out;
    ++num_swap_outs_;
  } else {
    // The prompt and the generated tokens are kept and re-prefilled later.
    blocks_->free(request->block_tables);
    request->num_computed_tokens = 0;
  }
  request->status = RequestStatus::kWaiting;
  ++request->num_preemptions;
  ++num_preemptions_;
  // Victims go back-first, so pushing each to the front leaves the earliest admitted first.
  waiting_.push_front(request);
  batch.preempted.push_back(request);
}

void Scheduler::release(Request* request) {
  blocks_->free(request->block_tables);
  blocks_->free_swapped(request->swapped);
}

void Scheduler::finish_out_of_blocks(Request* request, ScheduledBatch& batch) {
  remove_from_queues(request);
  remove_from_batch(request, batch);
  release(request);
  request->status = RequestStatus::kFinished;
  request->finish_reason = FinishReason::kLength;
  batch.finished_out_of_blocks.push_back(request);
}

bool Scheduler::remove_from_queues(Request* request) {
  auto r = std::find(running_.begin(), running_.end(), request);
  if (r != running_.end()) {
    running_.erase(r);  // erase, not swap: running_ order is the preemption order
    return true;
  }
  auto w = std::find(waiting_.begin(), waiting_.end(), request);
  if (w != waiting_.end()) {
    waiting_.erase(w);
    return true;
  }
  return false;
}

void Scheduler::on_step_done(const ScheduledBatch& batch) {
  for (const ScheduledSeq& s : batch.seqs) {
    Request* r = s.request;
    if (r->finished()) continue;  // aborted or finished between schedule() and now
    FANTAI_CHECK(r->num_computed_tokens == s.start, "request " << r->id << " computed "
                                                               << r->num_computed_tokens
                                                               << " tokens, chunk starts at " << s.start);
    r->num_computed_tokens += s.num_new_tokens;
    FANTAI_CHECK(r->block_tables.num_tokens() == r->num_computed_tokens,
                 "request " << r->id << " table holds " << r->block_tables.num_tokens() << " slots for "
                            << r->num_computed_tokens << " computed tokens");
    if (blocks_->prefix_caching() &&
        r->num_computed_tokens / blocks_->block_size() > r->block_tables.num_cached_blocks()) {
      gather_tokens(*r, r->num_computed_tokens, &tokens_);
      blocks_->cache_full_blocks(r->block_tables, tokens_.data(), r->num_computed_tokens);
    }
    // Registered first (a dropped block keeps its content for prefix hits until evicted).
    blocks_->drop_invisible(r->block_tables, r->num_computed_tokens);
  }
}

void Scheduler::finish(Request* request, FinishReason reason) {
  FANTAI_CHECK(request != nullptr, "Scheduler::finish: null request");
  if (request->finished()) return;  // e.g. already finished out of blocks: keep the first reason
  remove_from_queues(request);
  release(request);
  request->status = RequestStatus::kFinished;
  request->finish_reason = reason;
}

bool Scheduler::abort(Request* request) {
  if (request == nullptr || !remove_from_queues(request)) return false;
  release(request);
  request->status = RequestStatus::kFinished;
  request->finish_reason = FinishReason::kAbort;
  return true;
}

}  // namespace fantai::engine
