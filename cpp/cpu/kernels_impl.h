// cpu: kernel bodies written once over a vector-traits type VT; each kernels_<isa>.cpp defines VT
// (lane width, loads with dtype conversion, FMA, fixed-order horizontal reductions, exp) and
// includes this file inside its own namespace, so every ISA gets its own copy with its own flags.
//
// Deliberately no #include and no std:: templates here: an inline std:: function instantiated in
// an AVX-512 TU is a weak symbol the linker may hand to a baseline caller.
//
// Batch invariance: every output element has exactly one accumulation sequence, fixed by the
// shapes of the op (k, dim, head_dim, block_size) and never by m, tiling or threads:
//  - linear: one W-lane accumulator per y element, k visited in W steps (+ one masked tail),
//    then VT::hsum. Tiles of R rows x C weight rows only change how many such chains run side by
//    side, not any chain.
//  - attention: per (query, head) the KV blocks are visited in order with an online softmax;
//    a block's scores, exps, sum and V update do not depend on other queries in the tile.

#ifndef FANTAI_KERNELS_IMPL_BODY
#define FANTAI_KERNELS_IMPL_BODY
#endif

using V = VT::V;
constexpr int W = VT::W;

#define FT_INLINE inline __attribute__((always_inline))

// Weight/cache element loads by dtype (DT is the DType value: 0 f32, 1 f16, 2 bf16, 3 int8; int8
// loads give the raw integers as floats, the caller applies the scale).
template <int DT>
FT_INLINE V loadw(const void* base, int64_t i) {
  if constexpr (DT == 0) return VT::load(static_cast<const float*>(base) + i);
  else if constexpr (DT == 1) return VT::load_f16(static_cast<const uint16_t*>(base) + i);
  else if constexpr (DT == 2) return VT::load_bf16(static_cast<const uint16_t*>(base) + i);
  else return VT::load_i8(static_cast<const int8_t*>(base) + i);
}
template <int DT>
FT_INLINE V loadw_n(const void* base, int64_t i, int n) {
  if constexpr (DT == 0) return VT::load_n(static_cast<const float*>(base) + i, n);
  else if constexpr (DT == 1) return VT::load_f16_n(static_cast<const uint16_t*>(base) + i, n);
  else if constexpr (DT == 2) return VT::load_bf16_n(static_cast<const uint16_t*>(base) + i, n);
  else return VT::load_i8_n(static_cast<const int8_t*>(base) + i, n);
}
template <int DT>
constexpr int elem_bytes() { return DT == 0 ? 4 : DT == 3 ? 1 : 2; }

FT_INLINE float fmax_(float a, float b) { return a > b ? a : b; }
FT_INLINE int imin_(int a, int b) { return a < b ? a : b; }

// ---- linear ------------------------------------------------------------------------------------

