// cpu: the CPU Backend — argument checks, work splitting over the thread pool, and dispatch to
// the kernel table of the chosen ISA. Splitting never changes a row's arithmetic (see kernels.h).
#include "cpu/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/logging.h"
#include "cpu/cpu_features.h"
#include "cpu/cpu_quota.h"
#include "cpu/kernels.h"
#include "cpu/kernels_amx.h"
#include "cpu/qkernels.h"
#include "cpu/thread_pool.h"

namespace fantai::cpu {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Below this many multiply-adds (or bytes moved) an op runs on the calling thread: waking the
// pool costs more than it saves.
constexpr int64_t kParallelMinWork = 1 << 15;

class CpuBackend final : public Backend {
 public:
  CpuBackend(Isa isa, int num_threads)
      : isa_(isa), k_(kernels_for(isa)), qk_(qkernels_for(isa)), pool_(num_threads) {
    // Every ISA level has the int8-activation panel kernels, bit-equal to each other, so a
    // quantized model gives the same bits on AVX2, AVX-512 and portable builds' linears.
    const char* qk = std::getenv("FANTAI_QUANT_KERNEL");
    FANTAI_REQUIRE(!qk || !*qk || !std::strcmp(qk, "f32") || !std::strcmp(qk, "int8") || !std::strcmp(qk, "vnni"),
                   "FANTAI_QUANT_KERNEL='" << qk << "' not understood (int8|f32)");
    const PanelKernels pk = panel_kernels_for(isa);
    panel_name_ = pk.name;
    panel_fn_ = pk.linear;
    quant_rows_fn_ = pk.quantize;
    panel_ = !(qk && !std::strcmp(qk, "f32"));
    // AMX only on top of AVX-512 (the activation split uses it); FANTAI_AMX=0 turns it off (A/B).
    const char* amx = std::getenv("FANTAI_AMX");
    FANTAI_REQUIRE(!amx || !*amx || !std::strcmp(amx, "0") || !std::strcmp(amx, "1"),
                   "FANTAI_AMX='" << amx << "' not understood (0|1)");
    const bool amx_ok = isa == Isa::kAvx512 && !(amx && !std::strcmp(amx, "0"));
    amx_ = amx_ok && amx_usable();
    // Bit-equal to the VNNI kernel, so a call may take either by its row count.
    if (amx_ok && !std::strcmp(pk.name, "vnni")) amx_panel_fn_ = amx_int8_linear_panel();
    FANTAI_LOG(kDebug, "cpu backend: isa=" << k_.name << " threads=" << pool_.size()
                                           << " quantized kernels=" << (panel_ ? panel_name_ : "f32")
                                           << " amx=" << (amx_ ? "on" : "off")
                                           << " amx int8=" << (amx_panel_fn_ ? "on" : "off"));
  }

  std::string name() const override { return "cpu"; }
  int num_threads() const override { return pool_.size(); }

  // Large buffers (the KV pool, weights) get their own anonymous mapping: reserved, not
  // committed, so pages are backed only when first written, and never recycled from a heap that
  // other allocations already touched (the pool's resident size must mean what it says).
  void* alloc(size_t bytes) override {
    if (bytes >= kMapThreshold) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      std::lock_guard<std::mutex> lock(mapped_mu_);
      mapped_[p] = bytes;
      return p;
    }
    const size_t n = (std::max<size_t>(bytes, 1) + 63) & ~size_t{63};  // aligned_alloc wants a multiple
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void free(void* ptr) override {
    {
      std::lock_guard<std::mutex> lock(mapped_mu_);
      auto it = mapped_.find(ptr);
      if (it != mapped_.end()) {
        munmap(ptr, it->second);
        mapped_.erase(it);
        return;
      }
    }
    std::free(ptr);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }

