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

// One rope_parameters / rope_scaling object into (theta, scaling); `theta` holds the fallback.
void parse_rope_object(const json& rope, const ModelConfig& c, const json& top, float& theta,
                       RopeScaling& s) {
  theta = get_or<float>(rope, "rope_theta", theta);
  const std::string type = get_or<std::string>(rope, "rope_type",
                                               get_or<std::string>(rope, "type", "default"));
  // Phi-3's older configs call longrope "su" (transformers renames it the same way).
  s.type = type == "su" ? "longrope" : type;
  s.factor = get_or<float>(rope, "factor", 1.0f);
  s.low_freq_factor = get_or<float>(rope, "low_freq_factor", 1.0f);
  s.high_freq_factor = get_or<float>(rope, "high_freq_factor", 4.0f);
  s.original_max_position_embeddings = get_or<int32_t>(
      rope, "original_max_position_embeddings",
      get_or<int32_t>(top, "original_max_position_embeddings", 8192));
  FANTAI_REQUIRE(s.type == "default" || s.type == "linear" || s.type == "llama3" || s.type == "longrope",
                 "unsupported rope scaling type '" << type
                                                   << "' (supported: default, linear, llama3, longrope)");
  if (s.type != "longrope") return;
  s.short_factor = get_or<std::vector<float>>(rope, "short_factor", {});
  s.long_factor = get_or<std::vector<float>>(rope, "long_factor", {});
  const size_t half = static_cast<size_t>(c.rotary_dim / 2);
  FANTAI_REQUIRE(s.short_factor.size() == half && s.long_factor.size() == half,
                 "longrope needs short_factor and long_factor of rotary_dim / 2 = " << half << " entries");
  // transformers' defaults: the factor is the context extension, the attention factor follows it.
  const double orig = s.original_max_position_embeddings;
  const double factor = get_or<double>(rope, "factor", c.max_position_embeddings / orig);
  const double attn = factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(orig));
  s.attention_factor = static_cast<float>(get_or<double>(rope, "attention_factor", attn));
}

void parse_rope(const json& j, ModelConfig& c) {
  // transformers 5 folds rope_theta and the scaling into rope_parameters; Gemma 3 keeps one
  // object per attention kind there.
  const json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    rope = &j["rope_parameters"];
  } else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    rope = &j["rope_scaling"];
  }
  c.rope_theta = get_or<float>(j, "rope_theta", 10000.0f);
  double partial = get_or<double>(j, "partial_rotary_factor", 1.0);
  if (rope) partial = get_or<double>(*rope, "partial_rotary_factor", partial);
  c.rotary_dim = static_cast<int32_t>(c.head_dim * partial);
  FANTAI_REQUIRE(c.rotary_dim > 0 && c.rotary_dim <= c.head_dim && c.rotary_dim % 2 == 0,
                 "partial_rotary_factor " << partial << " gives an odd or empty rotary dim of head_dim "
                                          << c.head_dim);
  if (rope && rope->contains("full_attention") && (*rope)["full_attention"].is_object()) {
    parse_rope_object((*rope)["full_attention"], c, j, c.rope_theta, c.rope_scaling);
    if (rope->contains("sliding_attention") && (*rope)["sliding_attention"].is_object()) {
      RopeScaling local;
      c.local_rope_theta = get_or<float>(j, "rope_local_base_freq", 10000.0f);
      parse_rope_object((*rope)["sliding_attention"], c, j, c.local_rope_theta, local);
      FANTAI_REQUIRE(local.type == "default", "rope scaling on sliding layers is not supported");
    }
    return;
  }
  if (j.contains("rope_local_base_freq")) c.local_rope_theta = get_or<float>(j, "rope_local_base_freq", 0.0f);
  if (rope) parse_rope_object(*rope, c, j, c.rope_theta, c.rope_scaling);
}

