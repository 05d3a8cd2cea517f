// engine: unit tests of the FCFS scheduler (budget, chunked prefill, preemption, abort) with a fake
// engine that "samples" one token per finished chunk.
// Over 400 lines: one case per scheduling rule, all on the same fake engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/check.h"
#include "engine/block_manager.h"
#include "engine/request.h"
#include "engine/scheduler.h"

namespace fantai::engine {
namespace {

// The token the fake engine samples at output position i of request `id`: lets tests check that
// generated tokens survive preemption.
int32_t fake_token(uint64_t id, size_t i) { return static_cast<int32_t>(id * 1000 + i); }

std::unique_ptr<Request> make_request(uint64_t id, int32_t prompt_len, int32_t max_tokens) {
  auto r = std::make_unique<Request>();
  r->id = id;
  r->prompt.resize(prompt_len);
  std::iota(r->prompt.begin(), r->prompt.end(), 1);
  r->params.max_tokens = max_tokens;
  return r;
}

// Owns the pool, the scheduler and the requests; step() plays the engine.
struct Harness {
  BlockManager bm;
  Scheduler sched;
  std::vector<std::unique_ptr<Request>> reqs;

  Harness(int32_t num_blocks, int32_t block_size, SchedulerConfig cfg)
      : bm(num_blocks, block_size), sched(cfg, &bm) {}

  Request* add(int32_t prompt_len, int32_t max_tokens) {
    reqs.push_back(make_request(reqs.size(), prompt_len, max_tokens));
    sched.add(reqs.back().get());
    return reqs.back().get();
  }

  // Schedules, "runs" the batch, appends a sampled token where a chunk reached the end and
  // finishes requests at max_tokens, like the engine does.
  ScheduledBatch step() {
    ScheduledBatch b = sched.schedule();
    sched.on_step_done(b);
    for (const ScheduledSeq& s : b.seqs) {
      Request* r = s.request;
      if (!s.sample || r->finished()) continue;
      r->output.push_back(fake_token(r->id, r->output.size()));
      if (static_cast<int32_t>(r->output.size()) >= r->params.max_tokens) {
        sched.finish(r, FinishReason::kLength);
      }
    }
    check();
    return b;
  }

  void run_to_completion(int max_steps = 10000) {
    for (int i = 0; i < max_steps && sched.has_unfinished(); ++i) step();
    ASSERT_FALSE(sched.has_unfinished());
  }

  std::vector<const BlockTables*> live_tables() const {
    std::vector<const BlockTables*> out;
    for (const auto& r : reqs) out.push_back(&r->block_tables);
    return out;
  }

  void check() const {
    std::vector<const SwappedTables*> swapped;
    for (const auto& r : reqs) swapped.push_back(&r->swapped);
    bm.check_invariants(live_tables(), &swapped);
    for (const Request* r : sched.waiting()) {
      EXPECT_TRUE(r->block_tables.empty());
      EXPECT_EQ(r->num_computed_tokens, r->swapped.num_tokens());  // 0 unless swapped
    }
  }
};

const ScheduledSeq* find_seq(const ScheduledBatch& b, const Request* r) {
  for (const ScheduledSeq& s : b.seqs) {
    if (s.request == r) return &s;
  }
  return nullptr;
}

SchedulerConfig config(int32_t max_seqs, int32_t budget, bool chunked = true) {
  SchedulerConfig c;
  c.max_num_seqs = max_seqs;
  c.max_num_batched_tokens = budget;
  c.enable_chunked_prefill = chunked;
  return c;
}

TEST(Request, FinishReasonNames) {
  EXPECT_STREQ(finish_reason_name(FinishReason::kNone), "");
  EXPECT_STREQ(finish_reason_name(FinishReason::kStop), "stop");
  EXPECT_STREQ(finish_reason_name(FinishReason::kLength), "length");
  EXPECT_STREQ(finish_reason_name(FinishReason::kAbort), "abort");
}

TEST(Scheduler, ConstructorAndAddValidate) {
  BlockManager bm(4, 4);
  EXPECT_THROW(Scheduler(config(0, 8), &bm), InvalidArgument);
  EXPECT_THROW(Scheduler(config(1, 0), &bm), InvalidArgument);
  EXPECT_THROW(Scheduler(config(1, 8), nullptr), InvalidArgument);
  Scheduler s(config(1, 8), &bm);
  EXPECT_THROW(s.add(nullptr), InvalidArgument);
  auto empty = make_request(0, 0, 4);
  EXPECT_THROW(s.add(empty.get()), InvalidArgument);
  EXPECT_FALSE(s.has_unfinished());
}

TEST(Scheduler, EmptySchedulerGivesEmptyBatch) {
  Harness h(4, 4, config(4, 16));
  ScheduledBatch b = h.sched.schedule();
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.num_tokens, 0);
}

TEST(Scheduler, PrefillThenDecodes) {
  Harness h(8, 4, config(4, 64));
  Request* r = h.add(5, 3);
  ScheduledBatch b = h.step();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.seqs[0].start, 0);
  EXPECT_EQ(b.seqs[0].num_new_tokens, 5);
  EXPECT_TRUE(b.seqs[0].sample);
  EXPECT_EQ(b.num_prefill_tokens, 5);
  EXPECT_EQ(b.num_decode_tokens, 0);
  EXPECT_EQ(r->status, RequestStatus::kRunning);
  EXPECT_GE(r->first_scheduled_time, 0.0);
  EXPECT_EQ(r->num_computed_tokens, 5);
  EXPECT_EQ(r->block_tables.num_tokens(), 5);
  EXPECT_EQ(r->block_tables.kinds[0].blocks.size(), 2u);

  // Decode: feed the last sampled token (position 5), allocate its slot.
  b = h.step();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.seqs[0].start, 5);
  EXPECT_EQ(b.seqs[0].num_new_tokens, 1);
  EXPECT_TRUE(b.seqs[0].sample);
  EXPECT_EQ(b.num_decode_tokens, 1);
  EXPECT_EQ(b.num_prefill_tokens, 0);
  EXPECT_EQ(r->num_computed_tokens, 6);
  EXPECT_EQ(r->num_computed_tokens, r->num_tokens() - 1);

  b = h.step();  // third token reaches max_tokens
  EXPECT_TRUE(r->finished());
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->output, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(h.bm.num_free_blocks(), 8);
  EXPECT_FALSE(h.sched.has_unfinished());
}