  // Only whole pages inside the range go back; the partial pages at its ends are kept.
  void release_pages(void* ptr, size_t bytes) override {
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + page - 1) & ~(page - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(page - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

  // The one split of a linear over the pool (dense and quantized): rows in blocks of 64 (an x block
  // stays in L2 while weight tiles stream past it), columns in 16-aligned chunks sized for a few
  // tasks per thread (dynamic balance). fn(r0, r1, j0, j1) computes rows [r0, r1) x cols [j0, j1).
  template <typename Fn>
  void for_each_linear_tile(int64_t m, int64_t n, int64_t k, const Fn& fn) {
    const int64_t row_block = 64;
    const int64_t row_blocks = ceil_div(m, row_block);
    const int T = pool_.size();
    const int64_t want_chunks = (m * n * k < kParallelMinWork || T == 1) ? 1 : ceil_div(4 * T, row_blocks);
    int64_t col_chunk = (ceil_div(n, want_chunks) + 15) / 16 * 16;
    col_chunk = std::max<int64_t>(16, std::min<int64_t>(col_chunk, 2048));
    const int64_t col_chunks = ceil_div(n, col_chunk);
    pool_.parallel_for(row_blocks * col_chunks, [&](int64_t t, int) {
      const int64_t r0 = t / col_chunks * row_block, j0 = t % col_chunks * col_chunk;
      fn(r0, std::min(m, r0 + row_block), j0, std::min(n, j0 + col_chunk));
    });
  }

  void linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m,
              int64_t n, int64_t k) override {
    FANTAI_REQUIRE(m >= 0 && n >= 0 && k > 0, "linear: bad shape m=" << m << " n=" << n << " k=" << k);
    FANTAI_REQUIRE(w_dtype != DType::kI8, "linear: int8 is a KV-cache-only dtype");
    if (m == 0 || n == 0) return;
    const auto fn = k_.linear;
    for_each_linear_tile(m, n, k, [&](int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
      fn(x + r0 * k, w, w_dtype, bias, y + r0 * n, r1 - r0, n, k, j0, j1);
    });
  }

  // Only the AMX kernels have a cheaper bf16 form: the vector kernels multiply in f32 anyway.
  bool set_matmul_precision(DType precision) override {
    Backend::set_matmul_precision(precision);  // checks the name
    bf16_act_ = amx_ && precision == DType::kBF16;
    return bf16_act_;
  }

  size_t dense_packed_bytes(DType dt, int64_t n, int64_t k) const override {
    return amx_ && dt == DType::kBF16 && n > 0 && k > 0 ? amx_packed_bytes(n, k) : 0;
  }
  void pack_dense(const void* w, DType dt, int64_t n, int64_t k, void* dst) override {
    FANTAI_REQUIRE(dense_packed_bytes(dt, n, k) > 0, "pack_dense: no packed layout for " << dtype_name(dt)
                                                       << " [" << n << ", " << k << "] on this cpu backend");
    amx_pack_bf16(static_cast<const uint16_t*>(w), n, k, dst);
  }

  // AMX: x split into bf16 hi/lo rows once per call (per row, so batch invariant), then tasks of
  // a column chunk x a row block over the pool; each task sets up and releases the tiles of its
  // thread.
  void linear_packed(const float* x, const void* packed, DType dt, const float* bias, float* y, int64_t m,
                     int64_t n, int64_t k) override {
    FANTAI_REQUIRE(m >= 0 && n > 0 && k > 0, "linear_packed: bad shape m=" << m << " n=" << n << " k=" << k);
    FANTAI_REQUIRE(amx_ && dt == DType::kBF16, "linear_packed: matrix was not packed by this cpu backend");
    if (m == 0) return;
    uint16_t *hi, *lo;
    split_packed(x, m, n, k, &hi, &lo);
    run_packed(hi, lo, m, k, packed, n, bias, y, nullptr);
  }

  // gate|up with silu(gate) * up fused into its tiles' epilogue, written straight as the down
  // projection's bf16 halves: the f32 gate|up rows (m x 2 inter), the silu_mul pass and the split
  // of its output never touch memory. Same bits as linear_packed + silu_mul + linear_packed.
  bool mlp_packed(const float* x, const void* gate_up, const void* down, DType dt, float* out, int64_t m,
                  int64_t inter, int64_t hidden) override {
    if (!amx_ || dt != DType::kBF16 || m <= 0 || inter <= 0 || hidden <= 0 || inter % 32 != 0) return false;
    uint16_t *hi, *lo;
    split_packed(x, m, 2 * inter, hidden, &hi, &lo);
    const size_t need = static_cast<size_t>(amx_m_pad(m) * inter) + 32;
    if (amx_act_hi_.size() < need) amx_act_hi_.resize(need);
    if (!bf16_act_ && amx_act_lo_.size() < need) amx_act_lo_.resize(need);  // bf16 activations: no lo
    const AmxActOut act{aligned64(amx_act_hi_), bf16_act_ ? nullptr : aligned64(amx_act_lo_), inter};
    run_packed(hi, lo, m, hidden, gate_up, 2 * inter, nullptr, nullptr, &act);
    run_packed(act.hi, act.lo, m, inter, down, hidden, nullptr, out, nullptr);
    return true;
  }

  // 64-byte aligned start of a grow-only buffer (sized with 32 elements of slack): a tile row that
  // straddles two cache lines made the tile loads ~35% slower.
  static uint16_t* aligned64(std::vector<uint16_t>& v) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(v.data());
    return v.data() + ((64 - a % 64) % 64) / 2;
  }

