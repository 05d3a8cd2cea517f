// model: weight buffers, Hugging Face name mapping and fusion of q/k/v and gate/up.
// Just over 400 lines: the tensor-parallel cut of set / set_ggml sits beside the setters it feeds.
#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <regex>

#include "common/check.h"
#include "common/logging.h"
#include "model/quant_formats.h"

namespace fantai::model {

Weights::Weights(const ModelConfig& config, DType dtype, Backend* backend, const std::string& quantization)
    : config_(config),
      dtype_(dtype),
      backend_(backend),
      quantization_(quantization.empty() ? "none" : quantization),
      layers_(config.num_layers) {
  FANTAI_REQUIRE(dtype != DType::kI8,
                 "int8 is a KV cache dtype only; weights are float32, float16 or bfloat16");
  FANTAI_REQUIRE(quantization_ == "none" || quantization_ == "int8" || quantization_ == "int4",
                 "unknown quantization '" << quantization << "' (expected none, int8 or int4)");
  init_experts();
}

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
  // Embedding and lm_head are never quantized online (only when the checkpoint is): they are a
  // small share of a large model and the most sensitive matrices.
  if (name == "model.embed_tokens.weight")
    return {&embed_, c.vocab_size, 0, c.vocab_size, H, false, &embed_q_};
  if (name == "model.norm.weight") return {&final_norm_, H, 0, H, 1, true, nullptr, false, true};
  if (name == "lm_head.weight") return {&lm_head_, lm_head_rows(), 0, lm_head_rows(), H, false, &lm_head_q_};
  if (Slot e; resolve_expert(name, &e)) return e;
  static const std::regex re(R"(model\.layers\.(\d+)\.(\w+)\.?(\w*)\.(weight|bias))");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return {};
  const int layer = std::stoi(m[1]);
  if (layer < 0 || layer >= c.num_layers) return {};
  LayerWeights& L = layers_[layer];
  const std::string a = m[2], b = m[3];
  const bool bias = m[4] == "bias";
  auto norm = [](Buffer* b, int64_t n) { return Slot{b, n, 0, n, 1, true, nullptr, false, true}; };
  if (!bias) {
    // Gemma's post_attention_layernorm normalises the attention output; Llama's is the MLP's input.
    if (a == "input_layernorm") return norm(&L.input_norm, H);
    if (a == "post_attention_layernorm") return norm(c.sandwich_norms ? &L.post_attn_norm : &L.post_norm, H);
    if (a == "pre_feedforward_layernorm" && c.sandwich_norms) return norm(&L.post_norm, H);
    if (a == "post_feedforward_layernorm" && c.sandwich_norms) return norm(&L.post_mlp_norm, H);
    if (a == "self_attn" && c.qk_norm && b == "q_norm") return norm(&L.q_norm, c.head_dim);
    if (a == "self_attn" && c.qk_norm && b == "k_norm") return norm(&L.k_norm, c.head_dim);
    // Phi-3 stores q|k|v and gate|up already fused, in the order fantai fuses them.
    if (a == "self_attn" && b == "qkv_proj") return {&L.qkv, QKV, 0, QKV, H, false, &L.qkv_q, true};
    if (a == "mlp" && b == "gate_up_proj") return {&L.gate_up, 2 * I, 0, 2 * I, H, false, &L.gate_up_q, true};
  }
  if (a == "self_attn") {
    int64_t off = b == "q_proj" ? 0 : b == "k_proj" ? Q : b == "v_proj" ? Q + KV : -1;
    int64_t rows = b == "q_proj" ? Q : KV;
    if (off >= 0)
      return bias ? Slot{&L.qkv_bias, QKV, off, rows, 1, true}
                  : Slot{&L.qkv, QKV, off, rows, H, false, &L.qkv_q, true};
    if (b == "o_proj")
      return bias ? Slot{&L.o_bias, H, 0, H, 1, true}
                  : Slot{&L.o, H, 0, H, L.o_whole ? shard_.full.q_dim() : Q, false, &L.o_q, true};
  }
  if (a == "mlp" && !bias) {
    if (b == "gate_proj") return {&L.gate_up, 2 * I, 0, I, H, false, &L.gate_up_q, true};
    if (b == "up_proj") return {&L.gate_up, 2 * I, I, I, H, false, &L.gate_up_q, true};
    if (b == "down_proj")
      return {&L.down, H, 0, H, L.down_whole ? shard_.full.intermediate_size : I, false, &L.down_q, true};
  }
  return {};
}

