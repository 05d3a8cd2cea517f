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

// Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).
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
  // ---- attention pattern (sliding windows, logit soft-cap) ----
  // The config's window size (0: none); layer_window says which layers use it.
  int32_t sliding_window = 0;
  // Per layer: 0 = full causal attention, W > 0 = the query at position p sees keys j with
  // p - W < j <= p (transformers' sliding_window_overlay). Always num_layers entries.
  std::vector<int32_t> layer_window;
  // Gemma 2's attn_logit_softcapping: score = cap * tanh(score / cap) after the scale, before the
  // mask and softmax. 0: none.
  float attn_logit_softcap = 0.0f;
  DType torch_dtype = DType::kF32;
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  int32_t q_dim() const { return num_heads * head_dim; }
  int32_t kv_dim() const { return num_kv_heads * head_dim; }

  // Accepts both the transformers 4 keys (rope_theta, rope_scaling) and 5 (rope_parameters).
  static ModelConfig from_json(const std::string& json_text);
  // Only model_type, num_layers and the attention pattern (windows, soft-cap), for any model type
  // (no architecture check): how a config.json's keys map to layer_window, testable on its own.
  static ModelConfig attention_pattern_from_json(const std::string& json_text);
  static ModelConfig from_file(const std::string& path);
  std::string summary() const;
};

// The rotary inverse frequencies [head_dim / 2], with rope_scaling applied as transformers does.
std::vector<float> rope_inv_freq(const ModelConfig& config);

}  // namespace fantai::model