  // x [m, k] into bf16 halves, [amx_m_pad(m), amx_k_pad(k)] with zero padding (every element the
  // tiles read). n only sizes the call (tiny calls run as one task).
  void split_packed(const float* x, int64_t m, int64_t n, int64_t k, uint16_t** hi_out, uint16_t** lo_out) {
    const int64_t kp = amx_k_pad(k), mp = amx_m_pad(m);
    // Grow-only scratch: a fresh zeroed vector per call cost a memset of both halves per linear.
    const size_t need = static_cast<size_t>(mp * kp) + 32;
    if (amx_hi_.size() < need) amx_hi_.resize(need);
    if (!bf16_act_ && amx_lo_.size() < need) amx_lo_.resize(need);
    uint16_t* const hi = aligned64(amx_hi_);
    uint16_t* const lo = bf16_act_ ? nullptr : aligned64(amx_lo_);
    const bool whole = m * n * k < kParallelMinWork || pool_.size() == 1;
    const int64_t split_block = 64, split_blocks = whole ? 1 : ceil_div(m, split_block);
    pool_.parallel_for(split_blocks, [&](int64_t t, int) {
      const int64_t r0 = whole ? 0 : t * split_block, r1 = whole ? m : std::min(m, r0 + split_block);
      amx_split_rows(x, k, r0, r1, std::min(mp, amx_m_pad(r1)), hi, lo);
    });
    *hi_out = hi;
    *lo_out = lo;
  }

  // amx_linear_bf16 over the pool (act: the fused gate|up, whose units are gate blocks paired with
  // their up blocks).
  void run_packed(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed, int64_t n,
                  const float* bias, float* y, const AmxActOut* act) {
    const int T = pool_.size();
    // One task for tiny calls. One thread still takes column chunks: they are for the cache, not
    // the pool (a single task sweeping all of gate|up's 3.5 MB per row tile from L3 ran 4.7x slower).
    const bool one = m * n * k < kParallelMinWork;
    // Column chunks of at most kAmxChunkBytes of weights, as many as a multiple of the pool's size:
    // a chunk stays in L2 while every row tile of its task sweeps it. Rows are split only when
    // there are fewer chunks than threads. (Tasks of 64 rows x all columns re-read every weight
    // once per 64 rows; m = 16..256 calls are 1.2-1.5x faster this way.)
    const int64_t kp = amx_k_pad(k);
    const int64_t blocks = act ? n / 32 : ceil_div(n, 16), block_bytes = kp / 32 * 1024 * (act ? 2 : 1);
    int64_t chunks = one ? 1 : ceil_div(blocks, std::max<int64_t>(1, kAmxChunkBytes / block_bytes));
    if (!one) chunks = std::min(blocks, ceil_div(chunks, T) * T);
    const int64_t chunk = ceil_div(blocks, chunks);
    chunks = ceil_div(blocks, chunk);
    const int64_t row_blocks = one ? 1 : std::min(ceil_div(m, 16), std::max<int64_t>(1, ceil_div(T, chunks)));
    const int64_t row_block = ceil_div(ceil_div(m, row_blocks), 16) * 16;
    pool_.parallel_for(ceil_div(m, row_block) * chunks, [&](int64_t t, int) {
      const int64_t rb = t / chunks, cb = t % chunks;
      amx_linear_bf16(hi, lo, m, k, packed, n, bias, y, n, rb * row_block, (rb + 1) * row_block,
                      cb * chunk, (cb + 1) * chunk, act);
    });
  }

  size_t quant_packed_bytes(const QuantMatrix& canonical) const override {
    return panel_ ? cpu_quant_panel_bytes(canonical) : cpu_quant_packed_bytes(canonical);
  }
  QuantMatrix pack_quant(const QuantMatrix& canonical, void* dst) override {
    return panel_ ? cpu_pack_quant_panel(canonical, dst) : cpu_pack_quant(canonical, dst);
  }

