// cpu: paged attention over one work item (online softmax, block by block), written once over VT; included by kernels_impl.h inside each ISA's
// namespace (see there for the rules: no #include, no std:: templates, batch invariance).
#pragma once

// ---- attention ---------------------------------------------------------------------------------
//
// Per (query, head) row and KV block, in block order: scores s_j = (q . k_j) * scale (one W-lane
// FMA chain over head_dim, then VT::hsum), m' = max(m, max_j s_j), p_j = exp(s_j - m'), l =
// l*exp(m - m') + sum_j p_j (lanes summed in chunk order, then VT::hsum), o = o*exp(m - m') +
// sum_j p_j v_j (keys in order, one FMA per key and lane). That runs per key partition
// (kAttnPartitionKeys, kernels.h) from m = -inf, l = 0, o = 0; the partitions' states are folded
// in order by merge_state, inside the item or, for a decode row split over items, by
// attention_merge after the last of them.
// How that runs: a block's scores for all rows of the item (query rows x group heads) come from
// register tiles of rows x keys, whose chains are reduced W at a time by VT::hsum_w (bit-identical
// to W hsums); the output update streams V through tiles of rows that see the same keys. Each
// loaded K/V row thus serves many rows (prefill) instead of one query's heads. Tiles only decide
// which chains run side by side, never a chain's order, so a row's result depends on nothing but
// its own query, its position and the shapes. Many rows (not a decode's few) with head_dim % W ==
// 0 run the same arithmetic with W rows in the lanes of a vector instead (qk_lanes_tile,
// softmax_lanes below).
// int8 (DT 3): the raw integers are loaded as floats. A key's scale ks_j multiplies its finished
// dot product (s_j = (q . kq_j) * (ks_j * scale)), and a value's scale vs_j folds into its weight
// (o += (p_j * vs_j) vq_j) while l sums the plain p_j; no dequantized values are ever stored.
// Sliding window W: a row at position p sees keys (p - W, p]. The blocks a row does not see are
// skipped for it (and, before the first row's window, by the whole item: never read); in a block
// it partly sees, the keys before its window are -inf before the max and exactly 0 after the exp,
// as the padding past its position is, so a row's arithmetic is still its own alone. The logit
// soft-cap (vt_softcap_impl.h) maps each scaled score before the mask.

// Scores of keys j0 .. j0+C-1 (clamped to nk - 1; columns past nk hold junk) for R rows:
// srow[r][j] = hsum(chain of q_r . k_j) * (ks ? ks[j] * scale : scale). k_j at kc element base +
// j * hd, loaded as dtype LDT.
template <int R, int C, int LDT>
FT_INLINE void qk_tile(const float* const* q, const void* kc, int64_t base, int hd, int j0, int nk,
                       float scale, const float* ks, float* const* srow) {
  static_assert(R * C <= W, "one hsum_w per tile");
  const int dv = hd - hd % W, tail = hd - dv;
  int64_t e[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) e[c] = base + static_cast<int64_t>(imin_(j0 + c, nk - 1)) * hd;
  V acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = VT::zero();
  for (int d = 0; d < dv; d += W) {
    V qv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) qv[r] = VT::load(q[r] + d);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const V kv = loadw<LDT>(kc, e[c] + d);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r * C + c] = VT::fma(qv[r], kv, acc[r * C + c]);
    }
  }
  if (tail) {
    V qv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) qv[r] = VT::load_n(q[r] + dv, tail);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const V kv = loadw_n<LDT>(kc, e[c] + dv, tail);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r * C + c] = VT::fma(qv[r], kv, acc[r * C + c]);
    }
  }
  V s = VT::hsum_w(acc);
  if (ks) {
    alignas(64) float m[W];
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) m[i] = 0.f;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) m[r * C + c] = ks[imin_(j0 + c, nk - 1)] * scale;
    s = VT::mul(s, VT::load(m));
  } else {
    s = VT::mul(s, VT::set1(scale));
  }
  alignas(64) float t[W];
  VT::store(t, s);
  // All C columns (score rows have W columns of slack): constant-size copies.
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) srow[r][j0 + c] = t[r * C + c];
}

// Software prefetch of a later block's K and V rows, handed out a few lines per score tile so the
// requests never pile up in the fill buffers (a block is one page or less and blocks are
// scattered, so the hardware prefetchers never run ahead into the next one).
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int bytes = 0, step = 0, at = 0;
  FT_INLINE void next() {
    for (int e = at + step; at < bytes && at < e; at += 64) {
      __builtin_prefetch(k + at, 0, 3);
      __builtin_prefetch(v + at, 0, 3);
    }
  }
  FT_INLINE void rest() {
    step = bytes;
    next();
  }
};