TEST(Scheduler, RunningDecodesComeBeforeNewPrefills) {
  Harness h(32, 4, config(8, 64));
  Request* a = h.add(3, 10);
  Request* b = h.add(4, 10);
  h.step();  // both prefilled
  Request* c = h.add(6, 10);
  ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.seqs.size(), 3u);
  EXPECT_EQ(batch.seqs[0].request, a);
  EXPECT_EQ(batch.seqs[1].request, b);
  EXPECT_EQ(batch.seqs[2].request, c);
  EXPECT_EQ(batch.num_decode_tokens, 2);
  EXPECT_EQ(batch.num_prefill_tokens, 6);
  EXPECT_EQ(batch.num_tokens, 8);
}

TEST(Scheduler, TokenBudgetIsRespected) {
  Harness h(256, 4, config(64, 10));
  for (int i = 0; i < 12; ++i) h.add(3 + i % 5, 6);
  int steps = 0;
  while (h.sched.has_unfinished()) {
    ScheduledBatch b = h.step();
    ASSERT_LE(b.num_tokens, 10);
    int32_t sum = 0;
    for (const ScheduledSeq& s : b.seqs) {
      ASSERT_GE(s.num_new_tokens, 1);
      sum += s.num_new_tokens;
    }
    ASSERT_EQ(sum, b.num_tokens);
    ASSERT_EQ(b.num_decode_tokens + b.num_prefill_tokens, b.num_tokens);
    ASSERT_LT(++steps, 1000);
  }
  for (const auto& r : h.reqs) EXPECT_EQ(r->output.size(), 6u);
}

TEST(Scheduler, ChunkedPrefillSplitsLongPromptWhileDecodesFlow) {
  Harness h(64, 4, config(8, 8));
  Request* a = h.add(4, 50);
  h.step();  // a prefilled
  Request* b = h.add(30, 2);
  // Each step: a decodes one token, b gets the 7 left: chunks [0,7) [7,14) [14,21) [21,28) [28,30).
  int32_t expected_start = 0;
  for (int i = 0; i < 5; ++i) {
    const size_t a_out = a->output.size();
    ScheduledBatch batch = h.step();
    ASSERT_EQ(batch.seqs.size(), 2u) << i;
    EXPECT_EQ(batch.seqs[0].request, a);
    EXPECT_EQ(batch.seqs[0].num_new_tokens, 1);
    EXPECT_EQ(a->output.size(), a_out + 1);
    const ScheduledSeq& s = batch.seqs[1];
    EXPECT_EQ(s.request, b);
    EXPECT_EQ(s.start, expected_start);
    EXPECT_EQ(s.num_new_tokens, std::min(7, 30 - expected_start));
    EXPECT_EQ(s.sample, i == 4);  // only the last chunk samples
    EXPECT_EQ(b->output.size(), i == 4 ? 1u : 0u);
    EXPECT_LE(batch.num_tokens, 8);
    expected_start += s.num_new_tokens;
  }
  EXPECT_EQ(b->num_computed_tokens, 30);
  ScheduledBatch batch = h.step();  // both decode now
  EXPECT_EQ(batch.num_decode_tokens, 2);
  EXPECT_TRUE(b->finished());
}

TEST(Scheduler, WithoutChunkingAPromptWaitsUntilItFitsWhole) {
  Harness h(64, 4, config(8, 8, /*chunked=*/false));
  Request* a = h.add(3, 3);
  h.step();
  Request* b = h.add(8, 1);  // needs the whole budget; a's decode takes one token
  ScheduledBatch batch = h.step();
  EXPECT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  batch = h.step();  // a finishes at this step's sample
  EXPECT_TRUE(a->finished());
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  batch = h.step();
  ASSERT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(batch.seqs[0].request, b);
  EXPECT_EQ(batch.seqs[0].num_new_tokens, 8);
  EXPECT_TRUE(b->finished());
}

TEST(Scheduler, WithoutChunkingAPromptLongerThanAnyBudgetIsStillServed) {
  // It could never fit whole: chunking it is the only way not to wait forever.
  Harness h(64, 4, config(8, 8, /*chunked=*/false));
  Request* r = h.add(20, 2);
  ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(batch.seqs[0].num_new_tokens, 8);
  EXPECT_FALSE(batch.seqs[0].sample);
  h.run_to_completion();
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->output.size(), 2u);
}

TEST(Scheduler, MaxNumSeqsCapsTheRunningSet) {
  Harness h(64, 4, config(2, 64));
  for (int i = 0; i < 5; ++i) h.add(2, 2 + i);
  ScheduledBatch batch = h.step();
  EXPECT_EQ(batch.seqs.size(), 2u);
  EXPECT_EQ(h.sched.num_running(), 2u);
  EXPECT_EQ(h.sched.num_waiting(), 3u);
  h.step();  // request 0 finishes (max_tokens 2)
  EXPECT_TRUE(h.reqs[0]->finished());
  batch = h.step();  // request 2 takes the free seat, FCFS
  EXPECT_EQ(h.reqs[2]->status, RequestStatus::kRunning);
  EXPECT_EQ(h.reqs[3]->status, RequestStatus::kWaiting);
  while (h.sched.has_unfinished()) {
    h.step();
    EXPECT_LE(h.sched.num_running(), 2u);
  }
}

TEST(Scheduler, FcfsNeverSkipsAheadOfABlockedHead) {
  Harness h(4, 4, config(8, 64));
  Request* a = h.add(8, 20);  // 2 blocks
  h.step();
  Request* b = h.add(12, 1);  // 3 blocks: does not fit next to a
  Request* c = h.add(1, 1);   // would fit, but must not overtake b
  ScheduledBatch batch = h.step();
  EXPECT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  EXPECT_EQ(c->status, RequestStatus::kWaiting);
  EXPECT_EQ(h.sched.waiting().front(), b);
  h.sched.finish(a, FinishReason::kStop);
  batch = h.step();
  ASSERT_EQ(batch.seqs.size(), 2u);
  EXPECT_EQ(batch.seqs[0].request, b);
  EXPECT_EQ(batch.seqs[1].request, c);
}

