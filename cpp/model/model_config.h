// model: the decoder's hyper-parameters, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/types.h"

namespace fantai::model {

struct RopeScaling {
  std::string type = "default";  // "default" | "linear" | "llama3"
  float factor = 1.0f;
  float low_freq_factor = 1.0f;                     // llama3
  float high_freq_factor = 4.0f;                    // llama3
  int32_t original_max_position_embeddings = 8192;  // llama3
};

// Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM), and its
// mixture-of-experts form (MixtralForCausalLM).
struct ModelConfig {
  std::string architecture = "LlamaForCausalLM";
  std::string model_type = "llama";
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  int32_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  int32_t sliding_window = 0;  // 0: none. Mistral's window caps max_model_len (full attention).
  DType torch_dtype = DType::kF32;
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;
  // Mixture of experts (model/moe.cpp); num_experts == 0 for a dense model. A sparse layer's MLP
  // is num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok of them per token.
  int32_t num_experts = 0;
  int32_t num_experts_per_tok = 0;
  int32_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;            // the chosen experts' probabilities divided by their sum
  int32_t decoder_sparse_step = 1;       // layer i is sparse when (i + 1) % step == 0 ...
  std::vector<int32_t> mlp_only_layers;  // ... and i is not listed here (those keep a dense MLP)
  bool is_moe_layer(int32_t layer) const;

  int32_t q_dim() const { return num_heads * head_dim; }
  int32_t kv_dim() const { return num_kv_heads * head_dim; }

  // Accepts both the transformers 4 keys (rope_theta, rope_scaling) and 5 (rope_parameters).
  static ModelConfig from_json(const std::string& json_text);
  static ModelConfig from_file(const std::string& path);
  std::string summary() const;
};

// The rotary inverse frequencies [head_dim / 2], with rope_scaling applied as transformers does.
std::vector<float> rope_inv_freq(const ModelConfig& config);

}  // namespace fantai::model
