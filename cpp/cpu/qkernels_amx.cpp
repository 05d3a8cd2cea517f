// cpu: the VNNI panel linear (qkernels_vnni_avx512.cpp) on AMX int8 tiles (tdpbsud: s8
// activations x u8 weights). A block's integer sum q.qx is exact however it is formed, and the
// float update per block below is the VNNI kernel's, operation for operation, in the same block
// order, so both paths give the same bits: the backend may pick either per call (by row count)
// without breaking batch invariance. Per-file flags add -mamx-*; nothing here runs unless
// amx_int8_usable() said so.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/kernels_amx.h"
#include "cpu/qkernels.h"

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#include <immintrin.h>

#include "cpu/amx_tiles.h"

namespace fantai::cpu {
namespace {

#define FQ_INLINE inline __attribute__((always_inline))

FQ_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#include "cpu/qkernels_panel_impl.h"

// Thread-local scratch: plain malloc (no std:: templates in an ISA-flagged file, see
// kernels_impl.h), grown on demand, freed at thread exit.
struct Scratch {
  uint8_t* p = nullptr;
  size_t n = 0;
  ~Scratch() { std::free(p); }
  uint8_t* get(size_t bytes) {
    if (bytes > n) {
      std::free(p);
      p = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      if (!p) std::abort();
      n = bytes;
    }
    return p;
  }
};
thread_local Scratch t_scratch;

// One panel's weights as B tiles: activation block bi (B columns) at dst + bi * B * 16, B / 4
// rows of 64 bytes (row t: columns 4t..4t+3 of the block for each of the 16 panel rows, one u8
// each). Steps past the block's end (the short last block of a group) are zero, so a tile never
// reads another group's weights.
template <int BITS, bool CB>
void unpack_panel(const QuantMatrix& w, int64_t p, int B, uint8_t* dst) {
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  const int64_t gbytes = G * 2 * BITS;
  constexpr int64_t SC = panel_step_cols(BITS), PB = panel_plane_bytes(BITS);
  const uint8_t* panel = static_cast<const uint8_t*>(w.data) + p * w.ld;
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  const __m512i cb = CB ? _mm512_broadcast_i32x4(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook)))
                        : _mm512_setzero_si512();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t g0 = g * G, g1 = min64(g0 + G, k);
    for (int64_t b0 = g0; b0 < g1; b0 += B) {
      const int64_t blen = min64(B, g1 - b0);
      uint8_t* out = dst + (b0 / B) * B * 16;
      if constexpr (BITS < 4) {
        const uint8_t* src = panel + g * gbytes + (b0 - g0) / SC * 64;
        const uint8_t* pl = panel + g * gbytes + panel_planes_at(BITS, g1 - g0) + (b0 - g0) / SC * PB;
        const __m512i lo2 = _mm512_set1_epi8(0x03), b2 = _mm512_set1_epi8(0x04);
        for (int t = 0; t < B / 16; ++t) {
          const bool live = 16 * t < blen;
          const __m512i v = live ? _mm512_loadu_si512(src + 64 * t) : _mm512_setzero_si512();
          const __m512i hb = BITS == 3 && live ? plane3(pl + PB * t) : _mm512_setzero_si512();
          for (int sv = 0; sv < 4; ++sv) {
            __m512i wv = _mm512_and_si512(_mm512_srli_epi16(v, 2 * sv), lo2);
            if constexpr (BITS == 3)
              wv = _mm512_mask_add_epi8(wv, _mm512_test_epi8_mask(hb, plane3_bit(sv)), wv, b2);
            _mm512_storeu_si512(out + 256 * t + 64 * sv, wv);
          }
        }
      } else if constexpr (BITS == 8) {
        const uint8_t* src = panel + g * gbytes + (b0 - g0) * 16;
        for (int t = 0; t < B / 4; ++t) {
          const __m512i v = 4 * t < blen ? _mm512_loadu_si512(src + 64 * t) : _mm512_setzero_si512();
          _mm512_storeu_si512(out + 64 * t, v);
        }
      } else {
        const uint8_t* src = panel + g * gbytes + (b0 - g0) * 8;
        const uint8_t* pl = panel + g * gbytes + panel_planes_at(BITS, g1 - g0) + (b0 - g0) / SC * PB;
        for (int t = 0; t < B / 8; ++t) {
          __m512i wl = _mm512_setzero_si512(), wh = _mm512_setzero_si512();
          if (8 * t < blen) {
            const __m512i v = _mm512_loadu_si512(src + 64 * t);
            wl = _mm512_and_si512(v, lo4);
            wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            if constexpr (BITS == 5 || BITS == 6) add_planes<BITS>(pl + PB * t, &wl, &wh);
            if constexpr (CB) {
              wl = _mm512_shuffle_epi8(cb, wl);
              wh = _mm512_shuffle_epi8(cb, wh);
            }
          }
          _mm512_storeu_si512(out + 128 * t, wl);
          _mm512_storeu_si512(out + 128 * t + 64, wh);
        }
      }
    }
  }
}

