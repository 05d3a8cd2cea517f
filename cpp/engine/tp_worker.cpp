// engine: the step's wire format between tensor-parallel ranks and the worker loop of ranks > 0.
#include "engine/tp_worker.h"

#include <cstring>
#include <functional>
#include <string>

#include "common/check.h"
#include "common/logging.h"

namespace fantai::engine {
namespace {

enum : int64_t { kOpStep = 1, kOpStop = 2 };
// op, num_tokens, num_seqs, max_blocks_per_seq, num_copies, max_query_len, max_context_len, bytes
constexpr int kHeader = 8;

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

size_t payload_bytes(const int64_t* h) {
  const int64_t n = h[1], seqs = h[2], blocks = h[3], copies = h[4];
  return static_cast<size_t>(n) * sizeof(int64_t) +
         static_cast<size_t>(2 * n + (seqs + 1) + seqs + seqs * blocks + 2 * copies) * sizeof(int32_t);
}

}  // namespace

void tp_handshake_leader(model::Model& m, int32_t num_blocks, int32_t block_size, DType kv_dtype) {
  Communicator& comm = m.backend()->communicator();
  int64_t hs[4] = {num_blocks, block_size, static_cast<int64_t>(kv_dtype), fingerprint(m)};
  comm.broadcast(hs, sizeof hs, 0, true);  // idle: the other ranks may still be loading
  agree(comm, true, "model or options");
}

void tp_send_step(model::Model& m, const model::ForwardBatch& fb,
                  const std::vector<std::pair<int32_t, int32_t>>& block_copies) {
  Communicator& comm = m.backend()->communicator();
  const AttentionParams& a = fb.attn;
  int64_t h[kHeader] = {kOpStep,
                        fb.num_tokens,
                        a.num_seqs,
                        a.max_blocks_per_seq,
                        static_cast<int64_t>(block_copies.size()),
                        a.max_query_len,
                        a.max_context_len,
                        0};
  h[7] = static_cast<int64_t>(payload_bytes(h));
  comm.broadcast(h, sizeof h, 0);
  std::vector<char> p(static_cast<size_t>(h[7]));
  char* w = p.data();
  auto put = [&](const void* src, size_t bytes) {
    std::memcpy(w, src, bytes);
    w += bytes;
  };
  const size_t n = fb.num_tokens, seqs = a.num_seqs;
  put(fb.slot_mapping, n * sizeof(int64_t));
  put(fb.token_ids, n * sizeof(int32_t));
  put(fb.positions, n * sizeof(int32_t));
  put(a.cu_seqlens_q, (seqs + 1) * sizeof(int32_t));
  put(a.context_lens, seqs * sizeof(int32_t));
  put(a.block_tables, seqs * a.max_blocks_per_seq * sizeof(int32_t));
  for (const auto& [src, dst] : block_copies) {
    put(&src, sizeof src);
    put(&dst, sizeof dst);
  }
  comm.broadcast(p.data(), static_cast<int64_t>(p.size()), 0);
}

void tp_send_stop(model::Model& m) {
  int64_t h[kHeader] = {kOpStop, 0, 0, 0, 0, 0, 0, 0};
  m.backend()->communicator().broadcast(h, sizeof h, 0);
}

void run_tp_worker(const std::shared_ptr<model::Model>& m) {
  Communicator& comm = m->backend()->communicator();
  FANTAI_REQUIRE(comm.rank() > 0, "the worker loop is for tensor-parallel ranks > 0");
  int64_t hs[4] = {0, 0, 0, 0};
  comm.broadcast(hs, sizeof hs, 0, true);
  agree(comm, hs[3] == fingerprint(*m), "model or options");
  model::KVCache cache(m->config(), static_cast<int32_t>(hs[0]), static_cast<int32_t>(hs[1]),
                       static_cast<DType>(hs[2]), m->backend());
  FANTAI_LOG(kInfo, "tensor-parallel rank " << comm.rank() << " of " << comm.world_size() << ": KV pool "
                                            << hs[0] << " blocks, " << cache.bytes() / (1 << 20) << " MiB");
  std::vector<char> p;
  for (;;) {
    int64_t h[kHeader];
    comm.broadcast(h, sizeof h, 0, true);
    if (h[0] == kOpStop) return;
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
    model::ForwardBatch fb;
    fb.num_tokens = static_cast<int32_t>(n);
    fb.slot_mapping = reinterpret_cast<const int64_t*>(take(n * sizeof(int64_t)));
    fb.token_ids = reinterpret_cast<const int32_t*>(take(n * sizeof(int32_t)));
    fb.positions = reinterpret_cast<const int32_t*>(take(n * sizeof(int32_t)));
    AttentionParams& a = fb.attn;
    a.num_seqs = static_cast<int32_t>(seqs);
    a.num_tokens = fb.num_tokens;
    a.max_query_len = static_cast<int32_t>(h[5]);
    a.max_context_len = static_cast<int32_t>(h[6]);
    a.max_blocks_per_seq = static_cast<int32_t>(h[3]);
    a.cu_seqlens_q = reinterpret_cast<const int32_t*>(take((seqs + 1) * sizeof(int32_t)));
    a.context_lens = reinterpret_cast<const int32_t*>(take(seqs * sizeof(int32_t)));
    a.block_tables = reinterpret_cast<const int32_t*>(take(seqs * a.max_blocks_per_seq * sizeof(int32_t)));
    const int32_t* copies = reinterpret_cast<const int32_t*>(take(2 * h[4] * sizeof(int32_t)));
    for (int64_t i = 0; i < h[4]; ++i) cache.copy_block(copies[2 * i], copies[2 * i + 1], m->backend());
    fb.num_logits = 0;  // the lm_head runs on rank 0 only
    fb.logits_indices = nullptr;
    m->forward(fb, cache, nullptr);
  }
}

}  // namespace fantai::engine