  void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                int64_t ldy) override {
    FANTAI_REQUIRE(w.layout == kCpuQuantLayout || (is_panel_layout(w.layout) && panel_fn_),
                   "linear_q: matrix was not packed by this cpu backend");
    FANTAI_REQUIRE(m >= 0 && ldy >= w.rows, "linear_q: bad shape m=" << m << " ldy=" << ldy);
    if (m == 0) return;
    const int64_t n = w.rows, k = w.cols;
    // Act-order: gather the activation columns once so the kernel reads x in stored order.
    // The scratch is a member so act-order matrices allocate only when a batch outgrows it.
    if (w.perm) {
      perm_scratch_.resize(std::max(perm_scratch_.size(), static_cast<size_t>(m * k)));
      float* gathered = perm_scratch_.data();
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c) gathered[r * k + c] = x[r * k + w.perm[c]];
      x = gathered;
    }
    if (is_panel_layout(w.layout)) return linear_panel(x, w, bias, y, m, ldy);
    const auto fn = qk_.linear_q;
    for_each_linear_tile(m, n, k, [&](int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
      fn(x + r0 * k, w, bias, y + r0 * ldy, r1 - r0, ldy, j0, j1);
    });
  }

  void embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out) override {
    FANTAI_REQUIRE(table.layout == kCpuQuantLayout || is_panel_layout(table.layout),
                   "embedding_q: table was not packed by the cpu backend");
    for (int64_t i = 0; i < n; ++i)
      FANTAI_REQUIRE(ids[i] >= 0 && ids[i] < table.rows, "embedding: token id " << ids[i] << " at "
                                                          << i << " is outside [0, " << table.rows << ")");
    const int64_t k = table.cols;
    const auto fn = is_panel_layout(table.layout) ? panel_dequant_row : qk_.dequant_row;
    std::vector<float> tmp(table.perm ? static_cast<size_t>(n * k) : 0);
    for_rows(n, k, [&](int64_t i) {
      if (!table.perm) return fn(table, ids[i], out + i * k);
      float* t = tmp.data() + i * k;
      fn(table, ids[i], t);
      for (int64_t c = 0; c < k; ++c) out[i * k + table.perm[c]] = t[c];
    });
  }

  // The panel path: activations to int8 blocks once per call (per row, so batch invariant), then
  // 16-row panels spread over the pool like the dense linear's column chunks.
  void linear_panel(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy) {
    const int64_t k = w.cols, panels = ceil_div(w.rows, 16);
    const int32_t block = xq_block(w);
    QuantizedRows xq;
    xq.nblocks = ceil_div(k, block);
    xq.ld = xq.nblocks * block;
    // Grow-only scratch (quantize_rows_int8 writes every element, padding included).
    if (xq_q_.size() < static_cast<size_t>(m * xq.ld)) xq_q_.resize(static_cast<size_t>(m * xq.ld));
    if (xq_d_.size() < static_cast<size_t>(m * xq.nblocks)) {
      xq_d_.resize(static_cast<size_t>(m * xq.nblocks));
      xq_s_.resize(static_cast<size_t>(m * xq.nblocks));
    }
    // Rows are independent; a prefill's worth is split over the pool (it ran on one thread and
    // took a fifth of a Q4_1 prefill).
    const QuantizeRowsFn quant = quant_rows_fn_;
    const int64_t qchunk = 16, qchunks = m * k < kParallelMinWork ? 1 : ceil_div(m, qchunk);
    pool_.parallel_for(qchunks, [&](int64_t t, int) {
      const int64_t r0 = qchunks == 1 ? 0 : t * qchunk, r1 = qchunks == 1 ? m : std::min(m, r0 + qchunk);
      quant(x + r0 * k, r1 - r0, k, block, xq_q_.data() + r0 * xq.ld, xq_d_.data() + r0 * xq.nblocks,
            xq_s_.data() + r0 * xq.nblocks);
    });
    xq.q = xq_q_.data();
    xq.d = xq_d_.data();
    xq.s = xq_s_.data();
    // AMX tiles take 16 rows at a time and unpack each panel once per task: taller row blocks.
    const bool amx = amx_panel_fn_ && m >= kAmxPanelMinRows;
    const int64_t row_block = amx ? 128 : 64;
    const int64_t row_blocks = ceil_div(m, row_block);
    const int T = pool_.size();
    const int64_t want = (m * w.rows * k < kParallelMinWork || T == 1) ? 1 : ceil_div(4 * T, row_blocks);
    // Decode tiles are 4 panels wide (4 independent vpdpbusd chains): keep chunks whole tiles.
    const int64_t chunk = m == 1 ? 4 * std::max<int64_t>(1, (panels + 2 * want) / (4 * want))
                                 : std::max<int64_t>(1, ceil_div(panels, want));
    const int64_t chunks = ceil_div(panels, chunk);
    const LinearPanelFn fn = amx ? amx_panel_fn_ : panel_fn_;
    pool_.parallel_for(row_blocks * chunks, [&](int64_t t, int) {
      const int64_t rb = t / chunks, cb = t % chunks;
      const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
      const int64_t p0 = cb * chunk, p1 = std::min(panels, p0 + chunk);
      QuantizedRows part = xq;
      part.q += r0 * xq.ld;
      part.d += r0 * xq.nblocks;
      part.s += r0 * xq.nblocks;
      fn(part, w, bias, y + r0 * ldy, r1 - r0, ldy, p0, p1);
    });
  }

  void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                float eps) override {
    FANTAI_REQUIRE(dim > 0 && rows >= 0, "rms_norm: bad shape rows=" << rows << " dim=" << dim);
    const auto fn = k_.rms_norm;
    for_rows(rows, dim, [&](int64_t r) { fn(x + r * dim, weight, out + r * dim, dim, eps); });
  }

  void add_rms_norm(float* residual, const float* x, const float* weight, float* out, int64_t rows,
                    int64_t dim, float eps) override {
    FANTAI_REQUIRE(dim > 0 && rows >= 0, "add_rms_norm: bad shape rows=" << rows << " dim=" << dim);
    const auto fn = k_.add_rms_norm;
    for_rows(rows, dim, [&](int64_t r) {
      fn(residual + r * dim, x + r * dim, weight, out + r * dim, dim, eps);
    });
  }

  void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int32_t* positions,
            int64_t num_tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
            const float* cos_sin) override {
    FANTAI_REQUIRE(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim must be even, got " << head_dim);
    const auto fn = k_.rope;
    for_rows(num_tokens, static_cast<int64_t>(num_q_heads + num_kv_heads) * head_dim, [&](int64_t t) {
      const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
      fn(q + t * q_stride, num_q_heads, head_dim, cs);
      fn(k + t * k_stride, num_kv_heads, head_dim, cs);
    });
  }

  void store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                int64_t num_tokens, void* k_cache, void* v_cache, const KVLayout& L) override {
    FANTAI_REQUIRE(L.block_size > 0 && L.num_kv_heads > 0 && L.head_dim > 0,
                   "store_kv: bad KV layout");
    const int64_t hd = L.head_dim, slots = static_cast<int64_t>(L.num_blocks) * L.block_size;
    for (int64_t t = 0; t < num_tokens; ++t)
      FANTAI_REQUIRE(slot_mapping[t] < slots, "store_kv: slot " << slot_mapping[t] << " of token "
                                              << t << " is past the cache (" << slots << " slots)");
    const size_t es = dtype_size(L.dtype);
    const bool i8 = L.dtype == DType::kI8;
    float* k_scales = i8 ? reinterpret_cast<float*>(static_cast<char*>(k_cache) + L.scales_offset()) : nullptr;
    float* v_scales = i8 ? reinterpret_cast<float*>(static_cast<char*>(v_cache) + L.scales_offset()) : nullptr;
    for_rows(num_tokens, 2 * L.num_kv_heads * hd, [&](int64_t t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) return;
      const int64_t blk = slot / L.block_size, off = slot % L.block_size;
      for (int h = 0; h < L.num_kv_heads; ++h) {
        const int64_t row = (blk * L.num_kv_heads + h) * L.block_size + off, dst = row * hd;
        const float* ks = k + t * stride + h * hd;
        const float* vs = v + t * stride + h * hd;
        if (i8) {
          k_scales[row] = quantize_row_i8(ks, static_cast<int8_t*>(k_cache) + dst, hd);
          v_scales[row] = quantize_row_i8(vs, static_cast<int8_t*>(v_cache) + dst, hd);
        } else {
          convert_from_f32(ks, static_cast<char*>(k_cache) + dst * es, L.dtype, hd);
          convert_from_f32(vs, static_cast<char*>(v_cache) + dst * es, L.dtype, hd);
        }
      }
    });
  }

  void attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                 const KVLayout& L, const AttentionParams& p, int32_t num_q_heads, float scale,
                 float* out) override;

  void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) override {
    const auto fn = k_.silu_mul;
    for_rows(rows, inter, [&](int64_t r) {
      fn(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
    });
  }

  void embedding(const int32_t* ids, int64_t n, const void* table, DType dtype, int64_t dim,
                 float* out) override {
    FANTAI_REQUIRE(dtype != DType::kI8, "embedding: int8 is a KV-cache-only dtype");
    const size_t es = dtype_size(dtype);
    const auto fn = k_.to_f32;
    for (int64_t i = 0; i < n; ++i)  // checked here: a throw inside a pool task cannot propagate
      FANTAI_REQUIRE(ids[i] >= 0, "embedding: negative token id " << ids[i] << " at " << i);
    for_rows(n, dim, [&](int64_t i) {
      fn(static_cast<const char*>(table) + static_cast<size_t>(ids[i]) * dim * es, dtype,
         out + i * dim, dim);
    });
  }

  void add(float* x, const float* y, int64_t n) override {
    // Elementwise, so any split is invariant; 4096-float chunks keep tasks coarse.
    const int64_t chunk = 4096;
    const auto fn = k_.add;
    if (n < kParallelMinWork) { fn(x, y, n); return; }
    pool_.parallel_for(ceil_div(n, chunk), [&](int64_t c, int) {
      const int64_t i0 = c * chunk;
      fn(x + i0, y + i0, std::min(chunk, n - i0));
    });
  }

 private:
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
  QuantizeRowsFn quant_rows_fn_ = quantize_rows_int8;
  LinearPanelFn amx_panel_fn_ = nullptr;  // AMX int8 twin of panel_fn_, or none
  static constexpr int64_t kAmxPanelMinRows = 16;
  static constexpr int64_t kAmxChunkBytes = 512 << 10;  // bf16 weights per linear_packed task
  bool panel_ = false;
  bool amx_ = false;  // bf16 dense matrices are packed into AMX tiles at load
  bool bf16_act_ = false;  // set_matmul_precision(kBF16) on AMX: one bf16 part, not two (or three)
  ThreadPool pool_;
  std::vector<float> perm_scratch_;  // linear_q act-order gather; the step thread is the only caller
  std::vector<uint16_t> amx_hi_, amx_lo_;  // linear_packed's bf16 halves of x; likewise
  std::vector<uint16_t> amx_act_hi_, amx_act_lo_;  // mlp_packed's activation halves; likewise
  std::vector<int8_t> xq_q_;                // linear_panel's int8 activations; likewise
  std::vector<float> xq_d_;
  std::vector<int32_t> xq_s_;
  std::mutex mapped_mu_;
  std::unordered_map<void*, size_t> mapped_;  // mmap-backed buffers and their lengths
};