// Per-row block factors, the VNNI kernel's scalars: d, float(s) and d * float(s) for rows
// [0, 16 * ceil(m / 16)) and blocks [0, nb), row-major; rows past m are zero.
struct RowFactors {
  float* d;
  float* sx;
  float* dsx;
};

void row_factors(const QuantizedRows& x, int64_t m, int64_t mp, RowFactors f) {
  const int64_t nb = x.nblocks;
  for (int64_t i = 0; i < m * nb; ++i) {
    const float d = x.d[i];
    const float sx = static_cast<float>(x.s[i]);
    f.d[i] = d;
    f.sx[i] = sx;
    f.dsx[i] = d * sx;
  }
  for (int64_t i = m * nb; i < mp * nb; ++i) f.d[i] = f.sx[i] = f.dsx[i] = 0.f;
}

// x.q rows [0, m) as A tiles: row tile t, block bi at dst + (t * nb + bi) * 16 * B, 16 rows of B
// bytes (one contiguous 512-byte tile instead of 16 strided lines); rows past m are zero.
void pack_rows(const QuantizedRows& x, int64_t m, int64_t mp, int B, int8_t* dst) {
  const int64_t nb = x.nblocks;
  for (int64_t r = 0; r < mp; ++r) {
    const int64_t t = r / 16, i = r % 16;
    const int8_t* src = x.q + r * x.ld;
    int8_t* out = dst + (t * nb * 16 + i) * B;  // block bi at out + bi * 16 * B
    if (r >= m) {
      for (int64_t bi = 0; bi < nb; ++bi) std::memset(out + bi * 16 * B, 0, static_cast<size_t>(B));
    } else if (B == 32) {
      for (int64_t bi = 0; bi < nb; ++bi)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + bi * 16 * 32),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + bi * 32)));
    } else {
      for (int64_t bi = 0; bi < nb; ++bi)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + bi * 16 * 16),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + bi * 16)));
    }
  }
}

// Block bi's exact integer sums for one row tile x PC panels (int32 [c][16][16] at cb)
// folded into the float accumulators fa[row][2][16], as the VNNI kernel does per block. All 16
// rows always (a tail's extra rows are zero and never stored).
template <int PC, bool HZ, bool HM>
FQ_INLINE void fold_block(const int32_t* cb, const float* d, const float* sx, const float* dsx, int64_t nb,
                          const __m512* vs, const __m512* vz, const __m512* vm, float* fa) {
#pragma GCC unroll 4
  for (int i = 0; i < 16; ++i) {
    const __m512 vd = _mm512_set1_ps(d[i * nb]);
#pragma GCC unroll 2
    for (int c = 0; c < PC; ++c) {
      float* f = fa + (i * 2 + c) * 16;
      __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(cb + c * 256 + i * 16));
      if constexpr (HZ) t = _mm512_sub_ps(t, _mm512_mul_ps(vz[c], _mm512_set1_ps(sx[i * nb])));
      __m512 acc = _mm512_fmadd_ps(t, _mm512_mul_ps(vs[c], vd), _mm512_load_ps(f));
      if constexpr (HM) acc = _mm512_fmadd_ps(vm[c], _mm512_set1_ps(dsx[i * nb]), acc);
      _mm512_store_ps(f, acc);
    }
  }
}