TEST(Scheduler, PreemptsMostRecentAdmissionAndResumesItFirst) {
  // 6 blocks of 2 slots. a, b, c each take a 3-token prompt (2 blocks): the pool is full.
  Harness h(6, 2, config(8, 64));
  Request* a = h.add(3, 10);
  Request* b = h.add(3, 10);
  Request* c = h.add(3, 10);
  h.step();
  EXPECT_EQ(h.bm.num_free_blocks(), 0);
  Request* d = h.add(1, 1);  // waiting behind the preempted one

  // Decode: every sequence fits token 4 in its second block, nobody is preempted.
  ScheduledBatch batch = h.step();
  EXPECT_TRUE(batch.preempted.empty());
  EXPECT_EQ(batch.seqs.size(), 3u);
  EXPECT_EQ(d->status, RequestStatus::kWaiting);  // no free block for d
  // The next decode needs a third block each: a preempts c (the most recent admission), and
  // c's two freed blocks serve a and b.
  batch = h.step();
  ASSERT_EQ(batch.preempted.size(), 1u);
  EXPECT_EQ(batch.preempted[0], c);
  ASSERT_EQ(batch.seqs.size(), 2u);
  EXPECT_EQ(batch.seqs[1].request, b);
  EXPECT_EQ(find_seq(batch, c), nullptr);
  EXPECT_EQ(c->status, RequestStatus::kWaiting);
  EXPECT_EQ(c->num_computed_tokens, 0);
  EXPECT_TRUE(c->block_tables.empty());
  EXPECT_EQ(c->num_preemptions, 1);
  EXPECT_EQ(h.sched.num_preemptions(), 1);
  EXPECT_EQ(c->output, (std::vector<int32_t>{2000, 2001}));  // generated tokens are kept
  ASSERT_EQ(h.sched.waiting().size(), 2u);
  EXPECT_EQ(h.sched.waiting()[0], c);  // ahead of d, which arrived earlier
  EXPECT_EQ(h.sched.waiting()[1], d);

  // When a finishes, c is resumed first: prompt + kept output recomputed in one chunk.
  h.sched.finish(a, FinishReason::kStop);
  batch = h.step();
  const ScheduledSeq* s = find_seq(batch, c);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->start, 0);
  EXPECT_EQ(s->num_new_tokens, 5);
  EXPECT_TRUE(s->sample);
  EXPECT_EQ(c->output.size(), 3u);
  EXPECT_EQ(c->output[2], 2002);
  h.run_to_completion();
  EXPECT_EQ(c->output.size(), 10u);
  for (size_t i = 0; i < c->output.size(); ++i) EXPECT_EQ(c->output[i], fake_token(c->id, i));
  EXPECT_EQ(h.bm.num_free_blocks(), 6);
}

TEST(Scheduler, SwapPreemptionKeepsTheComputedTokensAndCopiesTheBlocksBack) {
  // PreemptsMostRecentAdmissionAndResumesItFirst's pool, with 4 swap slots and swap forced.
  SchedulerConfig cfg = config(8, 64);
  cfg.preemption_mode = PreemptionMode::kSwap;
  Harness h(6, 2, cfg);
  h.bm.set_swap_slots(4);
  Request* a = h.add(3, 10);
  h.add(3, 10);
  Request* c = h.add(3, 10);
  h.step();
  h.step();
  const std::vector<int32_t> c_blocks = c->block_tables.kinds[0].blocks;
  ScheduledBatch batch = h.step();  // a preempts c, which is swapped out, not dropped
  ASSERT_EQ(batch.preempted.size(), 1u);
  EXPECT_EQ(batch.num_swapped_out, 1);
  EXPECT_EQ(c->num_computed_tokens, 4);  // prompt + first output; the second is fed next
  ASSERT_EQ(c->swapped.kinds.size(), 1u);
  EXPECT_EQ(c->swapped.kinds[0].slots.size(), 2u);
  EXPECT_EQ(h.bm.num_free_swap_slots(), 2);
  // c's blocks go to the slots before a and b write into them (the copies lead the list).
  ASSERT_GE(batch.block_copies.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(batch.block_copies[i].where, BlockCopy::kToSwap);
    EXPECT_EQ(batch.block_copies[i].src, c_blocks[i]);
    EXPECT_EQ(batch.block_copies[i].dst, c->swapped.kinds[0].slots[i]);
  }
  const std::vector<int32_t> slots = c->swapped.kinds[0].slots;
  h.sched.finish(a, FinishReason::kStop);
  batch = h.step();  // c comes back with its 4 tokens' KV and feeds its 5th token only
  const ScheduledSeq* s = find_seq(batch, c);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->start, 4);
  EXPECT_EQ(s->num_new_tokens, 1);
  EXPECT_EQ(batch.num_swapped_in, 1);
  EXPECT_TRUE(c->swapped.empty());
  int from_swap = 0;
  for (const BlockCopy& bc : batch.block_copies) {
    if (bc.where != BlockCopy::kFromSwap) continue;
    EXPECT_EQ(bc.src, slots[from_swap]);
    EXPECT_EQ(bc.dst, c->block_tables.kinds[0].blocks[from_swap]);
    ++from_swap;
  }
  EXPECT_EQ(from_swap, 2);
  EXPECT_EQ(h.sched.num_swap_outs(), 1);
  EXPECT_EQ(h.sched.num_swap_ins(), 1);
  h.run_to_completion();
  for (size_t i = 0; i < c->output.size(); ++i) EXPECT_EQ(c->output[i], fake_token(c->id, i));
  EXPECT_EQ(h.bm.num_free_blocks(), 6);
  EXPECT_EQ(h.bm.num_free_swap_slots(), 4);
}

TEST(Scheduler, SwapNeedsRoomAndAutoFollowsTheCosts) {
  struct Case {
    PreemptionMode mode;
    int32_t slots;
    PreemptionCosts costs;
    bool swapped;
  };
  const Case cases[] = {
      {PreemptionMode::kSwap, 1, {}, false},            // 2 blocks, 1 slot: recompute
      {PreemptionMode::kRecompute, 8, {}, false},       // never swaps
      {PreemptionMode::kAuto, 8, {1e-3, 1e-6}, false},  // copying costs more than 4 tokens
      {PreemptionMode::kAuto, 8, {1e-6, 1e-3}, true},   // recomputing costs more
      {PreemptionMode::kAuto, 8, {1e-6, 0.0}, false},   // no prefill measured yet
  };
  for (const Case& k : cases) {
    SchedulerConfig cfg = config(8, 64);
    cfg.preemption_mode = k.mode;
    Harness h(6, 2, cfg);
    h.bm.set_swap_slots(k.slots);
    h.sched.set_preemption_costs(k.costs);
    for (int i = 0; i < 3; ++i) h.add(3, 10);
    h.step();
    h.step();
    const ScheduledBatch batch = h.step();
    ASSERT_EQ(batch.preempted.size(), 1u);
    Request* c = batch.preempted[0];
    EXPECT_EQ(batch.num_swapped_out, k.swapped ? 1 : 0) << static_cast<int>(k.mode) << " " << k.slots;
    EXPECT_EQ(c->num_computed_tokens, k.swapped ? 4 : 0);
    EXPECT_EQ(c->swapped.empty(), !k.swapped);
    h.run_to_completion();
    EXPECT_EQ(h.bm.num_free_swap_slots(), h.bm.num_swap_slots());
  }
}