// y[r, j + c] for r < R, c < C. x: [R, k] (row stride k); w: element (j + c) * k + i; y: row
// stride ldy.
// pf: when not null, the next tile's weight rows (contiguous bytes); each k step prefetches as
// many bytes of it as it consumes of this tile, so DRAM streams ahead of the FMAs (rows are only
// k long, too short for the hardware prefetcher to ramp up on C interleaved streams).
template <int R, int C, int DT>
FT_INLINE void lin_tile(const float* x, const void* w, const float* bias, float* y, int64_t ldy,
                        int64_t k, int64_t j, const char* pf = nullptr) {
  constexpr int kEs = elem_bytes<DT>(), kPfStep = C * W * kEs;
  V acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = VT::zero();
  const int64_t kv = k - k % W;
  for (int64_t i = 0; i < kv; i += W) {
    if (pf) {
#pragma GCC unroll 8
      for (int b = 0; b < kPfStep; b += 64) __builtin_prefetch(pf + b, 0, 3);
      pf += kPfStep;
    }
    V xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = VT::load(x + r * k + i);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const V wv = loadw<DT>(w, (j + c) * k + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(xv[r], wv, acc[r][c]);
    }
  }
  if (kv < k) {
    const int t = static_cast<int>(k - kv);
    V xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = VT::load_n(x + r * k + kv, t);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const V wv = loadw_n<DT>(w, (j + c) * k + kv, t);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(xv[r], wv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = VT::hsum(acc[r][c]);
      y[r * ldy + j + c] = bias ? s + bias[j + c] : s;
    }
}

// lin_tile with a run-time row count in [1, RR] (the last, partial row tile of a batch).
template <int RR, int C, int DT>
FT_INLINE void lin_rows(int rows, const float* x, const void* w, const float* bias, float* y,
                        int64_t ldy, int64_t k, int64_t j, const char* pf) {
  if constexpr (RR > 1) {
    if (rows < RR) return lin_rows<RR - 1, C, DT>(rows, x, w, bias, y, ldy, k, j, pf);
  }
  lin_tile<RR, C, DT>(x, w, bias, y, ldy, k, j, pf);
}

template <int DT>
void linear_t(const float* x, const void* w, const float* bias, float* y, int64_t m, int64_t ldy,
              int64_t k, int64_t j0, int64_t j1) {
  constexpr int R = VT::kTileRows, C = VT::kTileCols, C1 = VT::kDecodeCols;
  constexpr int kEs = elem_bytes<DT>();
  const char* wb = static_cast<const char*>(w);
  int64_t j = j0;
  if (m == 1) {
    // Decode: memory-bound; C1 weight rows stream side by side against one x row.
    for (; j + C1 <= j1; j += C1)
      lin_tile<1, C1, DT>(x, w, bias, y, ldy, k, j, j + 2 * C1 <= j1 ? wb + (j + C1) * k * kEs : nullptr);
    for (; j < j1; ++j) lin_tile<1, 1, DT>(x, w, bias, y, ldy, k, j);
    return;
  }
  // Prefill: a panel of P weight rows (~64: L2-resident) is swept by every R-row tile of x (L1-
  // resident while it crosses the panel), so x and w are each read from L2 at most once per
  // panel x row tile. The first row tile prefetches the next C weight rows from DRAM.
  constexpr int64_t P = (64 + C - 1) / C * C;
  for (int64_t jp = j0; jp < j1; jp += P) {
    const int64_t jpe = jp + P < j1 ? jp + P : j1;
    int64_t r = 0;
    for (; r < m; r += R) {
      const int rows = m - r < R ? static_cast<int>(m - r) : R;
      const float* xr = x + r * k;
      float* yr = y + r * ldy;
      for (j = jp; j + C <= jpe; j += C) {
        const char* pf = r == 0 && j + 2 * C <= j1 ? wb + (j + C) * k * kEs : nullptr;
        lin_rows<R, C, DT>(rows, xr, w, bias, yr, ldy, k, j, pf);
      }
      for (; j < jpe; ++j) lin_rows<R, 1, DT>(rows, xr, w, bias, yr, ldy, k, j, nullptr);
    }
  }
}

void linear(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m,
            int64_t ldy, int64_t k, int64_t j0, int64_t j1) {
  switch (wt) {
    case DType::kF32: linear_t<0>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kF16: linear_t<1>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kBF16: linear_t<2>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kI8: return;  // KV-cache-only type; the backend rejects it before this
  }
}

// ---- row ops -----------------------------------------------------------------------------------

FT_INLINE void scale_store(const float* x, const float* w, float* out, int64_t dim, float inv) {
  const V s = VT::set1(inv);
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W)
    VT::store(out + i, VT::mul(VT::mul(VT::load(x + i), s), VT::load(w + i)));
  if (dv < dim) {
    const int t = static_cast<int>(dim - dv);
    VT::store_n(out + dv, VT::mul(VT::mul(VT::load_n(x + dv, t), s), VT::load_n(w + dv, t)), t);
  }
}

void rms_norm(const float* x, const float* w, float* out, int64_t dim, float eps) {
  V acc = VT::zero();
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W) {
    const V v = VT::load(x + i);
    acc = VT::fma(v, v, acc);
  }
  if (dv < dim) {
    const V v = VT::load_n(x + dv, static_cast<int>(dim - dv));
    acc = VT::fma(v, v, acc);
  }
  const float inv = 1.0f / __builtin_sqrtf(VT::hsum(acc) / static_cast<float>(dim) + eps);
  scale_store(x, w, out, dim, inv);
}

void add_rms_norm(float* res, const float* x, const float* w, float* out, int64_t dim, float eps) {
  V acc = VT::zero();
  const int64_t dv = dim - dim % W;
  for (int64_t i = 0; i < dv; i += W) {
    const V v = VT::add(VT::load(res + i), VT::load(x + i));
    VT::store(res + i, v);
    acc = VT::fma(v, v, acc);
  }
  if (dv < dim) {
    const int t = static_cast<int>(dim - dv);
    const V v = VT::add(VT::load_n(res + dv, t), VT::load_n(x + dv, t));
    VT::store_n(res + dv, v, t);
    acc = VT::fma(v, v, acc);
  }
  const float inv = 1.0f / __builtin_sqrtf(VT::hsum(acc) / static_cast<float>(dim) + eps);
  scale_store(res, w, out, dim, inv);
}