// Keys per score tile of rr rows: the largest power of two with rr * keys <= W, so tiles divide a
// block (3 rows take 4 keys, not 5: 5-key tiles would run 20 columns for a 16-key block).
constexpr int qk_keys(int rr) {
  int c = 1;
  while (2 * c * rr <= W) c *= 2;
  return c;
}

// Rows (a decode step's GQA group: 3 for SmolLM2, 4 for Llama 3 8B) that one score tile row-group
// covers when they are all an item has: every K element then feeds all of them from one load.
constexpr int kAttnFewRows = 4;

// qk_tile over all keys [0, nk) for a run-time row count in [1, RR]; fewer rows get wider key
// tiles so one hsum_w still reduces (nearly) W chains.
template <int RR, int LDT>
FT_INLINE void qk_rows(int rows, const float* const* q, const void* kc, int64_t base, int hd, int nk,
                       float scale, const float* ks, float* const* srow, Prefetch& pf) {
  if constexpr (RR > 1) {
    if (rows < RR) return qk_rows<RR - 1, LDT>(rows, q, kc, base, hd, nk, scale, ks, srow, pf);
  }
  constexpr int C = qk_keys(RR);
  for (int j0 = 0; j0 < nk; j0 += C) {
    pf.next();
    qk_tile<RR, C, LDT>(q, kc, base, hd, j0, nk, scale, ks, srow);
  }
}

// Online-softmax update of rows t < n, each with its own block scores srow[t][lo(t), nk(t)) (rows
// have room for nk rounded up to W; keys before lo(t) are outside the row's window), soft-capped
// first when cap > 0, running max mx[t] and denominator sum[t] (contiguous). Per row:
// m' = max(m, max_j s_j); p_j = exp(s_j - m') left in srow[t] (times vs_j for int8); l' =
// l * corr + hsum(sum of the p chunks), corr = exp(m - m') (0 for a row's first block), written
// to corr[t]. The rows' scalar steps run as lanes of one vector (W rows at a time), so no row waits
// on another's reduction chain; each lane's arithmetic is the single row's (exp and fma are
// lane-wise, hsum_w is bit-identical to hsum, max is exact in any order).
template <class NK, class LO>
FT_INLINE void softmax_rows(int n, float* const* srow, NK nk, LO lo, float cap, float* mx, float* sum,
                            const float* vs, float* corr) {
  const float ninf = -__builtin_inff();
  for (int t0 = 0; t0 < n; t0 += W) {
    const int rows = imin_(W, n - t0);
    alignas(64) float m_old[W], m_new[W], c[W];
    V ps[W];
    for (int t = 0; t < rows; ++t) {
      float* s = srow[t0 + t];
      const int k = nk(t0 + t), kp = (k + W - 1) / W * W;
      if (cap > 0.f)
        for (int i = 0; i < kp; i += W) VT::store(s + i, softcap_v(VT::load(s + i), cap));
      for (int j = k; j < kp; ++j) s[j] = ninf;
      for (int j = 0, e = lo(t0 + t); j < e; ++j) s[j] = ninf;
      V vmax = VT::set1(ninf);
      for (int i = 0; i < kp; i += W) vmax = VT::max(vmax, VT::load(s + i));
      m_old[t] = mx[t0 + t];
      m_new[t] = fmax_(m_old[t], VT::hmax(vmax));
    }
    for (int t = rows; t < W; ++t) m_old[t] = m_new[t] = 0.f, ps[t] = VT::zero();
    for (int t = 0; t < rows; ++t) {
      float* s = srow[t0 + t];
      const int k = nk(t0 + t), kp = (k + W - 1) / W * W;
      const V vm = VT::set1(m_new[t]);
      V acc = VT::zero();
      for (int i = 0; i < kp; i += W) {
        const V p = VT::exp(VT::sub(VT::load(s + i), vm));
        VT::store(s + i, p);
      }
      for (int j = k; j < kp; ++j) s[j] = 0.f;                 // padding lanes carry no weight
      for (int j = 0, e = lo(t0 + t); j < e; ++j) s[j] = 0.f;  // nor keys before the window
      for (int i = 0; i < kp; i += W) acc = VT::add(acc, VT::load(s + i));
      ps[t] = acc;
    }
    VT::store(c, VT::exp(VT::sub(VT::load(m_old), VT::load(m_new))));
    for (int t = 0; t < rows; ++t)
      if (m_old[t] == ninf) c[t] = 0.f;
    const V l = VT::fma(VT::load_n(sum + t0, rows), VT::load(c), VT::hsum_w(ps));
    VT::store_n(sum + t0, l, rows);
    VT::store_n(mx + t0, VT::load(m_new), rows);
    VT::store_n(corr + t0, VT::load(c), rows);
    if (vs) {
      for (int t = 0; t < rows; ++t) {
        float* s = srow[t0 + t];
        for (int j = 0, k = nk(t0 + t); j < k; ++j) s[j] *= vs[j];
      }
    }
  }
}

