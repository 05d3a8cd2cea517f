// model: weight buffers, Hugging Face name mapping and fusion of q/k/v and gate/up.
#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <regex>

#include "common/check.h"
#include "common/logging.h"

namespace fantai::model {

Buffer::Buffer(Backend* backend, size_t bytes, bool zero) : backend_(backend), bytes_(bytes) {
  data_ = backend_->alloc(bytes);
  if (zero) backend_->fill_zero(data_, bytes);
}
Buffer::~Buffer() {
  if (data_) backend_->free(data_);
}
Buffer::Buffer(Buffer&& o) noexcept : backend_(o.backend_), data_(o.data_), bytes_(o.bytes_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (data_) backend_->free(data_);
    backend_ = o.backend_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

// Where one checkpoint tensor goes: rows [row_offset, row_offset + rows) of `buffer`, which is
// lazily allocated with `total_rows` rows.
struct Weights::Slot {
  Buffer* buffer = nullptr;
  int64_t total_rows = 0;
  int64_t row_offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;  // 1 for vectors
  bool f32 = false;  // norms and biases stay f32
};

Weights::Weights(const ModelConfig& config, DType dtype, Backend* backend)
    : config_(config), dtype_(dtype), backend_(backend), layers_(config.num_layers) {}

ShardRule shard_rule(const std::string& n) {
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("q_proj") || has("k_proj") || has("v_proj") || has("gate_proj") || has("up_proj"))
    return ShardRule::kColumn;
  if ((has("o_proj") || has("down_proj")) && has(".weight")) return ShardRule::kRow;
  return ShardRule::kReplicated;
}

Weights::Slot Weights::resolve(const std::string& name) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = c.q_dim(), KV = c.kv_dim();
  const int64_t QKV = Q + 2 * KV;
  if (name == "model.embed_tokens.weight") return {&embed_, c.vocab_size, 0, c.vocab_size, H, false};
  if (name == "model.norm.weight") return {&final_norm_, H, 0, H, 1, true};
  if (name == "lm_head.weight") return {&lm_head_, c.vocab_size, 0, c.vocab_size, H, false};
  static const std::regex re(R"(model\.layers\.(\d+)\.(\w+)\.?(\w*)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return {};
  const int layer = std::stoi(m[1]);
  if (layer < 0 || layer >= c.num_layers) return {};
  LayerWeights& L = layers_[layer];
  const std::string a = m[2], b = m[3];
  const bool bias = m[4] == "bias";
  if (a == "input_layernorm" && !bias) return {&L.input_norm, H, 0, H, 1, true};
  if (a == "post_attention_layernorm" && !bias) return {&L.post_norm, H, 0, H, 1, true};
  if (a == "self_attn") {
    int64_t off = b == "q_proj" ? 0 : b == "k_proj" ? Q : b == "v_proj" ? Q + KV : -1;
    int64_t rows = b == "q_proj" ? Q : KV;
    if (off >= 0) return bias ? Slot{&L.qkv_bias, QKV, off, rows, 1, true} : Slot{&L.qkv, QKV, off, rows, H, false};
    if (b == "o_proj") return bias ? Slot{&L.o_bias, H, 0, H, 1, true} : Slot{&L.o, H, 0, H, Q, false};
  }
  if (a == "mlp" && !bias) {
    if (b == "gate_proj") return {&L.gate_up, 2 * I, 0, I, H, false};
    if (b == "up_proj") return {&L.gate_up, 2 * I, I, I, H, false};
    if (b == "down_proj") return {&L.down, H, 0, H, I, false};
  }
  return {};
}

void Weights::copy_rows(Buffer& dst, int64_t row_offset, int64_t rows, int64_t cols,
                        const void* src, DType src_dtype, DType dst_dtype) {
  const size_t n = static_cast<size_t>(rows * cols);
  char* out = dst.as<char>() + static_cast<size_t>(row_offset * cols) * dtype_size(dst_dtype);
  if (src_dtype == dst_dtype) {
    backend_->upload(out, src, n * dtype_size(dst_dtype));
    return;
  }
  // Convert through f32 in chunks so a large tensor never needs a full f32 copy. On a device
  // backend `out` is not host memory: convert into a host chunk, then upload it.
  constexpr size_t kChunk = 1 << 16;
  std::vector<float> tmp(std::min(n, kChunk));
  std::vector<char> staged(backend_->is_device() ? tmp.size() * dtype_size(dst_dtype) : 0);
  for (size_t i = 0; i < n; i += kChunk) {
    const size_t len = std::min(kChunk, n - i);
    convert_to_f32(static_cast<const char*>(src) + i * dtype_size(src_dtype), src_dtype, tmp.data(), len);
    char* dst = out + i * dtype_size(dst_dtype);
    if (staged.empty()) {
      convert_from_f32(tmp.data(), dst, dst_dtype, len);
    } else {
      convert_from_f32(tmp.data(), staged.data(), dst_dtype, len);
      backend_->upload(dst, staged.data(), len * dtype_size(dst_dtype));
    }
  }
}

bool Weights::set(const std::string& name, const void* data, DType src_dtype,
                  const std::vector<int64_t>& shape) {
  Slot s = resolve(name);
  if (!s.buffer) {
    FANTAI_LOG(kDebug, "ignoring checkpoint tensor " << name);
    return false;
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  FANTAI_REQUIRE(numel == s.rows * s.cols && (shape.size() != 2 || shape[0] == s.rows),
                 "tensor " << name << " has " << numel << " elements, expected [" << s.rows
                           << ", " << s.cols << "] from config.json");
  const DType dst_dtype = s.f32 ? DType::kF32 : dtype_;
  if (!s.buffer->data()) {
    *s.buffer = Buffer(backend_, static_cast<size_t>(s.total_rows * s.cols) * dtype_size(dst_dtype));
  }
  copy_rows(*s.buffer, s.row_offset, s.rows, s.cols, data, src_dtype, dst_dtype);
  loaded_.push_back(name);
  return true;
}

void Weights::finalize() {
  std::vector<std::string> missing;
  auto need = [&](const Buffer& b, const std::string& n) {
    if (!b.data()) missing.push_back(n);
  };
  need(embed_, "model.embed_tokens.weight");
  need(final_norm_, "model.norm.weight");
  for (int i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights& L = layers_[i];
    need(L.input_norm, p + "input_layernorm.weight");
    need(L.qkv, p + "self_attn.{q,k,v}_proj.weight");
    need(L.o, p + "self_attn.o_proj.weight");
    need(L.post_norm, p + "post_attention_layernorm.weight");
    need(L.gate_up, p + "mlp.{gate,up}_proj.weight");
    need(L.down, p + "mlp.down_proj.weight");
  }
  // Each fused buffer needs all its parts: count the loaded names per fused group.
  std::sort(loaded_.begin(), loaded_.end());
  loaded_.erase(std::unique(loaded_.begin(), loaded_.end()), loaded_.end());
  for (int i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* part : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                             "mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
      if (!std::binary_search(loaded_.begin(), loaded_.end(), p + part)) missing.push_back(p + part);
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    FANTAI_THROW("checkpoint is missing " << missing.size() << " tensor(s): " << list);
  }
  if (!lm_head_.data() && !config_.tie_word_embeddings) {
    FANTAI_LOG(kInfo, "no lm_head.weight in the checkpoint: tying it to the embedding");
  }
}

const void* Weights::lm_head() const { return lm_head_.data() ? lm_head_.data() : embed_.data(); }

size_t Weights::total_bytes() const {
  size_t total = embed_.bytes() + final_norm_.bytes() + lm_head_.bytes();
  for (const LayerWeights& L : layers_) {
    total += L.input_norm.bytes() + L.qkv.bytes() + L.qkv_bias.bytes() + L.o.bytes() +
             L.o_bias.bytes() + L.post_norm.bytes() + L.gate_up.bytes() + L.down.bytes();
  }
  return total;
}

}  // namespace fantai::model
