// model: the decoder loop, written only in backend ops (embedding → layers → norm → lm_head).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "common/check.h"
#include "common/logging.h"
#include "model/model.h"

namespace fantai::model {

namespace {
// Under tensor parallelism every rank builds the decoder of its share: the layer loop is the same
// code, only the head and column counts differ, and the all-reduces join the partial outputs.
ModelConfig rank_config(const ModelConfig& full, Communicator& comm, TpShard* shard) {
  if (comm.world_size() <= 1) return full;
  return shard_config(full, comm.rank(), comm.world_size(), shard);
}
}  // namespace

Model::Model(const ModelConfig& config, DType dtype, std::shared_ptr<Backend> backend,
             const std::string& quantization)
    : config_(rank_config(config, backend->communicator(), &shard_)),
      dtype_(dtype),
      backend_(std::move(backend)),
      weights_(config_, dtype, backend_.get(), quantization),
      staging_(backend_.get()) {
  weights_.set_shard(shard_);
}

std::shared_ptr<Model> Model::from_pretrained(const std::string& dir, const std::string& dtype,
                                              std::shared_ptr<Backend> backend,
                                              const std::string& quantization) {
  namespace fs = std::filesystem;
  FANTAI_REQUIRE(fs::is_directory(dir), "model directory not found: " << dir);
  ModelConfig config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  DType dt = dtype == "auto" || dtype.empty() ? config.torch_dtype : dtype_from_name(dtype);
  auto model = std::make_shared<Model>(config, dt, std::move(backend), quantization);
  load_safetensors_dir(dir, &model->weights());
  model->finalize();
  return model;
}

void Model::finalize() {
  weights_.finalize();
  // cos/sin table in f32 exactly as transformers computes it: angle = float(pos) * inv_freq.
  max_positions_ = config_.max_position_embeddings;
  auto upload_table = [&](bool local) {
    const std::vector<float> table = rope_cos_sin(config_, max_positions_, local);
    Buffer b(backend_.get(), table.size() * sizeof(float));
    backend_->upload(b.data(), table.data(), table.size() * sizeof(float));
    return b;
  };
  cos_sin_ = upload_table(false);
  if (config_.local_rope_theta > 0) local_cos_sin_ = upload_table(true);
  FANTAI_LOG(kInfo, config_.summary() << "; weights " << dtype_name(dtype_) << ", "
                                      << weights_.total_bytes() / (1 << 20) << " MiB");
}

void Model::ensure_workspace(int32_t n) {
  if (n <= capacity_) return;
  const int32_t cap = std::max(n, capacity_ * 2);
  const ModelConfig& c = config_;
  Backend* be = backend_.get();
  auto f32 = [&](int64_t cols) { return Buffer(be, static_cast<size_t>(cap) * cols * sizeof(float)); };
  residual_ = f32(c.hidden_size);
  normed_ = f32(c.hidden_size);
  qkv_ = f32(c.q_dim() + 2 * c.kv_dim());
  attn_out_ = f32(c.q_dim());
  proj_out_ = f32(c.hidden_size);
  gate_up_ = f32(2 * static_cast<int64_t>(c.intermediate_size));
  act_ = f32(c.intermediate_size);
  last_res_ = f32(c.hidden_size);
  last_x_ = f32(c.hidden_size);
  capacity_ = cap;
}

void Model::linear(const float* x, const void* dense, const QuantParts& parts, const float* bias, float* y,
                   int64_t m, int64_t n, int64_t k, bool packed) {
  Backend* be = backend_.get();
  // Rows that came dense (all of them for an unquantized model: the path of old, bit for bit).
  if (dense && packed) be->linear_packed(x, dense, dtype_, bias, y, m, n, k);
  else if (dense) be->linear(x, dense, dtype_, bias, y, m, n, k);
  // Parts are independent, so more than the limit (no model has them) just take several calls.
  constexpr size_t kMax = Backend::kMaxLinearParts;
  for (size_t i = 0; i < parts.size(); i += kMax) {
    const QuantMatrix* ws[kMax];
    int64_t row0[kMax];
    const size_t np = std::min(kMax, parts.size() - i);
    for (size_t j = 0; j < np; ++j) {
      ws[j] = &parts[i + j].w;
      row0[j] = parts[i + j].row0;
    }
    be->linear_q_parts(x, ws, row0, static_cast<int>(np), bias, y, m, n);
  }
}

// o and down: this rank's input columns x [m, k] give a partial of y [m, n], summed over the
// ranks. A whole matrix (act-order GPTQ, Weights::keep_whole) takes every rank's columns instead
// (heads and MLP columns are split in rank order, so rank r's k columns follow rank r - 1's) and
// gives every rank the whole of y: TP = 1's product, and no all-reduce.
void Model::row_parallel(const float* x, int64_t k, bool whole, const void* dense, const QuantParts& parts,
                         const float* bias, float* y, int64_t m, int64_t n, bool packed) {
  Backend* be = backend_.get();
  Communicator& comm = be->communicator();
  if (!whole) {
    linear(x, dense, parts, bias, y, m, n, k, packed);
    comm.all_reduce_sum(y, m * n);
    return;
  }
  const int N = comm.world_size();
  const size_t bytes = static_cast<size_t>(m * k * N) * sizeof(float);
  if (tp_gathered_.bytes() < bytes) {
    tp_gathered_ = Buffer(be, bytes);
    tp_whole_in_ = Buffer(be, bytes);
  }
  comm.all_gather(x, tp_gathered_.as<float>(), m * k);  // [N, m, k]
  float* in = tp_whole_in_.as<float>();
  const float* g = tp_gathered_.as<float>();
  for (int r = 0; r < N; ++r)
    for (int64_t i = 0; i < m; ++i) be->copy(in + (i * N + r) * k, g + (r * m + i) * k, k * sizeof(float));
  linear(in, dense, parts, bias, y, m, n, N * k, packed);
}

void Model::attention_block(int layer, const ForwardBatch& b, KVCache& cache) {
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layer(layer);
  Backend* be = backend_.get();
  const int64_t n = b.num_tokens, qkv_dim = c.q_dim() + 2 * c.kv_dim();
  float* qkv = qkv_.as<float>();
  linear(normed_.as<float>(), L.qkv.data(), L.qkv_q, L.qkv_bias.as<float>(), qkv, n, qkv_dim, c.hidden_size,
         L.packed);
  float* q = qkv;
  float* k = qkv + c.q_dim();
  float* v = k + c.kv_dim();
  if (c.qk_norm) {
    be->rms_norm_heads(q, qkv_dim, n, c.num_heads, c.head_dim, L.q_norm.as<float>(), c.rms_norm_eps);
    be->rms_norm_heads(k, qkv_dim, n, c.num_kv_heads, c.head_dim, L.k_norm.as<float>(), c.rms_norm_eps);
  }
  const Buffer& table = local_cos_sin_.data() && c.layer_is_sliding(layer) ? local_cos_sin_ : cos_sin_;
  be->rope(q, qkv_dim, k, qkv_dim, b.positions, n, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim,
           table.as<float>());
  const int kind = cache.kind(layer);  // the layer's pool, tables and window
  be->store_kv(k, v, qkv_dim, b.slot_mapping[kind], n, cache.k(layer), cache.v(layer), cache.layout(kind));
  const float scale = c.query_pre_attn_scalar > 0
                          ? static_cast<float>(1.0 / std::sqrt(c.query_pre_attn_scalar))
                          : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  be->attention(q, qkv_dim, cache.k(layer), cache.v(layer), cache.layout(kind), b.attn[kind], c.num_heads,
                scale, attn_out_.as<float>());
  row_parallel(attn_out_.as<float>(), c.q_dim(), L.o_whole, L.o.data(), L.o_q, L.o_bias.as<float>(),
               proj_out_.as<float>(), n, c.hidden_size, L.packed);
  if (c.sandwich_norms)  // Gemma: the attention output is normalised before the residual add
    be->rms_norm(proj_out_.as<float>(), L.post_attn_norm.as<float>(), proj_out_.as<float>(), n, c.hidden_size,
                 c.rms_norm_eps);
}

void Model::mlp_block(int layer, int32_t n) {
  if (config_.is_moe_layer(layer)) return moe_block(layer, n);
  const ModelConfig& c = config_;
  const LayerWeights& L = weights_.layer(layer);
  Backend* be = backend_.get();
  const int64_t inter = c.intermediate_size;
  // The fused packed MLP is SiLU's; GeGLU takes the three-op path.
  if (!(L.packed && !c.gelu_tanh &&
        be->mlp_packed(normed_.as<float>(), L.gate_up.data(), L.down.data(), dtype_, proj_out_.as<float>(), n,
                       inter, c.hidden_size))) {
    linear(normed_.as<float>(), L.gate_up.data(), L.gate_up_q, nullptr, gate_up_.as<float>(), n, 2 * inter,
           c.hidden_size, L.packed);
    if (c.gelu_tanh) be->gelu_tanh_mul(gate_up_.as<float>(), act_.as<float>(), n, inter);
    else be->silu_mul(gate_up_.as<float>(), act_.as<float>(), n, inter);
    row_parallel(act_.as<float>(), inter, L.down_whole, L.down.data(), L.down_q, nullptr,
                 proj_out_.as<float>(), n, c.hidden_size, L.packed);
  } else {
    be->communicator().all_reduce_sum(proj_out_.as<float>(), n * c.hidden_size);
  }
  if (c.sandwich_norms)
    be->rms_norm(proj_out_.as<float>(), L.post_mlp_norm.as<float>(), proj_out_.as<float>(), n, c.hidden_size,
                 c.rms_norm_eps);
}

void Model::forward(const ForwardBatch& host_batch, KVCache& cache, float* logits) {
  const ModelConfig& c = config_;
  const int32_t n = host_batch.num_tokens;
  FANTAI_CHECK(n > 0, "empty forward batch");
  ensure_workspace(n);
  Backend* be = backend_.get();
  const int64_t H = c.hidden_size;
  for (int32_t i = 0; i < n; ++i) {
    FANTAI_REQUIRE(host_batch.token_ids[i] >= 0 && host_batch.token_ids[i] < c.vocab_size,
                   "token id " << host_batch.token_ids[i] << " is outside the vocabulary [0, " << c.vocab_size
                               << ")");
    FANTAI_REQUIRE(host_batch.positions[i] < max_positions_,
                   "position " << host_batch.positions[i] << " exceeds max_position_embeddings "
                               << max_positions_);
  }
  ForwardBatch b = staging_.stage(host_batch);
  FANTAI_CHECK(b.num_kv_kinds == cache.num_kinds(),
               "forward batch has " << b.num_kv_kinds << " KV kinds, the cache " << cache.num_kinds());
  // Every layer of a kind attends over the same metadata: plan each kind once for the step.
  struct PlanScope {
    Backend* be;
    ~PlanScope() { be->end_attention_plan(); }
  } plan_scope{be};
  for (int kind = 0; kind < cache.num_kinds(); ++kind) {
    b.attn[kind].window = cache.kind_window(kind);
    b.attn[kind].logit_softcap = c.attn_logit_softcap;
    be->plan_attention(cache.layout(kind), b.attn[kind], c.num_heads);
  }
  float* residual = residual_.as<float>();
  float* normed = normed_.as<float>();
  if (!weights_.embed_q().empty()) be->embedding_q(b.token_ids, n, weights_.embed_q().front().w, residual);
  else be->embedding(b.token_ids, n, weights_.embed().data(), dtype_, H, residual);
  if (c.embed_scale > 0) be->scale(residual, c.embed_scale, n * H);
  be->rms_norm(residual, weights_.layer(0).input_norm.as<float>(), normed, n, H, c.rms_norm_eps);
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& L = weights_.layer(layer);
    attention_block(layer, b, cache);
    be->add_rms_norm(residual, proj_out_.as<float>(), L.post_norm.as<float>(), normed, n, H, c.rms_norm_eps);
    mlp_block(layer, n);
    if (layer + 1 < c.num_layers) {
      be->add_rms_norm(residual, proj_out_.as<float>(), weights_.layer(layer + 1).input_norm.as<float>(),
                       normed, n, H, c.rms_norm_eps);
    }
  }
  if (b.num_logits == 0) return;
  // Only rows that sample need the final norm and the (large) lm_head.
  // A pure decode step samples every row in order: use the rows in place (the residual is not
  // needed after this), saving two copies per row (separate transfers on a device backend).
  bool in_place = b.num_logits == n;
  for (int32_t i = 0; in_place && i < n; ++i) in_place = b.logits_indices[i] == i;
  float* res_rows = in_place ? residual : last_res_.as<float>();
  float* x_rows = in_place ? proj_out_.as<float>() : last_x_.as<float>();
  for (int32_t i = 0; !in_place && i < b.num_logits; ++i) {
    const int32_t r = b.logits_indices[i];
    be->copy(res_rows + i * H, residual + static_cast<int64_t>(r) * H, H * sizeof(float));
    be->copy(x_rows + i * H, proj_out_.as<float>() + static_cast<int64_t>(r) * H, H * sizeof(float));
  }
  be->add_rms_norm(res_rows, x_rows, weights_.final_norm().as<float>(), normed, b.num_logits, H,
                   c.rms_norm_eps);
  const int64_t rows = b.num_logits, V = c.vocab_size;
  if (shard_.active()) {
    // Vocab-parallel lm_head: every rank computes its vocab slice of the logits, soft-caps it
    // (elementwise), and rank 0 gathers the slices and lays them out as [rows, vocab].
    const int64_t Vr = weights_.lm_head_rows();
    if (logits_part_.bytes() < static_cast<size_t>(rows * Vr) * sizeof(float))
      logits_part_ = Buffer(be, static_cast<size_t>(rows * Vr) * sizeof(float));
    float* part = logits_part_.as<float>();
    const auto t0 = std::chrono::steady_clock::now();
    linear(normed, weights_.lm_head(), weights_.lm_head_q(), nullptr, part, rows, Vr, H,
           weights_.lm_head_packed());
    if (c.final_logit_softcap > 0) be->softcap(part, c.final_logit_softcap, rows * Vr);
    Communicator& comm = be->communicator();
    const bool root = comm.rank() == 0;
    std::vector<int64_t> counts;
    if (root) {
      if (gathered_.bytes() < static_cast<size_t>(rows * V) * sizeof(float))
        gathered_ = Buffer(be, static_cast<size_t>(rows * V) * sizeof(float));
      for (int r = 0; r < shard_.world; ++r)
        counts.push_back(rows * (shard_.vocab_begin(r + 1) - shard_.vocab_begin(r)));
    }
    comm.gather(part, rows * Vr, root ? gathered_.as<float>() : nullptr, counts.data(), 0);
    lm_head_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    lm_head_calls_++;
    if (!root) return;
    // Slices arrive rank after rank ([rows, V_r] each); the sampler reads [rows, V].
    float* out = staging_.logits_target(logits, b.num_logits, c.vocab_size);
    const float* g = gathered_.as<float>();
    for (int r = 0; r < shard_.world; ++r) {
      const int64_t v0 = shard_.vocab_begin(r), vr = shard_.vocab_begin(r + 1) - v0;
      for (int64_t i = 0; i < rows; ++i) be->copy(out + i * V + v0, g + i * vr, vr * sizeof(float));
      g += rows * vr;
    }
    staging_.finish_logits(logits, b.num_logits, c.vocab_size, greedy_tokens_, greedy_logprobs_,
                           device_sampling_);
    return;
  }
  float* out = staging_.logits_target(logits, b.num_logits, c.vocab_size);
  const auto t0 = std::chrono::steady_clock::now();
  linear(normed, weights_.lm_head(), weights_.lm_head_q(), nullptr, out, b.num_logits, c.vocab_size, H,
         weights_.lm_head_packed());
  lm_head_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lm_head_calls_++;
  if (c.final_logit_softcap > 0)
    be->softcap(out, c.final_logit_softcap, static_cast<int64_t>(b.num_logits) * c.vocab_size);
  staging_.finish_logits(logits, b.num_logits, c.vocab_size, greedy_tokens_, greedy_logprobs_,
                         device_sampling_);
}