// ---- rows in lanes (an item's many rows against a block: prefill, long chunks) ----------------
// The same arithmetic as qk_tile and softmax_rows, with W rows of the item in the lanes of a
// vector and the keys walked in order, so no score needs a horizontal sum and no row's max a
// horizontal max. The rows' queries are transposed once per item (qt: group g's element d of lane
// i at qt[(g * hd + d) * W + i]); a block's scores (and then its exps) are kept transposed too
// (key j of row r at st[j * lds + r]).
//
// Score chains: lane l of a pair's W-lane chain runs over d = l, l + W, ... (qk_tile's acc[]);
// here that chain, for W rows at once, is one vector (A_l), and the W chains are then folded by
// the fixed halving tree VT::hsum uses (lanes l and l + W/2, then l + W/4, ...: A_l + A_{l+W/2}
// first), so every score has qk_tile's bits. Needs hd % W == 0.
constexpr int kLaneGroups = 2, kLaneKeys = 4;  // a score tile: 2 row groups x 4 keys, 8 chains

// Scores of keys j0 .. j0 + kLaneKeys - 1 (clamped to nk - 1 when read; rows past nk written with
// junk) for ng (1 or 2) row groups; K row j at k + j * hd (f32).
FT_INLINE void qk_lanes_tile(const float* qt, int ng, const float* k, int hd, int j0, int nk, float scale,
                             const float* ks, float* st, int64_t lds) {
  constexpr int NG = kLaneGroups, NK = kLaneKeys, H = W / 2;
  const float* kr[NK];
#pragma GCC unroll 8
  for (int c = 0; c < NK; ++c) kr[c] = k + static_cast<int64_t>(imin_(j0 + c, nk - 1)) * hd;
  const float* qg[NG];
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) qg[g] = qt + static_cast<int64_t>(g < ng ? g : 0) * hd * W;
  V t[H][NG * NK];  // the tree's first level: A_l + A_{l + W/2}
  for (int l = 0; l < W; ++l) {
    V acc[NG][NK];
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < NK; ++c) acc[g][c] = VT::zero();
    for (int d = l; d < hd; d += W) {
      V kb[NK];
#pragma GCC unroll 8
      for (int c = 0; c < NK; ++c) kb[c] = VT::set1(kr[c][d]);
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) {
        const V q = VT::load(qg[g] + static_cast<int64_t>(d) * W);
#pragma GCC unroll 8
        for (int c = 0; c < NK; ++c) acc[g][c] = VT::fma(q, kb[c], acc[g][c]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < NK; ++c) {
        V& x = t[l < H ? l : l - H][g * NK + c];
        x = l < H ? acc[g][c] : VT::add(x, acc[g][c]);
      }
  }
  for (int h = H / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i)
#pragma GCC unroll 8
      for (int x = 0; x < NG * NK; ++x) t[i][x] = VT::add(t[i][x], t[i + h][x]);
#pragma GCC unroll 8
  for (int c = 0; c < NK; ++c) {
    const V sc = VT::set1(ks ? ks[imin_(j0 + c, nk - 1)] * scale : scale);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
      if (g < ng) VT::store(st + (j0 + c) * lds + g * W, VT::mul(t[0][g * NK + c], sc));
  }
}