// Architectures this decoder runs, and the model_type each is guessed from without `architectures`.
const char* const kArchitectures[][2] = {
    {"LlamaForCausalLM", "llama"}, {"MistralForCausalLM", "mistral"}, {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"}, {"Gemma2ForCausalLM", "gemma2"},   {"Gemma3ForCausalLM", "gemma3_text"},
    {"Phi3ForCausalLM", "phi3"},   {"MixtralForCausalLM", "mixtral"}, {"Qwen3MoeForCausalLM", "qwen3_moe"},
};

// The switches of the families that are Llama plus a few differences.
void parse_family(const json& j, ModelConfig& c) {
  const std::string& a = c.architecture;
  const bool gemma = a == "Gemma2ForCausalLM" || a == "Gemma3ForCausalLM";
  c.qk_norm = a == "Qwen3ForCausalLM" || a == "Qwen3MoeForCausalLM" || a == "Gemma3ForCausalLM";
  c.sandwich_norms = gemma;
  // A GGUF from llama.cpp's converter already holds 1 + w (its loader says so in this key).
  c.norm_plus_one = gemma && !get_or<bool>(j, "norm_weights_include_one", false);
  const std::string act = get_or<std::string>(j, "hidden_activation",
                                              get_or<std::string>(j, "hidden_act", "silu"));
  FANTAI_REQUIRE(act == "silu" || act == "gelu_pytorch_tanh",
                 "unsupported MLP activation '" << act << "' (supported: silu, gelu_pytorch_tanh)");
  c.gelu_tanh = act == "gelu_pytorch_tanh";
  if (gemma) {
    // transformers: torch.tensor(hidden_size ** 0.5), a double rounded once to f32.
    c.embed_scale = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
    c.query_pre_attn_scalar = get_or<float>(j, "query_pre_attn_scalar", 256.0f);  // the classes' default
    // Absent: the class default (Gemma 2: 30, Gemma 3: none); an explicit null: none.
    const auto cap = j.find("final_logit_softcapping");
    c.final_logit_softcap = cap == j.end()   ? (a == "Gemma2ForCausalLM" ? 30.0f : 0.0f)
                            : cap->is_null() ? 0.0f
                                             : cap->get<float>();
  }
}

// Mixtral names its experts num_local_experts and sizes them with intermediate_size; Qwen3-MoE
// says num_experts (transformers 5 writes num_local_experts for it too) and moe_intermediate_size.
void parse_moe(const json& j, ModelConfig& c) {
  const bool mixtral = c.architecture == "MixtralForCausalLM", qwen = c.architecture == "Qwen3MoeForCausalLM";
  if (!mixtral && !qwen) return;
  FANTAI_REQUIRE(!c.gelu_tanh, c.architecture << ": the experts are SwiGLU (hidden_act silu)");
  c.num_experts = get_or<int32_t>(j, "num_experts", get_or<int32_t>(j, "num_local_experts", 0));
  c.num_experts_per_tok = get_or<int32_t>(j, "num_experts_per_tok", mixtral ? 2 : 8);
  // transformers' defaults: Mixtral always renormalises, Qwen3-MoE only when asked.
  c.norm_topk_prob = mixtral || get_or<bool>(j, "norm_topk_prob", false);
  if (mixtral) {
    c.moe_intermediate_size = get_or<int32_t>(j, "moe_intermediate_size", c.intermediate_size);
  } else {
    c.moe_intermediate_size = get_or<int32_t>(j, "moe_intermediate_size", 0);
    c.decoder_sparse_step = get_or<int32_t>(j, "decoder_sparse_step", 1);
    c.mlp_only_layers = get_or<std::vector<int32_t>>(j, "mlp_only_layers", {});
  }
  FANTAI_REQUIRE(
      c.num_experts > 0 && c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts &&
          c.moe_intermediate_size > 0 && c.decoder_sparse_step > 0,
      c.architecture << ": config.json needs num_experts > 0, 0 < num_experts_per_tok <= "
                        "num_experts, a positive moe_intermediate_size and decoder_sparse_step (got "
                     << c.num_experts << ", " << c.num_experts_per_tok << ", " << c.moe_intermediate_size
                     << ", " << c.decoder_sparse_step << ")");
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
  c.layer_sliding = slides;
  c.layer_window.assign(static_cast<size_t>(c.num_layers), 0);
  for (int32_t i = 0; i < c.num_layers; ++i) c.layer_window[i] = slides[i] ? window : 0;
  // Absent: the class default (Gemma 2's 50); an explicit null turns it off, as in transformers.
  const auto cap = j.find("attn_logit_softcapping");
  c.attn_logit_softcap = cap == j.end()   ? (mt == "gemma2" ? 50.0f : 0.0f)
                         : cap->is_null() ? 0.0f
                                          : cap->get<float>();
  FANTAI_REQUIRE(c.attn_logit_softcap >= 0.0f, "attn_logit_softcapping must be >= 0");
}

ModelConfig parse_config(const json& j);  // below, after the range checks it uses

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
  FANTAI_REQUIRE(j.is_object(), "config.json is not a JSON object");
  try {
    return parse_config(j);
  } catch (const json::exception& e) {  // a key of the wrong type: name it, as a bad value
    FANTAI_THROW("config.json has a value of the wrong type: " << e.what());
  }
}

