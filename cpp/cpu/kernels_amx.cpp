// cpu: AMX bf16 dense linear (see kernels_amx.h). Per-file flags add -mamx-*; nothing here runs
// unless amx_usable() said so. Activations are f32: x = hi + lo with both halves in bf16, so the
// two exact-bf16-weight products carry ~16 significant bits of x (error ~2^-17 of |x|). In the
// bf16-activation mode there is no lo: one product per tile, x rounded to bf16 (2^-9).
#include "cpu/kernels_amx.h"

#include <cstring>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "cpu/amx_tiles.h"
#include "cpu/cpu_features.h"

#include "cpu/vt_avx512.h"  // last: from here on the TU is AVX-512 code

namespace fantai::cpu {
namespace {

#define FA_INLINE inline __attribute__((always_inline))

constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes

// One output tile pair's destination: rows [r, r + rows) x columns [j0, j0 + cols) of y. With
// act_hi set, the pair is (gate, up) of 16 columns instead, and what is stored is the MLP's
// activation silu(gate) * up, split into bf16 halves at act_hi / act_lo (row stride ldy) for the
// down projection's tiles.
struct Out {
  float* y;  // y + r * ldy + j0
  int64_t ldy;
  const float* bias;  // bias + j0, or null
  int rows, cols, trows;
  uint16_t* act_hi = nullptr;  // act_hi + r * ldy + j0
  uint16_t* act_lo = nullptr;
};

// silu(g) * u exactly as the AVX-512 kernel table's silu_mul (kernels_impl.h's silu_v) computes
// it: the fused MLP must give the unfused path's bits, which test_amx checks bitwise. (A copy,
// not a call: kernels_impl.h is instantiated per ISA inside each kernels_<isa>.cpp.)
FA_INLINE __m512 silu_mul16(__m512 g, __m512 u) {
  using VT = vt_avx512::VT;
  const __m512 one = VT::set1(1.0f);
  return VT::mul(VT::div(g, VT::add(one, VT::exp(VT::sub(VT::zero(), g)))), u);
}

// x = hi + lo in bf16, 16 lanes: the one split of activations for the tiles (amx_split_rows and
// the fused MLP's epilogue).
FA_INLINE void split16(__m512 v, uint16_t* hi, uint16_t* lo) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
  const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), (__m256i)h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), (__m256i)l);
}

// x rounded to bf16, 16 lanes: the bf16-activation mode's hi, with no lo.
FA_INLINE void round16(__m512 v, uint16_t* hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), (__m256i)_mm512_cvtneps_pbh(v));
}

// C tiles 2S, 2S+1 (one 16-row x 32-column output) into y: straight from the tiles when they
// cover exactly the destination and there is no bias, else through c (rows past r1 or columns
// past n must not be written; the bias is added after the sum, as in the other linears).
// (The intrinsics take tile numbers as literals, hence the macro per tile pair.)
#define FA_STORE_PAIR(C0, C1, dst, ld)  \
  do {                                  \
    _tile_stored(C0, (dst), (ld));      \
    _tile_stored(C1, (dst) + 16, (ld)); \
  } while (0)

// The fused activation of a (gate, up) pair parked in c, a row at a time: spread over the next
// sweep's k tiles, the exps and divisions run between tile products instead of stalling the tile
// unit all at once (done in one go, the epilogue ate most of what the fusion saved).
struct Epilogue {
  Out o{};
  int next = 0;
  FA_INLINE void step(const float* c) {
    if (next >= o.rows) return;
    const int i = next++;
    const __m512 v = silu_mul16(_mm512_load_ps(c + i * 32), _mm512_load_ps(c + i * 32 + 16));
    if (o.act_lo) split16(v, o.act_hi + i * o.ldy, o.act_lo + i * o.ldy);
    else round16(v, o.act_hi + i * o.ldy);
  }
  FA_INLINE void finish(const float* c) {
    while (next < o.rows) step(c);
  }
};

