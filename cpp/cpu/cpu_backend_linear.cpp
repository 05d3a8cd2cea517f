// cpu: the CPU backend's linears: dense (kernel table), AMX-packed bf16 with the fused MLP, and
// quantized (the int8-activation panel kernels, or the f32-dequant table).
#include "cpu/cpu_backend_impl.h"

#include "common/check.h"

namespace fantai::cpu {

void CpuBackend::linear(const float* x, const void* w, DType w_dtype, const float* bias, float* y, int64_t m,
                        int64_t n, int64_t k) {
  FANTAI_REQUIRE(m >= 0 && n >= 0 && k > 0, "linear: bad shape m=" << m << " n=" << n << " k=" << k);
  FANTAI_REQUIRE(w_dtype != DType::kI8, "linear: int8 is a KV-cache-only dtype");
  if (m == 0 || n == 0) return;
  const auto fn = k_.linear;
  for_each_linear_tile(m, n, k, n * k * static_cast<int64_t>(dtype_size(w_dtype)),
                       [&](int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
                         fn(x + r0 * k, w, w_dtype, bias, y + r0 * n, r1 - r0, n, k, j0, j1);
                       });
}

// Only the AMX kernels have a cheaper bf16 form: the vector kernels multiply in f32 anyway.
bool CpuBackend::set_matmul_precision(DType precision) {
  Backend::set_matmul_precision(precision);  // checks the name
  bf16_act_ = amx_ && precision == DType::kBF16;
  return bf16_act_;
}

// bf16 matrices are packed on every level: AMX tiles where usable, else the vector kernels' pair
// layout (same size; one widening op per W weights instead of two) or group layout (rows padded
// to whole groups; a decode reads each group as one stream).
size_t CpuBackend::dense_packed_bytes(DType dt, int64_t n, int64_t k) const {
  if (dt != DType::kBF16 || n <= 0 || k <= 0) return 0;
  if (amx_) return amx_packed_bytes(n, k);
  switch (bf16_layout_) {
    case CpuSwitches::Bf16Layout::kPairs: return static_cast<size_t>(n * k) * 2;
    case CpuSwitches::Bf16Layout::kGroups: return static_cast<size_t>(bf16_groups_bytes(n, k));
    default: return 0;
  }
}

void CpuBackend::pack_dense(const void* w, DType dt, int64_t n, int64_t k, void* dst) {
  FANTAI_REQUIRE(dense_packed_bytes(dt, n, k) > 0, "pack_dense: no packed layout for "
                                                       << dtype_name(dt) << " [" << n << ", " << k
                                                       << "] on this cpu backend");
  const auto* src = static_cast<const uint16_t*>(w);
  if (amx_) amx_pack_bf16(src, n, k, dst);
  else if (bf16_layout_ == CpuSwitches::Bf16Layout::kGroups)
    pack_bf16_groups(src, n, k, k_.lanes, static_cast<uint16_t*>(dst));
  else pack_bf16_pairs(src, n, k, k_.lanes, static_cast<uint16_t*>(dst));
}

void pack_bf16_pairs(const uint16_t* w, int64_t n, int64_t k, int lanes, uint16_t* dst) {
  const int64_t kp = k - k % (2 * lanes);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* s = w + j * k;
    uint16_t* d = dst + j * k;
    for (int64_t c = 0; c < kp; c += 2 * lanes)
      for (int i = 0; i < lanes; ++i) {
        d[c + 2 * i] = s[c + i];
        d[c + 2 * i + 1] = s[c + lanes + i];
      }
    for (int64_t i = kp; i < k; ++i) d[i] = s[i];
  }
}

void pack_bf16_groups(const uint16_t* w, int64_t n, int64_t k, int lanes, uint16_t* dst) {
  constexpr int G = kBf16GroupRows;
  const int64_t kv = k - k % lanes, groups = (n + G - 1) / G;
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* d = dst + g * G * k;
    for (int r = 0; r < G; ++r) {
      const int64_t j = g * G + r;
      for (int64_t c = 0; c < kv; c += lanes)
        for (int i = 0; i < lanes; ++i) d[c * G + r * lanes + i] = j < n ? w[j * k + c + i] : 0;
      for (int64_t i = kv; i < k; ++i) d[kv * G + r * (k - kv) + i - kv] = j < n ? w[j * k + i] : 0;
    }
  }
}