// softmax_rows for the W rows of one group in lanes: row lane i sees keys [lo[i], nk[i]) of the
// block (nk[i] = 0: a row that does not see it; its state is left alone), scores st[j * lds + i]
// for j < nkmax, overwritten by the p_j (times vs_j for int8). State at mx, sum, corr + i for
// lanes i < rows. Per lane: the same max (exact in any order), the same exps, and the sum's
// chunk chains (key j into chain j % W, in key order, from 0) folded by the same halving tree as
// VT::hsum; keys past a row's nk add exact zeros, as softmax_rows' padding does.
FT_INLINE void softmax_lanes(int rows, const float* nk, const float* lo, int nkmax, float* st, int64_t lds,
                             float cap, float* mx, float* sum, const float* vs, float* corr) {
  const float ninf = -__builtin_inff();
  const V vnk = VT::load(nk), vlo = VT::load(lo), vninf = VT::set1(ninf);
  V vmax = vninf;
  for (int j = 0; j < nkmax; ++j) {
    float* p = st + j * lds;
    V s = VT::load(p);
    if (cap > 0.f) s = softcap_v(s, cap);
    const V vj = VT::set1(static_cast<float>(j));
    s = VT::select_lt(vj, vlo, vninf, VT::select_lt(vj, vnk, s, vninf));
    VT::store(p, s);
    vmax = VT::max(vmax, s);
  }
  const V m_old = VT::load_n(mx, rows);
  // max(m, max_j s_j) in fmax_'s operand order.
  const V m_new = VT::select_lt(vmax, m_old, m_old, vmax);
  V ch[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) ch[i] = VT::zero();
  for (int j = 0; j < nkmax; ++j) {
    float* p = st + j * lds;
    const V vj = VT::set1(static_cast<float>(j));
    const V e = VT::exp(VT::sub(VT::load(p), m_new));
    const V pv = VT::select_lt(vj, vlo, VT::zero(), VT::select_lt(vj, vnk, e, VT::zero()));
    VT::store(p, pv);
    ch[j % W] = VT::add(ch[j % W], pv);
  }
  for (int h = W / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) ch[i] = VT::add(ch[i], ch[i + h]);
  // exp(m - m') with a row's first block (m = -inf) giving 0.
  const V c = VT::select_lt(m_old, VT::set1(-__FLT_MAX__), VT::zero(), VT::exp(VT::sub(m_old, m_new)));
  const V l = VT::fma(VT::load_n(sum, rows), c, ch[0]);
  alignas(64) float ml[W], ll[W], cl[W];
  VT::store(ml, m_new);
  VT::store(ll, l);
  VT::store(cl, c);
  for (int i = 0; i < rows; ++i)
    if (nk[i] > 0.f) mx[i] = ml[i], sum[i] = ll[i], corr[i] = cl[i];
  if (vs)
    for (int j = 0; j < nkmax; ++j) VT::store(st + j * lds, VT::mul(VT::load(st + j * lds), VT::set1(vs[j])));
}