template <int S>
FA_INLINE void store_out(const Out& o, float* c, Epilogue* epi) {
  if (epi) epi->finish(c);  // c is about to be overwritten
  if (o.act_hi) {
    if constexpr (S == 0) FA_STORE_PAIR(0, 1, c, 32 * 4);
    else FA_STORE_PAIR(2, 3, c, 32 * 4);
    epi->o = o;
    epi->next = 0;
    return;
  }
  const bool direct = !o.bias && o.rows == o.trows && o.cols == 32;
  float* const dst = direct ? o.y : c;
  const int64_t ld = direct ? o.ldy * 4 : 32 * 4;
  if constexpr (S == 0) FA_STORE_PAIR(0, 1, dst, ld);
  else FA_STORE_PAIR(2, 3, dst, ld);
  if (direct) return;
  for (int i = 0; i < o.rows; ++i) {
    float* yr = o.y + i * o.ldy;
    const float* cr = c + i * 32;
    if (o.bias) {
      for (int j = 0; j < o.cols; ++j) yr[j] = cr[j] + o.bias[j];
    } else {
      std::memcpy(yr, cr, static_cast<size_t>(o.cols) * sizeof(float));
    }
  }
}

// Weights load with the streaming hint (tileloaddt1) where stream is set: each weight tile is used
// once per row tile, and without the hint they pushed the row tile's hi/lo rows out of L1 (pp512
// +6%; with 2 threads the kernel alone went from ~15 to ~10 ns per tile product).
#define FA_LOAD_W(T, src)                       \
  do {                                          \
    if (stream) _tile_stream_loadd(T, src, 64); \
    else _tile_loadd(T, src, 64);               \
  } while (0)

// C tiles 2S, 2S+1 = one 16-row tile of x (hi/lo in tiles 4/5) against two column blocks (the
// second may be absent: TWO false), the k tiles in order, hi then lo. The previous sweep's output
// (the other tile pair) is stored after this sweep's first k tile is issued, so the tile unit is
// not drained between sweeps (storing right after the last product stalled it, ~25% of the time).
#define FA_SWEEP(C0, C1, OTHER)                                  \
  do {                                                           \
    if (init) {                                                  \
      _tile_loadd(C0, init, 32 * 4);                             \
      if constexpr (TWO) _tile_loadd(C1, init + 16, 32 * 4);     \
    } else {                                                     \
      _tile_zero(C0);                                            \
      if constexpr (TWO) _tile_zero(C1);                         \
    }                                                            \
    for (int64_t kb = k0; kb < k1; ++kb) {                       \
      _tile_loadd(4, hi + kb * 32, ldx_bytes);                   \
      if constexpr (LO) _tile_loadd(5, lo + kb * 32, ldx_bytes); \
      FA_LOAD_W(6, w0 + kb * kTileBytes);                        \
      _tile_dpbf16ps(C0, 4, 6);                                  \
      if constexpr (LO) _tile_dpbf16ps(C0, 5, 6);                \
      if constexpr (TWO) {                                       \
        FA_LOAD_W(7, w1 + kb * kTileBytes);                      \
        _tile_dpbf16ps(C1, 4, 7);                                \
        if constexpr (LO) _tile_dpbf16ps(C1, 5, 7);              \
      }                                                          \
      if (kb == k0 && prev) store_out<OTHER>(*prev, c, epi);     \
      else if (epi) epi->step(c);                                \
    }                                                            \
    if constexpr (!TWO) _tile_zero(C1);                          \
  } while (0)

// k tiles [k0, k1) of one sweep, starting from zero or from the partial sums at init (16 x 32
// floats, as a previous k chunk stored them).
template <int S, bool TWO, bool LO>
FA_INLINE void sweep(const uint16_t* hi, const uint16_t* lo, int64_t ldx_bytes, const uint8_t* w0,
                     const uint8_t* w1, int64_t k0, int64_t k1, const float* init, const Out* prev, float* c,
                     bool stream, Epilogue* epi) {
  if constexpr (S == 0) FA_SWEEP(0, 1, 1);
  else FA_SWEEP(2, 3, 0);
}