TEST(Scheduler, AbortingASwappedRequestFreesItsSlots) {
  SchedulerConfig cfg = config(8, 64);
  cfg.preemption_mode = PreemptionMode::kSwap;
  Harness h(6, 2, cfg);
  h.bm.set_swap_slots(4);
  for (int i = 0; i < 3; ++i) h.add(3, 10);
  h.step();
  h.step();
  const ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.num_swapped_out, 1);
  EXPECT_EQ(h.bm.num_free_swap_slots(), 2);
  EXPECT_TRUE(h.sched.abort(batch.preempted[0]));
  EXPECT_EQ(h.bm.num_free_swap_slots(), 4);
  EXPECT_TRUE(batch.preempted[0]->swapped.empty());
  h.run_to_completion();
}

TEST(Scheduler, SeveralPreemptionsKeepAdmissionOrderInTheQueue) {
  // 4 blocks of 2: a (1 block) grows while b, c, d (1 block each) hold the rest.
  Harness h(4, 2, config(8, 64));
  // max_tokens 6: 2 + 6 - 1 = 7 slots, so each still fits the 8-slot pool alone.
  Request* a = h.add(2, 6);
  Request* b = h.add(2, 6);
  Request* c = h.add(2, 6);
  Request* d = h.add(2, 6);
  h.step();
  EXPECT_EQ(h.bm.num_free_blocks(), 0);
  // Each needs a second block for token 3: a preempts d, b preempts c, then no one else runs.
  ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.preempted.size(), 2u);
  EXPECT_EQ(batch.preempted[0], d);
  EXPECT_EQ(batch.preempted[1], c);
  ASSERT_EQ(h.sched.waiting().size(), 2u);
  EXPECT_EQ(h.sched.waiting()[0], c);  // earliest admitted first
  EXPECT_EQ(h.sched.waiting()[1], d);
  EXPECT_EQ(h.sched.running(), (std::vector<Request*>{a, b}));
  h.run_to_completion();
  for (Request* r : {a, b, c, d}) EXPECT_EQ(r->output.size(), 6u);
}

TEST(Scheduler, RequestCanPreemptItselfWhenItIsTheMostRecent) {
  // 3 blocks of 2. a: 1 token (room left in its block); b: 4 tokens (2 full blocks).
  Harness h(3, 2, config(8, 64));
  Request* a = h.add(1, 3);
  Request* b = h.add(4, 3);
  h.step();
  EXPECT_EQ(h.bm.num_free_blocks(), 0);
  // a's token 2 fits its block; b's token 5 needs a block, and b is the back of running.
  ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(batch.seqs[0].request, a);
  ASSERT_EQ(batch.preempted.size(), 1u);
  EXPECT_EQ(batch.preempted[0], b);
  EXPECT_TRUE(batch.finished_out_of_blocks.empty());
  EXPECT_EQ(b->output.size(), 1u);
  h.run_to_completion();
  EXPECT_EQ(a->output.size(), 3u);
  EXPECT_EQ(b->output.size(), 3u);
  EXPECT_EQ(b->finish_reason, FinishReason::kLength);
}

TEST(Scheduler, NoAdmissionInAStepThatPreempted) {
  // 3 blocks of 2, budget 2. a decodes; b's prompt trickles in one token per step.
  Harness h(3, 2, config(8, 2));
  Request* a = h.add(1, 5);
  Request* b = h.add(4, 3);  // 4 + 3 - 1 = 6 slots: the whole pool
  h.step();                  // a [0,1), b [0,1)
  h.step();                  // a [1,2), b [1,2): one block each, one free
  // a takes the free block; b needs one too and is the back of running: it preempts itself. Its
  // one freed block would hold its next 1-token chunk, but re-admitting it in the same step
  // would only thrash.
  ScheduledBatch batch = h.step();
  ASSERT_EQ(batch.preempted, (std::vector<Request*>{b}));
  ASSERT_EQ(batch.seqs.size(), 1u);
  EXPECT_EQ(batch.seqs[0].request, a);
  EXPECT_EQ(b->status, RequestStatus::kWaiting);
  EXPECT_EQ(h.bm.num_free_blocks(), 1);
  batch = h.step();  // now it is admitted again
  ASSERT_NE(find_seq(batch, b), nullptr);
  EXPECT_EQ(find_seq(batch, b)->start, 0);
  h.run_to_completion();
  EXPECT_EQ(a->output.size(), 5u);
  EXPECT_EQ(b->output.size(), 3u);
}

TEST(Scheduler, SequenceLargerThanThePoolFinishesOutOfBlocks) {
  // 2 blocks of 4 = 8 slots; the request wants 6 + 10 tokens.
  Harness h(2, 4, config(8, 64));
  Request* r = h.add(6, 10);
  bool seen = false;
  for (int i = 0; i < 100 && h.sched.has_unfinished(); ++i) {
    ScheduledBatch b = h.step();
    if (!b.finished_out_of_blocks.empty()) {
      ASSERT_EQ(b.finished_out_of_blocks.size(), 1u);
      EXPECT_EQ(b.finished_out_of_blocks[0], r);
      seen = true;
    }
  }
  EXPECT_TRUE(seen);
  EXPECT_FALSE(h.sched.has_unfinished());
  EXPECT_TRUE(r->finished());
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(r->output.size(), 3u);  // tokens 7 and 8 fit, the 9th slot does not
  EXPECT_TRUE(r->block_tables.empty());
  EXPECT_EQ(h.bm.num_free_blocks(), 2);
  EXPECT_EQ(h.bm.used_slots(), 0);
}

