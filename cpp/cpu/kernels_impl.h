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

// Weight/cache element loads by dtype (DT is the DType value: 0 f32, 1 f16, 2 bf16).
template <int DT>
FT_INLINE V loadw(const void* base, int64_t i) {
  if constexpr (DT == 0) return VT::load(static_cast<const float*>(base) + i);
  else if constexpr (DT == 1) return VT::load_f16(static_cast<const uint16_t*>(base) + i);
  else return VT::load_bf16(static_cast<const uint16_t*>(base) + i);
}
template <int DT>
FT_INLINE V loadw_n(const void* base, int64_t i, int n) {
  if constexpr (DT == 0) return VT::load_n(static_cast<const float*>(base) + i, n);
  else if constexpr (DT == 1) return VT::load_f16_n(static_cast<const uint16_t*>(base) + i, n);
  else return VT::load_bf16_n(static_cast<const uint16_t*>(base) + i, n);
}

FT_INLINE float fmax_(float a, float b) { return a > b ? a : b; }
FT_INLINE int imin_(int a, int b) { return a < b ? a : b; }

// ---- linear ------------------------------------------------------------------------------------

// y[r, j + c] for r < R, c < C. x: [R, k] (row stride k); w: element (j + c) * k + i; y: row
// stride ldy.
template <int R, int C, int DT>
FT_INLINE void lin_tile(const float* x, const void* w, const float* bias, float* y, int64_t ldy,
                        int64_t k, int64_t j) {
  V acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = VT::zero();
  const int64_t kv = k - k % W;
  for (int64_t i = 0; i < kv; i += W) {
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

template <int DT>
void linear_t(const float* x, const void* w, const float* bias, float* y, int64_t m, int64_t ldy,
              int64_t k, int64_t j0, int64_t j1) {
  constexpr int R = VT::kTileRows, C = VT::kTileCols, C1 = VT::kDecodeCols;
  int64_t j = j0;
  if (m == 1) {
    // Decode: memory-bound; C1 weight rows stream side by side against one x row.
    for (; j + C1 <= j1; j += C1) lin_tile<1, C1, DT>(x, w, bias, y, ldy, k, j);
    for (; j < j1; ++j) lin_tile<1, 1, DT>(x, w, bias, y, ldy, k, j);
    return;
  }
  // C weight rows stay in L1 while every R-row tile of x passes over them.
  for (; j + C <= j1; j += C) {
    int64_t r = 0;
    for (; r + R <= m; r += R) lin_tile<R, C, DT>(x + r * k, w, bias, y + r * ldy, ldy, k, j);
    for (; r < m; ++r) lin_tile<1, C, DT>(x + r * k, w, bias, y + r * ldy, ldy, k, j);
  }
  for (; j < j1; ++j) {
    int64_t r = 0;
    for (; r + R <= m; r += R) lin_tile<R, 1, DT>(x + r * k, w, bias, y + r * ldy, ldy, k, j);
    for (; r < m; ++r) lin_tile<1, 1, DT>(x + r * k, w, bias, y + r * ldy, ldy, k, j);
  }
}

void linear(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m,
            int64_t ldy, int64_t k, int64_t j0, int64_t j1) {
  switch (wt) {
    case DType::kF32: linear_t<0>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kF16: linear_t<1>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kBF16: linear_t<2>(x, w, bias, y, m, ldy, k, j0, j1); return;
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
  }
}

// ---- attention ---------------------------------------------------------------------------------

// sc[j] = q . key_j * scale for j < nk. kb: element offset of key 0; keys head_dim apart.
template <int DT>
FT_INLINE void qk_scores(const float* q, const void* kc, int64_t kb, int hd, int nk, float scale,
                         float* sc) {
  const int dv = hd - hd % W, tail = hd - dv;
  int j = 0;
  // Four keys side by side for ILP; each key's chain is the same as in the single-key loop.
  for (; j + 4 <= nk; j += 4) {
    V a0 = VT::zero(), a1 = VT::zero(), a2 = VT::zero(), a3 = VT::zero();
    const int64_t e = kb + static_cast<int64_t>(j) * hd;
    for (int d = 0; d < dv; d += W) {
      const V qv = VT::load(q + d);
      a0 = VT::fma(qv, loadw<DT>(kc, e + d), a0);
      a1 = VT::fma(qv, loadw<DT>(kc, e + hd + d), a1);
      a2 = VT::fma(qv, loadw<DT>(kc, e + 2 * hd + d), a2);
      a3 = VT::fma(qv, loadw<DT>(kc, e + 3 * hd + d), a3);
    }
    if (tail) {
      const V qv = VT::load_n(q + dv, tail);
      a0 = VT::fma(qv, loadw_n<DT>(kc, e + dv, tail), a0);
      a1 = VT::fma(qv, loadw_n<DT>(kc, e + hd + dv, tail), a1);
      a2 = VT::fma(qv, loadw_n<DT>(kc, e + 2 * hd + dv, tail), a2);
      a3 = VT::fma(qv, loadw_n<DT>(kc, e + 3 * hd + dv, tail), a3);
    }
    sc[j] = VT::hsum(a0) * scale;
    sc[j + 1] = VT::hsum(a1) * scale;
    sc[j + 2] = VT::hsum(a2) * scale;
    sc[j + 3] = VT::hsum(a3) * scale;
  }
  for (; j < nk; ++j) {
    V a0 = VT::zero();
    const int64_t e = kb + static_cast<int64_t>(j) * hd;
    for (int d = 0; d < dv; d += W) a0 = VT::fma(VT::load(q + d), loadw<DT>(kc, e + d), a0);
    if (tail) a0 = VT::fma(VT::load_n(q + dv, tail), loadw_n<DT>(kc, e + dv, tail), a0);
    sc[j] = VT::hsum(a0) * scale;
  }
}

// sc[i] = exp(sc[i]) for i < n, elementwise (the lane a value lands in does not matter).
FT_INLINE void exp_inplace(float* sc, int n) {
  int i = 0;
  for (; i + W <= n; i += W) VT::store(sc + i, VT::exp(VT::load(sc + i)));
  if (i < n) VT::store_n(sc + i, VT::exp(VT::load_n(sc + i, n - i)), n - i);
}

template <int DT>
void attention_t(const AttnItem& a, float* scratch) {
  const int G = a.group, hd = a.head_dim, bs = a.block_size, nq = a.num_q;
  const int nh = nq * G;
  float* acc = scratch;                                 // [nq * G, hd]
  float* mx = acc + static_cast<int64_t>(nh) * hd;     // [nq * G] running max
  float* sum = mx + nh;                                 // [nq * G] running denominator
  float* sc = sum + nh;                                 // [bs + 1] scores of one block
  const float ninf = -__builtin_inff();
  for (int64_t i = 0; i < static_cast<int64_t>(nh) * hd; ++i) acc[i] = 0.f;
  for (int i = 0; i < nh; ++i) { mx[i] = ninf; sum[i] = 0.f; }

  const int dv = hd - hd % W, tail = hd - dv;
  const int last_pos = a.first_pos + nq - 1;
  const int nblocks = last_pos / bs + 1;
  const int64_t head_elems = static_cast<int64_t>(bs) * hd;
  for (int b = 0; b < nblocks; ++b) {
    const int64_t base = (static_cast<int64_t>(a.block_table[b]) * a.num_kv_heads + a.kv_head) * head_elems;
    const int start = b * bs;
    for (int i = 0; i < nq; ++i) {
      const int pos = a.first_pos + i;
      if (pos < start) continue;
      const int nk = imin_(bs, pos - start + 1);
      for (int h = 0; h < G; ++h) {
        const float* q = a.q + i * a.q_stride + static_cast<int64_t>(a.kv_head * G + h) * hd;
        const int sh = i * G + h;
        qk_scores<DT>(q, a.k_cache, base, hd, nk, a.scale, sc);
        float bm = sc[0];
        for (int j = 1; j < nk; ++j) bm = fmax_(bm, sc[j]);
        const float m_old = mx[sh];
        const float m_new = fmax_(m_old, bm);
        for (int j = 0; j < nk; ++j) sc[j] -= m_new;
        sc[nk] = m_old == ninf ? 0.f : m_old - m_new;  // exp'd with the scores: the rescale
        exp_inplace(sc, nk + 1);
        const float corr = m_old == ninf ? 0.f : sc[nk];
        float ps = 0.f;
        for (int j = 0; j < nk; ++j) ps += sc[j];
        sum[sh] = sum[sh] * corr + ps;
        mx[sh] = m_new;
        float* o = acc + static_cast<int64_t>(sh) * hd;
        const V vc = VT::set1(corr);
        int d = 0;
        // Four head_dim chunks side by side (independent chains); keys in order within each.
        for (; d + 4 * W <= dv; d += 4 * W) {
          V s0 = VT::mul(VT::load(o + d), vc), s1 = VT::mul(VT::load(o + d + W), vc);
          V s2 = VT::mul(VT::load(o + d + 2 * W), vc), s3 = VT::mul(VT::load(o + d + 3 * W), vc);
          for (int j = 0; j < nk; ++j) {
            const V p = VT::set1(sc[j]);
            const int64_t e = base + static_cast<int64_t>(j) * hd + d;
            s0 = VT::fma(p, loadw<DT>(a.v_cache, e), s0);
            s1 = VT::fma(p, loadw<DT>(a.v_cache, e + W), s1);
            s2 = VT::fma(p, loadw<DT>(a.v_cache, e + 2 * W), s2);
            s3 = VT::fma(p, loadw<DT>(a.v_cache, e + 3 * W), s3);
          }
          VT::store(o + d, s0);
          VT::store(o + d + W, s1);
          VT::store(o + d + 2 * W, s2);
          VT::store(o + d + 3 * W, s3);
        }
        for (; d < dv; d += W) {
          V s = VT::mul(VT::load(o + d), vc);
          for (int j = 0; j < nk; ++j)
            s = VT::fma(VT::set1(sc[j]), loadw<DT>(a.v_cache, base + static_cast<int64_t>(j) * hd + d), s);
          VT::store(o + d, s);
        }
        if (tail) {
          V s = VT::mul(VT::load_n(o + dv, tail), vc);
          for (int j = 0; j < nk; ++j)
            s = VT::fma(VT::set1(sc[j]), loadw_n<DT>(a.v_cache, base + static_cast<int64_t>(j) * hd + dv, tail), s);
          VT::store_n(o + dv, s, tail);
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
  }
}

const KernelTable kTable = {VT::kName, linear, rms_norm, add_rms_norm, rope, silu_mul, add, to_f32,
                            attention};

#undef FT_INLINE