// AMX: x split into bf16 hi/lo rows once per call (per row, so batch invariant), then tasks of
// a column chunk x a row block over the pool; each task sets up and releases the tiles of its
// thread.
void CpuBackend::linear_packed(const float* x, const void* packed, DType dt, const float* bias, float* y,
                               int64_t m, int64_t n, int64_t k) {
  FANTAI_REQUIRE(m >= 0 && n > 0 && k > 0, "linear_packed: bad shape m=" << m << " n=" << n << " k=" << k);
  FANTAI_REQUIRE(dt == DType::kBF16, "linear_packed: matrix was not packed by this cpu backend");
  if (m == 0) return;
  if (!amx_) {
    const auto fn = bf16_packed_fn_;
    for_each_linear_tile(m, n, k, n * k * 2, [&](int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
      fn(x + r0 * k, packed, bias, y + r0 * n, r1 - r0, n, k, j0, j1);
    });
    return;
  }
  uint16_t *hi, *lo;
  split_packed(x, m, n, k, &hi, &lo);
  run_packed(hi, lo, m, k, packed, n, bias, y, nullptr);
}

// gate|up with silu(gate) * up fused into its tiles' epilogue, written straight as the down
// projection's bf16 halves: the f32 gate|up rows (m x 2 inter), the silu_mul pass and the split
// of its output never touch memory. Same bits as linear_packed + silu_mul + linear_packed.
bool CpuBackend::mlp_packed(const float* x, const void* gate_up, const void* down, DType dt, float* out,
                            int64_t m, int64_t inter, int64_t hidden) {
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
uint16_t* CpuBackend::aligned64(std::vector<uint16_t>& v) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - a % 64) % 64) / 2;
}

// x [m, k] into bf16 halves, [amx_m_pad(m), amx_k_pad(k)] with zero padding (every element the
// tiles read). n only sizes the call (tiny calls run as one task).
void CpuBackend::split_packed(const float* x, int64_t m, int64_t n, int64_t k, uint16_t** hi_out,
                              uint16_t** lo_out) {
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
void CpuBackend::run_packed(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed,
                            int64_t n, const float* bias, float* y, const AmxActOut* act) {
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
    amx_linear_bf16(hi, lo, m, k, packed, n, bias, y, n, rb * row_block, (rb + 1) * row_block, cb * chunk,
                    (cb + 1) * chunk, act);
  });
}

size_t CpuBackend::quant_packed_bytes(const QuantMatrix& canonical) const {
  return panel_ ? cpu_quant_panel_bytes(canonical) : cpu_quant_packed_bytes(canonical);
}

QuantMatrix CpuBackend::pack_quant(const QuantMatrix& canonical, void* dst) {
  return panel_ ? cpu_pack_quant_panel(canonical, dst) : cpu_pack_quant(canonical, dst);
}

void CpuBackend::linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                          int64_t ldy) {
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
  for_each_linear_tile(m, n, k, n * k * w.bits / 8, [&](int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
    fn(x + r0 * k, w, bias, y + r0 * ldy, r1 - r0, ldy, j0, j1);
  });
}