void Weights::copy_rows(Buffer& dst, int64_t row_offset, int64_t rows, int64_t cols, const void* src,
                        DType src_dtype, DType dst_dtype) {
  const size_t n = static_cast<size_t>(rows * cols);
  char* out = dst.as<char>() + static_cast<size_t>(row_offset * cols) * dtype_size(dst_dtype);
  if (src_dtype == dst_dtype) {
    backend_->upload(out, src, n * dtype_size(dst_dtype));
    return;
  }
  // Convert through f32 in chunks so a large tensor never needs a full f32 copy, each chunk into
  // host memory and then uploaded (`out` may be device memory; on the CPU the upload is a copy of
  // a cache-resident chunk).
  constexpr size_t kChunk = 1 << 16;
  std::vector<float> tmp(std::min(n, kChunk));
  std::vector<char> staged(tmp.size() * dtype_size(dst_dtype));
  for (size_t i = 0; i < n; i += kChunk) {
    const size_t len = std::min(kChunk, n - i);
    convert_to_f32(static_cast<const char*>(src) + i * dtype_size(src_dtype), src_dtype, tmp.data(), len);
    convert_from_f32(tmp.data(), staged.data(), dst_dtype, len);
    backend_->upload(out + i * dtype_size(dst_dtype), staged.data(), len * dtype_size(dst_dtype));
  }
}

// Only this rank's rows and columns are read from the (mapped) checkpoint and converted.
bool Weights::set(const std::string& name, const void* data, DType src_dtype,
                  const std::vector<int64_t>& shape) {
  if (shape.size() == 3 && set_fused_experts(name, data, src_dtype, shape)) return true;
  if (!shard_.active() || shape.size() > 2 || shape.empty()) return set_local(name, data, src_dtype, shape);
  const int64_t rows = shape[0], cols = shape.size() == 2 ? shape[1] : 1;
  const ShardSelection sel = select_shard(shard_, name, rows, cols);
  if (sel.whole) return set_local(name, data, src_dtype, shape);
  const size_t es = dtype_size(src_dtype);
  std::vector<char> part(static_cast<size_t>(sel.num_rows() * sel.cols) * es);
  if (!sel.zero) {
    char* out = part.data();
    for (const auto& [r0, n] : sel.rows)
      for (int64_t r = r0; r < r0 + n; ++r, out += sel.cols * es)
        std::memcpy(out, static_cast<const char*>(data) + (r * cols + sel.col0) * es, sel.cols * es);
  }
  if (sel.cols != cols && quantization_ == "int4")
    FANTAI_REQUIRE(sel.cols % 32 == 0, "tensor " << name << ": int4 groups of 32 would be cut by the "
                                                 << shard_.world << "-way tensor-parallel split (" << sel.cols
                                                 << " columns per rank)");
  std::vector<int64_t> local{sel.num_rows()};
  if (shape.size() == 2) local.push_back(sel.cols);
  return set_local(name, part.data(), src_dtype, local);
}

bool Weights::set_local(const std::string& name, const void* data, DType src_dtype,
                        const std::vector<int64_t>& shape) {
  Slot s = resolve(name);
  if (!s.buffer) {
    FANTAI_LOG(kDebug, "ignoring checkpoint tensor " << name);
    return false;
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  FANTAI_REQUIRE(numel == s.rows * s.cols && (shape.size() != 2 || shape[0] == s.rows),
                 "tensor " << name << " has " << numel << " elements, expected [" << s.rows << ", " << s.cols
                           << "] from config.json");
  if (s.projection && quantization_ != "none") {
    std::vector<float> w(static_cast<size_t>(numel));
    convert_to_f32(data, src_dtype, w.data(), w.size());
    const bool int8 = quantization_ == "int8";
    const QuantTensor t = quantize_rtn(w.data(), s.rows, s.cols, int8 ? 8 : 4, int8 ? -1 : 32, true);
    add_quant_part(s, name, t.view(), int8 ? "int8" : "int4g32");
    return true;
  }
  if (s.norm && config_.norm_plus_one) {
    // Gemma scales by (1 + w) in f32, as transformers does; the sum is the weight fantai keeps.
    std::vector<float> w(static_cast<size_t>(numel));
    convert_to_f32(data, src_dtype, w.data(), w.size());
    for (float& v : w) v = 1.0f + v;
    return set_resolved(s, name, w.data(), DType::kF32);
  }
  return set_resolved(s, name, data, src_dtype);
}

bool Weights::set_resolved(const Slot& s, const std::string& name, const void* data, DType src_dtype) {
  const DType dst_dtype = s.f32 ? DType::kF32 : dtype_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.buffer->data()) {
      *s.buffer = Buffer(backend_, static_cast<size_t>(s.total_rows * s.cols) * dtype_size(dst_dtype));
    }
  }
  // Tensors of one fused buffer fill disjoint row ranges.
  copy_rows(*s.buffer, s.row_offset, s.rows, s.cols, data, src_dtype, dst_dtype);
  std::lock_guard<std::mutex> lock(mu_);
  loaded_.push_back(name);
  formats_[name] = dst_dtype == DType::kF32 ? "f32" : dst_dtype == DType::kF16 ? "f16" : "bf16";
  return true;
}