// Up to 2 row tiles (rows rows, packed at xa) x PC panels from p, all blocks. Tiles: C 0..3 (row
// tile i, panel c at 2i + c), A 4/5, B 6/7. The four products of block bi + 1 are issued before
// block bi is folded in (from the other half of cbuf), so the tile unit and the vector units
// overlap; four independent products per round hide the tile latency.
template <int PC, bool TWO_ROWS, bool HZ, bool HM, int HS>
FQ_INLINE void row_pair(const QuantMatrix& w, int64_t nb, const float* bias, float* y, int64_t ldy, int64_t p,
                        int64_t r, int rows, const int8_t* xa, const uint8_t* wb, int64_t panel_stride,
                        int32_t* cbuf, float* fa, const float* fd, const float* fsx, const float* fdsx) {
  const int64_t G = w.group;
  const int B = xq_block(w);
  const int64_t a_next = nb * 16 * B;  // second row tile's packed rows
  const int nt = TWO_ROWS ? 2 : 1;
  // Unrolled: as a loop GCC turns this into rep stosq, whose start-up cost showed in profiles.
  const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 64
  for (int i = 0; i < nt * 16 * 2; ++i) _mm512_store_ps(fa + i * 16, zero);
  __m512 vs[PC], vz[PC], vm[PC];
  int64_t cur_g = -1;
  // Row tile 0's products (C 0/1, A 4, B 6/7) and row tile 1's (C 2/3, A 5, same B).
  auto issue0 = [&](int64_t bi) {
    _tile_zero(0);
    _tile_loadd(4, xa + bi * 16 * B, B);
    _tile_loadd(6, wb + bi * B * 16, 64);
    _tile_dpbsud(0, 4, 6);
    if constexpr (PC > 1) {
      _tile_zero(1);
      _tile_loadd(7, wb + panel_stride + bi * B * 16, 64);
      _tile_dpbsud(1, 4, 7);
    }
  };
  auto issue1 = [&](int64_t bi) {
    _tile_zero(2);
    _tile_loadd(5, xa + a_next + bi * 16 * B, B);
    _tile_dpbsud(2, 5, 6);
    if constexpr (PC > 1) {
      _tile_zero(3);
      _tile_dpbsud(3, 5, 7);
    }
  };
  auto store0 = [&](int32_t* cb) {
    _tile_stored(0, cb, 64);
    if constexpr (PC > 1) _tile_stored(1, cb + 256, 64);
  };
  auto store1 = [&](int32_t* cb) {
    _tile_stored(2, cb + 512, 64);
    if constexpr (PC > 1) _tile_stored(3, cb + 768, 64);
  };
  issue0(0);
  if constexpr (TWO_ROWS) issue1(0);
  store0(cbuf);
  if constexpr (TWO_ROWS) store1(cbuf);
  for (int64_t bi = 0; bi < nb; ++bi) {
    int32_t* cur = cbuf + (bi & 1) * 1024;
    const bool more = bi + 1 < nb;
    int32_t* nxt = cbuf + ((bi + 1) & 1) * 1024;
    if (more) issue0(bi + 1);
    const int64_t g = bi * B / G;
    if (g != cur_g) {
      cur_g = g;
      panel_group_scales<PC, HZ, HM, HS>(w, p, g, vs, vz, vm);
    }
    if (more && TWO_ROWS) issue1(bi + 1);
    fold_block<PC, HZ, HM>(cur, fd + bi, fsx + bi, fdsx + bi, nb, vs, vz, vm, fa);
    if (more) store0(nxt);
    if constexpr (TWO_ROWS)
      fold_block<PC, HZ, HM>(cur + 512, fd + 16 * nb + bi, fsx + 16 * nb + bi, fdsx + 16 * nb + bi, nb, vs,
                             vz, vm, fa + 16 * 2 * 16);
    if (more && TWO_ROWS) store1(nxt);
  }
#pragma GCC unroll 2
  for (int c = 0; c < PC; ++c) {
    const int64_t j = (p + c) * 16;
    const int n = static_cast<int>(min64(16, w.rows - j));
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 vb = bias ? _mm512_maskz_loadu_ps(mk, bias + j) : _mm512_setzero_ps();
    for (int i = 0; i < rows; ++i)
      _mm512_mask_storeu_ps(y + (r + i) * ldy + j, mk,
                            _mm512_add_ps(_mm512_load_ps(fa + (i * 2 + c) * 16), vb));
  }
}

