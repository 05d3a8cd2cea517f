// model: the decoder's weights in backend memory, fused for one GEMM per projection group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/buffer.h"
#include "model/model_config.h"
#include "model/tp_shard.h"

namespace fantai::model {

// A row range of a linear held quantized in the backend's packed layout. A fused matrix may be
// made of parts in different formats (GGUF Q4_K_M stores attn_v as Q6_K beside Q4_K attn_q);
// each part writes its own column slice of the output.
struct QuantPart {
  int64_t row0 = 0;  // first output row of the fused matrix
  Buffer mem;        // backend memory holding the packed matrix
  QuantMatrix w;     // view into mem, w.rows rows
};
using QuantParts = std::vector<QuantPart>;

// One expert of a mixture-of-experts layer, held as the dense MLP's matrices are (weights_moe.cpp).
struct ExpertWeights {
  Buffer gate_up;  // [2 * moe_intermediate, hidden]; rows gate | up
  Buffer down;     // [hidden, moe_intermediate]
  QuantParts gate_up_q, down_q;
};

struct LayerWeights {
  Buffer input_norm;  // [hidden] f32
  Buffer qkv;         // [q_dim + 2 * kv_dim, hidden] weight dtype; rows q | k | v
  Buffer qkv_bias;    // [q_dim + 2 * kv_dim] f32, empty without bias
  Buffer o;           // [hidden, q_dim]
  Buffer o_bias;      // [hidden] f32 or empty
  Buffer post_norm;   // [hidden] f32, the norm before the MLP (Gemma's pre_feedforward_layernorm)
  // Qwen3 / Gemma 3: q_norm, k_norm [head_dim] f32. Gemma 2 / 3 (sandwich norms): the norms of
  // the attention output and of the MLP output [hidden] f32. Empty for other families.
  Buffer q_norm, k_norm, post_attn_norm, post_mlp_norm;
  Buffer gate_up;  // [2 * intermediate, hidden]; rows gate | up
  Buffer down;     // [hidden, intermediate]
  // Quantized row ranges of the same matrices; a dense buffer above exists only when some part
  // of it came dense (its rows under a quantized part are zero and get overwritten).
  QuantParts qkv_q, o_q, gate_up_q, down_q;
  // qkv/o/gate_up/down hold the backend's packed dense layout (Backend::pack_dense) instead of
  // row-major; set by Weights::finalize for layers with no quantized part.
  bool packed = false;
  // Tensor parallelism, act-order GPTQ: an o / down whose act-order groups every split would cut
  // is kept whole on every rank and fed the ranks' gathered inputs (Model::row_parallel).
  bool o_whole = false, down_whole = false;
  // A sparse layer (ModelConfig::is_moe_layer) has no gate_up / down above but a router
  // [num_experts, hidden] in f32 and its experts; moe_view describes them to the backend
  // (Backend::moe_experts) once finalize has packed them (experts_packed) or not.
  Buffer router;
  std::vector<ExpertWeights> experts;
  std::vector<MoeExpert> moe_view;
  bool experts_packed = false;
};

// How a linear is split across tensor-parallel ranks: column-parallel splits output rows
// (q/k/v, gate/up), row-parallel splits the input dim (o, down) and is followed by an all-reduce.
enum class ShardRule : uint8_t { kReplicated, kColumn, kRow };

// Owns every weight; filled tensor by tensor with Hugging Face names, then finalize() checks that
// nothing is missing. Norms and biases are kept in f32; matrices in `dtype`.
class Weights {
 public:
  // quantization: "none", or "int8" / "int4" to quantize dense q/k/v/o/gate/up/down matrices as
  // they are set (round to nearest: int8 per channel, int4 in groups of 32, both symmetric).
  Weights(const ModelConfig& config, DType dtype, Backend* backend, const std::string& quantization = "none");

  // Copies (converting) one checkpoint tensor into place. Unknown names are ignored (returns
  // false), shape mismatches throw. data: row-major in src_dtype. set, set_ggml and set_quant may
  // be called from several threads at once for different tensors (the loader converts in
  // parallel); everything else is single-threaded.
  bool set(const std::string& name, const void* data, DType src_dtype, const std::vector<int64_t>& shape);
  // A GGUF tensor [rows, cols] in ggml type `ggml_type` (raw bytes). Block formats stay
  // quantized; F32/F16/BF16 become the dense dtype (or are quantized online). Destination row i
  // takes source row row_perm[i] when row_perm is given.
  bool set_ggml(const std::string& name, const void* data, size_t nbytes, int32_t ggml_type, int64_t rows,
                int64_t cols, const int32_t* row_perm = nullptr);
  // A canonical quantized matrix (GPTQ / AWQ / RTN checkpoints); `format` is reported as is.
  bool set_quant(const std::string& name, const QuantMatrix& canonical, const std::string& format);
  void finalize();  // throws listing missing tensors; ties lm_head to the embedding if needed
  // Tensor parallelism: the setters above take full checkpoint tensors and keep this rank's
  // share (model/tp_shard); the config given to the constructor is already the share's.
  void set_shard(const TpShard& shard) { shard_ = shard; }

