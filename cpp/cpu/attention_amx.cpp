// cpu: paged attention over a bf16 KV cache on AMX tiles (see kernels_amx.h). Per-file flags add
// -mamx-*; nothing here runs unless amx_usable() said so.
// Over 400 lines: one tile kernel, its packing helpers and its window / soft-cap masking together.
//
// Layout, per tile of 16 query rows (rows = query x head of the item's group) and chunk of 16
// keys, so that every softmax step is lane-wise with the lanes = the 16 rows:
//  - scores transposed, S^T[key][row] = K . Q^T: A = the chunk's K rows straight from the cache,
//    B = Q^T packed once per tile (VNNI: dim pairs x rows);
//  - the online softmax on the 16 S^T rows as vectors (max, exp, sum are per lane);
//  - P transposed to rows (one 16x16 transpose), then O_chunk[row][dim] = P . V: A = P rows, B =
//    V with key pairs interleaved (one vpermt2w per 32 outputs);
//  - O = O * corr + O_chunk per row.
// Precision: f32 math on bf16 K/V. Q and P are f32, so each goes into the tiles as three bf16
// parts (x = hi + mid + lo carries all 24 significant bits), and the tile unit accumulates the
// exact bf16 x bf16 products in f32. Only the order of the f32 sums differs from the vector
// kernel. A row's result depends on its own query, its position and the keys: rows are lanes or
// tile rows, never mixed, so prefill rows equal the same rows decoded alone (batch invariance).
// Sliding window W: chunks start at the first row's window, and a lane masks the keys before its
// own as it masks those past its position; a lane that has seen no key yet keeps exactly zero
// state through a chunk it does not see (its max stands in as 0 in the exps), so it enters its
// first visible chunk as it would alone. The soft-cap maps each scaled score before the mask.
#include "cpu/kernels_amx.h"

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "cpu/amx_tiles.h"
#include "cpu/vt_avx512.h"

namespace fantai::cpu {
namespace {

using VT = vt_avx512::VT;
#define FA_INLINE inline __attribute__((always_inline))

#include "cpu/vt_softcap_impl.h"

constexpr int kSplits = 3;   // bf16 parts of Q (all 24 bits: scores can be large)
constexpr int kPSplits = 3;  // and of the softmax weights (two leave ~3e-5 relative error)
// (With bf16 activations, Q and P are rounded to bf16 instead: one part each.)
constexpr int kRows = 16;  // query rows per tile = lanes
constexpr int kKeys = 16;  // keys per chunk
constexpr int kAhead = 2;  // chunks of prefetch distance
// Tiles of at most this many rows take the softmax's exps per row (after the transpose) rather
// than per lane: fewer exps when most lanes are padding (decode: one query x its group's heads).
constexpr int kRowsPathMax = 8;

// Tiles: 0 S^T; 1 K (A); 2 Q^T part (B); 3, 4 two 16-dim column blocks of O_chunk; 5 P part (A,
// 16 keys = 32 bytes a row); 6 V key pairs (B, 8 rows). O_chunk and P have one row per query row:
// a tile of fewer rows configures just those (a product of <= 8 rows takes ~2.6 ns, of 16 ~4.5).
void configure(int rows) {
  amx::TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  for (int t : {3, 4}) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows);
  cfg.colsb[5] = 32, cfg.rows[5] = static_cast<uint8_t>(rows);
  cfg.colsb[6] = 64, cfg.rows[6] = 8;
  amx::load_config(cfg);
}

// f32 value of bf16 b (16 lanes).
FA_INLINE __m512 widen(__m256bh b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(b)), 16));
}

// exp(d) for d <= 0, -inf (and anything under -87.3) giving exactly 0, to ~1e-5 relative: for
// the bf16-activation form, whose softmax weights are rounded to bf16 (2^-9) right after. One
// ln2 constant, a degree-5 polynomial and vscalefps: 12 operations against VT::exp_nonpos's 19.
FA_INLINE __m512 exp_nonpos_bf16(__m512 d) {
  const __m512 lo = _mm512_set1_ps(-87.33654f);
  const __mmask16 keep = _mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ);
  const __m512 x = _mm512_max_ps(d, lo);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693147180559945f), x);  // |r| <= ln2 / 2
  __m512 p = _mm512_set1_ps(1.f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, fx);
}