namespace {

// Sizes no real checkpoint reaches: larger ones are a corrupt or hostile config.json, refused
// before they size a buffer.
void check_ranges(const ModelConfig& c) {
  auto in = [](const char* key, int64_t v, int64_t hi) {
    FANTAI_REQUIRE(v >= 1 && v <= hi,
                   "config.json: " << key << " = " << v << " is outside [1, " << hi << "]");
  };
  in("vocab_size", c.vocab_size, 1 << 28);
  in("hidden_size", c.hidden_size, 1 << 20);
  in("intermediate_size", c.intermediate_size, 1 << 22);
  in("num_hidden_layers", c.num_layers, 1 << 12);
  in("num_attention_heads", c.num_heads, 1 << 12);
  in("head_dim", c.head_dim, 1 << 12);
  in("max_position_embeddings", c.max_position_embeddings, 1 << 24);
  FANTAI_REQUIRE(c.head_dim % 2 == 0, "config.json: head_dim " << c.head_dim << " must be even (RoPE)");
  FANTAI_REQUIRE(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0,
                 "config.json: rms_norm_eps must be a positive number");
  FANTAI_REQUIRE(std::isfinite(c.rope_theta) && c.rope_theta > 0, "config.json: rope_theta must be positive");
}

ModelConfig parse_config(const json& j) {
  ModelConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama");
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty()) {
    c.architecture = j["architectures"][0].get<std::string>();
  } else {
    c.architecture = "LlamaForCausalLM";
    for (const auto& row : kArchitectures)
      if (c.model_type == row[1]) c.architecture = row[0];
  }
  bool known = false;
  std::string names;
  for (const auto& row : kArchitectures) {
    known = known || c.architecture == row[0];
    names += std::string(names.empty() ? "" : ", ") + row[0];
  }
  FANTAI_REQUIRE(known, "unsupported architecture '" << c.architecture << "' (supported: " << names << ")");
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
  check_ranges(c);
  c.rms_norm_eps = get_or<float>(j, "rms_norm_eps", 1e-6f);
  c.max_position_embeddings = get_or<int32_t>(j, "max_position_embeddings", 2048);
  parse_rope(j, c);
  parse_family(j, c);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
  parse_attention_pattern(j, c);
  std::string dt = get_or<std::string>(j, "torch_dtype", get_or<std::string>(j, "dtype", "float32"));
  c.torch_dtype = dtype_from_name(dt);
  c.eos_token_ids = token_ids(j, "eos_token_id");
  c.bos_token_id = get_or<int32_t>(j, "bos_token_id", -1);
  parse_moe(j, c);
  return c;
}

}  // namespace

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
  if (num_experts > 0) o << ", experts " << num_experts_per_tok << " of " << num_experts;
  return o.str();
}

std::vector<float> rope_inv_freq(const ModelConfig& c, bool local, bool long_factors) {
  const int32_t dim = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim, half = dim / 2;
  const float theta = local && c.local_rope_theta > 0 ? c.local_rope_theta : c.rope_theta;
  const RopeScaling s = local && c.local_rope_theta > 0 ? RopeScaling{} : c.rope_scaling;
  std::vector<float> inv(half);
  for (int32_t i = 0; i < half; ++i) {
    // Same f32 arithmetic as transformers: base ** (2i / dim), then reciprocal.
    float e = static_cast<float>(2 * i) / static_cast<float>(dim);
    const float base = std::pow(theta, e);
    if (s.type == "longrope") {
      inv[i] = 1.0f / ((long_factors ? s.long_factor[i] : s.short_factor[i]) * base);
    } else {
      inv[i] = 1.0f / base;
    }
  }
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

std::vector<float> rope_cos_sin(const ModelConfig& c, int32_t positions, bool local) {
  const int32_t dim = c.rotary_dim > 0 ? c.rotary_dim : c.head_dim, half = dim / 2;
  const bool longrope = !(local && c.local_rope_theta > 0) && c.rope_scaling.type == "longrope";
  const std::vector<float> inv = rope_inv_freq(c, local, false);
  const std::vector<float> inv_long = longrope ? rope_inv_freq(c, local, true) : inv;
  const float attn = longrope ? c.rope_scaling.attention_factor : 1.0f;
  const int32_t switch_at = longrope ? c.rope_scaling.original_max_position_embeddings : positions;
  std::vector<float> table(static_cast<size_t>(positions) * dim);
  for (int32_t p = 0; p < positions; ++p) {
    float* row = table.data() + static_cast<size_t>(p) * dim;
    const std::vector<float>& f = p < switch_at ? inv : inv_long;
    for (int32_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(p) * f[i];
      row[i] = std::cos(angle) * attn;
      row[half + i] = std::sin(angle) * attn;
    }
  }
  return table;
}

}  // namespace fantai::model
