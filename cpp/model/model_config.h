// model: the decoder's hyper-parameters, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/types.h"

namespace fantai::model {

struct RopeScaling {
  std::string type = "default";  // "default" | "linear" | "llama3" | "longrope"
  float factor = 1.0f;
  float low_freq_factor = 1.0f;                     // llama3
  float high_freq_factor = 4.0f;                    // llama3
  int32_t original_max_position_embeddings = 8192;  // llama3, longrope
  std::vector<float> short_factor, long_factor;     // longrope: [rotary_dim / 2] each
  float attention_factor = 1.0f;                    // longrope: multiplies cos and sin
};

// The decoders fantai runs: Llama (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM), the
// families that differ from it by switches below (Qwen3, Gemma 2 / 3, Phi-3), and the
// mixture-of-experts forms of Llama and Qwen3 (MixtralForCausalLM, Qwen3MoeForCausalLM).
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
  // Mixture of experts (model/moe.cpp); num_experts == 0 for a dense model. A sparse layer's MLP
  // is num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok of them per token.
  int32_t num_experts = 0;
  int32_t num_experts_per_tok = 0;
  int32_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;            // the chosen experts' probabilities divided by their sum
  int32_t decoder_sparse_step = 1;       // layer i is sparse when (i + 1) % step == 0 ...
  std::vector<int32_t> mlp_only_layers;  // ... and i is not listed here (those keep a dense MLP)
  bool is_moe_layer(int32_t layer) const;

  // ---- family switches; the defaults are the Llama decoder ----
  bool qk_norm = false;                // RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
  bool norm_plus_one = false;          // Gemma: every RMSNorm scales by (1 + w); folded into w at load
  bool sandwich_norms = false;         // Gemma 2 / 3: norms after attention and after the MLP as well
  bool gelu_tanh = false;              // MLP activation gelu_pytorch_tanh (Gemma) instead of SiLU
  float embed_scale = 0.0f;            // embeddings times this (Gemma: sqrt(hidden)); 0 = none
  float final_logit_softcap = 0.0f;    // logits = cap * tanh(logits / cap) (Gemma 2); 0 = none
  float query_pre_attn_scalar = 0.0f;  // attention scale = this ** -0.5 (Gemma); 0 = head_dim
  int32_t rotary_dim = 0;              // rotated dims per head (partial_rotary_factor); = head_dim
  // Gemma 3's sliding layers rotate with their own base and no scaling (rope_parameters
  // ["sliding_attention"]); local_rope_theta 0 means every layer uses rope_theta / rope_scaling.
  float local_rope_theta = 0.0f;
  // Sliding layers by type (transformers' layer_types or the family's pattern), whatever the
  // window: Gemma 3 rotates them with local_rope_theta. Empty when set in code: none slide.
  std::vector<bool> layer_sliding;
  bool layer_is_sliding(int32_t layer) const {
    return layer < static_cast<int32_t>(layer_sliding.size()) && layer_sliding[layer];
  }

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

// The rotary inverse frequencies [rotary_dim / 2], with rope_scaling applied as transformers does
// (longrope: the short factors, or the long ones when `long_factors`). local: Gemma 3's sliding
// layers' own base, unscaled.
std::vector<float> rope_inv_freq(const ModelConfig& config, bool local = false, bool long_factors = false);

// The cos|sin table RoPE reads: [positions, rotary_dim], row p = cos(p * f) for the rotary_dim / 2
// frequencies, then sin, in f32 as transformers computes them (times longrope's attention
// factor). longrope takes the short factors below original_max_position_embeddings and the long
// ones from there on, a fixed choice per position.
std::vector<float> rope_cos_sin(const ModelConfig& config, int32_t positions, bool local = false);

}  // namespace fantai::model
