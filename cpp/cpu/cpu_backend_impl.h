// cpu: the CPU Backend class, shared by its rooms: construction and memory (cpu_backend.cpp),
// linears dense, packed and quantized (cpu_backend_linear.cpp), the KV store and paged attention
// (cpu_backend_attention.cpp), norms, RoPE, SiLU-mul, embedding and add (cpu_backend_misc.cpp),
// mixture-of-experts routing and experts (cpu_backend_moe.cpp).
// Each op checks its arguments, splits the work over the thread pool and calls the kernel table
// of the chosen ISA; splitting never changes a row's arithmetic (see kernels.h). Private to cpu/.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/kernels_amx.h"
#include "cpu/qkernels.h"
#include "cpu/thread_pool.h"

namespace fantai::cpu {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Below this many multiply-adds (or bytes moved) an op runs on the calling thread: waking the
// pool costs more than it saves.
constexpr int64_t kParallelMinWork = 1 << 15;
// Weight bytes a decode chunk of a quantized linear streams before the op is cut finer than a
// chunk per thread: ~70 us at a core's ~15 GB/s, against a few us of fixed costs per chunk.
constexpr int64_t kDecodeChunkBytes = int64_t{1} << 20;
// Weight bytes of a prefill chunk of a quantized linear: with a 64-row block of int8 activations
// (~37 KiB at k = 576) it fits the smallest L2 fantai runs on (Zen 2/3: 512 KiB).
constexpr int64_t kPanelChunkBytes = int64_t{256} << 10;

class CpuBackend final : public Backend {
 public:
  CpuBackend(Isa isa, int num_threads);

  std::string name() const override { return "cpu"; }
  int num_threads() const override { return pool_.size(); }
  std::vector<int> bind_threads(const std::string& spec, int offset) override;

  void* alloc(size_t bytes) override;
  void* alloc_weights(size_t bytes) override;
  void free(void* ptr) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void release_pages(void* ptr, size_t bytes) override;

  void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m, int64_t n,
              int64_t k) override;

  bool set_matmul_precision(DType precision) override;

  size_t dense_packed_bytes(DType dt, int64_t n, int64_t k) const override;
  void pack_dense(const void* w, DType dt, int64_t n, int64_t k, void* dst) override;

  void linear_packed(const float* x, const void* packed, DType dt, const float* bias, float* y, int64_t m,
                     int64_t n, int64_t k) override;
  // AMX only: the pair layout gains nothing on the lm_head's DRAM-bound decode.
  bool packs_tied_lm_head() const override { return amx_; }

  bool mlp_packed(const float* x, const void* gate_up, const void* down, DType dt, float* out, int64_t m,
                  int64_t inter, int64_t hidden) override;

  size_t quant_packed_bytes(const QuantMatrix& canonical) const override;
  QuantMatrix pack_quant(const QuantMatrix& canonical, void* dst) override;

