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

// Which layers slide and by how much, as transformers 5 decides it per model type (their config
// classes' defaults and post-init, their modeling code's use):
//  - Llama: never. Mistral, Mixtral, Phi-3: every layer by sliding_window (null: none; defaults
//    4096, none, none), layer_types ignored. Qwen3-MoE: every layer, with use_sliding_window.
//  - Qwen2 / Qwen3 / Qwen2-MoE: only with use_sliding_window; then the layers the saved
//    layer_types name, else layers >= max_window_layers (Qwen2-MoE: even layers < it).
//  - Gemma 2 / 3 and any other model: the saved layer_types ("sliding_attention" /
//    "full_attention"); else Gemma's default pattern; else none.
void parse_attention_pattern(const json& j, ModelConfig& c) {
  const std::string& mt = c.model_type;
  const bool use_flag = mt == "qwen2" || mt == "qwen3" || mt == "qwen2_moe" || mt == "qwen3_moe";
  const bool every_layer = mt == "mistral" || mt == "mixtral" || mt == "phi3" || mt == "qwen3_moe";
  const bool gemma = mt == "gemma2" || mt == "gemma3_text";
  int32_t window = 0;
  if (!(j.contains("sliding_window") && j["sliding_window"].is_null())) {
    const int32_t class_default = mt == "mistral" || use_flag || gemma ? 4096 : 0;
    window = get_or<int32_t>(j, "sliding_window", class_default);
  }
  if ((use_flag && !get_or<bool>(j, "use_sliding_window", false)) || mt == "llama") window = 0;
  FANTAI_REQUIRE(window >= 0, "sliding_window must be >= 0, got " << window);
  c.sliding_window = window;
  std::vector<bool> slides(static_cast<size_t>(c.num_layers), every_layer);
  const auto types = j.find("layer_types");
  if (!every_layer && mt != "llama" && types != j.end() && types->is_array()) {
    FANTAI_REQUIRE(static_cast<int32_t>(types->size()) == c.num_layers,
                   "layer_types lists " << types->size() << " layers, the model has " << c.num_layers);
    for (int32_t i = 0; i < c.num_layers; ++i) {
      const std::string t = (*types)[i].get<std::string>();
      FANTAI_REQUIRE(t == "sliding_attention" || t == "full_attention",
                     "unsupported layer type '" << t << "' (supported: sliding_attention, full_attention)");
      slides[i] = t == "sliding_attention";
    }
  } else if (use_flag && !every_layer) {
    const int32_t mwl = get_or<int32_t>(j, "max_window_layers", 28);
    for (int32_t i = 0; i < c.num_layers; ++i)
      slides[i] = mt == "qwen2_moe" ? (i + 1) % 2 && i < mwl : i >= mwl;
  } else if (gemma) {
    const int32_t period = mt == "gemma2" ? 2 : get_or<int32_t>(j, "sliding_window_pattern", 6);
    for (int32_t i = 0; i < c.num_layers; ++i) slides[i] = (i + 1) % period != 0;
  }
  c.layer_window.assign(static_cast<size_t>(c.num_layers), 0);
  for (int32_t i = 0; i < c.num_layers; ++i) c.layer_window[i] = slides[i] ? window : 0;
  c.attn_logit_softcap = get_or<float>(j, "attn_logit_softcapping", mt == "gemma2" ? 50.0f : 0.0f);
  FANTAI_REQUIRE(c.attn_logit_softcap >= 0.0f, "attn_logit_softcapping must be >= 0");
}

}  // namespace

ModelConfig ModelConfig::attention_pattern_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    FANTAI_THROW("config.json is not valid JSON: " << e.what());
  }
  ModelConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama");
  c.num_layers = get_or<int32_t>(j, "num_hidden_layers", 0);
  parse_attention_pattern(j, c);
  return c;
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
                                                 : "LlamaForCausalLM";
  }
  FANTAI_REQUIRE(c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM" ||
                     c.architecture == "Qwen2ForCausalLM",
                 "unsupported architecture '"
                     << c.architecture
                     << "' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
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
  parse_attention_pattern(j, c);
  std::string dt = get_or<std::string>(j, "torch_dtype", get_or<std::string>(j, "dtype", "float32"));
  c.torch_dtype = dtype_from_name(dt);
  c.eos_token_ids = token_ids(j, "eos_token_id");
  c.bos_token_id = get_or<int32_t>(j, "bos_token_id", -1);
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
  const auto windowed = std::count_if(layer_window.begin(), layer_window.end(),
                                      [](int32_t w) { return w > 0; });
  if (windowed)
    o << ", sliding window " << sliding_window << " on " << windowed << " of " << num_layers << " layers";
  if (attn_logit_softcap > 0) o << ", attention soft-cap " << attn_logit_softcap;
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