void configure(int B) {
  amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;                           // C
  for (int t = 4; t < 6; ++t) cfg.colsb[t] = static_cast<uint16_t>(B), cfg.rows[t] = 16;     // A
  for (int t = 6; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(B / 4);  // B
  amx::load_config(cfg);
}

template <int PC, int BITS, bool HZ, bool HM, int HS>
FQ_INLINE void panels_rows(const QuantMatrix& w, int64_t nb, const float* bias, float* y, int64_t ldy,
                           int64_t p, int64_t m, const int8_t* apk, const uint8_t* wb, int64_t panel_stride,
                           int32_t* cbuf, float* fa, const RowFactors& f) {
  const int B = xq_block(w);
  for (int64_t r = 0; r < m; r += 32) {
    const int rows = static_cast<int>(min64(32, m - r));
    const int8_t* xa = apk + r * nb * B;
    if (rows > 16)
      row_pair<PC, true, HZ, HM, HS>(w, nb, bias, y, ldy, p, r, rows, xa, wb, panel_stride, cbuf, fa,
                                     f.d + r * nb, f.sx + r * nb, f.dsx + r * nb);
    else
      row_pair<PC, false, HZ, HM, HS>(w, nb, bias, y, ldy, p, r, rows, xa, wb, panel_stride, cbuf, fa,
                                      f.d + r * nb, f.sx + r * nb, f.dsx + r * nb);
  }
}

template <int BITS, bool HZ, bool HM, int HS, bool CB>
void linear_panel_t(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy, int64_t p0, int64_t p1) {
  const int B = xq_block(w);
  const int64_t nb = x.nblocks, panel_bytes = nb * B * 16, mp = (m + 15) / 16 * 16;
  const size_t fbytes = static_cast<size_t>(mp * nb) * 4, abytes = static_cast<size_t>(mp * nb * B);
  // [2 unpacked panels | 2 x 4 C tiles | 32 x 2 x 16 float accumulators | row factors | packed rows]
  const size_t cbytes = 2 * 4 * 1024, fabytes = 32 * 2 * 16 * 4;
  uint8_t* base = t_scratch.get(static_cast<size_t>(2 * panel_bytes) + cbytes + fabytes + 3 * fbytes +
                                abytes);
  uint8_t* wb = base;
  int32_t* cbuf = reinterpret_cast<int32_t*>(base + 2 * panel_bytes);
  float* fa = reinterpret_cast<float*>(base + 2 * panel_bytes + cbytes);
  float* ff = reinterpret_cast<float*>(base + 2 * panel_bytes + cbytes + fabytes);
  int8_t* apk = reinterpret_cast<int8_t*>(base + 2 * panel_bytes + cbytes + fabytes + 3 * fbytes);
  const RowFactors f{ff, ff + mp * nb, ff + 2 * mp * nb};
  row_factors(x, m, mp, f);
  pack_rows(x, m, mp, B, apk);
  configure(B);
  // 8-bit panels with only whole blocks already are B tiles (a block's 4-column steps are its
  // tile rows, and block bi starts at byte bi * B * 16): no copy, the tiles load from the matrix.
  const int64_t k = w.cols, G = w.group;
  const bool direct = BITS == 8 && k % B == 0 && (G % B == 0 || w.ngroups() == 1);
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    const uint8_t* wp = wb;
    int64_t stride = panel_bytes;
    if (direct) {
      wp = data + p * w.ld;
      stride = w.ld;
    } else {
      unpack_panel<BITS, CB>(w, p, B, wb);
      if (two) unpack_panel<BITS, CB>(w, p + 1, B, wb + panel_bytes);
    }
    if (two) panels_rows<2, BITS, HZ, HM, HS>(w, nb, bias, y, ldy, p, m, apk, wp, stride, cbuf, fa, f);
    else panels_rows<1, BITS, HZ, HM, HS>(w, nb, bias, y, ldy, p, m, apk, wp, stride, cbuf, fa, f);
  }
  _tile_release();
}

#include "cpu/qkernels_panel_dispatch.h"

#undef FQ_INLINE

}  // namespace

LinearPanelFn amx_int8_linear_panel() { return amx_int8_usable() ? linear_panel : nullptr; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
LinearPanelFn amx_int8_linear_panel() { return nullptr; }
}  // namespace fantai::cpu
#endif