TEST(Scheduler, PromptLargerThanThePoolNeverBlocksTheQueue) {
  for (bool chunked : {true, false}) {
    Harness h(2, 4, config(8, 64, chunked));
    Request* big = h.add(20, 4);
    Request* small = h.add(3, 2);
    h.run_to_completion(100);
    EXPECT_EQ(big->finish_reason, FinishReason::kLength);
    EXPECT_TRUE(big->output.empty());
    EXPECT_EQ(small->output.size(), 2u);
    EXPECT_EQ(h.bm.num_free_blocks(), 2);
  }
}

TEST(Scheduler, ChunkedPromptLargerThanThePoolTerminates) {
  // Small budget: the prompt is admitted chunk by chunk, then cannot grow even alone.
  Harness h(2, 4, config(8, 3));
  Request* r = h.add(20, 4);
  h.run_to_completion(100);
  EXPECT_EQ(r->finish_reason, FinishReason::kLength);
  EXPECT_EQ(h.bm.num_free_blocks(), 2);
}

TEST(Scheduler, EmptyPoolFinishesEverything) {
  Harness h(0, 4, config(8, 64));
  Request* a = h.add(1, 1);
  Request* b = h.add(5, 1);
  ScheduledBatch batch = h.step();
  EXPECT_TRUE(batch.seqs.empty());
  EXPECT_EQ(batch.finished_out_of_blocks, (std::vector<Request*>{a, b}));
  EXPECT_FALSE(h.sched.has_unfinished());
}

TEST(Scheduler, AbortWaitingRunningAndMidPrefill) {
  Harness h(32, 4, config(2, 8));
  Request* running = h.add(3, 50);
  Request* prefill = h.add(40, 5);
  Request* waiting = h.add(3, 5);
  h.step();
  h.step();
  ASSERT_EQ(running->status, RequestStatus::kRunning);
  ASSERT_EQ(prefill->status, RequestStatus::kRunning);
  ASSERT_GT(prefill->num_computed_tokens, 0);
  ASSERT_LT(prefill->num_computed_tokens, 40);
  ASSERT_EQ(waiting->status, RequestStatus::kWaiting);

  EXPECT_TRUE(h.sched.abort(prefill));
  EXPECT_TRUE(prefill->finished());
  EXPECT_EQ(prefill->finish_reason, FinishReason::kAbort);
  EXPECT_TRUE(prefill->block_tables.empty());
  EXPECT_FALSE(h.sched.abort(prefill));  // no longer known
  h.check();

  EXPECT_TRUE(h.sched.abort(waiting));
  EXPECT_EQ(waiting->finish_reason, FinishReason::kAbort);
  EXPECT_EQ(h.sched.num_waiting(), 0u);
  h.check();

  EXPECT_TRUE(h.sched.abort(running));
  EXPECT_FALSE(h.sched.has_unfinished());
  EXPECT_EQ(h.bm.num_free_blocks(), 32);
  EXPECT_EQ(h.bm.used_slots(), 0);
  h.check();

  auto stranger = make_request(99, 3, 1);
  EXPECT_FALSE(h.sched.abort(stranger.get()));
  EXPECT_FALSE(stranger->finished());
  EXPECT_FALSE(h.sched.abort(nullptr));
}

TEST(Scheduler, AbortBetweenScheduleAndStepDoneIsSafe) {
  Harness h(16, 4, config(4, 64));
  Request* a = h.add(5, 5);
  Request* b = h.add(5, 5);
  ScheduledBatch batch = h.sched.schedule();
  EXPECT_TRUE(h.sched.abort(a));
  h.sched.on_step_done(batch);  // must skip the aborted one
  EXPECT_EQ(b->num_computed_tokens, 5);
  EXPECT_EQ(a->finish_reason, FinishReason::kAbort);
  h.check();
}

TEST(Scheduler, FinishFromEitherQueueFreesAndKeepsTheFirstReason) {
  Harness h(16, 4, config(1, 64));
  Request* a = h.add(5, 5);
  Request* b = h.add(5, 5);
  h.step();
  h.sched.finish(b, FinishReason::kStop);  // still waiting (max_num_seqs 1)
  EXPECT_EQ(b->finish_reason, FinishReason::kStop);
  EXPECT_EQ(h.sched.num_waiting(), 0u);
  h.sched.finish(a, FinishReason::kStop);
  EXPECT_TRUE(a->block_tables.empty());
  h.sched.finish(a, FinishReason::kLength);  // second finish is a no-op
  EXPECT_EQ(a->finish_reason, FinishReason::kStop);
  EXPECT_EQ(h.bm.num_free_blocks(), 16);
  h.check();
}

TEST(Scheduler, StepDoneKeepsTheTableInSync) {
  Harness h(16, 4, config(4, 4));
  Request* r = h.add(10, 3);
  for (int i = 0; i < 5 && !r->finished(); ++i) {
    ScheduledBatch b = h.sched.schedule();
    ASSERT_EQ(b.seqs.size(), 1u);
    EXPECT_EQ(r->block_tables.num_tokens(), b.seqs[0].start + b.seqs[0].num_new_tokens);
    h.sched.on_step_done(b);
    EXPECT_EQ(r->num_computed_tokens, r->block_tables.num_tokens());
    if (b.seqs[0].sample) r->output.push_back(7);
  }
}

// ---- randomized: a fake engine drives admit / grow / finish / abort / preempt ------------------

// One random configuration (tiny pools included) run to completion, checked after every step.
// windows: a full-attention pool and a sliding window's (its own size), some with prefix caching.
class SchedulerFuzz {
 public:
  explicit SchedulerFuzz(uint64_t seed, bool windows = false) : seed_(seed), rng_(seed) {
    const int32_t blocks[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 256};
    const int32_t sizes[] = {1, 2, 3, 4, 8, 16};
    const int32_t seqs[] = {1, 2, 3, 4, 8, 32};
    const int32_t budgets[] = {1, 2, 3, 5, 8, 16, 64, 512};
    cfg_.max_num_seqs = pick(seqs);
    cfg_.max_num_batched_tokens = pick(budgets);
    cfg_.enable_chunked_prefill = rng_() % 4 != 0;
    if (windows) {
      const int32_t wins[] = {1, 2, 5, 9, 17, 40};
      const int32_t bs = pick(sizes);
      window_ = pick(wins);
      bm_ = std::make_unique<BlockManager>(
          std::vector<BlockPoolSpec>{{pick(blocks), 0}, {pick(blocks), window_}}, bs, rng_() % 3 == 0);
    } else {
      bm_ = std::make_unique<BlockManager>(pick(blocks), pick(sizes), rng_() % 3 == 0);
    }
    // Swap space in half the runs (a few slots to many), under every preemption mode; kAuto's
    // costs are drawn too, so both of its answers come up.
    if (rng_() % 2 == 0) {
      const int32_t slots[] = {1, 2, 4, 16, 256};
      bm_->set_swap_slots(pick(slots));
      cfg_.preemption_mode = static_cast<PreemptionMode>(rng_() % 3);
    }
    sched_ = std::make_unique<Scheduler>(cfg_, bm_.get());
    sched_->set_preemption_costs({1e-6 * (rng_() % 100), 1e-6 * (rng_() % 20)});
    for (int k = 0; k < bm_->num_kinds(); ++k) {
      kv_.emplace_back(static_cast<size_t>(bm_->pool(k).num_blocks()) * bm_->block_size(), -1);
      swap_.emplace_back(static_cast<size_t>(bm_->num_swap_slots() / bm_->num_kinds()) * bm_->block_size(),
                         -1);
    }
    num_requests_ = 20 + static_cast<int>(rng_() % 60);
    // Half the runs never abort: aborts would also end a livelocked request and hide the bug.
    abort_percent_ = seed % 2 == 0 ? 0 : 3;
  }