template <bool LO>
FA_INLINE void run_sweep(int set, bool two, const uint16_t* hi, const uint16_t* lo, int64_t ldx_bytes,
                         const uint8_t* w0, const uint8_t* w1, int64_t k0, int64_t k1, const float* init,
                         const Out* prev, float* c, bool stream, Epilogue* epi) {
  if (set == 0) {
    if (two) sweep<0, true, LO>(hi, lo, ldx_bytes, w0, w1, k0, k1, init, prev, c, stream, epi);
    else sweep<0, false, LO>(hi, lo, ldx_bytes, w0, nullptr, k0, k1, init, prev, c, stream, epi);
  } else {
    if (two) sweep<1, true, LO>(hi, lo, ldx_bytes, w0, w1, k0, k1, init, prev, c, stream, epi);
    else sweep<1, false, LO>(hi, lo, ldx_bytes, w0, nullptr, k0, k1, init, prev, c, stream, epi);
  }
}

// bf16 activations (no lo), two row tiles at once: C tiles 0/1 = row tile 0 x blocks (w0, w1),
// 2/3 = row tile 1 x the same blocks, so each weight tile loaded serves two products (the one-row
// sweep loads three tiles per two products and was load bound). A sweep's outputs are stored
// after it, the tile unit drained: no tile is left to pipeline them as the one-row sweeps do.
template <bool TWO>
FA_INLINE void sweep_rows2(const uint16_t* h0, const uint16_t* h1, int64_t ldx_bytes, const uint8_t* w0,
                           const uint8_t* w1, int64_t k0, int64_t k1, const float* init0, const float* init1,
                           bool stream, Epilogue* epi0, Epilogue* epi1, const float* c0, const float* c1) {
  if (init0) {  // init1 too: the pair's partial sums are parked together
    _tile_loadd(0, init0, 32 * 4);
    if constexpr (TWO) _tile_loadd(1, init0 + 16, 32 * 4);
    _tile_loadd(2, init1, 32 * 4);
    if constexpr (TWO) _tile_loadd(3, init1 + 16, 32 * 4);
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if constexpr (TWO) {
      _tile_zero(1);
      _tile_zero(3);
    }
  }
  for (int64_t kb = k0; kb < k1; ++kb) {
    _tile_loadd(4, h0 + kb * 32, ldx_bytes);
    FA_LOAD_W(6, w0 + kb * kTileBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, h1 + kb * 32, ldx_bytes);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (TWO) {
      FA_LOAD_W(7, w1 + kb * kTileBytes);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (epi0) {
      epi0->step(c0);
      epi1->step(c1);
    }
  }
  if constexpr (!TWO) {
    _tile_zero(1);
    _tile_zero(3);
  }
}

}  // namespace

bool amx_usable() { return cpu_features().amx_bf16; }

bool amx_int8_usable() { return cpu_features().amx_int8; }

size_t amx_packed_bytes(int64_t n, int64_t k) {
  return static_cast<size_t>((n + 15) / 16) * static_cast<size_t>(amx_k_pad(k) / 32) * kTileBytes;
}

void amx_pack_bf16(const uint16_t* w, int64_t n, int64_t k, void* dst) {
  const int64_t kt = amx_k_pad(k) / 32, nb = (n + 15) / 16;
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t jb = 0; jb < nb; ++jb)
    for (int64_t kb = 0; kb < kt; ++kb) {
      uint16_t* t = out + (jb * kt + kb) * (kTileBytes / 2);
      for (int p = 0; p < 16; ++p)
        for (int c = 0; c < 16; ++c)
          for (int s = 0; s < 2; ++s) {
            const int64_t j = jb * 16 + c, i = kb * 32 + 2 * p + s;
            t[p * 32 + c * 2 + s] = j < n && i < k ? w[j * k + i] : 0;
          }
    }
}

void amx_split_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int64_t r_pad, uint16_t* hi,
                    uint16_t* lo) {
  const int64_t kp = amx_k_pad(k);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * k;
    for (int64_t i = 0; i < kp; i += 16) {
      const int64_t left = k - i;
      const __mmask16 mask = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, xr + i);
      if (lo) split16(v, hi + r * kp + i, lo + r * kp + i);
      else round16(v, hi + r * kp + i);
    }
  }
  if (r_pad > r1) {
    std::memset(hi + r1 * kp, 0, static_cast<size_t>((r_pad - r1) * kp) * 2);
    if (lo) std::memset(lo + r1 * kp, 0, static_cast<size_t>((r_pad - r1) * kp) * 2);
  }
}