  DType dtype() const { return dtype_; }
  const Buffer& embed() const { return embed_; }            // [vocab, hidden]
  const Buffer& final_norm() const { return final_norm_; }  // [hidden] f32
  // [vocab, hidden] row-major, or the backend's packed layout when lm_head_packed().
  const void* lm_head() const;
  bool lm_head_packed() const { return lm_head_packed_.data() != nullptr; }
  const QuantParts& embed_q() const { return embed_q_; }  // empty unless quantized
  // The lm_head's quantized parts: its own, or the embedding's when tied (never a dense copy).
  // Under tensor parallelism a tied quantized lm_head is a packed copy of this rank's vocab rows
  // of the embedding (the embedding itself stays whole: every rank looks up every token).
  const QuantParts& lm_head_q() const;
  // Rows of lm_head() / lm_head_q(): the vocab size, or this rank's vocab slice under tensor
  // parallelism (TpShard::vocab_rows).
  int64_t lm_head_rows() const { return shard_.active() ? shard_.vocab_rows() : config_.vocab_size; }
  // Bytes this rank keeps for the lm_head alone (0 for a tied one read from the embedding itself).
  size_t lm_head_bytes() const;
  const std::string& quantization() const { return quantization_; }
  // Hugging Face name -> resident format ("q4_1", "int4g32", "bf16", "f32", ...).
  const std::map<std::string, std::string>& formats() const { return formats_; }
  // Hugging Face name -> bytes the backend keeps for that tensor when it is held quantized (its
  // packed layout: values, scales, mins, zeros, padding), to set beside the file's bytes.
  const std::map<std::string, size_t>& quant_bytes() const { return quant_bytes_; }
  const LayerWeights& layer(int i) const { return layers_[i]; }
  // The experts of sparse layer i as the backend takes them (valid after finalize).
  MoeExperts moe_experts(int i) const;
  size_t total_bytes() const;

 private:
  // Where one checkpoint tensor goes: rows [row_offset, row_offset + rows) of `buffer`, which is
  // lazily allocated with `total_rows` rows.
  struct Slot {
    Buffer* buffer = nullptr;
    int64_t total_rows = 0;
    int64_t row_offset = 0;
    int64_t rows = 0;
    int64_t cols = 0;              // 1 for vectors
    bool f32 = false;              // norms and biases stay f32
    QuantParts* qparts = nullptr;  // where quantized row ranges of this matrix go
    bool projection = false;       // q/k/v/o/gate/up/down: quantized online when asked
    bool norm = false;             // an RMSNorm weight: Gemma's (1 + w) is folded in at load
  };
  Slot resolve(const std::string& name);
  bool set_local(const std::string& name, const void* data, DType src_dtype,
                 const std::vector<int64_t>& shape);
  bool set_ggml_local(const std::string& name, const void* data, size_t nbytes, int32_t ggml_type,
                      int64_t rows, int64_t cols, const int32_t* row_perm);
  bool set_quant_local(const std::string& name, const QuantMatrix& canonical, const std::string& format);
  bool set_resolved(const Slot& s, const std::string& name, const void* data, DType src_dtype);
  // Mixture of experts (weights_moe.cpp): expert and router names, transformers' fused 3-D expert
  // tensors split into experts, the finalize checks, packing and the backend's descriptors.
  void init_experts();
  bool resolve_expert(const std::string& name, Slot* slot);
  bool set_fused_experts(const std::string& name, const void* data, DType src_dtype,
                         const std::vector<int64_t>& shape);
  void check_experts(int layer, std::vector<std::string>* missing) const;
  void pack_experts(LayerWeights& L);
  void build_moe_views();
  size_t expert_bytes(const LayerWeights& L) const;
  void add_quant_part(const Slot& s, const std::string& name, const QuantMatrix& canonical,
                      const std::string& format);
  void pack_layers();
  void pack_lm_head();
  void add_tied_slice(const QuantMatrix& embed);
  bool keep_whole(const std::string& name);
  const void* tied_rows() const;
  void copy_rows(Buffer& dst, int64_t row_offset, int64_t rows, int64_t cols, const void* src,
                 DType src_dtype, DType dst_dtype);

  ModelConfig config_;
  TpShard shard_;
  DType dtype_;
  Backend* backend_;
  std::string quantization_;
  Buffer embed_, final_norm_, lm_head_;
  Buffer lm_head_packed_;  // the dense lm_head (own or tied) in the backend's packed layout
  QuantParts embed_q_, lm_head_q_;
  QuantParts tied_q_;  // tensor parallelism: this rank's rows of a quantized embedding, for a tied lm_head
  std::map<std::string, std::string> formats_;
  std::map<std::string, size_t> quant_bytes_;
  std::vector<LayerWeights> layers_;
  std::vector<std::string> loaded_;
  // Guards the bookkeeping the setters share (parts lists, lazily made fused buffers, loaded_,
  // formats_); conversion and packing run outside it.
  std::mutex mu_;
};

ShardRule shard_rule(const std::string& hf_name);

// Loads *.safetensors (single file or sharded with model.safetensors.index.json) from a model
// directory into `weights`, memory-mapping each file and converting tensor by tensor.
void load_safetensors_dir(const std::string& dir, Weights* weights);

}  // namespace fantai::model