  int64_t run() {
    int64_t steps = 0;
    while (static_cast<int>(reqs_.size()) < num_requests_ || sched_->has_unfinished()) {
      step();
      if (::testing::Test::HasFatalFailure()) return steps;
      if (++steps > 200000) {
        ADD_FAILURE() << where() << "did not terminate";
        return steps;
      }
    }
    check_final();
    return steps;
  }

  // What this run exercised, so the test can insist the hard paths were actually taken.
  struct Coverage {
    int64_t preemptions = 0, out_of_blocks = 0, aborts = 0, stops = 0, chunked = 0, swap_ins = 0;
  };
  Coverage coverage() const {
    return {sched_->num_preemptions(),
            static_cast<int64_t>(out_of_blocks_.size()),
            static_cast<int64_t>(aborted_.size()),
            static_cast<int64_t>(stopped_.size()),
            chunks_,
            sched_->num_swap_ins()};
  }

 private:
  template <size_t N>
  int32_t pick(const int32_t (&a)[N]) {
    return a[rng_() % N];
  }
  bool chance(int percent) { return static_cast<int>(rng_() % 100) < percent; }
  std::string where() const {
    return "seed " + std::to_string(seed_) + " blocks " + std::to_string(bm_->pool(0).num_blocks()) +
           (window_ ? " + " + std::to_string(bm_->pool(1).num_blocks()) + " (window " +
                          std::to_string(window_) + ")"
                    : std::string()) +
           "x" + std::to_string(bm_->block_size()) + " seqs " + std::to_string(cfg_.max_num_seqs) +
           " budget " + std::to_string(cfg_.max_num_batched_tokens) + ": ";
  }

  void step() {
    if (static_cast<int>(reqs_.size()) < num_requests_ && (chance(30) || !sched_->has_unfinished())) {
      const int n = 1 + static_cast<int>(rng_() % 3);
      for (int i = 0; i < n && static_cast<int>(reqs_.size()) < num_requests_; ++i) add();
    }
    if (chance(abort_percent_)) abort_random();
    const bool had_work = sched_->has_unfinished();
    std::vector<RequestStatus> before;
    for (const auto& r : reqs_) before.push_back(r->status);

    ScheduledBatch batch = sched_->schedule();
    if (had_work) {
      ASSERT_TRUE(!batch.seqs.empty() || !batch.preempted.empty() || !batch.finished_out_of_blocks.empty())
          << where() << "no progress";
    }
    check_batch(batch);
    check_queues_after_schedule(batch, before);
    run_on_fake_kv(batch);
    if (::testing::Test::HasFatalFailure()) return;
    if (chance(abort_percent_) && !batch.seqs.empty()) {  // abort while the step is "on the device"
      Request* r = batch.seqs[rng_() % batch.seqs.size()].request;
      ASSERT_TRUE(sched_->abort(r));
      aborted_.insert(r);
    }
    sched_->on_step_done(batch);
    sample(batch);
    check_state();
  }

  void add() {
    const int32_t prompt = 1 + static_cast<int32_t>(rng_() % (chance(30) ? 64 : 12));
    const int32_t max_tokens = 1 + static_cast<int32_t>(rng_() % 24);
    reqs_.push_back(make_request(reqs_.size(), prompt, max_tokens));
    admit_seq_.push_back(0);
    sched_->add(reqs_.back().get());
  }

  void abort_random() {
    Request* r = reqs_.empty() ? nullptr : reqs_[rng_() % reqs_.size()].get();
    if (r == nullptr) return;
    const bool was_live = !r->finished();
    ASSERT_EQ(sched_->abort(r), was_live) << where();
    if (was_live) aborted_.insert(r);
  }

  // The KV the model would read and write, as the token each slot holds: the step's copies in
  // list order (in the pool, to swap, from swap), then every scheduled sequence must find its
  // earlier tokens in the slots its tables name (where its queries can see them), then the
  // "forward" writes the chunk's tokens. So a swap, a copy-on-write or a prefix hit that served
  // the wrong KV fails here.
  void run_on_fake_kv(const ScheduledBatch& b) {
    const int32_t bs = bm_->block_size();
    auto copy = [bs](const std::vector<int32_t>& from, int32_t src, std::vector<int32_t>& to, int32_t dst) {
      std::copy_n(from.begin() + int64_t{src} * bs, bs, to.begin() + int64_t{dst} * bs);
    };
    for (const BlockCopy& c : b.block_copies) {
      if (c.where == BlockCopy::kInPool) copy(kv_[c.kind], c.src, kv_[c.kind], c.dst);
      if (c.where == BlockCopy::kToSwap) copy(kv_[c.kind], c.src, swap_[c.kind], c.dst);
      if (c.where == BlockCopy::kFromSwap) copy(swap_[c.kind], c.src, kv_[c.kind], c.dst);
    }
    for (const ScheduledSeq& s : b.seqs) {
      const Request* r = s.request;
      for (int k = 0; k < bm_->num_kinds(); ++k) {
        const BlockTable& t = r->block_tables.kinds[k];
        const int32_t first = bm_->first_needed_block(k, s.start) * bs;
        for (int32_t p = first; p < s.start; ++p) {
          const int32_t blk = t.blocks[p / bs];
          ASSERT_GE(blk, 0) << where() << "request " << r->id << " position " << p << " was dropped";
          ASSERT_EQ(kv_[k][int64_t{blk} * bs + p % bs], r->token_at(p))
              << where() << "request " << r->id << " kind " << k << " position " << p << " of " << s.start;
        }
        for (int32_t p = s.start; p < s.start + s.num_new_tokens; ++p)
          kv_[k][int64_t{t.blocks[p / bs]} * bs + p % bs] = r->token_at(p);
      }
    }
  }

