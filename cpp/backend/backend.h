// backend: the one seam between the model and its kernels (cpu/ always, cuda/ optionally).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/op_types.h"
#include "common/types.h"

namespace fantai {

// Collective ops for tensor parallelism. The single-process implementation is a no-op that costs a
// virtual call; the MPI one (backend/mpi_communicator) plugs in under the same calls, so the model
// never knows how many ranks there are beyond the shapes it was sharded to.
// What a communicator spent: calls and payload bytes of the all-reduces, and wall seconds spent
// inside any collective (waiting included). Zero in one process.
struct CommStats {
  int64_t all_reduce_calls = 0;
  int64_t all_reduce_bytes = 0;
  int64_t gather_calls = 0;  // the vocab-parallel logits gathers (bytes: what this rank sent)
  int64_t gather_bytes = 0;
  double seconds = 0.0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const { return 0; }
  virtual int world_size() const { return 1; }
  virtual void all_reduce_sum(float* /*data*/, int64_t /*n*/) {}
  virtual void all_gather(const float* in, float* out, int64_t n);  // out = in when world_size==1
  // Every rank sends its n floats; `root` receives them in rank order into out (counts[r] floats
  // from rank r, read on root only; out and counts unused elsewhere). in / out are the backend's
  // memory, as for all_reduce_sum. One process: out = in (no copy when they are the same buffer).
  virtual void gather(const float* in, int64_t n, float* out, const int64_t* counts, int root = 0);
  // `bytes` from `root` to every rank. idle: a wait that may be long in coming (a rank > 0 waiting
  // for the next step: no deadline; rank 0 waiting for ranks still loading: a start-up deadline).
  virtual void broadcast(void* /*data*/, int64_t /*bytes*/, int /*root*/, bool /*idle*/ = false) {}
  virtual CommStats stats() const { return {}; }
  // The step loop of a tensor-parallel group (engine/tp_worker): kStepsRunning once the ranks
  // shook hands, kStepsStopped once rank 0 sent the stop and (on a rank > 0) it arrived. Only a
  // group that stopped so is finalized (mpi_finalize).
  enum : int { kStepsNone = 0, kStepsRunning = 1, kStepsStopped = 2 };
  std::atomic<int> steps_state{kStepsNone};
  // Whose steps_state stands for the group: this one, or the host (MPI) communicator a device
  // one (NCCL) runs beside, so the step loop and mpi_finalize read the same state.
  virtual Communicator& steps_owner() { return *this; }
};

// Coarse ops over raw pointers. All activations are f32, row-major. Implementations must be
// batch invariant: a row's result may not depend on how many other rows are in the call or on the
// thread count (same reduction order), so batching and chunked prefill never change tokens.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int num_threads() const = 0;
  // Pins the backend's host threads by a --cpu-bind spec ("compact", "spread", a CPU list;
  // offset: see cpu/cpu_topology.h) and returns the CPU of each thread; empty where the backend
  // has no host threads to pin (a GPU's).
  virtual std::vector<int> bind_threads(const std::string& /*spec*/, int /*offset*/) { return {}; }