void rope(float* x, int32_t num_heads, int32_t head_dim, const float* cs) {
  const int half = head_dim / 2, hv = half - half % W;
  for (int h = 0; h < num_heads; ++h) {
    float* a = x + static_cast<int64_t>(h) * head_dim;
    float* b = a + half;
    for (int i = 0; i < hv; i += W) {
      const V va = VT::load(a + i), vb = VT::load(b + i);
      const V c = VT::load(cs + i), s = VT::load(cs + half + i);
      VT::store(a + i, VT::sub(VT::mul(va, c), VT::mul(vb, s)));
      VT::store(b + i, VT::add(VT::mul(vb, c), VT::mul(va, s)));
    }
    if (hv < half) {
      const int t = half - hv;
      const V va = VT::load_n(a + hv, t), vb = VT::load_n(b + hv, t);
      const V c = VT::load_n(cs + hv, t), s = VT::load_n(cs + half + hv, t);
      VT::store_n(a + hv, VT::sub(VT::mul(va, c), VT::mul(vb, s)), t);
      VT::store_n(b + hv, VT::add(VT::mul(vb, c), VT::mul(va, s)), t);
    }
  }
}

FT_INLINE V silu_v(V g, V u) {
  const V one = VT::set1(1.0f);
  return VT::mul(VT::div(g, VT::add(one, VT::exp(VT::sub(VT::zero(), g)))), u);
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(out + i, silu_v(VT::load(gate + i), VT::load(up + i)));
  if (nv < n) {
    const int t = static_cast<int>(n - nv);
    VT::store_n(out + nv, silu_v(VT::load_n(gate + nv, t), VT::load_n(up + nv, t)), t);
  }
}

void add(float* x, const float* y, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(x + i, VT::add(VT::load(x + i), VT::load(y + i)));
  if (nv < n) {
    const int t = static_cast<int>(n - nv);
    VT::store_n(x + nv, VT::add(VT::load_n(x + nv, t), VT::load_n(y + nv, t)), t);
  }
}

template <int DT>
void to_f32_t(const void* src, float* dst, int64_t n) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(dst + i, loadw<DT>(src, i));
  if (nv < n) VT::store_n(dst + nv, loadw_n<DT>(src, nv, static_cast<int>(n - nv)), static_cast<int>(n - nv));
}

void to_f32(const void* src, DType st, float* dst, int64_t n) {
  switch (st) {
    case DType::kF32: to_f32_t<0>(src, dst, n); return;
    case DType::kF16: to_f32_t<1>(src, dst, n); return;
    case DType::kBF16: to_f32_t<2>(src, dst, n); return;
    case DType::kI8: return;  // KV-cache-only type; the backend rejects it before this
  }
}

// ---- attention ---------------------------------------------------------------------------------
//
// Per (query, head) and KV block, in block order: scores s_j = (q . k_j) * scale (one W-lane chain
// over head_dim, then VT::hsum), m' = max(m, max_j s_j), p_j = exp(s_j - m'), l = l*exp(m - m') +
// sum_j p_j (lanes summed in chunk order, then VT::hsum), o = o*exp(m - m') + sum_j p_j v_j (keys
// in order). Up to 4 heads of a group run together so K and V rows are loaded once for all of
// them and their chains interleave; that changes no chain.
// int8 (DT 3): rows are dequantized in registers. A key's scale ks_j multiplies its finished dot
// product (s_j = (q . kq_j) * ks_j * scale), and a value's scale vs_j folds into its weight
// (o += (p_j * vs_j) vq_j) while l sums the plain p_j; no dequantized copy is ever written.

FT_INLINE float exp1(float x) {
  alignas(64) float t[W];
  VT::store(t, VT::exp(VT::set1(x)));
  return t[0];
}