void CpuBackend::attention(const float* q, int64_t q_stride, const void* k_cache,
                           const void* v_cache, const KVLayout& L, const AttentionParams& p,
                           int32_t num_q_heads, float scale, float* out) {
  FANTAI_REQUIRE(L.num_kv_heads > 0 && L.head_dim > 0 && L.block_size > 0, "attention: bad KV layout");
  FANTAI_REQUIRE(num_q_heads > 0 && num_q_heads % L.num_kv_heads == 0,
                 "attention: num_q_heads " << num_q_heads << " not a multiple of num_kv_heads "
                                           << L.num_kv_heads);
  const int group = num_q_heads / L.num_kv_heads;
  const int hd = L.head_dim;
  // Query tiles of 16 rows share each K/V block while it is hot in L1.
  constexpr int kQTile = 16;
  std::vector<AttnItem> items;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.cu_seqlens_q[s], qlen = p.cu_seqlens_q[s + 1] - q0, ctx = p.context_lens[s];
    FANTAI_REQUIRE(qlen >= 0 && ctx >= qlen, "attention: sequence " << s << " has q_len " << qlen
                                                                    << " > context_len " << ctx);
    if (qlen == 0) continue;
    const int32_t* bt = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
    const int nblocks = static_cast<int>(ceil_div(ctx, L.block_size));
    FANTAI_REQUIRE(nblocks <= p.max_blocks_per_seq, "attention: sequence " << s << " needs "
                   << nblocks << " blocks > max_blocks_per_seq " << p.max_blocks_per_seq);
    for (int b = 0; b < nblocks; ++b)
      FANTAI_REQUIRE(bt[b] >= 0 && bt[b] < L.num_blocks, "attention: sequence " << s << " block "
                     << b << " -> physical " << bt[b] << " out of range [0, " << L.num_blocks << ")");
    for (int t0 = 0; t0 < qlen; t0 += kQTile)
      for (int g = 0; g < L.num_kv_heads; ++g) {
        AttnItem it;
        it.q = q + static_cast<int64_t>(q0 + t0) * q_stride;
        it.q_stride = q_stride;
        it.out = out + static_cast<int64_t>(q0 + t0) * num_q_heads * hd;
        it.out_stride = static_cast<int64_t>(num_q_heads) * hd;
        it.k_cache = k_cache;
        it.v_cache = v_cache;
        it.kv_dtype = L.dtype;
        if (L.dtype == DType::kI8) {
          it.k_scales = reinterpret_cast<const float*>(static_cast<const char*>(k_cache) + L.scales_offset());
          it.v_scales = reinterpret_cast<const float*>(static_cast<const char*>(v_cache) + L.scales_offset());
        }
        it.block_size = L.block_size;
        it.num_kv_heads = L.num_kv_heads;
        it.head_dim = hd;
        it.block_table = bt;
        it.kv_head = g;
        it.group = group;
        it.num_q = std::min(kQTile, qlen - t0);
        it.first_pos = ctx - qlen + t0;
        it.scale = scale;
        items.push_back(it);
      }
  }
  if (items.empty()) return;
  // bf16 KV with AMX: tile kernel for every item of the call (and of every call: the choice
  // depends only on the layout).
  const bool amx_attn = amx_ && L.dtype == DType::kBF16 && amx_attention_supported(hd, L.block_size);
  const int64_t need =
      amx_attn ? amx_attn_scratch_floats(hd) : attn_scratch_floats(kQTile, group, hd, L.block_size);
  // Per-thread scratch, per call (a few KiB per thread), so concurrent calls share nothing.
  const int64_t per = (need + 16 + 15) / 16 * 16;
  std::vector<float> scratch(static_cast<size_t>(per * pool_.size() + 16));
  const auto fn = amx_attn ? (bf16_act_ ? amx_attention_bf16_act : amx_attention_bf16) : k_.attention;
  // Causal work grows with a tile's position: hand out the last tiles first (longest first), so
  // the pool does not end on one thread finishing a long tile while the others wait.
  const int64_t n_items = static_cast<int64_t>(items.size());
  pool_.parallel_for(n_items, [&](int64_t task, int tid) {
    const int64_t i = n_items - 1 - task;
    // 64-byte align each thread's scratch (vector<float> only promises 16).
    float* base = scratch.data() + per * tid;
    const uintptr_t a = (reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t{63};
    fn(items[i], reinterpret_cast<float*>(a));
  });
}

}  // namespace