// In-register transpose of 16 rows of 16 dwords.
FA_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

// Sum over the 16 keys of one chunk's softmax weights, in one fixed tree: keys j and j + 8, then
// j and j + 4, j and j + 2, 0 and 1. lane_sum: per lane, keys in p[0..15] (lanes = rows);
// key_sum: keys in the lanes of v (one row). Both compute the same additions, so the same bits.
FA_INLINE __m512 lane_sum(const __m512 p[16]) {
  __m512 t[8];
  for (int j = 0; j < 8; ++j) t[j] = _mm512_add_ps(p[j], p[j + 8]);
  for (int j = 0; j < 4; ++j) t[j] = _mm512_add_ps(t[j], t[j + 4]);
  for (int j = 0; j < 2; ++j) t[j] = _mm512_add_ps(t[j], t[j + 2]);
  return _mm512_add_ps(t[0], t[1]);
}

FA_INLINE float key_sum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // lane j += lane j + 8
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));  // lane j += lane j + 4
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));        // lane j += lane j + 2
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));        // lane 0 += lane 1
  return _mm512_cvtss_f32(v);
}

// Scratch, in floats (every region a multiple of 16 floats, so all stay 64-byte aligned).
struct Scratch {
  float* qb;     // [hd/32][kSplits] B tiles of Q^T, 256 floats (1 KiB) each
  uint16_t* qs;  // [kSplits][16][hd] bf16 parts of the tile's query rows
  float* o;      // [16][hd] running outputs
  float* ct;     // [16][hd] this chunk's P . V
  float* st;     // [2][16][16] S^T of this chunk and the next
  uint16_t* pa;  // [kPSplits][16][16] bf16 parts of P
  uint16_t* vb;  // [hd/16][8][32] V with key pairs interleaved
  float* corr;   // [16] this chunk's correction
  static int64_t floats(int hd) {
    return static_cast<int64_t>(hd / 32) * kSplits * 256 + kSplits * 16 * hd / 2 + 2 * 16 * hd + 512 +
           kPSplits * 128 + (hd / 16) * 128 + 16;
  }
  Scratch(float* s, int hd) {
    qb = s;
    s += static_cast<int64_t>(hd / 32) * kSplits * 256;
    qs = reinterpret_cast<uint16_t*>(s);
    s += kSplits * 16 * hd / 2;
    o = s;
    s += 16 * hd;
    ct = s;
    s += 16 * hd;
    st = s;
    s += 512;
    pa = reinterpret_cast<uint16_t*>(s);
    s += kPSplits * 128;
    vb = reinterpret_cast<uint16_t*>(s);
    s += (hd / 16) * 128;
    corr = s;
  }
};

// Q^T parts of the tile's rows q[0, rows) (zero rows past them) into qb.
template <int kSplits>
FA_INLINE void pack_queries(const Scratch& S, int hd, int rows, const float* const* q) {
  for (int n = rows; n < kRows; ++n)
    for (int sp = 0; sp < kSplits; ++sp)
      for (int e = 0; e < hd; e += 16)
        _mm256_store_si256(reinterpret_cast<__m256i*>(S.qs + (static_cast<int64_t>(sp) * 16 + n) * hd + e),
                           _mm256_setzero_si256());
  for (int n = 0; n < rows; ++n) {
    const float* src = q[n];
    for (int e = 0; e < hd; e += 16) {
      __m512 x = _mm512_loadu_ps(src + e);
      for (int sp = 0; sp < kSplits; ++sp) {
        const __m256bh b = _mm512_cvtneps_pbh(x);
        _mm256_store_si256(reinterpret_cast<__m256i*>(S.qs + (static_cast<int64_t>(sp) * 16 + n) * hd + e),
                           reinterpret_cast<__m256i>(b));
        x = _mm512_sub_ps(x, widen(b));
      }
    }
  }
  // B tile row p = dim pair p of every row: a transpose of 16 rows x 16 dim pairs (dwords).
  for (int s = 0; s < hd / 32; ++s)
    for (int sp = 0; sp < kSplits; ++sp) {
      __m512 r[16];
      for (int n = 0; n < 16; ++n)
        r[n] = _mm512_load_ps(
            reinterpret_cast<const float*>(S.qs + (static_cast<int64_t>(sp) * 16 + n) * hd + s * 32));
      transpose16(r);
      float* dst = S.qb + (static_cast<int64_t>(s) * kSplits + sp) * 256;
      for (int p = 0; p < 16; ++p) _mm512_store_ps(dst + p * 16, r[p]);
    }
}