template <int HG, int DT>
FT_INLINE void attn_step(const float* const* q, float* const* o, float* mx, float* sum,
                         const void* kc, const void* vc, int64_t base, int hd, int nk, float scale,
                         float* sc /* [HG, bsp] */, int bsp, const float* ks, const float* vs,
                         const char* pk = nullptr, const char* pv = nullptr, int pf_bytes = 0) {
  const int dv = hd - hd % W, tail = hd - dv;
  const float ninf = -__builtin_inff();
  // Scores. Keys are independent, so consecutive keys' chains overlap in the core.
  // pk/pv: the next block's K and V rows of this head (pf_bytes each); a block is one page or
  // less, so the hardware prefetchers never cross into the next (scattered) block by themselves.
  // Each key step requests a share of them while this block computes.
  const int pf_step = pk ? (pf_bytes / nk + 63) / 64 * 64 : 0;
  for (int j = 0; j < nk; ++j) {
    if (pk) {
      for (int o = j * pf_step; o < (j + 1) * pf_step && o < pf_bytes; o += 64) {
        __builtin_prefetch(pk + o, 0, 3);
        __builtin_prefetch(pv + o, 0, 3);
      }
    }
    V acc[HG];
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) acc[h] = VT::zero();
    const int64_t e = base + static_cast<int64_t>(j) * hd;
    for (int d = 0; d < dv; d += W) {
      const V kv = loadw<DT>(kc, e + d);
#pragma GCC unroll 4
      for (int h = 0; h < HG; ++h) acc[h] = VT::fma(VT::load(q[h] + d), kv, acc[h]);
    }
    if (tail) {
      const V kv = loadw_n<DT>(kc, e + dv, tail);
#pragma GCC unroll 4
      for (int h = 0; h < HG; ++h) acc[h] = VT::fma(VT::load_n(q[h] + dv, tail), kv, acc[h]);
    }
    const float sj = DT == 3 ? ks[j] * scale : scale;
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) sc[h * bsp + j] = VT::hsum(acc[h]) * sj;
  }
  const int nkp = (nk + W - 1) / W * W;
  float corr[HG];
  for (int h = 0; h < HG; ++h) {
    float* s = sc + h * bsp;
    for (int j = nk; j < nkp; ++j) s[j] = ninf;
    V vmax = VT::set1(ninf);
    for (int c = 0; c < nkp; c += W) vmax = VT::max(vmax, VT::load(s + c));
    const float m_old = mx[h];
    const float m_new = fmax_(m_old, VT::hmax(vmax));
    const V vm = VT::set1(m_new);
    for (int c = 0; c < nkp; c += W) VT::store(s + c, VT::exp(VT::sub(VT::load(s + c), vm)));
    for (int j = nk; j < nkp; ++j) s[j] = 0.f;  // padding lanes carry no weight
    V ps = VT::zero();
    for (int c = 0; c < nkp; c += W) ps = VT::add(ps, VT::load(s + c));
    corr[h] = m_old == ninf ? 0.f : exp1(m_old - m_new);
    sum[h] = sum[h] * corr[h] + VT::hsum(ps);
    mx[h] = m_new;
    if constexpr (DT == 3) {
      for (int j = 0; j < nk; ++j) s[j] *= vs[j];
    }
  }
  // Output: KC head_dim chunks x HG heads of accumulators live across the key loop.
  constexpr int KC = VT::kAttnChunks;
  int d = 0;
  for (; d + KC * W <= dv; d += KC * W) {
    V acc[HG][KC];
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) {
      const V vc_h = VT::set1(corr[h]);
#pragma GCC unroll 4
      for (int c = 0; c < KC; ++c) acc[h][c] = VT::mul(VT::load(o[h] + d + c * W), vc_h);
    }
    for (int j = 0; j < nk; ++j) {
      const int64_t e = base + static_cast<int64_t>(j) * hd + d;
#pragma GCC unroll 4
      for (int c = 0; c < KC; ++c) {
        const V vv = loadw<DT>(vc, e + c * W);
#pragma GCC unroll 4
        for (int h = 0; h < HG; ++h) acc[h][c] = VT::fma(VT::set1(sc[h * bsp + j]), vv, acc[h][c]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h)
#pragma GCC unroll 4
      for (int c = 0; c < KC; ++c) VT::store(o[h] + d + c * W, acc[h][c]);
  }
  for (; d < hd; d += W) {
    const int n = hd - d < W ? hd - d : W;
    V acc[HG];
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) acc[h] = VT::mul(VT::load_n(o[h] + d, n), VT::set1(corr[h]));
    for (int j = 0; j < nk; ++j) {
      const V vv = loadw_n<DT>(vc, base + static_cast<int64_t>(j) * hd + d, n);
#pragma GCC unroll 4
      for (int h = 0; h < HG; ++h) acc[h] = VT::fma(VT::set1(sc[h * bsp + j]), vv, acc[h]);
    }
#pragma GCC unroll 4
    for (int h = 0; h < HG; ++h) VT::store_n(o[h] + d, acc[h], n);
  }
}