void Weights::add_quant_part(const Slot& s, const std::string& name, const QuantMatrix& canonical,
                             const std::string& format) {
  FANTAI_REQUIRE(s.qparts != nullptr, "tensor " << name << " cannot be held quantized");
  FANTAI_REQUIRE(canonical.rows == s.rows && canonical.cols == s.cols,
                 "tensor " << name << " is [" << canonical.rows << ", " << canonical.cols << "], expected ["
                           << s.rows << ", " << s.cols << "] from config.json");
  QuantPart part;
  part.row0 = s.row_offset;
  const size_t bytes = backend_->quant_packed_bytes(canonical);
  part.mem = Buffer::weights(backend_, bytes, false);
  part.w = backend_->pack_quant(canonical, part.mem.data());
  if (shard_.active() && s.qparts == &embed_q_) add_tied_slice(canonical);
  std::lock_guard<std::mutex> lock(mu_);
  QuantParts& parts = *s.qparts;
  parts.erase(
      std::remove_if(parts.begin(), parts.end(), [&](const QuantPart& p) { return p.row0 == part.row0; }),
      parts.end());
  parts.push_back(std::move(part));
  loaded_.push_back(name);
  formats_[name] = format;
  quant_bytes_[name] = bytes;
}

// A quantized embedding under tensor parallelism: its rows [vocab0, vocab0 + vocab_rows) packed
// once more, as the lm_head shard should the checkpoint have no lm_head (finalize drops it if it
// has one). Whole rows: each row's groups, scales and mins come along untouched.
void Weights::add_tied_slice(const QuantMatrix& m) {
  const int64_t r0 = shard_.vocab0(), ng = m.ngroups(), nf = m.fgroups > 0 ? ng / m.fgroups : 0;
  QuantMatrix v = m;
  v.rows = shard_.vocab_rows();
  v.data = static_cast<const uint8_t*>(m.data) + r0 * m.ld;
  v.scale = m.scale ? m.scale + r0 * ng : nullptr;
  v.zero = m.zero ? m.zero + r0 * ng : nullptr;
  v.min = m.min ? m.min + r0 * ng : nullptr;
  v.iscale = m.iscale ? m.iscale + r0 * ng : nullptr;
  v.imin = m.imin ? m.imin + r0 * ng : nullptr;
  v.fscale = m.fscale ? m.fscale + r0 * nf : nullptr;
  v.fmin = m.fmin ? m.fmin + r0 * nf : nullptr;
  QuantPart part;
  part.row0 = 0;
  part.mem = Buffer::weights(backend_, backend_->quant_packed_bytes(v), false);
  part.w = backend_->pack_quant(v, part.mem.data());
  std::lock_guard<std::mutex> lock(mu_);
  tied_q_.clear();
  tied_q_.push_back(std::move(part));
}

