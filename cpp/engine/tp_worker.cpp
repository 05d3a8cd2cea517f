// engine: the step's wire format between tensor-parallel ranks and the worker loop of ranks > 0.
#include "engine/tp_worker.h"

#include <cstring>
#include <functional>
#include <string>

#include "common/check.h"
#include "common/logging.h"
#include "engine/model_runner.h"

namespace fantai::engine {
namespace {

enum : int64_t { kOpStep = 1, kOpStop = 2, kOpRelease = 3, kOpCopies = 4 };
// op, num_tokens, num_seqs, max_blocks_per_seq, num_copies, max_query_len, max_context_len, bytes,
// num_kv_kinds, num_logits
constexpr int kHeader = 10;
// num_kinds, block_size, kv dtype, fingerprint, blocks per kind, then swap slots per kind
constexpr int kHandshake = 5 + model::kMaxKvKinds;
constexpr int kCopyInts = 4;  // kind, src, dst, where
// Same checkpoint, dtype, quantization and config on every rank: the config's summary and the
// bits of the (replicated) final norm.
int64_t fingerprint(model::Model& m) {
  std::string s = m.full_config().summary() + "|" + dtype_name(m.dtype()) + "|" + m.weights().quantization();
  const Buffer& norm = m.weights().final_norm();
  std::string bytes(norm.bytes(), '\0');
  m.backend()->download(bytes.data(), norm.data(), norm.bytes());
  return static_cast<int64_t>(std::hash<std::string>{}(s) ^ (std::hash<std::string>{}(bytes) * 31));
}

// Every rank reports whether it agrees; the sum says whether anyone did not.
void agree(Communicator& comm, bool ok, const std::string& what) {
  float bad = ok ? 0.0f : 1.0f;
  comm.all_reduce_sum(&bad, 1);
  FANTAI_REQUIRE(bad == 0.0f, "tensor-parallel ranks disagree: " << what
                                                                 << " (every rank must be started with "
                                                                 << "the same model and options)");
}

// Each kind's slots first (8-byte aligned in the buffer), tokens and positions, the shared query
// layout, each kind's block tables, then the block copies as (kind, src, dst, where).
size_t payload_bytes(const int64_t* h) {
  const int64_t n = h[1], seqs = h[2], blocks = h[3], copies = h[4], kinds = h[8], logits = h[9];
  return static_cast<size_t>(kinds * n) * sizeof(int64_t) +
         static_cast<size_t>(2 * n + (seqs + 1) + seqs + kinds * seqs * blocks + kCopyInts * copies +
                             logits) *
             sizeof(int32_t);
}

}  // namespace

namespace {

// The copies as kCopyInts int32 each, the wire's order.
void put_copies(const std::vector<BlockCopy>& copies, std::vector<int32_t>* out) {
  for (const BlockCopy& c : copies)
    out->insert(out->end(), {c.kind, c.src, c.dst, static_cast<int32_t>(c.where)});
}

std::vector<BlockCopy> take_copies(const int32_t* t, int64_t n) {
  std::vector<BlockCopy> copies(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i, t += kCopyInts) {
    FANTAI_CHECK(t[3] >= BlockCopy::kInPool && t[3] <= BlockCopy::kFromSwap, "bad block copy from rank 0");
    copies[i] = {t[0], t[1], t[2], static_cast<BlockCopy::Where>(t[3])};
  }
  return copies;
}

}  // namespace

void tp_handshake_leader(model::Model& m, const std::vector<int32_t>& num_blocks, int32_t block_size,
                         DType kv_dtype, int32_t swap_slots) {
  Communicator& comm = m.backend()->communicator();
  const int kinds = static_cast<int>(num_blocks.size());
  FANTAI_CHECK(kinds >= 1 && kinds <= model::kMaxKvKinds, "bad number of KV kinds " << kinds);
  int64_t hs[kHandshake] = {kinds, block_size, static_cast<int64_t>(kv_dtype), fingerprint(m)};
  for (int k = 0; k < kinds; ++k) hs[4 + k] = num_blocks[k];
  hs[4 + model::kMaxKvKinds] = swap_slots;
  comm.broadcast(hs, sizeof hs, 0, true);  // idle: the other ranks may still be loading
  agree(comm, true, "model or options");
  comm.steps_owner().steps_state = Communicator::kStepsRunning;
}

void tp_send_step(model::Model& m, const model::ForwardBatch& fb,
                  const std::vector<BlockCopy>& block_copies) {
  Communicator& comm = m.backend()->communicator();
  const AttentionParams& a = fb.attn[0];
  const int kinds = fb.num_kv_kinds;
  int64_t h[kHeader] = {kOpStep,
                        fb.num_tokens,
                        a.num_seqs,
                        a.max_blocks_per_seq,
                        static_cast<int64_t>(block_copies.size()),
                        a.max_query_len,
                        a.max_context_len,
                        0,
                        kinds,
                        fb.num_logits};
  h[7] = static_cast<int64_t>(payload_bytes(h));
  comm.broadcast(h, sizeof h, 0);
  std::vector<char> p(static_cast<size_t>(h[7]));
  char* w = p.data();
  auto put = [&](const void* src, size_t bytes) {
    std::memcpy(w, src, bytes);
    w += bytes;
  };
  const size_t n = fb.num_tokens, seqs = a.num_seqs;
  for (int k = 0; k < kinds; ++k) put(fb.slot_mapping[k], n * sizeof(int64_t));
  put(fb.token_ids, n * sizeof(int32_t));
  put(fb.positions, n * sizeof(int32_t));
  put(a.cu_seqlens_q, (seqs + 1) * sizeof(int32_t));
  put(a.context_lens, seqs * sizeof(int32_t));
  for (int k = 0; k < kinds; ++k) {
    // Every kind shares the queries and the block-table width (ModelRunner::prepare).
    FANTAI_CHECK(fb.attn[k].max_blocks_per_seq == a.max_blocks_per_seq,
                 "KV kinds with different table widths");
    put(fb.attn[k].block_tables, seqs * a.max_blocks_per_seq * sizeof(int32_t));
  }
  std::vector<int32_t> copies;
  put_copies(block_copies, &copies);
  put(copies.data(), copies.size() * sizeof(int32_t));
  if (fb.num_logits > 0) put(fb.logits_indices, fb.num_logits * sizeof(int32_t));
  comm.broadcast(p.data(), static_cast<int64_t>(p.size()), 0);
}

// Copies alone: h[1] copies, h[7] their bytes.
void tp_send_copies(model::Model& m, const std::vector<BlockCopy>& block_copies) {
  Communicator& comm = m.backend()->communicator();
  std::vector<int32_t> t;
  put_copies(block_copies, &t);
  const int64_t n = static_cast<int64_t>(block_copies.size());
  int64_t h[kHeader] = {kOpCopies, n, 0, 0, 0, 0, 0, static_cast<int64_t>(t.size() * sizeof(int32_t)), 0, 0};
  comm.broadcast(h, sizeof h, 0);
  if (n > 0) comm.broadcast(t.data(), h[7], 0);
}

// A release: h[1] runs of (kind, first, count), h[7] their bytes.
void tp_send_release(model::Model& m, const std::vector<int32_t>& runs) {
  Communicator& comm = m.backend()->communicator();
  if (comm.steps_owner().steps_state != Communicator::kStepsRunning) return;
  const int64_t n = static_cast<int64_t>(runs.size() / 3);
  int64_t h[kHeader] = {kOpRelease, n, 0, 0, 0, 0, 0, n * 3 * static_cast<int64_t>(sizeof(int32_t)), 0, 0};
  comm.broadcast(h, sizeof h, 0);
  if (n > 0) comm.broadcast(const_cast<int32_t*>(runs.data()), h[7], 0);
}

void tp_send_stop(model::Model& m) { tp_stop_group(m.backend()->communicator()); }

void tp_stop_group(Communicator& comm) {
  int running = Communicator::kStepsRunning;
  if (comm.rank() != 0 ||
      !comm.steps_owner().steps_state.compare_exchange_strong(running, Communicator::kStepsStopped))
    return;
  int64_t h[kHeader] = {kOpStop, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  comm.broadcast(h, sizeof h, 0);
}

void run_tp_worker(const std::shared_ptr<model::Model>& m) {
  Communicator& comm = m->backend()->communicator();
  FANTAI_REQUIRE(comm.rank() > 0, "the worker loop is for tensor-parallel ranks > 0");
  int64_t hs[kHandshake] = {};
  comm.broadcast(hs, sizeof hs, 0, true);
  agree(comm, hs[3] == fingerprint(*m), "model or options");
  comm.steps_owner().steps_state = Communicator::kStepsRunning;
  const std::vector<int32_t> windows = model::KVCache::kind_windows(m->config());
  FANTAI_CHECK(hs[0] == static_cast<int64_t>(windows.size()),
               "rank 0 has " << hs[0] << " KV kinds, this rank " << windows.size());
  const std::vector<int32_t> num_blocks(hs + 4, hs + 4 + hs[0]);
  model::KVCache cache(m->config(), num_blocks, static_cast<int32_t>(hs[1]), static_cast<DType>(hs[2]),
                       m->backend());
  cache.reserve_swap(static_cast<int32_t>(hs[4 + model::kMaxKvKinds]), m->backend());
  std::string pools;
  for (int32_t b : num_blocks) pools += (pools.empty() ? "" : " + ") + std::to_string(b);
  FANTAI_LOG(kInfo, "tensor-parallel rank " << comm.rank() << " of " << comm.world_size() << ": KV pool "
                                            << pools << " blocks, " << cache.bytes() / (1 << 20) << " MiB");
  std::vector<char> p;
  for (;;) {
    int64_t h[kHeader];
    comm.broadcast(h, sizeof h, 0, true);
    if (h[0] == kOpStop) {
      comm.steps_owner().steps_state = Communicator::kStepsStopped;
      return;
    }
    if (h[0] == kOpRelease) {
      FANTAI_CHECK(h[7] == h[1] * 3 * static_cast<int64_t>(sizeof(int32_t)),
                   "bad release header from rank 0");
      std::vector<int32_t> runs(static_cast<size_t>(3 * h[1]));
      if (h[1] > 0) comm.broadcast(runs.data(), h[7], 0);
      for (size_t i = 0; i + 2 < runs.size(); i += 3) {
        if (runs[i] >= model::kMaxKvKinds) {  // swap slots (Engine::release_memory)
          cache.release_swap_slots(runs[i] - model::kMaxKvKinds, runs[i + 1], runs[i + 2], m->backend());
        } else {
          cache.release_blocks(runs[i], runs[i + 1], runs[i + 2], m->backend());
        }
      }
      continue;
    }
    if (h[0] == kOpCopies) {
      FANTAI_CHECK(h[7] == h[1] * kCopyInts * static_cast<int64_t>(sizeof(int32_t)),
                   "bad copies header from rank 0");
      std::vector<int32_t> t(static_cast<size_t>(kCopyInts * h[1]));
      if (h[1] > 0) comm.broadcast(t.data(), h[7], 0);
      apply_block_copies(cache, take_copies(t.data(), h[1]), m->backend());
      continue;
    }
    FANTAI_CHECK(h[0] == kOpStep && h[7] == static_cast<int64_t>(payload_bytes(h)),
                 "bad step header from rank 0");
    p.resize(static_cast<size_t>(h[7]));
    comm.broadcast(p.data(), h[7], 0);
    const char* r = p.data();
    auto take = [&](size_t bytes) {
      const char* at = r;
      r += bytes;
      return at;
    };
    const size_t n = h[1], seqs = h[2];
    const int kinds = static_cast<int>(h[8]);
    FANTAI_CHECK(kinds == cache.num_kinds(), "bad KV kind count from rank 0");
    model::ForwardBatch fb;
    fb.num_tokens = static_cast<int32_t>(n);
    fb.num_kv_kinds = kinds;
    for (int k = 0; k < kinds; ++k)
      fb.slot_mapping[k] = reinterpret_cast<const int64_t*>(take(n * sizeof(int64_t)));
    fb.token_ids = reinterpret_cast<const int32_t*>(take(n * sizeof(int32_t)));
    fb.positions = reinterpret_cast<const int32_t*>(take(n * sizeof(int32_t)));
    const int32_t* cu_seqlens = reinterpret_cast<const int32_t*>(take((seqs + 1) * sizeof(int32_t)));
    const int32_t* context_lens = reinterpret_cast<const int32_t*>(take(seqs * sizeof(int32_t)));
    for (int k = 0; k < kinds; ++k) {
      AttentionParams& a = fb.attn[k];
      a.num_seqs = static_cast<int32_t>(seqs);
      a.num_tokens = fb.num_tokens;
      a.max_query_len = static_cast<int32_t>(h[5]);
      a.max_context_len = static_cast<int32_t>(h[6]);
      a.max_blocks_per_seq = static_cast<int32_t>(h[3]);
      a.cu_seqlens_q = cu_seqlens;
      a.context_lens = context_lens;
      a.block_tables = reinterpret_cast<const int32_t*>(take(seqs * a.max_blocks_per_seq * sizeof(int32_t)));
    }
    const int32_t* copies = reinterpret_cast<const int32_t*>(take(kCopyInts * h[4] * sizeof(int32_t)));
    apply_block_copies(cache, take_copies(copies, h[4]), m->backend());
    // The rows that sample: each rank computes its vocab slice of their logits (rank 0 gathers).
    fb.num_logits = static_cast<int32_t>(h[9]);
    fb.logits_indices = reinterpret_cast<const int32_t*>(take(h[9] * sizeof(int32_t)));
    m->forward(fb, cache, nullptr);
  }
}

}  // namespace fantai::engine