template <int DT>
void attention_t(const AttnItem& a, float* scratch) {
  const int G = a.group, hd = a.head_dim, bs = a.block_size, nq = a.num_q;
  const int nh = nq * G;
  const int bsp = (bs + W - 1) / W * W;
  float* acc = scratch;                                 // [nq * G, hd] unnormalised outputs
  float* mx = acc + static_cast<int64_t>(nh) * hd;     // [nq * G] running max
  float* sum = mx + nh;                                 // [nq * G] running denominator
  float* sc = sum + nh;                                 // [4, bsp] one block's scores
  for (int64_t i = 0; i < static_cast<int64_t>(nh) * hd; ++i) acc[i] = 0.f;
  for (int i = 0; i < nh; ++i) { mx[i] = -__builtin_inff(); sum[i] = 0.f; }

  const int last_pos = a.first_pos + nq - 1;
  const int nblocks = last_pos / bs + 1;
  const int64_t head_elems = static_cast<int64_t>(bs) * hd;
  constexpr int kEs = elem_bytes<DT>();
  const int head_bytes = static_cast<int>(head_elems) * kEs;
  for (int b = 0; b < nblocks; ++b) {
    const int64_t base = (static_cast<int64_t>(a.block_table[b]) * a.num_kv_heads + a.kv_head) * head_elems;
    const int start = b * bs;
    // int8: this (block, head)'s bs scales, contiguous.
    const float* ks = DT == 3 ? a.k_scales + base / hd : nullptr;
    const float* vs = DT == 3 ? a.v_scales + base / hd : nullptr;
    // The first query row that visits this block prefetches the next block (K and V of this head).
    const char* pk = nullptr;
    const char* pv = nullptr;
    if (b + 1 < nblocks) {
      const int64_t nb = (static_cast<int64_t>(a.block_table[b + 1]) * a.num_kv_heads + a.kv_head) * head_elems * kEs;
      pk = static_cast<const char*>(a.k_cache) + nb;
      pv = static_cast<const char*>(a.v_cache) + nb;
    }
    for (int i = 0; i < nq; ++i) {
      const int pos = a.first_pos + i;
      if (pos < start) continue;
      const int nk = imin_(bs, pos - start + 1);
      const char* qpk = pk;
      const char* qpv = pv;
      pk = pv = nullptr;
      for (int h0 = 0; h0 < G; h0 += 4) {
        const int hg = imin_(4, G - h0);
        const float* qs[4];
        float* os[4];
        for (int h = 0; h < hg; ++h) {
          qs[h] = a.q + i * a.q_stride + static_cast<int64_t>(a.kv_head * G + h0 + h) * hd;
          os[h] = acc + static_cast<int64_t>(i * G + h0 + h) * hd;
        }
        float* m = mx + i * G + h0;
        float* l = sum + i * G + h0;
        switch (hg) {
          case 1: attn_step<1, DT>(qs, os, m, l, a.k_cache, a.v_cache, base, hd, nk, a.scale, sc, bsp, ks, vs, h0 == 0 ? qpk : nullptr, qpv, head_bytes); break;
          case 2: attn_step<2, DT>(qs, os, m, l, a.k_cache, a.v_cache, base, hd, nk, a.scale, sc, bsp, ks, vs, h0 == 0 ? qpk : nullptr, qpv, head_bytes); break;
          case 3: attn_step<3, DT>(qs, os, m, l, a.k_cache, a.v_cache, base, hd, nk, a.scale, sc, bsp, ks, vs, h0 == 0 ? qpk : nullptr, qpv, head_bytes); break;
          default: attn_step<4, DT>(qs, os, m, l, a.k_cache, a.v_cache, base, hd, nk, a.scale, sc, bsp, ks, vs, h0 == 0 ? qpk : nullptr, qpv, head_bytes); break;
        }
      }
    }
  }
  for (int i = 0; i < nq; ++i)
    for (int h = 0; h < G; ++h) {
      const int sh = i * G + h;
      const float inv = 1.0f / sum[sh];
      const float* o = acc + static_cast<int64_t>(sh) * hd;
      float* dst = a.out + i * a.out_stride + static_cast<int64_t>(a.kv_head * G + h) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = o[d] * inv;
    }
}

void attention(const AttnItem& a, float* scratch) {
  switch (a.kv_dtype) {
    case DType::kF32: attention_t<0>(a, scratch); return;
    case DType::kF16: attention_t<1>(a, scratch); return;
    case DType::kBF16: attention_t<2>(a, scratch); return;
    case DType::kI8: attention_t<3>(a, scratch); return;
  }
}

const KernelTable kTable = {VT::kName, linear, rms_norm, add_rms_norm, rope, silu_mul, add, to_f32,
                            attention};

#undef FT_INLINE