// A GGUF block is never cut: a column split must fall on block boundaries (32 or 256 values).
bool Weights::set_ggml(const std::string& name, const void* data, size_t nbytes, int32_t ggml_type,
                       int64_t rows, int64_t cols, const int32_t* row_perm) {
  if (!shard_.active()) return set_ggml_local(name, data, nbytes, ggml_type, rows, cols, row_perm);
  const ShardSelection sel = select_shard(shard_, name, rows, cols);
  if (sel.whole && !row_perm) return set_ggml_local(name, data, nbytes, ggml_type, rows, cols, row_perm);
  FANTAI_REQUIRE(!sel.zero,
                 "tensor " << name << " (a bias) cannot come as GGUF blocks under tensor parallelism");
  const int64_t block = ggml_is_float(ggml_type) ? 1 : ggml_type >= 10 ? 256 : 32;
  FANTAI_REQUIRE(sel.col0 % block == 0 && sel.cols % block == 0,
                 "tensor " << name << " (" << ggml_format_name(ggml_type) << ", blocks of " << block
                           << ") cannot be split " << shard_.world << " ways: each rank would take "
                           << sel.cols << " of its " << cols << " columns, not a whole number of blocks");
  const size_t row_bytes = nbytes / static_cast<size_t>(rows);
  const size_t c0 = sel.col0 ? ggml_tensor_bytes(ggml_type, 1, sel.col0) : 0;
  const size_t width = ggml_tensor_bytes(ggml_type, 1, sel.cols);
  const auto ranges = sel.whole ? std::vector<std::pair<int64_t, int64_t>>{{0, rows}} : sel.rows;
  int64_t n_rows = 0;
  for (const auto& r : ranges) n_rows += r.second;
  std::vector<char> part(static_cast<size_t>(n_rows) * width);
  char* out = part.data();
  // Destination row g of the full tensor reads source row row_perm[g]: un-permuted here, once.
  for (const auto& [r0, n] : ranges)
    for (int64_t g = r0; g < r0 + n; ++g, out += width) {
      const int64_t src = row_perm ? row_perm[g] : g;
      FANTAI_REQUIRE(src >= 0 && src < rows, "tensor " << name << ": row permutation out of range");
      std::memcpy(out, static_cast<const char*>(data) + src * row_bytes + c0, width);
    }
  return set_ggml_local(name, part.data(), part.size(), ggml_type, n_rows, sel.cols, nullptr);
}

bool Weights::set_ggml_local(const std::string& name, const void* data, size_t nbytes, int32_t ggml_type,
                             int64_t rows, int64_t cols, const int32_t* row_perm) {
  Slot s = resolve(name);
  if (!s.buffer) {
    FANTAI_LOG(kDebug, "ignoring checkpoint tensor " << name);
    return false;
  }
  if (ggml_is_quant(ggml_type) && s.qparts) {
    QuantTensor t;
    try {
      t = ggml_decode(data, nbytes, ggml_type, rows, cols, row_perm);
    } catch (const InvalidArgument& e) {
      FANTAI_THROW("tensor " << name << ": " << e.what());
    }
    add_quant_part(s, name, t.view(), t.format);
    return true;
  }
  // Float tensors (and quantized norms, which are never kept quantized) go through f32.
  std::vector<float> f(static_cast<size_t>(rows * cols));
  ggml_to_f32(data, nbytes, ggml_type, rows, cols, row_perm, f.data());
  const std::vector<int64_t> shape = s.cols == 1 ? std::vector<int64_t>{rows * cols}
                                                 : std::vector<int64_t>{rows, cols};
  return set_local(name, f.data(), DType::kF32, shape);
}

namespace {
// The storage columns of `m` that hold original columns [col0, col0 + cols) (the act-order
// permutation maps storage column c to original column perm[c]), in storage order; false when
// a group would be cut (some but not all of its columns kept). One group per row (per channel)
// is never cut: every column keeps its row's one scale.
bool kept_columns(const QuantMatrix& m, int64_t col0, int64_t cols, std::vector<int64_t>* out) {
  out->clear();
  for (int64_t c = 0; c < m.cols; ++c) {
    const int64_t orig = m.perm ? m.perm[c] : c;
    if (orig >= col0 && orig < col0 + cols) out->push_back(c);
  }
  if (m.group >= m.cols) return true;
  for (int64_t g = 0; g < m.ngroups(); ++g) {
    const int64_t lo = g * m.group, hi = std::min<int64_t>(m.cols, lo + m.group);
    const int64_t in = std::count_if(out->begin(), out->end(), [&](int64_t c) { return c >= lo && c < hi; });
    if (in != 0 && in != hi - lo) return false;
  }
  return true;
}
}  // namespace