  // The fake engine: one token per sampled chunk; finish at max_tokens or, rarely, on "EOS".
  void sample(const ScheduledBatch& batch) {
    for (const ScheduledSeq& s : batch.seqs) {
      Request* r = s.request;
      if (!s.sample || r->finished()) continue;
      r->output.push_back(fake_token(r->id, r->output.size()));
      if (static_cast<int32_t>(r->output.size()) >= r->params.max_tokens) {
        sched_->finish(r, FinishReason::kLength);
      } else if (chance(2)) {
        sched_->finish(r, FinishReason::kStop);
        stopped_.insert(r);
      }
    }
  }

  void check_batch(const ScheduledBatch& b) {
    ASSERT_LE(b.num_tokens, cfg_.max_num_batched_tokens) << where();
    ASSERT_LE(static_cast<int32_t>(b.seqs.size()), cfg_.max_num_seqs) << where();
    int32_t sum = 0, decode = 0;
    bool seen_prefill = false;
    std::set<const Request*> seen;
    for (const ScheduledSeq& s : b.seqs) {
      const Request* r = s.request;
      ASSERT_TRUE(seen.insert(r).second) << where() << "request scheduled twice";
      ASSERT_EQ(r->status, RequestStatus::kRunning) << where();
      ASSERT_GE(s.num_new_tokens, 1) << where();
      ASSERT_EQ(s.start, r->num_computed_tokens) << where();
      ASSERT_LE(s.start + s.num_new_tokens, r->num_tokens()) << where();
      ASSERT_EQ(s.sample, s.start + s.num_new_tokens == r->num_tokens()) << where();
      ASSERT_EQ(r->block_tables.num_tokens(), s.start + s.num_new_tokens) << where();
      const bool is_decode = s.start >= static_cast<int32_t>(r->prompt.size());
      ASSERT_FALSE(is_decode && seen_prefill) << where() << "decode after a prefill chunk";
      seen_prefill |= !is_decode;
      sum += s.num_new_tokens;
      decode += is_decode ? s.num_new_tokens : 0;
      chunks_ += (!s.sample && s.start == 0) ? 1 : 0;
    }
    ASSERT_EQ(sum, b.num_tokens) << where();
    ASSERT_EQ(decode, b.num_decode_tokens) << where();
    ASSERT_EQ(sum - decode, b.num_prefill_tokens) << where();
    for (Request* r : b.finished_out_of_blocks) {
      ASSERT_EQ(r->finish_reason, FinishReason::kLength) << where();
      // Only a sequence that cannot fit even a whole pool may be cut short.
      bool too_big = false;
      for (int k = 0; k < bm_->num_kinds(); ++k)
        too_big |= bm_->peak_blocks(k, r->num_tokens(), cfg_.max_num_batched_tokens) >
                   bm_->pool(k).num_blocks();
      ASSERT_TRUE(too_big) << where();
      ASSERT_TRUE(out_of_blocks_.insert(r).second) << where() << "finished twice";
    }
  }

  // Admission, preemption victims and queue order, against the statuses before schedule().
  void check_queues_after_schedule(const ScheduledBatch& b, const std::vector<RequestStatus>& before) {
    for (size_t i = 0; i < reqs_.size(); ++i) {
      Request* r = reqs_[i].get();
      if (before[i] != RequestStatus::kWaiting || r->status != RequestStatus::kRunning) continue;
      ASSERT_TRUE(b.preempted.empty()) << where() << "admitted in a step that preempted";
      admit_seq_[i] = ++next_admit_;
      const ScheduledSeq* s = find_seq(b, r);
      ASSERT_NE(s, nullptr) << where();
      // From 0, or (prefix caching) after the whole blocks found cached, or where a swapped
      // sequence left off.
      if (!swapped_before_.count(r)) {
        ASSERT_EQ(s->start % bm_->block_size(), 0) << where();
        ASSERT_TRUE(s->start == 0 || bm_->prefix_caching()) << where();
      }
      const int32_t whole = r->num_tokens() - s->start;
      if (!cfg_.enable_chunked_prefill && whole <= cfg_.max_num_batched_tokens) {
        ASSERT_EQ(s->num_new_tokens, whole) << where() << "prompt chunked with chunking off";
      }
    }
    const auto& waiting = sched_->waiting();
    ASSERT_GE(waiting.size(), b.preempted.size()) << where();
    for (size_t k = 0; k < b.preempted.size(); ++k) {
      Request* p = b.preempted[k];
      ASSERT_EQ(before[p->id], RequestStatus::kRunning) << where();
      ASSERT_EQ(waiting[b.preempted.size() - 1 - k], p) << where() << "preempted not at the head";
      ASSERT_TRUE(p->block_tables.empty()) << where();
      if (cfg_.preemption_mode == PreemptionMode::kRecompute || bm_->num_swap_slots() == 0) {
        ASSERT_TRUE(p->swapped.empty()) << where() << "swapped without swap space";
      }
      for (const Request* r : sched_->running()) {  // victims are the most recent admissions
        ASSERT_GT(admit_seq_[p->id], admit_seq_[r->id]) << where();
      }
    }
  }