void CpuBackend::embedding_q(const int32_t* ids, int64_t n, const QuantMatrix& table, float* out) {
  FANTAI_REQUIRE(table.layout == kCpuQuantLayout || is_panel_layout(table.layout),
                 "embedding_q: table was not packed by the cpu backend");
  for (int64_t i = 0; i < n; ++i)
    FANTAI_REQUIRE(ids[i] >= 0 && ids[i] < table.rows, "embedding: token id " << ids[i] << " at " << i
                                                                              << " is outside [0, "
                                                                              << table.rows << ")");
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
void CpuBackend::linear_panel(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                              int64_t ldy) {
  const QuantMatrix* parts[] = {&w};
  const int64_t row0[] = {0};
  run_panels(quantize_rows(x, m, w.cols, xq_block(w)), parts, row0, 1, bias, y, m, ldy);
}

// Every part in the panel layout, without act-order, over the same columns and activation
// blocks: one quantization of x and one pool dispatch for all of them. Otherwise part by part.
void CpuBackend::linear_q_parts(const float* x, const QuantMatrix* const* parts, const int64_t* row0,
                                int n_parts, const float* bias, float* y, int64_t m, int64_t ldy) {
  bool together = n_parts > 1 && n_parts <= kMaxLinearParts && m > 0;
  for (int i = 0; i < n_parts && together; ++i) {
    const QuantMatrix& w = *parts[i];
    together = is_panel_layout(w.layout) && panel_fn_ && !w.perm && w.cols == parts[0]->cols &&
               xq_block(w) == xq_block(*parts[0]) && ldy >= row0[i] + w.rows;
  }
  if (!together) return Backend::linear_q_parts(x, parts, row0, n_parts, bias, y, m, ldy);
  run_panels(quantize_rows(x, m, parts[0]->cols, xq_block(*parts[0])), parts, row0, n_parts, bias, y, m, ldy);
}

QuantizedRows CpuBackend::quantize_rows(const float* x, int64_t m, int64_t k, int32_t block) {
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
  return xq;
}

// The parts' panels in one index space (part 0's units, then part 1's, ...), dealt into chunks
// as one matrix's would be; a chunk that straddles parts runs each part's share. Which task runs
// which panels never changes a row's result.
void CpuBackend::run_panels(const QuantizedRows& xq, const QuantMatrix* const* parts, const int64_t* row0,
                            int n_parts, const float* bias, float* y, int64_t m, int64_t ldy) {
  const int64_t k = parts[0]->cols;
  // AMX tiles take 16 rows at a time and unpack each panel once per task: taller row blocks.
  const bool amx = amx_panel_fn_ && m >= kAmxPanelMinRows;
  const int64_t row_block = amx ? 128 : 64;
  const int64_t row_blocks = ceil_div(m, row_block);
  // Decode: whole tiles (decode_panels_ wide, their independent chains) dealt as evenly as
  // they go into linear_chunks' count. Fixed-size chunks of 4 panels left SmolLM2's 36-panel o and down
  // projections 9 chunks for 2 threads (5 against 4: 11% of those calls idle on AVX2, whose
  // tiles are 2 panels and so split 18 / 18).
  const int64_t unit = m == 1 ? decode_panels_ : 1;
  int64_t units = 0, rows = 0, bytes = 0;
  int64_t first_unit[kMaxLinearParts + 1];
  for (int i = 0; i < n_parts; ++i) {
    const int64_t panels = ceil_div(parts[i]->rows, 16);
    first_unit[i] = units;
    units += ceil_div(panels, unit);
    rows += parts[i]->rows;
    bytes += panels * parts[i]->ld;
  }
  first_unit[n_parts] = units;
  int64_t chunks = linear_chunks(m, rows, k, bytes, row_blocks);
  // Prefill: column chunks of at most kPanelChunkBytes of weights, and tasks in column-major
  // order, so a chunk is read from L3 once and stays in L2 while its row blocks sweep it
  // (rather than every 64 rows re-reading the whole matrix).
  if (m > 1) chunks = std::max(chunks, ceil_div(bytes, kPanelChunkBytes));
  chunks = std::min(units, chunks);
  const LinearPanelFn fn = amx ? amx_panel_fn_ : panel_fn_;
  pool_.parallel_for(row_blocks * chunks, [&](int64_t t, int) {
    const int64_t rb = t % row_blocks, cb = t / row_blocks;
    const int64_t r0 = rb * row_block, r1 = std::min(m, r0 + row_block);
    const int64_t u0 = units * cb / chunks, u1 = units * (cb + 1) / chunks;
    QuantizedRows part = xq;
    part.q += r0 * xq.ld;
    part.d += r0 * xq.nblocks;
    part.s += r0 * xq.nblocks;
    for (int i = 0; i < n_parts; ++i) {
      const int64_t a = std::max(u0, first_unit[i]), b = std::min(u1, first_unit[i + 1]);
      if (a >= b) continue;
      const QuantMatrix& w = *parts[i];
      const int64_t panels = ceil_div(w.rows, 16);
      const int64_t p0 = std::min(panels, (a - first_unit[i]) * unit);
      const int64_t p1 = std::min(panels, (b - first_unit[i]) * unit);
      fn(part, w, bias ? bias + row0[i] : nullptr, y + r0 * ldy + row0[i], r1 - r0, ldy, p0, p1);
    }
  });
}

}  // namespace fantai::cpu