// GPTQ / AWQ under tensor parallelism: column-parallel tensors keep their output rows (with the
// rows' scales and zeros); row-parallel ones keep whole quantization groups of their input
// columns. A split that would cut a group is refused naming the sizes that keep every group whole.
bool Weights::set_quant(const std::string& name, const QuantMatrix& canonical, const std::string& format) {
  if (!shard_.active()) return set_quant_local(name, canonical, format);
  check_quant_matrix(canonical);
  const QuantMatrix& m = canonical;
  const ShardSelection sel = select_shard(shard_, name, m.rows, m.cols);
  if (sel.whole) return set_quant_local(name, canonical, format);
  FANTAI_REQUIRE(!sel.zero, "tensor " << name << " cannot come quantized under tensor parallelism");
  std::vector<int64_t> keep;
  const bool whole_groups = kept_columns(m, sel.col0, sel.cols, &keep);
  if (!whole_groups && m.perm && keep_whole(name)) {
    // Act-order scatters each group over the input columns, so a column split almost always
    // cuts groups: every rank holds the whole matrix instead (its memory; the compute is
    // repeated on each rank, which saves the all-reduce it would have needed).
    FANTAI_LOG(kInfo, "tensor " << name << " (act-order " << format << "): kept whole on every rank");
    return set_quant_local(name, canonical, format);
  }
  if (!whole_groups) {
    std::string sizes;
    for (int n : valid_tp_sizes(shard_.full)) {
      bool ok = true;
      for (int r = 0; r < n && ok; ++r) {
        TpShard t;
        shard_config(shard_.full, r, n, &t);
        const ShardSelection s = select_shard(t, name, m.rows, m.cols);
        std::vector<int64_t> k;
        ok = s.whole || kept_columns(m, s.col0, s.cols, &k);
      }
      if (ok) sizes += (sizes.empty() ? "" : ", ") + std::to_string(n);
    }
    FANTAI_THROW("tensor " << name << " (" << format << (m.perm ? ", act-order" : "") << ") cannot be split "
                           << shard_.world << " ways: each rank would take " << sel.cols << " of its "
                           << m.cols << " input columns, cutting quantization "
                           << "groups of " << m.group << "; valid sizes: " << sizes);
  }
  const int64_t rows = sel.num_rows(), cols = static_cast<int64_t>(keep.size());
  const int64_t ng = m.ngroups();
  // Kept groups in storage order: whole groups (or the one group of a per-channel matrix).
  std::vector<int64_t> groups;
  if (m.group >= m.cols) groups.push_back(0);
  else
    for (int64_t c : keep)
      if (groups.empty() || groups.back() != c / m.group) groups.push_back(c / m.group);
  const int64_t lng = static_cast<int64_t>(groups.size());
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  std::vector<float> scale(static_cast<size_t>(rows * lng)), mins(m.min ? scale.size() : 0);
  std::vector<uint8_t> zero(m.zero ? scale.size() : 0);
  int64_t lr = 0;
  for (const auto& [r0, n] : sel.rows)
    for (int64_t r = r0; r < r0 + n; ++r, ++lr) {
      const uint8_t* src = static_cast<const uint8_t*>(m.data) + r * m.ld;
      for (int64_t c = 0; c < cols; ++c) q[lr * cols + c] = src[keep[c]];
      for (int64_t g = 0; g < lng; ++g) {
        scale[lr * lng + g] = m.scale[r * ng + groups[g]];
        if (m.zero) zero[lr * lng + g] = m.zero[r * ng + groups[g]];
        if (m.min) mins[lr * lng + g] = m.min[r * ng + groups[g]];
      }
    }
  std::vector<int32_t> perm;
  if (m.perm)
    for (int64_t c : keep) perm.push_back(static_cast<int32_t>(m.perm[c] - sel.col0));
  QuantMatrix local = m;
  local.rows = rows;
  local.cols = cols;
  local.ld = cols;
  local.group = m.group >= m.cols ? static_cast<int32_t>(cols) : m.group;
  local.data = q.data();
  local.scale = scale.data();
  local.zero = m.zero ? zero.data() : nullptr;
  local.min = m.min ? mins.data() : nullptr;
  local.perm = m.perm ? perm.data() : nullptr;
  return set_quant_local(name, local, format);
}