  // Memory on the backend's device (host memory for cpu). Aligned to 64 bytes.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  // Memory for a model's weights: written once at load, then streamed by every step until the
  // model goes. The cpu backend carves it out of huge-page slabs (see CpuBackend::alloc_weights);
  // free() takes it back like any other.
  virtual void* alloc_weights(size_t bytes) { return alloc(bytes); }
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  // Host memory <-> backend memory. On cpu both sides are host memory, so a memcpy; a device
  // backend overrides them. copy() above is backend memory to backend memory only.
  virtual void upload(void* dst, const void* host_src, size_t bytes) { std::memcpy(dst, host_src, bytes); }
  virtual void download(void* host_dst, const void* src, size_t bytes) { std::memcpy(host_dst, src, bytes); }
  // Host memory for the KV swap space, and copies between it and backend memory. A device
  // backend pins it and copies on its stream without waiting: the host never reads swap memory,
  // and stream order puts a swap-out before the forward that reuses its blocks. On cpu, plain
  // (lazily backed) memory and a memcpy.
  virtual void* alloc_host(size_t bytes) { return alloc(bytes); }
  virtual void free_host(void* ptr) { free(ptr); }
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) {
    std::memcpy(host_dst, src, bytes);
  }
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) {
    std::memcpy(dst, host_src, bytes);
  }
  // True when alloc() returns memory the host cannot dereference: the model then uploads the
  // per-step metadata (token ids, positions, slots, block tables) once per step and downloads
  // the logits once, instead of handing host pointers to the ops.
  virtual bool is_device() const { return false; }
  // Free bytes of the backend's memory for sizing the KV pool; < 0 means host memory (the engine
  // then applies its own RAM-based default).
  virtual int64_t free_memory() const { return -1; }
  // Greedy sampling where the logits live: tokens[r] = argmax of logits row r (ties to the lowest
  // id) and logprobs[r] = its log-softmax, both written to host memory, so a device backend
  // returns 2 numbers per row instead of the vocab-wide row. Returns false when the backend leaves
  // sampling to the host sampler (cpu).
  virtual bool sample_greedy(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                             float* logprobs) {
    return false;
  }
  // Top-k / top-p sampling where the logits live, with the host sampler's rules (sampling/
  // sampler.cpp) for a plain row (sampling::plain_row). Per row r, all host arrays:
  // temperature[r] > 0, top_k[r] (<= 0 or >= vocab: off), top_p[r] in (0, 1], uniform[r] in
  // [0, 1) (sampling::device_uniform of the row's draw). tokens[r] and logprobs[r] (the token's
  // log-softmax under the raw logits) are written to host memory; tokens[r] = -1 for a row with
  // NaN, +inf or only -inf logits (the host sampler refuses such a row). rows == 0 probes.
  // Returns false when the backend leaves this to the host sampler (cpu).
  virtual bool sample_top_k_top_p(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                                  const int32_t* top_k, const float* top_p, const float* uniform,
                                  int32_t* tokens, float* logprobs) {
    return false;
  }
  // Gives the physical pages of [ptr, ptr + bytes) back (contents become undefined, the range
  // stays valid and is backed again on the next write). Default: keep them.
  virtual void release_pages(void* ptr, size_t bytes) {}

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when bias != nullptr). w is row-major in w_dtype.
  virtual void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m,
                      int64_t n, int64_t k) = 0;

  // out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight[:]; out may alias x.
  virtual void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                        float eps) = 0;

  // residual[r, :] += x[r, :]; then out[r, :] = rms_norm(residual[r, :]). Fused for one pass.
  virtual void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                            int64_t dim, float eps) = 0;

  // Per-head RMSNorm in place (Qwen3's and Gemma 3's q_norm / k_norm): x [num_tokens, stride]
  // holds num_heads heads of head_dim from its first float; each is normalised and scaled by
  // weight [head_dim].
  virtual void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads,
                              int32_t head_dim, const float* weight, float eps) = 0;

  // Rotary embedding, rotate-half (GPT-NeoX / HF Llama) convention, in place on
  // q [num_tokens, q_stride] holding num_q_heads heads of head_dim and
  // k [num_tokens, k_stride] holding num_kv_heads heads (strides in floats, so q and k may be
  // column slices of one fused qkv buffer). The first rotary_dim floats of each head rotate (all
  // of it unless partial_rotary_factor < 1); the rest pass. cos_sin: [max_positions, rotary_dim]
  // with cos of the rotary_dim/2 frequencies in the first half of a row and sin in the second.
  virtual void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
                    int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                    int32_t rotary_dim, const float* cos_sin) = 0;

  // Scatters new keys/values into their slots. k, v: [num_tokens, stride] with num_kv_heads *
  // head_dim used floats per row. slot_mapping: [num_tokens]; slot < 0 means skip the token.
  // k_cache / v_cache are whole layer buffers (layout.bytes(), int8 scales included).
  virtual void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                        int64_t num_tokens, void* k_cache, void* v_cache, const KVLayout& layout) = 0;

  // Attention is planned once per step and run per layer (FlashInfer's plan / run): the model
  // calls plan_attention with the step's layout, metadata and head count before its first layer
  // and end_attention_plan after its last (or when it throws). An attention() call with that same
  // layout, metadata and head count reuses the plan (work items built, block ids checked once);
  // any other call plans for itself. A model whose layers differ in window (so in KV pool and
  // block tables) plans once per kind; every plan stays until end_attention_plan. The default has
  // nothing to plan.
  virtual void plan_attention(const KVLayout& /*layout*/, const AttentionParams& /*p*/,
                              int32_t /*num_q_heads*/) {}
  virtual void end_attention_plan() {}

  // Paged causal attention (prefill chunks and decodes mixed) with grouped-query heads.
  // q: [num_tokens, q_stride] with num_q_heads * head_dim used; out: [num_tokens, num_q_heads *
  // head_dim]. Query head h reads KV head h / (num_q_heads / num_kv_heads). scale multiplies q.k;
  // p.logit_softcap, when set, then caps the score; p.window, when set, limits each query to the
  // last window keys, and the blocks before a sequence's first query's window are never read.
  virtual void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                         const KVLayout& layout, const AttentionParams& p, int32_t num_q_heads, float scale,
                         float* out) = 0;

  // out[r, :] = silu(gate_up[r, :inter]) * gate_up[r, inter:2*inter]
  virtual void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) = 0;
  // out[r, :] = gelu_pytorch_tanh(gate_up[r, :inter]) * gate_up[r, inter:2*inter] (GeGLU)
  virtual void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) = 0;

  // out[i, :] = table[ids[i], :] converted to f32. table: [vocab, dim] in dtype.
  virtual void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim,
                         float* out) = 0;

  // x[i] += y[i]
  virtual void add(float* x, const float* y, int64_t n) = 0;
  // x[i] *= s (Gemma's scaled embeddings)
  virtual void scale(float* x, float s, int64_t n) = 0;
  // x[i] = cap * tanh(x[i] / cap) (Gemma 2's final logit soft-capping)
  virtual void softcap(float* x, float cap, int64_t n) = 0;

  // Quantized weights. pack_quant copies a canonical QuantMatrix into `dst` (quant_packed_bytes
  // of this backend's memory, from alloc) in the backend's own layout and returns the view that
  // linear_q / embedding_q take. Defaults throw, so a backend without them still builds.
  virtual size_t quant_packed_bytes(const QuantMatrix& canonical) const;
  virtual QuantMatrix pack_quant(const QuantMatrix& canonical, void* dst);
  // y[r, j] = x[r, :] . w[j, :] (+ bias[j]) for r < m, j < w.rows; x: [m, w.cols]; y row stride
  // ldy floats (so a row-part of a fused matrix writes its column slice). Batch invariant.
  virtual void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                        int64_t ldy);
  // The row parts of one fused matrix (q | k | v, gate | up), part i writing y's columns from
  // row0[i] (its bias from bias + row0[i]): linear_q on each, the default. A backend may run
  // them as one op with the same results (the CPU backend: one activation quantization and one
  // pool dispatch for a decode step's q, k and v instead of three of each). Callers pass at most
  // kMaxLinearParts, so neither side allocates per call.
  static constexpr int kMaxLinearParts = 4;
  virtual void linear_q_parts(const float* x, const QuantMatrix* const* parts, const int64_t* row0,
                              int n_parts, const float* bias, float* y, int64_t m, int64_t ldy);
  // out[i, :] = dequantized row ids[i] of `table` (original column order), [n, table.cols].
  virtual void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out);

  // Dense matrices in a backend-owned layout (the CPU backend, bf16: AMX tiles, else the vector
  // kernels' pair layout). When
  // dense_packed_bytes is 0 the backend keeps `dt` matrices row-major for linear() (the default)
  // and the other two are never called. pack_dense copies w [n, k] into dst (that many bytes of
  // this backend's memory); linear_packed is linear() on the packed copy, y row stride n. A
  // matrix packed once is run packed for every m, so a row's result never depends on the batch.
  virtual size_t dense_packed_bytes(DType dt, int64_t n, int64_t k) const;
  virtual void pack_dense(const void* w, DType dt, int64_t n, int64_t k, void* dst);
  virtual void linear_packed(const float* x, const void* packed, DType dt, const float* bias, float* y,
                             int64_t m, int64_t n, int64_t k);
  // Whether a tied lm_head gets a packed copy beside the embedding (which stays row-major for
  // embedding lookups): worth its memory only where the packed kernel is much faster on it.
  virtual bool packs_tied_lm_head() const { return true; }
  // The MLP on packed matrices in one call: out = (silu(x . gate^T) * (x . up^T)) . down^T, with
  // gate_up [2 * inter, hidden] (gate rows first) and down [hidden, inter] packed by pack_dense;
  // bit for bit linear_packed + silu_mul + linear_packed. false (the default): no fused path for
  // these shapes, and the caller runs those three.
  virtual bool mlp_packed(const float* x, const void* gate_up, const void* down, DType dt, float* out,
                          int64_t m, int64_t inter, int64_t hidden);

  // Mixture-of-experts routing, per row of the router's logits [rows, num_experts]: the softmax
  // over all experts in f32, its top_k largest (ties to the lower expert id), largest first, into
  // ids [rows, top_k] and their probabilities into weights [rows, top_k], divided by the sum of
  // those top_k when renormalize (Mixtral always; Qwen3-MoE when norm_topk_prob). A row's result
  // depends on that row alone. Default: throws.
  virtual void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k,
                         bool renormalize, int32_t* ids, float* weights);
  // The experts' SwiGLU MLPs, out [rows, hidden] = for each row r, over its top_k experts e = ids[r, j]
  // in ascending expert id, the sum of weights[r, j] * down_e . (silu(gate_e . x[r]) * (up_e . x[r]))
  // (transformers' order: a zero row, then each expert's weighted output added). The rows routed
  // to one expert run as one batch through the backend's own linears, so each expert's matrices
  // are read once per call, not once per row; the linears are batch invariant, so a row's result
  // never depends on which experts the other rows chose. ids, weights: from moe_route (backend
  // memory). Default: throws.
  virtual void moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows,
                           int32_t top_k, const MoeExperts& experts, float* out);

  // Precision of the activations that meet bf16 matrices in a matrix unit: the inputs of
  // linears on bf16 weights, and attention's queries and softmax weights over a bf16 KV cache.
  // kF32 (the default) keeps them f32-grade. kBF16 lets the backend round them to bf16 where that
  // makes the product faster, as torch's bf16 matmul, llama.cpp and vLLM's CPU backend always do
  // (the CPU backend on AMX: half the tile work in linears, a third in attention). Accumulation,
  // norms, the residual stream and the softmax itself stay f32. Returns whether this backend now
  // rounds (false where it has no such unit, or for kF32). Set it before the first forward; rows
  // stay batch invariant in either mode.
  virtual bool set_matmul_precision(DType precision);

  Communicator& communicator() { return *comm_; }
  void set_communicator(std::shared_ptr<Communicator> comm) { comm_ = std::move(comm); }

 protected:
  std::shared_ptr<Communicator> comm_ = std::make_shared<Communicator>();
};

// Registry: "cpu" is always present; "cuda" when built with FANTAI_CUDA and a device is found.
// num_threads <= 0 means the cores this process may run on.
std::shared_ptr<Backend> create_backend(const std::string& name, int num_threads = 0);
std::vector<std::string> available_backends();
// The communicator every backend made from here on gets (tensor parallelism: one per process).
void set_process_communicator(std::shared_ptr<Communicator> comm);
std::shared_ptr<Communicator> process_communicator();

// The host CPU, whatever backend runs the model: the sampler's row reductions (cpu/row_reduce.h)
// from the CPU kernel table of the active ISA level, that level's name ("avx512", "avxvnni",
// "avx2", "scalar"; FANTAI_CPU_ISA lowers it), every level this CPU can run (lowest first), and the
// threads a CPU backend gets when none are asked for (affinity capped by the cgroup quota).
struct RowReductions {
  MaxSumExp (*max_sum_exp)(const float* l, int32_t n) = nullptr;
  int32_t (*argmax)(const float* l, int32_t n) = nullptr;
};
const RowReductions& host_row_reductions();
const char* host_cpu_isa();
std::vector<std::string> host_cpu_isa_levels();
int host_default_threads();

}  // namespace fantai
