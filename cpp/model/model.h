// model: a Llama-family decoder (dense or mixture-of-experts): config + weights + one batched
// forward over paged KV.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/kv_cache.h"
#include "model/model_config.h"
#include "model/step_staging.h"
#include "model/weights.h"

namespace fantai::model {

// One step's flattened, variable-length batch (prefill chunks and decodes mixed).
struct ForwardBatch {
  int32_t num_tokens = 0;
  const int32_t* token_ids = nullptr;  // [num_tokens]
  const int32_t* positions = nullptr;  // [num_tokens]
  // Per KV kind (KVCache::kind, kind 0 the only one of most models): the slot each token writes
  // [num_tokens] and the attention metadata, the same queries over that kind's block tables.
  // Model::forward sets each kind's window and soft-cap from the config itself.
  int32_t num_kv_kinds = 1;
  const int64_t* slot_mapping[kMaxKvKinds] = {};
  AttentionParams attn[kMaxKvKinds];
  const int32_t* logits_indices = nullptr;  // [num_logits] rows whose next token is sampled
  int32_t num_logits = 0;
};

class Model {
 public:
  // quantization: "none", "int8" or "int4" (see Weights).
  Model(const ModelConfig& config, DType dtype, std::shared_ptr<Backend> backend,
        const std::string& quantization = "none");

  // Loads a Hugging Face model directory (config.json + safetensors). dtype "auto" takes the
  // checkpoint's torch_dtype.
  static std::shared_ptr<Model> from_pretrained(const std::string& dir, const std::string& dtype,
                                                std::shared_ptr<Backend> backend,
                                                const std::string& quantization = "none");

  Weights& weights() { return weights_; }
  void finalize();  // after all tensors are set: checks, rope tables
  // This rank's share under tensor parallelism (heads, KV heads, MLP columns); full_config() is the
  // checkpoint's. The same object in one process.
  const ModelConfig& config() const { return config_; }
  const ModelConfig& full_config() const { return shard_.active() ? shard_.full : config_; }
  const TpShard& tp_shard() const { return shard_; }
  // Wall time in the lm_head linear and its calls (a figure for the replicated-vs-vocab-parallel
  // choice of tensor parallelism; host time, so exact on the CPU backend).
  double lm_head_seconds() const { return lm_head_seconds_; }
  int64_t lm_head_calls() const { return lm_head_calls_; }
  DType dtype() const { return dtype_; }
  Backend* backend() const { return backend_.get(); }
  std::shared_ptr<Backend> backend_ptr() const { return backend_; }

  // batch: host pointers. logits: [batch.num_logits, vocab_size] f32 in host memory (a device
  // backend uploads the metadata and downloads the logits inside).
  void forward(const ForwardBatch& batch, KVCache& cache, float* logits);

  // On a backend that samples greedily where the logits live (Backend::sample_greedy, device
  // backends): the argmax token and its logprob per logits row instead of the logits. Returns
  // false, computing nothing, when the backend cannot.
  bool forward_greedy(const ForwardBatch& batch, KVCache& cache, int32_t* tokens, float* logprobs);
  // Whether forward_greedy would take a step (false on host backends, at no cost).
  bool samples_greedy_on_backend() { return staging_.samples_greedy(config_.vocab_size); }
  // Like forward_greedy, with each logits row drawn on the backend by its own temperature, top_k,
  // top_p and uniform (Backend::sample_top_k_top_p). Returns false, computing nothing, when the
  // backend cannot.
  bool forward_sampled(const ForwardBatch& batch, KVCache& cache, const DeviceSampling& sampling,
                       int32_t* tokens, float* logprobs);
  bool samples_top_k_top_p_on_backend() { return staging_.samples_top_k_top_p(config_.vocab_size); }

  // Logits for every position of one sequence, with a private KV cache of kv_dtype: [n, vocab_size].
  // For tests and scoring (e.g. the perplexity cost of a KV dtype); the engine never calls it.
  std::vector<float> score(const std::vector<int32_t>& token_ids, DType kv_dtype = DType::kF32);

 private:
  void ensure_workspace(int32_t num_tokens);
  // y[m, n] = x[m, k] . W^T (+ bias) for a linear held dense, quantized, or as a mix of row parts.
  // packed: `dense` is in the backend's packed layout (LayerWeights::packed).
  void linear(const float* x, const void* dense, const QuantParts& parts, const float* bias, float* y,
              int64_t m, int64_t n, int64_t k, bool packed = false);
  void row_parallel(const float* x, int64_t k, bool whole, const void* dense, const QuantParts& parts,
                    const float* bias, float* y, int64_t m, int64_t n, bool packed);
  void attention_block(int layer, const ForwardBatch& b, KVCache& cache);
  void mlp_block(int layer, int32_t num_tokens);
  void moe_block(int layer, int32_t num_tokens);  // a sparse layer's MLP (moe.cpp)

  double lm_head_seconds_ = 0;
  int64_t lm_head_calls_ = 0;
  TpShard shard_;  // before config_: the constructor fills it while sharding the config
  ModelConfig config_;
  DType dtype_;
  std::shared_ptr<Backend> backend_;
  Weights weights_;
  Buffer cos_sin_;        // [max_positions, rotary_dim]
  Buffer local_cos_sin_;  // Gemma 3's sliding layers' own table, or empty
  int32_t max_positions_ = 0;
  // Step workspace, grown on demand, reused across steps (no allocation in the steady state).
  int32_t capacity_ = 0;
  Buffer residual_, normed_, qkv_, attn_out_, proj_out_, gate_up_, act_, last_res_, last_x_;
  // Sparse layers' step workspace (moe.cpp): router logits, chosen experts and their weights.
  int32_t moe_capacity_ = 0;
  Buffer router_logits_, moe_ids_, moe_weights_;
  // Tensor parallelism: this rank's vocab slice of the logits; on rank 0 every rank's slice, in
  // rank order, before the [rows, vocab] layout.
  Buffer logits_part_, gathered_;
  Buffer tp_gathered_, tp_whole_in_;  // a whole o / down's input: as gathered, then row by row
  StepStaging staging_;               // the step's metadata and logits on a device backend
  int32_t* greedy_tokens_ = nullptr;  // set only inside forward_greedy
  float* greedy_logprobs_ = nullptr;
  const DeviceSampling* device_sampling_ = nullptr;  // set only inside forward_sampled
};

}  // namespace fantai::model