  void check_state() {
    std::vector<const BlockTables*> tables;
    std::vector<const SwappedTables*> swapped;
    int64_t used = 0;
    for (const auto& r : reqs_) tables.push_back(&r->block_tables);
    for (const auto& r : reqs_) swapped.push_back(&r->swapped);
    ASSERT_NO_THROW(bm_->check_invariants(tables, &swapped)) << where();
    swapped_before_.clear();
    for (const Request* r : sched_->waiting())
      if (!r->swapped.empty()) swapped_before_.insert(r);
    std::set<const Request*> queued(sched_->waiting().begin(), sched_->waiting().end());
    ASSERT_EQ(queued.size(), sched_->num_waiting()) << where();
    ASSERT_LE(static_cast<int32_t>(sched_->num_running()), cfg_.max_num_seqs) << where();
    for (const Request* r : sched_->running()) {
      ASSERT_TRUE(queued.insert(r).second) << where() << "request in two queues";
      ASSERT_EQ(r->status, RequestStatus::kRunning) << where();
      ASSERT_EQ(r->block_tables.num_tokens(), r->num_computed_tokens) << where();
      ASSERT_LE(r->num_computed_tokens, r->num_tokens()) << where();
      const int64_t alloc = static_cast<int64_t>(r->block_tables.kinds[0].blocks.size()) * bm_->block_size();
      ASSERT_LE(r->block_tables.num_tokens(), alloc) << where();
      ASSERT_LT(alloc, r->block_tables.num_tokens() + bm_->block_size()) << where();
      used += r->block_tables.num_tokens();
      if (window_) {  // the window pool holds only what the next query sees
        const BlockTable& w = r->block_tables.kinds[1];
        ASSERT_EQ(w.num_dropped, bm_->first_needed_block(1, r->num_computed_tokens)) << where();
        ASSERT_LE(w.num_live(), bm_->peak_blocks(1, r->num_tokens(), 1)) << where();
      }
    }
    // Shared prefix blocks count once.
    if (bm_->prefix_caching()) ASSERT_LE(bm_->pool(0).used_slots(), used) << where();
    else ASSERT_EQ(bm_->pool(0).used_slots(), used) << where();
    for (const auto& r : reqs_) {  // no request lost: each is queued xor finished
      ASSERT_NE(queued.count(r.get()) != 0, r->finished()) << where() << "request " << r->id;
      if (r->status == RequestStatus::kWaiting) {
        ASSERT_EQ(r->num_computed_tokens, r->swapped.num_tokens()) << where();
        ASSERT_TRUE(r->block_tables.empty()) << where();
      } else {
        ASSERT_TRUE(r->swapped.empty()) << where() << "request " << r->id << " holds swap slots";
      }
    }
  }

  void check_final() {
    for (const auto& r : reqs_) {
      ASSERT_TRUE(r->finished()) << where();
      ASSERT_TRUE(r->block_tables.empty()) << where();
      for (size_t i = 0; i < r->output.size(); ++i) {
        ASSERT_EQ(r->output[i], fake_token(r->id, i)) << where() << "output lost or reordered";
      }
      if (aborted_.count(r.get())) {
        ASSERT_EQ(r->finish_reason, FinishReason::kAbort) << where();
      } else if (stopped_.count(r.get())) {
        ASSERT_EQ(r->finish_reason, FinishReason::kStop) << where();
      } else if (out_of_blocks_.count(r.get())) {
        ASSERT_EQ(r->finish_reason, FinishReason::kLength) << where();
      } else {
        ASSERT_EQ(r->finish_reason, FinishReason::kLength) << where();
        ASSERT_EQ(static_cast<int32_t>(r->output.size()), r->params.max_tokens) << where();
      }
    }
    ASSERT_EQ(bm_->num_free_blocks(), bm_->num_blocks()) << where();
    ASSERT_EQ(bm_->used_slots(), 0) << where();
    ASSERT_EQ(bm_->num_free_swap_slots(), bm_->num_swap_slots()) << where();
  }

  uint64_t seed_;
  std::mt19937_64 rng_;
  SchedulerConfig cfg_;
  int32_t window_ = 0;
  std::unique_ptr<BlockManager> bm_;
  std::unique_ptr<Scheduler> sched_;
  int num_requests_ = 0;
  int abort_percent_ = 0;
  std::vector<std::unique_ptr<Request>> reqs_;  // index == id
  std::vector<uint64_t> admit_seq_;             // by id: order of the latest admission
  uint64_t next_admit_ = 0;
  int64_t chunks_ = 0;  // first chunks of a split prefill
  std::set<const Request*> aborted_, stopped_, out_of_blocks_;
  std::set<const Request*> swapped_before_;      // waiting with swapped KV before this schedule()
  std::vector<std::vector<int32_t>> kv_, swap_;  // per kind: the token each slot holds
};

TEST(SchedulerRandomized, InvariantsHoldAcrossManyConfigs) {
  int64_t total_steps = 0;
  SchedulerFuzz::Coverage sum;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    SchedulerFuzz fuzz(seed);
    total_steps += fuzz.run();
    if (HasFailure()) break;
    const SchedulerFuzz::Coverage c = fuzz.coverage();
    sum.preemptions += c.preemptions;
    sum.out_of_blocks += c.out_of_blocks;
    sum.aborts += c.aborts;
    sum.stops += c.stops;
    sum.chunked += c.chunked;
    sum.swap_ins += c.swap_ins;
  }
  EXPECT_GT(total_steps, 5000);
  EXPECT_GT(sum.preemptions, 100);
  EXPECT_GT(sum.out_of_blocks, 10);
  EXPECT_GT(sum.aborts, 100);
  EXPECT_GT(sum.stops, 10);
  EXPECT_GT(sum.chunked, 100);
  EXPECT_GT(sum.swap_ins, 100);
  std::printf(
      "randomized: %lld steps, %lld preemptions, %lld out of blocks, %lld aborts, %lld stops, "
      "%lld split prefills, %lld swap-ins\n",
      static_cast<long long>(total_steps), static_cast<long long>(sum.preemptions),
      static_cast<long long>(sum.out_of_blocks), static_cast<long long>(sum.aborts),
      static_cast<long long>(sum.stops), static_cast<long long>(sum.chunked),
      static_cast<long long>(sum.swap_ins));
}

// The same rules with a window kind beside the full one (and prefix caching in a third of the
// runs): every kind all or nothing, the window pool only ever holding what the next query sees.
TEST(SchedulerRandomized, InvariantsHoldWithAWindowKind) {
  int64_t total_steps = 0, preemptions = 0, out_of_blocks = 0, swap_ins = 0;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    SchedulerFuzz fuzz(seed, /*windows=*/true);
    total_steps += fuzz.run();
    if (HasFailure()) break;
    preemptions += fuzz.coverage().preemptions;
    out_of_blocks += fuzz.coverage().out_of_blocks;
    swap_ins += fuzz.coverage().swap_ins;
  }
  EXPECT_GT(total_steps, 3000);
  EXPECT_GT(preemptions, 50);
  EXPECT_GT(swap_ins, 20);
  EXPECT_GT(out_of_blocks, 5);
}

}  // namespace
}  // namespace fantai::engine