// o_r = o_r * corr_r + sum_{j < nk} p_r[j] v_j for R rows that all see keys [0, nk). v_j at vc
// element base + j * hd, loaded as dtype LDT. KC head_dim chunks x R rows of accumulators live
// across the key loop.
// p_r[j] at p[r][j * ps]: ps is lds for the rows-in-lanes scores (TP), else 1 (score rows).
template <int R, int LDT, bool TP>
FT_INLINE void pv_tile(float* const* o, const float* const* p, int64_t lds, const float* corr, const void* vc,
                       int64_t base, int hd, int nk) {
  const int64_t ps = TP ? lds : 1;
  // A tile short of the full kAttnRows leaves registers for more head_dim chunks: more independent
  // FMA chains per key.
  constexpr int KC = R < VT::kAttnRows ? VT::kAttnChunksFew : VT::kAttnChunks;
  const int dv = hd - hd % W;
  int d = 0;
  for (; d + KC * W <= dv; d += KC * W) {
    V acc[R][KC];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V cr = VT::set1(corr[r]);
#pragma GCC unroll 8
      for (int c = 0; c < KC; ++c) acc[r][c] = VT::mul(VT::load(o[r] + d + c * W), cr);
    }
    for (int j = 0; j < nk; ++j) {
      const int64_t e = base + static_cast<int64_t>(j) * hd + d;
#pragma GCC unroll 8
      for (int c = 0; c < KC; ++c) {
        V vv;
        if constexpr (LDT == 2) vv = VT::load_bf16_lean(static_cast<const uint16_t*>(vc) + e + c * W);
        else vv = loadw<LDT>(vc, e + c * W);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(VT::set1(p[r][j * ps]), vv, acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < KC; ++c) VT::store(o[r] + d + c * W, acc[r][c]);
  }
  for (; d < hd; d += W) {
    const int n = hd - d < W ? hd - d : W;
    V acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = VT::mul(VT::load_n(o[r] + d, n), VT::set1(corr[r]));
    for (int j = 0; j < nk; ++j) {
      const V vv = loadw_n<LDT>(vc, base + static_cast<int64_t>(j) * hd + d, n);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = VT::fma(VT::set1(p[r][j * ps]), vv, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) VT::store_n(o[r] + d, acc[r], n);
  }
}

template <int RR, int LDT, bool TP>
FT_INLINE void pv_rows(int rows, float* const* o, const float* const* p, int64_t lds, const float* corr,
                       const void* vc, int64_t base, int hd, int nk) {
  if constexpr (RR > 1) {
    if (rows < RR) return pv_rows<RR - 1, LDT, TP>(rows, o, p, lds, corr, vc, base, hd, nk);
  }
  pv_tile<RR, LDT, TP>(o, p, lds, corr, vc, base, hd, nk);
}

// f32 copy of a block's first n rows of one head (exact for every KV dtype; int8 stays unscaled).
template <int DT>
FT_INLINE void rows_to_f32(const void* c, int64_t base, int64_t n, float* dst) {
  const int64_t nv = n - n % W;
  for (int64_t i = 0; i < nv; i += W) VT::store(dst + i, loadw<DT>(c, base + i));
  if (nv < n)
    VT::store_n(dst + nv, loadw_n<DT>(c, base + nv, static_cast<int>(n - nv)), static_cast<int>(n - nv));
}

// Key partitions (kernels.h): blocks per partition, and one partition state's floats. Local
// copies of kernels.h's helpers: no inline function shared across the ISA files (see
// kernels_impl.h).
FT_INLINE int part_blocks(int bs) { return bs >= kAttnPartitionKeys ? 1 : kAttnPartitionKeys / bs; }
FT_INLINE int state_floats(int hd) { return hd + 2; }

// Folds one partition's state of a row (max m, sum s, unnormalised outputs o) into the row's
// running one (gm, gs, go): with M = max(gm, m), a = exp(gm - M), b = exp(m - M): gs = gs a + s b,
// go = go a + o b. An empty state (max -inf: the row saw no key there) is skipped; into an empty
// running state it is copied. The one code path for both the in-item fold and attention_merge,
// so a row's bits do not depend on which of them ran.
FT_INLINE void merge_state(float* gm, float* gs, float* go, float m, float s, const float* o, int hd) {
  const float ninf = -__builtin_inff();
  if (m == ninf) return;
  if (*gm == ninf) {
    *gm = m;
    *gs = s;
    for (int d = 0; d < hd; ++d) go[d] = o[d];
    return;
  }
  const float mn = fmax_(*gm, m);
  alignas(64) float x[W], e[W];
  for (int i = 0; i < W; ++i) x[i] = 0.f;
  x[0] = *gm - mn;
  x[1] = m - mn;
  VT::store(e, VT::exp(VT::load(x)));
  const V va = VT::set1(e[0]), vb = VT::set1(e[1]);
  VT::store(x, VT::fma(VT::set1(*gs), va, VT::mul(VT::set1(s), vb)));
  *gs = x[0];
  *gm = mn;
  const int dv = hd - hd % W;
  for (int d = 0; d < dv; d += W)
    VT::store(go + d, VT::fma(VT::load(go + d), va, VT::mul(VT::load(o + d), vb)));
  if (dv < hd) {
    const int n = hd - dv;
    VT::store_n(go + dv, VT::fma(VT::load_n(go + dv, n), va, VT::mul(VT::load_n(o + dv, n), vb)), n);
  }
}

template <int DT>
void attention_t(const AttnItem& a, float* scratch) {
  constexpr int RQ = VT::kAttnQkRows, RP = VT::kAttnRows;
  const int G = a.group, hd = a.head_dim, bs = a.block_size, nq = a.num_q;
  const int nh = nq * G;
  const int bsp = (bs + W - 1) / W * W + W;           // score row: bs rounded up to W, plus a tile's overhang
  float* acc = scratch;                               // [nh, hd] unnormalised outputs
  float* mx = acc + static_cast<int64_t>(nh) * hd;    // [nh] running max
  float* sum = mx + nh;                               // [nh] running denominator
  float* sc = sum + nh;                               // [nh, bsp] one block's scores
  float* kf = sc + static_cast<int64_t>(nh) * bsp;    // [bs, hd] the block's K in f32
  float* vf = kf + static_cast<int64_t>(bs) * hd;     // [bs, hd] and V
  float* cr = vf + static_cast<int64_t>(bs) * hd;     // [nh] this block's softmax correction
  float* gacc = cr + nh;                              // [nh, hd] past partitions folded (many only)
  float* gmx = gacc + static_cast<int64_t>(nh) * hd;  // [nh]
  float* gsum = gmx + nh;                             // [nh]
  // Rows in lanes (not few rows, hd % W == 0): the item's queries transposed, then a block's
  // scores, each [.., ngw] with the rows rounded up to whole vectors (64-byte aligned).
  const int ngw = (nh + W - 1) / W * W;
  float* qt = scratch + ((gsum + nh - scratch) + 15) / 16 * 16;  // [hd] per row group: [ngw / W, hd, W]
  float* st = qt + static_cast<int64_t>(ngw) * hd;               // [bs + kLaneKeys, ngw]
  const int64_t lds = ngw;
  bool qt_ready = false;
  auto reset = [&](float* o, float* m, float* l) {
    for (int64_t i = 0; i < static_cast<int64_t>(nh) * hd; ++i) o[i] = 0.f;
    for (int i = 0; i < nh; ++i) {
      m[i] = -__builtin_inff();
      l[i] = 0.f;
    }
  };
  reset(acc, mx, sum);

  // Row r = query i * G + head h. The per-block row loops ask for i = r / G about a dozen times a
  // block, so it is a multiply, not a division: with m = floor(2^32 / G) + 1, floor(r m / 2^32) =
  // floor(r / G) whenever r G < 2^32, and r < nq G with nq <= kAttnQTile (16) keeps r G below
  // 16 G^2, under 2^32 for any G < 16384.
  const uint64_t g_mul = (uint64_t{1} << 32) / static_cast<uint64_t>(G) + 1;
  auto query_of = [&](int r) { return static_cast<int>((static_cast<uint64_t>(r) * g_mul) >> 32); };
  // Its q, output and score row.
  auto q_of = [&](int r) {
    const int i = query_of(r);
    return a.q + i * a.q_stride + static_cast<int64_t>(a.kv_head * G + r - i * G) * hd;
  };
  const int last_pos = a.first_pos + nq - 1;
  const int nblocks = last_pos / bs + 1;
  const int win = a.window;
  // The first block row 0's window reaches; no row of the item reads an earlier one.
  const int b_window = win > 0 && a.first_pos - win + 1 > 0 ? (a.first_pos - win + 1) / bs : 0;
  // The blocks this item visits: all from there, or a split item's partitions.
  const int pb = part_blocks(bs);
  const bool split = a.partial != nullptr;
  const int b_first = split ? imax_(b_window, a.part_begin * pb) : b_window;
  const int b_end = split ? imin_(nblocks, a.part_end * pb) : nblocks;
  const bool one_part = !split && b_first / pb == (b_end - 1) / pb;
  if (!split && !one_part) reset(gacc, gmx, gsum);
  // Partition p done: its states to the split item's slots, or folded into the running ones;
  // then a fresh state for the next.
  auto end_partition = [&](int p) {
    for (int r = 0; r < nh; ++r) {
      float* o = acc + static_cast<int64_t>(r) * hd;
      if (split) {
        float* slot = a.partial + r * a.partial_head_stride +
                      static_cast<int64_t>(p - a.partial_part0) * state_floats(hd);
        slot[0] = mx[r];
        slot[1] = sum[r];
        for (int d = 0; d < hd; ++d) slot[2 + d] = o[d];
      } else {
        merge_state(gmx + r, gsum + r, gacc + static_cast<int64_t>(r) * hd, mx[r], sum[r], o, hd);
      }
    }
    reset(acc, mx, sum);
  };
  const int64_t head_elems = static_cast<int64_t>(bs) * hd;
  constexpr int kEs = elem_bytes<DT>();
  const int head_bytes = static_cast<int>(head_elems) * kEs;
  auto block_base = [&](int b) {
    return (static_cast<int64_t>(a.block_table[b]) * a.num_kv_heads + a.kv_head) * head_elems;
  };
  auto prefetch_block = [&](int b) {
    Prefetch pf;
    if (b < b_end) {
      const int64_t off = block_base(b) * kEs;
      pf.k = static_cast<const char*>(a.k_cache) + off;
      pf.v = static_cast<const char*>(a.v_cache) + off;
      pf.bytes = head_bytes;
    }
    return pf;
  };
  constexpr int kAhead = VT::kAttnPrefetchBlocks;
  for (int b = b_first; b < b_first + kAhead; ++b) prefetch_block(b).rest();
  constexpr int kRowPtrs = imax_(imax_(RQ, RP), kAttnFewRows);
  const float* qs[kRowPtrs];
  float* srow[kRowPtrs];
  float* os[RP];
  const float* ps[RP];
  for (int b = b_first; b < b_end; ++b) {
    if (!one_part && b > b_first && b % pb == 0) end_partition(b / pb - 1);
    const int64_t base = block_base(b);
    const int start = b * bs;
    // int8: this (block, head)'s bs scales, contiguous.
    const float* ks = DT == 3 ? a.k_scales + base / hd : nullptr;
    const float* vs = DT == 3 ? a.v_scales + base / hd : nullptr;
    // Rows [r0, r1) see this block: from the first at or past its start to the last whose window
    // reaches its end. Their last sees the most keys.
    const int i0 = start > a.first_pos ? start - a.first_pos : 0;
    const int i1 = win > 0 ? imin_(nq, start + bs + win - 1 - a.first_pos) : nq;
    const int r0 = i0 * G, r1 = i1 * G;
    const int nkmax = imin_(bs, a.first_pos + i1 - 1 - start + 1);
    // Up to kAttnFewRows rows (a decode step's GQA group) form one score tile row-group and one
    // output tile, so each K and V element is loaded (and widened) exactly once, straight from
    // the cache. More rows: convert the block to f32 once (exact) so the tiles reload plain floats.
    constexpr int RF = kAttnFewRows;
    const bool few = r1 - r0 <= RF;
    const bool lanes = !few && hd % W == 0;
    const bool convert = DT != 0 && !few;
    const void* kc = a.k_cache;
    const void* vc = a.v_cache;
    int64_t kvbase = base;
    if (convert) {
      rows_to_f32<DT>(a.k_cache, base, static_cast<int64_t>(nkmax) * hd, kf);
      rows_to_f32<DT>(a.v_cache, base, static_cast<int64_t>(nkmax) * hd, vf);
      kc = kf;
      vc = vf;
      kvbase = 0;
    }
    auto nk_of = [&](int r) { return imin_(bs, a.first_pos + query_of(r) - start + 1); };
    auto lo_of = [&](int r) {
      const int l = a.first_pos + query_of(r) - win + 1 - start;
      return win > 0 && l > 0 ? l : 0;
    };
    // Score row-groups: all the rows when few, else RQ at a time.
    const int rstep = few ? r1 - r0 : RQ;
    // Block b + kAhead, spread over this block's score tiles.
    Prefetch pf = prefetch_block(b + kAhead);
    if (lanes) {
      if (!qt_ready) {
        for (int r = 0; r < ngw; ++r) {
          float* dst = qt + static_cast<int64_t>(r / W) * hd * W + r % W;
          const float* q = r < nh ? q_of(r) : nullptr;
          for (int d = 0; d < hd; ++d) dst[d * W] = q ? q[d] : 0.f;
        }
        qt_ready = true;
      }
      // The groups holding rows [r0, r1); their other rows' scores are never read.
      const int g0 = r0 / W, g1 = (r1 + W - 1) / W;
      const int tiles = (g1 - g0 + kLaneGroups - 1) / kLaneGroups * ((nkmax + kLaneKeys - 1) / kLaneKeys);
      pf.step = (head_bytes / tiles + 63) / 64 * 64;
      // A row sees more keys than the one before it or as many, so a group's last row bounds its
      // keys (below nkmax only in the block holding the item's first positions).
      auto nk_upto = [&](int g_end) { return nk_of(imin_(g_end * W, r1) - 1); };
      for (int g = g0; g < g1; g += kLaneGroups) {
        const int ng = imin_(kLaneGroups, g1 - g), nk = nk_upto(g + ng);
        for (int j0 = 0; j0 < nk; j0 += kLaneKeys) {
          pf.next();
          qk_lanes_tile(qt + static_cast<int64_t>(g) * hd * W, ng, static_cast<const float*>(kc) + kvbase, hd,
                        j0, nk, a.scale, ks, st + g * W, lds);
        }
      }
      pf.rest();
      for (int g = g0; g < g1; ++g) {
        alignas(64) float nkl[W], lol[W];
        for (int i = 0; i < W; ++i) {
          const int r = g * W + i;
          const bool in = r >= r0 && r < r1;
          nkl[i] = in ? static_cast<float>(nk_of(r)) : 0.f;
          lol[i] = in ? static_cast<float>(lo_of(r)) : 0.f;
        }
        softmax_lanes(imin_(W, nh - g * W), nkl, lol, nk_upto(g + 1), st + g * W, lds, a.softcap, mx + g * W,
                      sum + g * W, vs, cr + g * W);
      }
    } else {
      {
        const int rq = imin_(rstep, r1 - r0), kc = qk_keys(rq),
                  tiles = (r1 - r0 + rq - 1) / rq * ((nkmax + kc - 1) / kc);
        pf.step = (head_bytes / tiles + 63) / 64 * 64;
      }
      // Scores. A row past its own position's keys gets extra columns it never reads.
      for (int r = r0; r < r1; r += rstep) {
        const int rows = imin_(rstep, r1 - r);
        for (int t = 0; t < rows; ++t) {
          qs[t] = q_of(r + t);
          srow[t] = sc + static_cast<int64_t>(r + t) * bsp;
        }
        // Not few: f32 in the cache, or converted above.
        if (few) qk_rows<RF, DT>(rows, qs, kc, kvbase, hd, nkmax, a.scale, ks, srow, pf);
        else qk_rows<RQ, 0>(rows, qs, kc, kvbase, hd, nkmax, a.scale, ks, srow, pf);
      }
      pf.rest();
      // Softmax of every row that sees this block, W rows at a time.
      float* rows_s[W];
      for (int r = r0; r < r1; r += W) {
        const int n = imin_(W, r1 - r);
        for (int t = 0; t < n; ++t) rows_s[t] = sc + static_cast<int64_t>(r + t) * bsp;
        softmax_rows(
            n, rows_s, [&](int t) { return nk_of(r + t); }, [&](int t) { return lo_of(r + t); }, a.softcap,
            mx + r, sum + r, vs, cr + r);
      }
    }
    // Output, in tiles of rows that see the same keys (consecutive rows of one query, or of
    // several queries past the block's end).
    for (int r = r0; r < r1;) {
      const int nk = nk_of(r);
      int rows = 0;
      while (rows < RP && r + rows < r1 && nk_of(r + rows) == nk) {
        ps[rows] = lanes ? st + r + rows : sc + static_cast<int64_t>(r + rows) * bsp;
        os[rows] = acc + static_cast<int64_t>(r + rows) * hd;
        ++rows;
      }
      if (lanes) pv_rows<RP, 0, true>(rows, os, ps, lds, cr + r, vc, kvbase, hd, nk);
      else if (DT == 0 || convert) pv_rows<RP, 0, false>(rows, os, ps, lds, cr + r, vc, kvbase, hd, nk);
      else pv_rows<RP, DT, false>(rows, os, ps, lds, cr + r, vc, kvbase, hd, nk);
      r += rows;
    }
  }
  if (!one_part) end_partition((b_end - 1) / pb);
  if (split) return;
  // One partition: its state is the row's (folding it into an empty one would copy it).
  const float* l = one_part ? sum : gsum;
  const float* out = one_part ? acc : gacc;
  for (int i = 0; i < nq; ++i)
    for (int h = 0; h < G; ++h) {
      const int sh = i * G + h;
      const float inv = 1.0f / l[sh];
      const float* o = out + static_cast<int64_t>(sh) * hd;
      float* dst = a.out + i * a.out_stride + static_cast<int64_t>(a.kv_head * G + h) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = o[d] * inv;
    }
}

void attention_merge(const float* parts, int32_t nparts, int32_t head_dim, float* out) {
  const int hd = head_dim, sf = state_floats(hd);
  float m = -__builtin_inff(), l = 0.f;
  for (int p = 0; p < nparts; ++p)
    merge_state(&m, &l, out, parts[p * sf], parts[p * sf + 1], parts + p * sf + 2, hd);
  const float inv = 1.0f / l;
  for (int d = 0; d < hd; ++d) out[d] = out[d] * inv;
}

void attention(const AttnItem& a, float* scratch) {
  switch (a.kv_dtype) {
    case DType::kF32: attention_t<0>(a, scratch); return;
    case DType::kF16: attention_t<1>(a, scratch); return;
    case DType::kBF16: attention_t<2>(a, scratch); return;
    case DType::kI8: attention_t<3>(a, scratch); return;
  }
}
