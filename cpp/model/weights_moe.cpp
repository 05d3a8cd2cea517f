// model: the weights of mixture-of-experts layers — expert and router names (Mixtral's and
// Qwen3-MoE's), transformers' fused 3-D expert tensors, checks, packing and the backend's view.
#include <algorithm>
#include <regex>
#include <tuple>

#include "common/check.h"
#include "model/weights.h"

namespace fantai::model {

void Weights::init_experts() {
  for (int i = 0; i < config_.num_layers; ++i)
    if (config_.is_moe_layer(i)) layers_[i].experts.resize(static_cast<size_t>(config_.num_experts));
}

// Router: block_sparse_moe.gate (Mixtral) or mlp.gate (Qwen3-MoE), kept in f32: it is small and
// decides which experts run. Experts: block_sparse_moe.experts.E.w1 / w3 / w2 (Mixtral's gate, up,
// down) or mlp.experts.E.gate_proj / up_proj / down_proj, each into its expert's fused gate|up or
// down, quantized online like any projection when asked.
bool Weights::resolve_expert(const std::string& name, Slot* slot) {
  static const std::regex re(
      R"(model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.(gate|experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj))\.weight)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return false;
  const int layer = std::stoi(m[1]);
  if (layer < 0 || layer >= config_.num_layers || !config_.is_moe_layer(layer)) return false;
  LayerWeights& L = layers_[layer];
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size, E = config_.num_experts;
  if (m[3] == "gate") {
    *slot = {&L.router, E, 0, E, H, true};
    return true;
  }
  const int64_t e = std::stoll(m[4]);
  if (e >= E) return false;
  ExpertWeights& X = L.experts[static_cast<size_t>(e)];
  const std::string part = m[5];
  if (part == "w1" || part == "gate_proj") *slot = {&X.gate_up, 2 * I, 0, I, H, false, &X.gate_up_q, true};
  else if (part == "w3" || part == "up_proj") *slot = {&X.gate_up, 2 * I, I, I, H, false, &X.gate_up_q, true};
  else *slot = {&X.down, H, 0, H, I, false, &X.down_q, true};
  return true;
}

// transformers keeps a layer's experts as two 3-D parameters, mlp.experts.gate_up_proj
// [experts, 2 * inter, hidden] and mlp.experts.down_proj [experts, hidden, inter]; its
// save_pretrained writes them back per expert, but a checkpoint saved without that conversion has
// them fused. Each expert's slice is set under its per-expert name.
bool Weights::set_fused_experts(const std::string& name, const void* data, DType src_dtype,
                                const std::vector<int64_t>& shape) {
  static const std::regex re(
      R"(model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj))");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return false;
  // The checkpoint's sizes (a tensor-parallel rank's own config has 1/N of the expert width):
  // each full expert slice goes through set(), which keeps this rank's share.
  const ModelConfig& full = shard_.active() ? shard_.full : config_;
  const int64_t H = full.hidden_size, I = full.moe_intermediate_size, E = full.num_experts;
  const bool gate_up = m[3] == "gate_up_proj";
  const std::vector<int64_t> want = gate_up ? std::vector<int64_t>{E, 2 * I, H}
                                            : std::vector<int64_t>{E, H, I};
  FANTAI_REQUIRE(shape == want, "tensor " << name << " is [" << shape[0] << ", " << shape[1] << ", "
                                          << shape[2] << "], expected [" << want[0] << ", " << want[1] << ", "
                                          << want[2] << "] from config.json");
  const std::string p = "model.layers." + std::string(m[1]) + ".mlp.experts.";
  const size_t es = dtype_size(src_dtype), per_expert = static_cast<size_t>(want[1] * want[2]) * es;
  const char* base = static_cast<const char*>(data);
  for (int64_t e = 0; e < E; ++e) {
    const char* w = base + static_cast<size_t>(e) * per_expert;
    const std::string q = p + std::to_string(e);
    if (gate_up) {
      set(q + ".gate_proj.weight", w, src_dtype, {I, H});
      set(q + ".up_proj.weight", w + static_cast<size_t>(I * H) * es, src_dtype, {I, H});
    } else {
      set(q + ".down_proj.weight", w, src_dtype, {H, I});
    }
  }
  return true;
}

// After finalize sorted loaded_: the router and every expert's three matrices, in either naming.
void Weights::check_experts(int layer, std::vector<std::string>* missing) const {
  const LayerWeights& L = layers_[layer];
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  auto loaded = [&](const std::string& a, const std::string& b) {
    return std::binary_search(loaded_.begin(), loaded_.end(), a) ||
           std::binary_search(loaded_.begin(), loaded_.end(), b);
  };
  if (!L.router.data()) missing->push_back(p + "mlp.gate.weight");
  for (int e = 0; e < config_.num_experts; ++e) {
    const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
    const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
    if (!loaded(q + "gate_proj.weight", x + "w1.weight")) missing->push_back(q + "gate_proj.weight");
    if (!loaded(q + "up_proj.weight", x + "w3.weight")) missing->push_back(q + "up_proj.weight");
    if (!loaded(q + "down_proj.weight", x + "w2.weight")) missing->push_back(q + "down_proj.weight");
  }
}

// Dense experts go into the backend's packed layout with the rest of their layer (AMX tiles for
// bf16 on the CPU), each original freed once its copy exists; a layer with any quantized expert
// keeps them all as they are.
void Weights::pack_experts(LayerWeights& L) {
  const int64_t H = config_.hidden_size, I = config_.moe_intermediate_size;
  if (L.experts_packed || backend_->dense_packed_bytes(dtype_, 2 * I, H) == 0 ||
      backend_->dense_packed_bytes(dtype_, H, I) == 0)
    return;
  for (const ExpertWeights& X : L.experts)
    if (!X.gate_up_q.empty() || !X.down_q.empty() || !X.gate_up.data() || !X.down.data()) return;
  for (ExpertWeights& X : L.experts) {
    for (auto [b, n, k] : {std::tuple<Buffer*, int64_t, int64_t>{&X.gate_up, 2 * I, H}, {&X.down, H, I}}) {
      Buffer packed = Buffer::weights(backend_, backend_->dense_packed_bytes(dtype_, n, k), false);
      backend_->pack_dense(b->data(), dtype_, n, k, packed.data());
      *b = std::move(packed);
    }
  }
  L.experts_packed = true;
}

namespace {

MoeLinear moe_linear(const Buffer& dense, const QuantParts& parts, const std::string& what) {
  MoeLinear l;
  l.dense = dense.data();
  FANTAI_REQUIRE(parts.size() <= 2, what << " has " << parts.size() << " quantized parts (at most 2)");
  for (const QuantPart& p : parts) {
    l.parts[l.num_parts] = p.w;
    l.part_row0[l.num_parts++] = p.row0;
  }
  return l;
}

}  // namespace

void Weights::build_moe_views() {
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerWeights& L = layers_[i];
    L.moe_view.clear();
    for (size_t e = 0; e < L.experts.size(); ++e) {
      const ExpertWeights& X = L.experts[e];
      const std::string what = "layer " + std::to_string(i) + " expert " + std::to_string(e);
      L.moe_view.push_back({moe_linear(X.gate_up, X.gate_up_q, what + " gate|up"),
                            moe_linear(X.down, X.down_q, what + " down")});
    }
  }
}

MoeExperts Weights::moe_experts(int i) const {
  const LayerWeights& L = layers_[i];
  MoeExperts m;
  m.num_experts = static_cast<int32_t>(L.moe_view.size());
  m.hidden = config_.hidden_size;
  m.inter = config_.moe_intermediate_size;
  m.dtype = dtype_;
  m.packed = L.experts_packed;
  m.experts = L.moe_view.data();
  return m;
}

size_t Weights::expert_bytes(const LayerWeights& L) const {
  size_t n = L.router.bytes();
  for (const ExpertWeights& X : L.experts) {
    n += X.gate_up.bytes() + X.down.bytes();
    for (const QuantPart& p : X.gate_up_q) n += p.mem.bytes();
    for (const QuantPart& p : X.down_q) n += p.mem.bytes();
  }
  return n;
}

}  // namespace fantai::model