// The chunk's V (keys [0, nk) of v; later keys zero: they may be unwritten cache) as B tiles of
// key pairs: tile u row p = (v[2p][16u + i], v[2p + 1][16u + i]) for i < 16.
FA_INLINE void pack_values(const Scratch& S, const uint16_t* v, int hd, int nk) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                      6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int p = 0; p < kKeys / 2; ++p) {
    const uint16_t* a = v + static_cast<int64_t>(2 * p) * hd;
    const uint16_t* b = a + hd;
    for (int h = 0; h < hd / 32; ++h) {
      const __m512i va = 2 * p < nk ? _mm512_loadu_si512(a + 32 * h) : _mm512_setzero_si512();
      const __m512i vb = 2 * p + 1 < nk ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
      _mm512_store_si512(S.vb + (static_cast<int64_t>(2 * h) * 8 + p) * 32,
                         _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_store_si512(S.vb + (static_cast<int64_t>(2 * h + 1) * 8 + p) * 32,
                         _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// Software prefetch of a later chunk's K and V, a few lines at a time at several points of a
// chunk's work, so the requests never fill the line-fill buffers at once (blocks are scattered
// pages: the hardware prefetchers do not run ahead into the next one).
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int bytes = 0, at = 0;
  FA_INLINE void next(int lines) {
    for (int e = at + 64 * lines; at < bytes && at < e; at += 64) {
      __builtin_prefetch(k + at, 0, 3);
      __builtin_prefetch(v + at, 0, 3);
    }
  }
};

}  // namespace

bool amx_attention_supported(int head_dim, int block_size) {
  return amx_usable() && head_dim > 0 && head_dim % 32 == 0 && head_dim <= 512 && block_size > 0 &&
         block_size % kKeys == 0;
}

int64_t amx_attn_scratch_floats(int head_dim) { return Scratch::floats(head_dim); }

namespace {

// Q in QS bf16 parts, P in PS: 3 and 3 (f32 math) or 1 and 1 (bf16 activations).
template <int QS, int PS>
void attention_tiles(const AttnItem& a, float* scratch) {
  constexpr int kSplits = QS, kPSplits = PS;
  // One bf16 part of P: the shorter exp is exact enough (every row and layout uses the same one).
  const auto exp_p = [](__m512 d) { return PS == 1 ? exp_nonpos_bf16(d) : VT::exp_nonpos(d); };
  const int G = a.group, hd = a.head_dim, bs = a.block_size;
  const int nh = a.num_q * G;
  const Scratch S(scratch, hd);
  const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(a.v_cache);
  const int64_t head_elems = static_cast<int64_t>(bs) * hd;
  auto chunk_offset = [&](int start) {  // element offset of the chunk of keys from position start
    return (static_cast<int64_t>(a.block_table[start / bs]) * a.num_kv_heads + a.kv_head) * head_elems +
           static_cast<int64_t>(start % bs) * hd;
  };
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int win = a.window;
  const float cap = a.softcap;
  int configured = 0;
  for (int r0 = 0; r0 < nh; r0 += kRows) {
    const int rows = nh - r0 < kRows ? nh - r0 : kRows;
    // Row r = query r / G, head r % G (counted up, not divided: an idiv per row was ~5%).
    alignas(64) int32_t pos[16];
    const float* qrow[16];
    float* orow[16];
    for (int n = 0, i = r0 / G, h = r0 % G; n < rows; ++n) {
      pos[n] = a.first_pos + i;
      qrow[n] = a.q + i * a.q_stride + static_cast<int64_t>(a.kv_head * G + h) * hd;
      orow[n] = a.out + i * a.out_stride + static_cast<int64_t>(a.kv_head * G + h) * hd;
      if (++h == G) h = 0, ++i;
    }
    const int last = pos[rows - 1];                 // the tile's last position
    for (int n = rows; n < 16; ++n) pos[n] = last;  // padding lanes (zero queries) see what it sees
    const __m512i posv = _mm512_load_si512(pos);
    // Lane n sees keys [pos[n] - win + 1, pos[n]]; chunks from the one holding row 0's first.
    const __m512i lov = _mm512_sub_epi32(posv, _mm512_set1_epi32(win > 0 ? win - 1 : 1 << 30));
    const int first = win > 0 && pos[0] - win + 1 > 0 ? (pos[0] - win + 1) / kKeys * kKeys : 0;
    const bool rows_path = rows <= kRowsPathMax;
    const int tile_rows = rows_path ? (rows + 1) / 2 * 2 : 16;  // P rows are written in pairs
    if (tile_rows != configured) configure(configured = tile_rows);
    pack_queries<kSplits>(S, hd, rows, qrow);
    for (int i = 0; i < rows * hd; i += 16) _mm512_store_ps(S.o + i, _mm512_setzero_ps());
    __m512 mx = ninf, l = _mm512_setzero_ps();
    // S^T of the chunk at key position start into tile 0 (stored by the caller).
    auto scores = [&](int start) {
      const int64_t off = chunk_offset(start);
      _tile_zero(0);
      for (int s = 0; s < hd / 32; ++s) {
        _tile_loadd(1, kc + off + s * 32, hd * 2);
        const float* qb = S.qb + static_cast<int64_t>(s) * kSplits * 256;
        for (int sp = 0; sp < kSplits; ++sp) {
          _tile_loadd(2, qb + sp * 256, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
    };
    auto prefetch = [&](int start) {
      Prefetch pf;
      if (start <= last) {
        const int64_t off = chunk_offset(start);
        pf.k = reinterpret_cast<const char*>(kc + off);
        pf.v = reinterpret_cast<const char*>(vc + off);
        pf.bytes = kKeys * hd * 2;
      }
      return pf;
    };
    const int lines = (kKeys * hd * 2 / 64 + 3) / 4;  // per call of next(): a chunk in four
    for (int c = 1; c <= kAhead; ++c) prefetch(first + c * kKeys).next(1 << 20);
    scores(first);
    _tile_stored(0, S.st, 64);
    for (int start = first, c = 0; start <= last; start += kKeys, c ^= 1) {
      const int64_t off = chunk_offset(start);
      const int nk = last - start + 1 < kKeys ? last - start + 1 : kKeys;
      const bool next = start + kKeys <= last;
      // The next chunk's scores go to the tile unit first and run beside this chunk's softmax.
      Prefetch pf = prefetch(start + (kAhead + 1) * kKeys);
      pf.next(lines);
      if (next) scores(start + kKeys);
      pack_values(S, vc + off, hd, nk);
      // Online softmax. Keys past a lane's position (or past the written ones) are -inf by
      // selection, so garbage never enters; exp_nonpos makes their weight exactly 0. Max and
      // correction run on the lanes (= rows); the exps and sums either there too (many rows) or
      // per row after the transpose (few rows): the same operations on the same values, and the
      // same sum tree (key_sum / lane_sum), so both give the same bits.
      const float* st = S.st + c * 256;
      __m512 p[16];
      __m512 m = mx;
      // Every lane sees every key: the same values, unmasked.
      if (start + kKeys - 1 <= pos[0] && (win == 0 || start >= last - win + 1)) {
        for (int j = 0; j < kKeys; ++j) {
          p[j] = _mm512_mul_ps(_mm512_load_ps(st + 16 * j), scale);
          if (cap > 0.f) p[j] = softcap_v(p[j], cap);
          m = _mm512_max_ps(m, p[j]);
        }
      } else {
        for (int j = 0; j < kKeys; ++j) {
          const __m512i key = _mm512_set1_epi32(start + j);
          const __mmask16 see = _mm512_cmp_epi32_mask(key, posv, _MM_CMPINT_LE) &
                                _mm512_cmp_epi32_mask(key, lov, _MM_CMPINT_NLT);
          __m512 x = _mm512_mul_ps(_mm512_load_ps(st + 16 * j), scale);
          if (cap > 0.f) x = softcap_v(x, cap);
          p[j] = _mm512_mask_mov_ps(ninf, see, x);
          m = _mm512_max_ps(m, p[j]);
        }
      }
      pf.next(lines);
      // A lane that has seen no key yet (window): its exps run against 0, giving zero weights and
      // a zero correction, so its state stays exactly empty (and its running max -inf).
      const __m512 msub = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
      const __m512 corr = exp_p(_mm512_sub_ps(mx, msub));
      if (rows_path) {
        // Few rows: transpose first, then one exp and one sum per row (lanes = keys).
        transpose16(p);
        alignas(64) float mrow[16], srow[16] = {};
        _mm512_store_ps(mrow, msub);
        for (int n = 0; n < rows; ++n) {
          p[n] = exp_p(_mm512_sub_ps(p[n], _mm512_set1_ps(mrow[n])));
          srow[n] = key_sum(p[n]);
        }
        if (rows & 1) p[rows] = _mm512_setzero_ps();
        l = _mm512_fmadd_ps(l, corr, _mm512_load_ps(srow));
      } else {
        for (int j = 0; j < kKeys; ++j) p[j] = exp_p(_mm512_sub_ps(p[j], msub));
        l = _mm512_fmadd_ps(l, corr, lane_sum(p));
        transpose16(p);
      }
      mx = m;
      _mm512_store_ps(S.corr, corr);
      // P rows (row n = lane n's weights over the keys), as bf16 parts, two rows per vector.
      for (int n = 0; n < rows; n += 2) {
        __m512 x0 = p[n], x1 = p[n + 1];
        for (int sp = 0; sp < kPSplits; ++sp) {
          const __m512bh b = _mm512_cvtne2ps_pbh(x1, x0);
          _mm512_store_si512(S.pa + sp * 256 + n * 16, reinterpret_cast<__m512i>(b));
          if (sp + 1 == kPSplits) break;
          const __m512i bi = reinterpret_cast<__m512i>(b);
          x0 = _mm512_sub_ps(x0, widen(reinterpret_cast<__m256bh>(_mm512_castsi512_si256(bi))));
          x1 = _mm512_sub_ps(x1, widen(reinterpret_cast<__m256bh>(_mm512_extracti64x4_epi64(bi, 1))));
        }
      }
      pf.next(lines);
      // O_chunk = P . V, two 16-dim column blocks at a time.
      for (int u = 0; u < hd / 16; u += 2) {
        _tile_zero(3);
        _tile_zero(4);
        for (int sp = 0; sp < kPSplits; ++sp) {
          _tile_loadd(5, S.pa + sp * 256, 32);
          _tile_loadd(6, S.vb + static_cast<int64_t>(u) * 256, 64);
          _tile_dpbf16ps(3, 5, 6);
          _tile_loadd(6, S.vb + static_cast<int64_t>(u + 1) * 256, 64);
          _tile_dpbf16ps(4, 5, 6);
        }
        _tile_stored(3, S.ct + u * 16, hd * 4);
        _tile_stored(4, S.ct + (u + 1) * 16, hd * 4);
      }
      pf.next(lines);
      if (next) _tile_stored(0, S.st + (c ^ 1) * 256, 64);
      for (int n = 0; n < rows; ++n) {
        const __m512 c = _mm512_set1_ps(S.corr[n]);
        float* o = S.o + static_cast<int64_t>(n) * hd;
        const float* ct = S.ct + static_cast<int64_t>(n) * hd;
        for (int d = 0; d < hd; d += 16)
          _mm512_store_ps(o + d, _mm512_fmadd_ps(_mm512_load_ps(o + d), c, _mm512_load_ps(ct + d)));
      }
    }
    alignas(64) float lsum[16];
    _mm512_store_ps(lsum, l);
    for (int n = 0; n < rows; ++n) {
      const __m512 inv = _mm512_set1_ps(1.0f / lsum[n]);
      const float* o = S.o + static_cast<int64_t>(n) * hd;
      for (int d = 0; d < hd; d += 16)
        _mm512_storeu_ps(orow[n] + d, _mm512_mul_ps(_mm512_load_ps(o + d), inv));
    }
  }
  _tile_release();
}

}  // namespace

void amx_attention_bf16(const AttnItem& a, float* scratch) { attention_tiles<3, 3>(a, scratch); }
void amx_attention_bf16_act(const AttnItem& a, float* scratch) { attention_tiles<1, 1>(a, scratch); }

}  // namespace fantai::cpu

#else  // no AMX in this build

namespace fantai::cpu {
bool amx_attention_supported(int, int) { return false; }
int64_t amx_attn_scratch_floats(int) { return 0; }
void amx_attention_bf16(const AttnItem&, float*) {}
void amx_attention_bf16_act(const AttnItem&, float*) {}
}  // namespace fantai::cpu

#endif
