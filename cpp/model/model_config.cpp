// model: config.json parsing and rotary frequencies.
#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/check.h"

namespace fantai::model {
namespace {

using nlohmann::json;

template <typename T>
T get_or(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<T>();
}

std::vector<int32_t> token_ids(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (it->is_array()) return it->get<std::vector<int32_t>>();
  return {it->get<int32_t>()};
}

void parse_rope(const json& j, ModelConfig& c) {
  // transformers 5 folds rope_theta and the scaling into rope_parameters.
  const json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rope = &j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    rope = &j["rope_scaling"];
  }
  c.rope_theta = get_or<float>(j, "rope_theta", 10000.0f);
  if (!rope) return;
  c.rope_theta = get_or<float>(*rope, "rope_theta", c.rope_theta);
  std::string type = get_or<std::string>(*rope, "rope_type", get_or<std::string>(*rope, "type", "default"));
  RopeScaling& s = c.rope_scaling;
  s.type = type;
  s.factor = get_or<float>(*rope, "factor", 1.0f);
  s.low_freq_factor = get_or<float>(*rope, "low_freq_factor", 1.0f);
  s.high_freq_factor = get_or<float>(*rope, "high_freq_factor", 4.0f);
  s.original_max_position_embeddings = get_or<int32_t>(*rope, "original_max_position_embeddings", 8192);
  FANTAI_REQUIRE(type == "default" || type == "linear" || type == "llama3",
                 "unsupported rope scaling type '" << type << "' (supported: default, linear, llama3)");
}

// Mixtral names its experts num_local_experts and sizes them with intermediate_size; Qwen3-MoE
// says num_experts (transformers 5 writes num_local_experts for it too) and moe_intermediate_size.
void parse_moe(const json& j, ModelConfig& c) {
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  if (!mixtral) return;
  c.num_experts = get_or<int32_t>(j, "num_local_experts", get_or<int32_t>(j, "num_experts", 0));
  c.num_experts_per_tok = get_or<int32_t>(j, "num_experts_per_tok", 2);
  c.moe_intermediate_size = get_or<int32_t>(j, "moe_intermediate_size", c.intermediate_size);
  c.norm_topk_prob = true;
  FANTAI_REQUIRE(c.num_experts > 0 && c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts &&
                     c.moe_intermediate_size > 0,
                 c.architecture << ": config.json needs num_experts > 0, 0 < num_experts_per_tok <= "
                                   "num_experts and a positive expert intermediate size (got "
                                << c.num_experts << ", " << c.num_experts_per_tok << ", "
                                << c.moe_intermediate_size << ")");
}

}  // namespace

bool ModelConfig::is_moe_layer(int32_t layer) const {
  if (num_experts == 0 || decoder_sparse_step <= 0 || (layer + 1) % decoder_sparse_step != 0) return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

ModelConfig ModelConfig::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    FANTAI_THROW("config.json is not valid JSON: " << e.what());
  }
  ModelConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama");
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    c.architecture = j["architectures"][0].get<std::string>();
  } else {
    c.architecture = c.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                     : c.model_type == "mistral" ? "MistralForCausalLM"
                     : c.model_type == "mixtral" ? "MixtralForCausalLM"
                                                 : "LlamaForCausalLM";
  }
  FANTAI_REQUIRE(c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM" ||
                     c.architecture == "Qwen2ForCausalLM" || c.architecture == "MixtralForCausalLM",
                 "unsupported architecture '" << c.architecture
                                              << "' (supported: LlamaForCausalLM, MistralForCausalLM, "
                                                 "Qwen2ForCausalLM, MixtralForCausalLM)");
  c.vocab_size = get_or<int32_t>(j, "vocab_size", 0);
  c.hidden_size = get_or<int32_t>(j, "hidden_size", 0);
  c.intermediate_size = get_or<int32_t>(j, "intermediate_size", 0);
  c.num_layers = get_or<int32_t>(j, "num_hidden_layers", 0);
  c.num_heads = get_or<int32_t>(j, "num_attention_heads", 0);
  c.num_kv_heads = get_or<int32_t>(j, "num_key_value_heads", c.num_heads);
  FANTAI_REQUIRE(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0 &&
                     c.num_heads > 0 && c.num_kv_heads > 0,
                 "config.json lacks one of vocab_size, hidden_size, intermediate_size, "
                 "num_hidden_layers, num_attention_heads");
  FANTAI_REQUIRE(c.num_heads % c.num_kv_heads == 0,
                 "num_attention_heads must be a multiple of num_key_value_heads");
  c.head_dim = get_or<int32_t>(j, "head_dim", c.hidden_size / c.num_heads);
  c.rms_norm_eps = get_or<float>(j, "rms_norm_eps", 1e-6f);
  parse_rope(j, c);
  c.max_position_embeddings = get_or<int32_t>(j, "max_position_embeddings", 2048);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  if (get_or<bool>(j, "use_sliding_window", true)) c.sliding_window = get_or<int32_t>(j, "sliding_window", 0);
  std::string dt = get_or<std::string>(j, "torch_dtype", get_or<std::string>(j, "dtype", "float32"));
  c.torch_dtype = dtype_from_name(dt);
  c.eos_token_ids = token_ids(j, "eos_token_id");
  c.bos_token_id = get_or<int32_t>(j, "bos_token_id", -1);
  parse_moe(j, c);
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream f(path);
  FANTAI_REQUIRE(f.good(), "cannot open " << path);
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json(ss.str());
}

std::string ModelConfig::summary() const {
  std::ostringstream o;
  o << architecture << ": " << num_layers << " layers, hidden " << hidden_size << ", heads " << num_heads
    << "/" << num_kv_heads << " (q/kv), head_dim " << head_dim << ", vocab " << vocab_size << ", rope "
    << rope_scaling.type << " theta " << rope_theta;
  if (num_experts > 0) o << ", experts " << num_experts_per_tok << " of " << num_experts;
  return o.str();
}

std::vector<float> rope_inv_freq(const ModelConfig& c) {
  const int32_t half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int32_t i = 0; i < half; ++i) {
    // Same f32 arithmetic as transformers: base ** (2i / dim), then reciprocal.
    float e = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv[i] = 1.0f / std::pow(c.rope_theta, e);
  }
  const RopeScaling& s = c.rope_scaling;
  if (s.type == "linear") {
    for (float& f : inv) f /= s.factor;
  } else if (s.type == "llama3") {
    const float old_len = static_cast<float>(s.original_max_position_embeddings);
    const float low_wavelen = old_len / s.low_freq_factor;
    const float high_wavelen = old_len / s.high_freq_factor;
    for (float& f : inv) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        const float smooth = (old_len / wavelen - s.low_freq_factor) /
                             (s.high_freq_factor - s.low_freq_factor);
        f = (1.0f - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return inv;
}

}  // namespace fantai::model