// A dense layer's o / down (not an expert's): marks it whole, so resolve() gives it every input
// column and the forward gathers its input.
bool Weights::keep_whole(const std::string& name) {
  static const std::regex re(R"(model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return false;
  const int layer = std::stoi(m[1]);
  if (layer < 0 || layer >= config_.num_layers || config_.is_moe_layer(layer)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  (m[2] == "self_attn.o_proj" ? layers_[layer].o_whole : layers_[layer].down_whole) = true;
  return true;
}

bool Weights::set_quant_local(const std::string& name, const QuantMatrix& canonical,
                              const std::string& format) {
  Slot s = resolve(name);
  if (!s.buffer) {
    FANTAI_LOG(kDebug, "ignoring checkpoint tensor " << name);
    return false;
  }
  check_quant_matrix(canonical);
  add_quant_part(s, name, canonical, format);
  return true;
}

void Weights::finalize() {
  std::vector<std::string> missing;
  auto need = [&](const Buffer& b, const std::string& n) {
    if (!b.data()) missing.push_back(n);
  };
  auto need_linear = [&](const Buffer& b, const QuantParts& q, const std::string& n) {
    if (!b.data() && q.empty()) missing.push_back(n);
  };
  need_linear(embed_, embed_q_, "model.embed_tokens.weight");
  need(final_norm_, "model.norm.weight");
  for (int i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const LayerWeights& L = layers_[i];
    need(L.input_norm, p + "input_layernorm.weight");
    need_linear(L.qkv, L.qkv_q, p + "self_attn.{q,k,v}_proj.weight");
    need_linear(L.o, L.o_q, p + "self_attn.o_proj.weight");
    // Only rank 0 holds o's bias (it enters a sum of partials once); a whole o sums nothing.
    FANTAI_REQUIRE(!(L.o_whole && L.o_bias.data()),
                   "tensor " << p << "self_attn.o_proj.weight (act-order) cannot be split under tensor "
                             << "parallelism and is kept whole, which its bias does not support yet");
    need(L.post_norm, p + (config_.sandwich_norms ? "pre_feedforward_layernorm.weight"
                                                  : "post_attention_layernorm.weight"));
    if (config_.sandwich_norms) {
      need(L.post_attn_norm, p + "post_attention_layernorm.weight");
      need(L.post_mlp_norm, p + "post_feedforward_layernorm.weight");
    }
    if (config_.qk_norm) {
      need(L.q_norm, p + "self_attn.q_norm.weight");
      need(L.k_norm, p + "self_attn.k_norm.weight");
    }
    if (config_.is_moe_layer(i)) continue;  // its experts are checked below
    need_linear(L.gate_up, L.gate_up_q, p + "mlp.{gate,up}_proj.weight");
    need_linear(L.down, L.down_q, p + "mlp.down_proj.weight");
  }
  // Each fused buffer needs all its parts: count the loaded names per fused group.
  std::sort(loaded_.begin(), loaded_.end());
  loaded_.erase(std::unique(loaded_.begin(), loaded_.end()), loaded_.end());
  for (int i = 0; i < config_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    auto has = [&](const std::string& n) {
      return std::binary_search(loaded_.begin(), loaded_.end(), p + n);
    };
    // A fused checkpoint tensor (Phi-3) stands for all its parts.
    const bool fused_qkv = has("self_attn.qkv_proj.weight"), fused_gate_up = has("mlp.gate_up_proj.weight");
    const bool moe = config_.is_moe_layer(i);
    for (const char* part : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                             "mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
      const bool attn = std::string(part).rfind("self_attn", 0) == 0;
      if (moe && !attn) continue;
      if (!(attn ? fused_qkv : fused_gate_up) && !has(part)) missing.push_back(p + part);
    }
    if (moe) check_experts(i, &missing);
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    FANTAI_THROW("checkpoint is missing " << missing.size() << " tensor(s): " << list);
  }
  if (!lm_head_.data() && lm_head_q_.empty() && !config_.tie_word_embeddings) {
    FANTAI_LOG(kInfo, "no lm_head.weight in the checkpoint: tying it to the embedding");
  }
  if (lm_head_.data() || !lm_head_q_.empty()) tied_q_.clear();  // the checkpoint's own lm_head
  pack_layers();
  pack_lm_head();
  build_moe_views();
}

// The layer matrices move into the backend's packed layout when it has one for this dtype; each
// row-major original is freed as soon as its copy exists, so the weights never sit in memory
// twice. The embedding (and a tied lm_head) stay row-major: embedding() reads rows of them.
void Weights::pack_layers() {
  const ModelConfig& c = config_;
  for (LayerWeights& L : layers_) {
    if (L.packed || !L.qkv_q.empty() || !L.o_q.empty() || !L.gate_up_q.empty() || !L.down_q.empty()) continue;
    const int64_t H = c.hidden_size, qkv = c.q_dim() + 2 * c.kv_dim(), inter = c.intermediate_size;
    const struct {
      Buffer* b;
      int64_t n, k;
    } mats[] = {{&L.qkv, qkv, H}, {&L.o, H, c.q_dim()}, {&L.gate_up, 2 * inter, H}, {&L.down, H, inter}};
    const size_t count = L.experts.empty() ? 4 : 2;  // a sparse layer's MLP is its experts
    bool all = true;
    for (size_t i = 0; i < count; ++i)
      all = all && backend_->dense_packed_bytes(dtype_, mats[i].n, mats[i].k) > 0;
    if (!all) return;  // the same for every layer
    if (!L.experts.empty()) pack_experts(L);
    for (size_t i = 0; i < count; ++i) {
      const auto& mt = mats[i];
      Buffer packed = Buffer::weights(backend_, backend_->dense_packed_bytes(dtype_, mt.n, mt.k), false);
      backend_->pack_dense(mt.b->data(), dtype_, mt.n, mt.k, packed.data());
      *mt.b = std::move(packed);
    }
    L.packed = true;
  }
}

// Every sampled row crosses the lm_head (up to 64 rows a step in a batched decode), so a dense one
// goes into the packed layout too, as the layers do; the backend then runs it on the same tiles for
// every row count. An own matrix moves (the row-major original is freed); a tied one gets a packed
// copy beside the embedding, which embedding() still reads row by row, where the backend finds
// the copy worth its memory (Backend::packs_tied_lm_head).
void Weights::pack_lm_head() {
  const int64_t V = lm_head_rows(), H = config_.hidden_size;
  const bool own = lm_head_.data() != nullptr;
  const bool dense = own ? lm_head_q_.empty()
                         : embed_.data() != nullptr && embed_q_.empty() && lm_head_q_.empty();
  if (lm_head_packed_.data() || !dense || backend_->dense_packed_bytes(dtype_, V, H) == 0) return;
  if (!own && !backend_->packs_tied_lm_head()) return;
  Buffer packed = Buffer::weights(backend_, backend_->dense_packed_bytes(dtype_, V, H), false);
  backend_->pack_dense(own ? lm_head_.data() : tied_rows(), dtype_, V, H, packed.data());
  lm_head_packed_ = std::move(packed);
  if (own) lm_head_ = Buffer();
}

// Tied unless the checkpoint gave an lm_head of its own (dense or quantized).
const void* Weights::lm_head() const {
  if (lm_head_packed_.data()) return lm_head_packed_.data();
  if (lm_head_.data() || !lm_head_q_.empty()) return lm_head_.data();
  return tied_rows();
}

// A tied dense lm_head reads the embedding's rows in place: this rank's vocab slice of them.
const void* Weights::tied_rows() const {
  if (!embed_.data() || !shard_.active()) return embed_.data();
  return embed_.as<char>() + static_cast<size_t>(shard_.vocab0() * config_.hidden_size) * dtype_size(dtype_);
}

const QuantParts& Weights::lm_head_q() const {
  if (lm_head_packed_.data() || lm_head_.data() || !lm_head_q_.empty()) return lm_head_q_;
  return shard_.active() ? tied_q_ : embed_q_;
}

size_t Weights::lm_head_bytes() const {
  size_t n = lm_head_.bytes() + lm_head_packed_.bytes();
  for (const QuantParts* q : {&lm_head_q_, &tied_q_})
    for (const QuantPart& p : *q) n += p.mem.bytes();
  return n;
}

size_t Weights::total_bytes() const {
  auto parts = [](const QuantParts& q) {
    size_t n = 0;
    for (const QuantPart& p : q) n += p.mem.bytes();
    return n;
  };
  size_t total = embed_.bytes() + final_norm_.bytes() + lm_head_.bytes() + lm_head_packed_.bytes() +
                 parts(embed_q_) + parts(lm_head_q_) + parts(tied_q_);
  for (const LayerWeights& L : layers_) {
    total += L.q_norm.bytes() + L.k_norm.bytes() + L.post_attn_norm.bytes() + L.post_mlp_norm.bytes();
    total += L.input_norm.bytes() + L.qkv.bytes() + L.qkv_bias.bytes() + L.o.bytes() + L.o_bias.bytes() +
             L.post_norm.bytes() + L.gate_up.bytes() + L.down.bytes() + parts(L.qkv_q) + parts(L.o_q) +
             parts(L.gate_up_q) + parts(L.down_q) + expert_bytes(L);
  }
  return total;
}

}  // namespace fantai::model
