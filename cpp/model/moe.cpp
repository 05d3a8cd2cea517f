// model: a sparse layer's MLP — the router, then the chosen experts, all in backend ops.
#include <algorithm>

#include "model/model.h"

namespace fantai::model {

// The router is an f32 linear on the normed rows (transformers: in the model's dtype; a bf16
// router weight is exact in f32, and routing is where a rounding flips which experts run).
void Model::moe_block(int layer, int32_t n) {
  const ModelConfig& c = config_;
  Backend* be = backend_.get();
  const int32_t E = c.num_experts, k = c.num_experts_per_tok;
  if (n > moe_capacity_) {
    const int32_t cap = std::max(n, moe_capacity_ * 2);
    router_logits_ = Buffer(be, static_cast<size_t>(cap) * E * sizeof(float));
    moe_ids_ = Buffer(be, static_cast<size_t>(cap) * k * sizeof(int32_t));
    moe_weights_ = Buffer(be, static_cast<size_t>(cap) * k * sizeof(float));
    moe_capacity_ = cap;
  }
  const LayerWeights& L = weights_.layer(layer);
  be->linear(normed_.as<float>(), L.router.data(), DType::kF32, nullptr, router_logits_.as<float>(), n, E,
             c.hidden_size);
  be->moe_route(router_logits_.as<float>(), n, E, k, c.norm_topk_prob, moe_ids_.as<int32_t>(),
                moe_weights_.as<float>());
  be->moe_experts(normed_.as<float>(), moe_ids_.as<int32_t>(), moe_weights_.as<float>(), n, k,
                  weights_.moe_experts(layer), proj_out_.as<float>());
  be->communicator().all_reduce_sum(proj_out_.as<float>(), static_cast<int64_t>(n) * c.hidden_size);
}

}  // namespace fantai::model