  void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                int64_t ldy) override;
  void linear_q_parts(const float* x, const QuantMatrix* const* parts, const int64_t* row0, int n_parts,
                      const float* bias, float* y, int64_t m, int64_t ldy) override;

  void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out) override;

  void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                float eps) override;

  void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                    int64_t dim, float eps) override;

  void rms_norm_heads(float* x, int64_t stride, int64_t num_tokens, int32_t num_heads, int32_t head_dim,
                      const float* weight, float eps) override;
  void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
            int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
            int32_t rotary_dim, const float* cos_sin) override;

  void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                int64_t num_tokens, void* k_cache, void* v_cache, const KVLayout& L) override;

  void plan_attention(const KVLayout& L, const AttentionParams& p, int32_t num_q_heads) override;
  void end_attention_plan() override;
  void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                 const KVLayout& L, const AttentionParams& p, int32_t num_q_heads, float scale,
                 float* out) override;

  void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) override;
  void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) override;
  void scale(float* x, float s, int64_t n) override;
  void softcap(float* x, float cap, int64_t n) override;

  void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim,
                 float* out) override;

  void add(float* x, const float* y, int64_t n) override;

  void moe_route(const float* logits, int64_t rows, int32_t num_experts, int32_t top_k, bool renormalize,
                 int32_t* ids, float* weights) override;
  void moe_experts(const float* x, const int32_t* ids, const float* weights, int64_t rows, int32_t top_k,
                   const MoeExperts& experts, float* out) override;

 private:
  // A step's attention work, planned once and run per layer (cpu_backend_attention.cpp).
  static constexpr int kAttnQTile = 16;  // query rows per work item
  struct AttnPlan {
    bool active = false;  // made by plan_attention, not yet ended
    KVLayout layout;
    AttentionParams params;
    int32_t num_q_heads = 0;
    std::vector<AttnItem> items;     // without the per-layer pointers
    std::vector<int64_t> first_row;  // each item's first query row
    // Decode rows split over key partitions (split_rows): one Split per (row, KV head), its
    // items' index in splits (-1: a whole item). The split's last item to finish folds it.
    struct Split {
      int64_t parts;        // head 0's first partition state, in floats into attn_partial_
      int64_t head_stride;  // floats from one head's states to the next's
      int64_t out;          // head 0's output, in floats from the call's out
      int32_t nparts, heads, runs;
    };
    std::vector<int32_t> split_of;
    std::vector<Split> splits;
    int64_t partial_floats = 0;
    std::vector<AttnItem> spare_items;  // split_rows' rebuild, swapped in (keeps both capacities)
    std::vector<int64_t> spare_rows;
    std::vector<int32_t> spare_split;
  };
  void build_attention_plan(const KVLayout& L, const AttentionParams& p, int32_t num_q_heads,
                            AttnPlan* plan) const;
  void split_rows(AttnPlan* plan) const;
  bool amx_attention(const KVLayout& L) const;
  // One plan per attention kind of the step (full, each window: their block tables differ);
  // grow-only, the first num_plans_ active.
  std::vector<AttnPlan> plans_;
  size_t num_plans_ = 0;
  std::vector<float> attn_scratch_;  // attention()'s per-thread scratch; the step thread is the only caller
  std::vector<float> attn_partial_;  // split rows' partition states (grow-only, as attn_scratch_)
  std::unique_ptr<std::atomic<int32_t>[]> attn_done_;  // per split: its items finished (grow-only)
  size_t attn_done_size_ = 0;

  // How many column chunks a linear of m x n x k (weight_bytes of weights, row_blocks row blocks)
  // is cut into. Prefill: about 4 tasks a thread (dynamic balance). Decode streams the weights
  // once: a chunk per thread, more (whole rounds of T, up to 4) only where each keeps
  // kDecodeChunkBytes to stream, so a chunk's fixed costs (its claim, its prefetch stream
  // starting cold, the join's tail) stay small next to its reads. Per-thread chunks ran
  // SmolLM2's Q4_1 decode (0.2-1.1 MB matrices) 6-9% faster than 4 a thread (medians of 8
  // alternated pairs each).
  int64_t linear_chunks(int64_t m, int64_t n, int64_t k, int64_t weight_bytes, int64_t row_blocks) const {
    const int T = pool_.size();
    if (m * n * k < kParallelMinWork || T == 1) return 1;
    if (m == 1) return std::min<int64_t>(ceil_div(ceil_div(weight_bytes, kDecodeChunkBytes), T), 4) * T;
    return ceil_div(4 * T, row_blocks);
  }

  // The one split of a dense or f32-dequant linear over the pool: rows in blocks of 64 (an x block
  // stays in L2 while weight tiles stream past it), columns in 16-aligned chunks, linear_chunks of
  // them (weight_bytes: the matrix's size). fn(r0, r1, j0, j1) computes rows [r0, r1) x cols [j0, j1).
  template <typename Fn>
  void for_each_linear_tile(int64_t m, int64_t n, int64_t k, int64_t weight_bytes, const Fn& fn) {
    const int64_t row_block = 64;
    const int64_t row_blocks = ceil_div(m, row_block);
    const int64_t want_chunks = linear_chunks(m, n, k, weight_bytes, row_blocks);
    int64_t col_chunk = (ceil_div(n, want_chunks) + 15) / 16 * 16;
    col_chunk = std::max<int64_t>(16, std::min<int64_t>(col_chunk, 2048));
    const int64_t col_chunks = ceil_div(n, col_chunk);
    pool_.parallel_for(row_blocks * col_chunks, [&](int64_t t, int) {
      const int64_t r0 = t / col_chunks * row_block, j0 = t % col_chunks * col_chunk;
      fn(r0, std::min(m, r0 + row_block), j0, std::min(n, j0 + col_chunk));
    });
  }

  static uint16_t* aligned64(std::vector<uint16_t>& v);
  void split_packed(const float* x, int64_t m, int64_t n, int64_t k, uint16_t** hi_out, uint16_t** lo_out);
  void run_packed(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed, int64_t n,
                  const float* bias, float* y, const AmxActOut* act);
  void linear_panel(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy);
  // linear_panel's halves: x to int8 blocks (member scratch), then the parts' panels over the pool.
  QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int32_t block);
  void run_panels(const QuantizedRows& xq, const QuantMatrix* const* parts, const int64_t* row0, int n_parts,
                  const float* bias, float* y, int64_t m, int64_t ldy);

  // Runs f(row) for every row, spread over the pool in contiguous runs when there is enough work.
  template <typename F>
  void for_rows(int64_t rows, int64_t work_per_row, F&& f) {
    if (rows <= 0) return;
    if (rows == 1 || rows * work_per_row < kParallelMinWork || pool_.size() == 1) {
      for (int64_t r = 0; r < rows; ++r) f(r);
      return;
    }
    const int64_t tasks = std::min<int64_t>(rows, 4 * pool_.size());
    pool_.parallel_for(tasks, [&](int64_t t, int) {
      const int64_t r0 = rows * t / tasks, r1 = rows * (t + 1) / tasks;
      for (int64_t r = r0; r < r1; ++r) f(r);
    });
  }

  static constexpr size_t kMapThreshold = size_t{1} << 20;

  Isa isa_;
  const KernelTable& k_;
  const QKernelTable& qk_;
  // Quantized matrices use the panel path (int8 activations: VNNI, AVX2 or portable) unless
  // FANTAI_QUANT_KERNEL=f32 asks for the f32-dequant kernels (exact activations).
  const char* panel_name_ = "scalar";
  LinearPanelFn panel_fn_ = nullptr;
  int64_t decode_panels_ = 1;  // PanelKernels::decode_panels
  QuantizeRowsFn quant_rows_fn_ = quantize_rows_int8;
  LinearPanelFn amx_panel_fn_ = nullptr;  // AMX int8 twin of panel_fn_, or none
  static constexpr int64_t kAmxPanelMinRows = 16;
  static constexpr int64_t kAmxChunkBytes = 512 << 10;  // bf16 weights per linear_packed task
  bool panel_ = false;
  bool amx_ = false;  // bf16 dense matrices are packed into AMX tiles at load
  // bf16 matrices off AMX: row-major (linear), or packed at load (FANTAI_BF16_LAYOUT).
  CpuSwitches::Bf16Layout bf16_layout_ = CpuSwitches::Bf16Layout::kPairs;
  // The kernel of the packed bf16 layout (pairs or groups); nullptr when bf16 stays row-major.
  decltype(KernelTable::linear_bf16_pairs) bf16_packed_fn_ = nullptr;
  bool bf16_act_ = false;  // set_matmul_precision(kBF16) on AMX: one bf16 part, not two (or three)
  ThreadPool pool_;
  std::vector<float> perm_scratch_;        // linear_q act-order gather; the step thread is the only caller
  std::vector<uint16_t> amx_hi_, amx_lo_;  // linear_packed's bf16 halves of x; likewise
  std::vector<uint16_t> amx_act_hi_, amx_act_lo_;  // mlp_packed's activation halves; likewise
  std::vector<int8_t> xq_q_;                       // linear_panel's int8 activations; likewise
  std::vector<float> xq_d_;
  std::vector<int32_t> xq_s_;
  // Mixture of experts (cpu_backend_moe.cpp): grow-only scratch; the step thread is the only caller.
  void moe_linear(const float* x, const MoeLinear& L, const MoeExperts& ex, float* y, int64_t m, int64_t n,
                  int64_t k);
  // Experts side by side, one pool task each, when no expert has more rows than this.
  static constexpr int64_t kMoeSideBySideRows = 4;
  struct MoeTaskScratch {  // one pool thread's int8 activations
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> s;
  };
  void moe_linear_one_thread(const float* x, const MoeLinear& L, const MoeExperts& ex, float* y, int64_t m,
                             int64_t n, int64_t k, MoeTaskScratch* xq);
  bool moe_experts_fit_one_thread(const MoeExperts& ex, const int64_t* offsets) const;
  std::vector<float> moe_probs_, moe_x_, moe_y_, moe_gu_, moe_side_;
  std::vector<int64_t> moe_offsets_, moe_slots_;
  std::vector<int32_t> moe_active_;
  std::vector<MoeTaskScratch> moe_task_scratch_;
  std::mutex mapped_mu_;
  std::unordered_map<void*, size_t> mapped_;  // mmap-backed buffers and their lengths
  // Weight slabs (alloc_weights): huge-page-aligned mappings that small tensors share, by base
  // address; a slab goes back to the OS when its last tensor is freed. Under mapped_mu_.
  struct Slab {  // kSlabBytes long
    size_t used = 0;
    int64_t live = 0;
  };
  std::map<char*, Slab> slabs_;
  char* open_slab_ = nullptr;  // where the next small tensor goes
  bool huge_pages_ = true;     // FANTAI_HUGEPAGES=0: the same slabs, no MADV_HUGEPAGE (A/B)
  static constexpr size_t kHugePage = size_t{2} << 20, kSlabBytes = size_t{8} << 20;
  void* map_aligned(size_t bytes);
};

}  // namespace fantai::cpu