const KernelTable& kernels_for(Isa isa) {
  FANTAI_REQUIRE(static_cast<int>(isa) <= static_cast<int>(detected_isa()),
                 "cpu: ISA level " << isa_name(isa) << " is not supported by this CPU");
  const KernelTable* t = isa == Isa::kAvx512 ? avx512_kernels()
                         : isa == Isa::kAvx2 ? avx2_kernels()
                                             : scalar_kernels();
  FANTAI_REQUIRE(t != nullptr, "cpu: kernels for " << isa_name(isa) << " were not built");
  return *t;
}

std::shared_ptr<Backend> make_cpu_backend(Isa isa, int num_threads) {
  return std::make_shared<CpuBackend>(isa, num_threads <= 0 ? default_thread_count() : num_threads);
}

const RowReductions& row_reductions() {
  static const RowReductions r = [] {
    const KernelTable& k = kernels_for(active_isa());
    RowReductions t;
    t.max_sum_exp = k.max_sum_exp;
    t.argmax = k.argmax;
    return t;
  }();
  return r;
}

std::shared_ptr<Backend> create_cpu_backend(int num_threads) {
  return make_cpu_backend(active_isa(), num_threads);
}

const char* selected_isa() { return isa_name(active_isa()); }

std::vector<std::string> runnable_isas() {
  std::vector<std::string> v;
  for (int i = 0; i <= static_cast<int>(detected_isa()); ++i) v.emplace_back(isa_name(static_cast<Isa>(i)));
  return v;
}

int default_threads() { return default_thread_count(); }

}  // namespace fantai::cpu