void amx_linear_bf16(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed,
                     int64_t n, const float* bias, float* y, int64_t ldy, int64_t r0, int64_t r1, int64_t b0,
                     int64_t b1, const AmxActOut* act) {
  const int64_t kp = amx_k_pad(k), kt = kp / 32, nb = (n + 15) / 16;
  // Fused MLP: blocks [b0, b1) are gate blocks, each swept beside its up block (half further on).
  const int64_t half = act ? nb / 2 : 0, step = act ? 1 : 2;
  if (r1 > m) r1 = m;
  if (b1 > (act ? half : nb)) b1 = act ? half : nb;
  // A call of fewer than 16 rows runs tiles of just those rows: a tile product costs per row, and
  // a row's arithmetic is the same in a short tile as in a full one (rows are independent).
  const uint8_t trows = static_cast<uint8_t>(m < 16 ? m : 16);
  amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t < 6 ? trows : 16;
  amx::load_config(cfg);
  const uint8_t* w = static_cast<const uint8_t*>(packed);
  // Row tiles outermost: a tile's hi/lo rows (2 x kt KiB) stay in L1 while it sweeps the blocks'
  // weights, which the caller sizes to stay in L2 (see CpuBackend::linear_packed). Sweeps of two
  // blocks alternate between tile pairs 0/1 and 2/3. Where the rows would not fit L1 (k > 640),
  // k is cut into chunks of <= 16 tiles (32 KiB of hi/lo), run over a group of up to kGroup
  // sweeps with the partial sums parked in part between chunks: stored and reloaded as f32,
  // the k tiles still in order, so the bits do not change (the 2-block sweeps re-read 96 KiB
  // rows from L2 at k = 1536 otherwise and ran ~25% slower than 4-block ones).
  constexpr int kGroup = 8;
  // Streaming hint only where a weight tile is swept by several row tiles: for decode-sized calls
  // each tile is used once, and the hint cost ~5% of the weight stream from DRAM
  // (bench_kernels --only amx-decode).
  const bool stream = m > 16;
  const int64_t nkc = kt <= 20 ? 1 : (kt + 15) / 16, kc = (kt + nkc - 1) / nkc;
  alignas(64) float c[16 * 32];
  alignas(64) float part[kGroup][16 * 32];
  Out pending[2];
  Epilogue epi_state;
  Epilogue* const epi = act ? &epi_state : nullptr;
  const Out* prev = nullptr;
  int set = 0;
  const int64_t block_bytes = kt * kTileBytes;
  // One sweep's place: its blocks, its k chunk, and its slot in the group's partial sums.
  struct Sweep {
    bool two, last, first;  // two blocks; the last k chunk (outputs final); the first (start at 0)
    const uint8_t *w0, *w1;
    int64_t j0, k0, k1, slot;
  };
  // Every path visits the sweeps of a row range in this one order: block groups, k chunks, blocks.
  auto for_each_sweep = [&](auto&& f) {
    for (int64_t g0 = b0; g0 < b1; g0 += step * kGroup) {
      const int64_t g1 = g0 + step * kGroup < b1 ? g0 + step * kGroup : b1;
      for (int64_t ci = 0; ci < nkc; ++ci) {
        const int64_t k0 = ci * kc, k1 = k0 + kc < kt ? k0 + kc : kt;
        for (int64_t g = g0; g < g1; g += step) {
          const uint8_t* w0 = w + g * block_bytes;
          f(Sweep{act || g + 1 < g1, ci + 1 == nkc, ci == 0, w0,
                  act ? w + (g + half) * block_bytes : w0 + block_bytes, g * 16, k0, k1, (g - g0) / step});
        }
      }
    }
  };
  // Where a sweep of row tile r (rows live rows) puts its tile pair: the MLP's activation halves,
  // y, or (k chunks before the last) the partial sums pt.
  auto out_for = [&](const Sweep& s, int64_t r, int rows, float* pt) {
    if (s.last && act)
      return Out{nullptr,
                 act->ld,
                 nullptr,
                 rows,
                 32,
                 trows,
                 act->hi + r * act->ld + s.j0,
                 act->lo ? act->lo + r * act->ld + s.j0 : nullptr};
    if (s.last)
      return Out{y + r * ldy + s.j0,
                 ldy,
                 bias ? bias + s.j0 : nullptr,
                 rows,
                 static_cast<int>(n - s.j0 < (s.two ? 32 : 16) ? n - s.j0 : (s.two ? 32 : 16)),
                 trows};
    return Out{pt, 32, nullptr, trows, 32, trows};
  };
  // bf16 activations: row tiles in pairs (the last one alone, below). Same k order per element,
  // so a row's bits do not depend on which path or pair it took.
  int64_t r_one = r0;
  if (!lo && r1 - r0 >= 32) {
    alignas(64) float c2[2][16 * 32];
    alignas(64) float part2[2][kGroup][16 * 32];
    Epilogue epis[2];
    Epilogue* const e0 = act ? &epis[0] : nullptr;
    Epilogue* const e1 = act ? &epis[1] : nullptr;
    for (; r1 - r_one >= 32; r_one += 32) {
      const int64_t r = r_one;
      const uint16_t* h0 = hi + r * kp;
      const uint16_t* h1 = h0 + 16 * kp;
      const int rows1 = static_cast<int>(r1 - r - 16 < 16 ? r1 - r - 16 : 16);
      for_each_sweep([&](const Sweep& s) {
        float* pt0 = part2[0][s.slot];
        float* pt1 = part2[1][s.slot];
        const float* init0 = s.first ? nullptr : pt0;
        const float* init1 = s.first ? nullptr : pt1;
        if (s.two)
          sweep_rows2<true>(h0, h1, kp * 2, s.w0, s.w1, s.k0, s.k1, init0, init1, stream, e0, e1, c2[0],
                            c2[1]);
        else
          sweep_rows2<false>(h0, h1, kp * 2, s.w0, nullptr, s.k0, s.k1, init0, init1, stream, e0, e1, c2[0],
                             c2[1]);
        store_out<0>(out_for(s, r, 16, pt0), c2[0], e0);
        store_out<1>(out_for(s, r + 16, rows1, pt1), c2[1], e1);
      });
    }
    if (e0) {
      e0->finish(c2[0]);
      e1->finish(c2[1]);
    }
  }
  for (int64_t r = r_one; r < r1; r += 16) {
    const uint16_t* h = hi + r * kp;
    const uint16_t* l = lo ? lo + r * kp : nullptr;
    const int rows = static_cast<int>(r1 - r < 16 ? r1 - r : 16);
    for_each_sweep([&](const Sweep& s) {
      float* pt = part[s.slot];
      const float* init = s.first ? nullptr : pt;
      // A one-sweep group's pending store is its own partial sums: store before reloading.
      if (init && prev && prev->y == pt) {
        if (set == 1) store_out<0>(*prev, c, epi);
        else store_out<1>(*prev, c, epi);
        prev = nullptr;
      }
      Out& o = pending[set];
      o = out_for(s, r, rows, pt);
      if (l) run_sweep<true>(set, s.two, h, l, kp * 2, s.w0, s.w1, s.k0, s.k1, init, prev, c, stream, epi);
      else run_sweep<false>(set, s.two, h, l, kp * 2, s.w0, s.w1, s.k0, s.k1, init, prev, c, stream, epi);
      prev = &o;
      set ^= 1;
    });
  }
  if (prev) {
    if (set == 1) store_out<0>(*prev, c, epi);
    else store_out<1>(*prev, c, epi);
  }
  if (epi) epi->finish(c);
  _tile_release();
}

}  // namespace fantai::cpu

#else  // no AMX in this build: the probe says no and nothing else is ever called.

#include <cstdlib>

namespace fantai::cpu {
bool amx_usable() { return false; }
bool amx_int8_usable() { return false; }
size_t amx_packed_bytes(int64_t, int64_t) { return 0; }
void amx_pack_bf16(const uint16_t*, int64_t, int64_t, void*) { std::abort(); }
void amx_split_rows(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*, uint16_t*) { std::abort(); }
void amx_linear_bf16(const uint16_t*, const uint16_t*, int64_t, int64_t, const void*, int64_t, const float*,
                     float*, int64_t, int64_t, int64_t, int64_t, int64_t, const AmxActOut*) {
  std::abort();
}
}  // namespace fantai::cpu

#endif