bool Model::forward_greedy(const ForwardBatch& b, KVCache& cache, int32_t* tokens, float* logprobs) {
  // A backend that says yes takes the real rows too, so forward needs no host logits buffer.
  if (!staging_.samples_greedy(config_.vocab_size)) return false;
  struct Reset {
    Model* m;
    ~Reset() {
      m->greedy_tokens_ = nullptr;
      m->greedy_logprobs_ = nullptr;
    }
  } reset{this};
  greedy_tokens_ = tokens;
  greedy_logprobs_ = logprobs;
  forward(b, cache, nullptr);
  return true;
}

bool Model::forward_sampled(const ForwardBatch& b, KVCache& cache, const DeviceSampling& sampling,
                            int32_t* tokens, float* logprobs) {
  if (!staging_.samples_top_k_top_p(config_.vocab_size)) return false;
  struct Reset {
    Model* m;
    ~Reset() {
      m->greedy_tokens_ = nullptr;
      m->greedy_logprobs_ = nullptr;
      m->device_sampling_ = nullptr;
    }
  } reset{this};
  greedy_tokens_ = tokens;
  greedy_logprobs_ = logprobs;
  device_sampling_ = &sampling;
  forward(b, cache, nullptr);
  return true;
}

std::vector<float> Model::score(const std::vector<int32_t>& ids, DType kv_dtype) {
  const int32_t n = static_cast<int32_t>(ids.size());
  FANTAI_REQUIRE(n > 0, "score needs at least one token");
  // The other ranks run only the engine's steps; a forward of its own here would leave them out.
  FANTAI_REQUIRE(!shard_.active(), "score() runs in one process only; use tensor_parallel_size 1");
  const int32_t bs = 16, num_blocks = (n + bs - 1) / bs;
  KVCache cache(config_, num_blocks, bs, kv_dtype, backend_.get());
  std::vector<int32_t> positions(n), table(num_blocks), indices(n), cu{0, n}, ctx{n};
  std::vector<int64_t> slots(n);
  for (int32_t i = 0; i < n; ++i) positions[i] = indices[i] = i, slots[i] = i;
  for (int32_t b = 0; b < num_blocks; ++b) table[b] = b;
  ForwardBatch fb;
  fb.num_tokens = n;
  fb.token_ids = ids.data();
  fb.positions = positions.data();
  fb.logits_indices = indices.data();
  fb.num_logits = n;
  // Every kind's pool is as large and holds the sequence the same way.
  fb.num_kv_kinds = cache.num_kinds();
  for (int kind = 0; kind < cache.num_kinds(); ++kind) {
    fb.slot_mapping[kind] = slots.data();
    fb.attn[kind] = AttentionParams{1, n, n, n, cu.data(), ctx.data(), table.data(), num_blocks};
  }
  std::vector<float> logits(static_cast<size_t>(n) * config_.vocab_size);
  forward(fb, cache, logits.data());
  return logits;
}

}  // namespace fantai::model
