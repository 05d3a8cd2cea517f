// cpu: quantized linear on AVX-512 VNNI (vpdpbusd: u8 weights x s8 activations), row panels of
// 16 (see kCpuQuantPanelLayout in qkernels.h). Per-file ISA flags; called only when the CPUID
// probe found AVX512-VNNI.
#include <cstdint>
#include <cstring>

#include "cpu/qkernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__x86_64__) && ((defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || \
                            (defined(__GNUC__) && !defined(__clang__)))
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace fantai::cpu {
namespace {

#define FV_INLINE inline __attribute__((always_inline))

FV_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

FV_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#include "cpu/qkernels_panel_impl.h"
#include "cpu/qkernels_panel_prefetch.h"

// One 4-column step of 8-bit weights for R rows x PC panels: panel c's 64 bytes at wp + c * wld,
// row r's 4 activations at xq + r * xld.
template <int R, int PC>
FV_INLINE void step8(const uint8_t* wp, int64_t wld, const int8_t* xq, int64_t xld, __m512i (&iacc)[R][PC]) {
  __m512i xv[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xv[r] = bcast4(xq + r * xld);
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const __m512i wv = _mm512_loadu_si512(wp + c * wld);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], wv, xv[r]);
  }
}

// One 8-column step of 4-, 5- or 6-bit values (or codebook indices) laid out as step8's (panel c's
// planes at pp + c * wld, unused for 4 bits); row r's 8 activations at xq + r * xld.
template <int R, int PC, int BITS, bool CB>
FV_INLINE void nibble_step(const uint8_t* wp, const uint8_t* pp, int64_t wld, const int8_t* xq, int64_t xld,
                           __m512i cb, __m512i (&iacc)[R][PC]) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  __m512i xl[R], xh[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    xl[r] = bcast4(xq + r * xld);
    xh[r] = bcast4(xq + r * xld + 4);
  }
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const __m512i wb = _mm512_loadu_si512(wp + c * wld);
    __m512i wl = _mm512_and_si512(wb, lo4);
    __m512i wh = _mm512_and_si512(_mm512_srli_epi16(wb, 4), lo4);
    if constexpr (BITS == 5 || BITS == 6) add_planes<BITS>(pp + c * wld, &wl, &wh);
    if constexpr (CB) {
      wl = _mm512_shuffle_epi8(cb, wl);
      wh = _mm512_shuffle_epi8(cb, wh);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], wl, xl[r]);
      iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], wh, xh[r]);
    }
  }
}

// Block bi's float update of rows r0 .. r0 + R - 1, the order every panel kernel keeps.
template <int R, int PC, bool HZ, bool HM>
FV_INLINE void block_update(const QuantizedRows& x, int64_t r0, int64_t bi, const __m512i (&iacc)[R][PC],
                            const __m512* vs, const __m512* vz, const __m512* vm, __m512 (&facc)[R][PC]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const float d = x.d[(r0 + r) * x.nblocks + bi];
    const float sx = static_cast<float>(x.s[(r0 + r) * x.nblocks + bi]);
    const __m512 vd = _mm512_set1_ps(d), vsx = _mm512_set1_ps(sx), vdsx = _mm512_set1_ps(d * sx);
#pragma GCC unroll 4
    for (int c = 0; c < PC; ++c) {
      __m512 t = _mm512_cvtepi32_ps(iacc[r][c]);
      if constexpr (HZ) t = _mm512_sub_ps(t, _mm512_mul_ps(vz[c], vsx));  // exact: integers < 2^24
      facc[r][c] = _mm512_fmadd_ps(t, _mm512_mul_ps(vs[c], vd), facc[r][c]);
      if constexpr (HM) facc[r][c] = _mm512_fmadd_ps(vm[c], vdsx, facc[r][c]);
    }
  }
}

// The tile's sums plus the bias into y (rows r0 .., panels p .. p + PC - 1).
template <int R, int PC>
FV_INLINE void store_tile(const QuantMatrix& w, const float* bias, float* y, int64_t ldy, int64_t p,
                          int64_t r0, const __m512 (&facc)[R][PC]) {
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const int64_t j = (p + c) * 16;
    const int n = static_cast<int>(min64(16, w.rows - j));
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 vb = bias ? _mm512_maskz_loadu_ps(mk, bias + j) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + (r0 + r) * ldy + j, mk, _mm512_add_ps(facc[r][c], vb));
  }
}

// panel_tile where every group is one full 32-column block (G == 32, k % 32 == 0: Q4_0, Q4_1,
// Q8_0, 32-groups of GPTQ / AWQ) with plain f32 or f16 scales: the same arithmetic in the same
// order, with the block loop, its steps and the addresses fixed at compile time.
template <int R, int PC, int BITS, bool HZ, bool HM, int HS>
FV_INLINE void panel_tile_g32(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                              int64_t ldy, int64_t p, int64_t r0, int64_t pf0, int64_t pf1) {
  static_assert(BITS == 4 || BITS == 8, "");
  const int64_t ng = w.ngroups();
  constexpr int64_t gbytes = 32 * 2 * BITS;  // a group's bytes in a panel
  const uint8_t* wp = static_cast<const uint8_t*>(w.data) + p * w.ld;
  const int8_t* xq = x.q + r0 * x.ld;
  __m512 facc[R][PC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < PC; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, wp += gbytes, xq += 32) {
    panel_prefetch_group<BITS, HZ, HM, HS>(w, pf0, pf1, g);
    __m512 vs[PC], vz[PC], vm[PC];
    panel_group_scales<PC, HZ, HM, HS>(w, p, g, vs, vz, vm);
    __m512i iacc[R][PC];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < PC; ++c) iacc[r][c] = _mm512_setzero_si512();
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) step8<R, PC>(wp + 64 * t, w.ld, xq + 4 * t, x.ld, iacc);
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t)
        nibble_step<R, PC, 4, false>(wp + 64 * t, nullptr, w.ld, xq + 8 * t, x.ld, _mm512_setzero_si512(),
                                     iacc);
    }
    block_update<R, PC, HZ, HM>(x, r0, g, iacc, vs, vz, vm, facc);
  }
  store_tile<R, PC>(w, bias, y, ldy, p, r0, facc);
}

// R activation rows x PC panels. Integer sums inside a block are exact, so only the per-block
// float updates have an order, and it is fixed by (k, group, block). pf0 .. pf1: the panels to
// prefetch (see qkernels_panel_prefetch.h).
template <int R, int PC, int BITS, bool HZ, bool HM, int HS, bool CB>
FV_INLINE void panel_tile(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                          int64_t ldy, int64_t p, int64_t r0, int64_t pf0 = 0, int64_t pf1 = 0) {
  if constexpr ((BITS == 4 || BITS == 8) && !CB && !is_sub_scale_mode(HS)) {
    if (w.group == 32 && w.cols % 32 == 0)
      return panel_tile_g32<R, PC, BITS, HZ, HM, HS>(x, w, bias, y, ldy, p, r0, pf0, pf1);
  }
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  const int B = xq_block(w);
  // B is 32 or 16 (xq_block): a shift, not the 64-bit idiv b0 / B compiled to once per block.
  const int bshift = B == 32 ? 5 : 4;
  const int64_t gbytes = G * 2 * BITS;  // bytes of a full group in a panel (see qkernels.h)
  constexpr int64_t SC = panel_step_cols(BITS), PB = panel_plane_bytes(BITS);
  const uint8_t* wbase = static_cast<const uint8_t*>(w.data);
  // The codebook in every 128-bit lane: vpshufb turns a vector of indices into their u8 values.
  const __m512i cb = CB ? _mm512_broadcast_i32x4(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook)))
                        : _mm512_setzero_si512();
  __m512 facc[R][PC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < PC; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    panel_prefetch_group<BITS, HZ, HM, HS>(w, pf0, pf1, g);
    __m512 vs[PC], vz[PC], vm[PC];
    panel_group_scales<PC, HZ, HM, HS>(w, p, g, vs, vz, vm);
    const int64_t g0 = g * G, g1 = min64(g0 + G, k);
    for (int64_t b0 = g0; b0 < g1; b0 += B) {
      const int64_t blen = min64(B, g1 - b0);
      const int64_t bi = b0 >> bshift;
      __m512i iacc[R][PC];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < PC; ++c) iacc[r][c] = _mm512_setzero_si512();
      // Byte offset of this block inside each panel's row of groups, and of its bit planes.
      const int64_t boff = g * gbytes + (b0 - g0) / SC * 64;
      const int64_t poff = PB ? g * gbytes + panel_planes_at(BITS, g1 - g0) + (b0 - g0) / SC * PB : 0;
      if constexpr (BITS < 4) {
        // 16-column steps: vector s of a step is its bytes' bits 2s, 2s + 1 (and for 3-bit, bit 2
        // from plane bit s for the step's first 32 bytes, 4 + s for the others), against
        // activations 4s .. 4s + 3 of the step.
        const __m512i lo2 = _mm512_set1_epi8(0x03), b2 = _mm512_set1_epi8(0x04);
        const int steps = static_cast<int>((blen + 15) / 16);
        for (int t = 0; t < steps; ++t) {
          __m512i wb[PC], pl[PC] = {};
#pragma GCC unroll 4
          for (int c = 0; c < PC; ++c) {
            const uint8_t* wp = static_cast<const uint8_t*>(w.data) + (p + c) * w.ld;
            wb[c] = _mm512_loadu_si512(wp + boff + 64 * t);
            if constexpr (BITS == 3) pl[c] = plane3(wp + poff + PB * t);
          }
#pragma GCC unroll 4
          for (int sv = 0; sv < 4; ++sv) {
            __m512i xv[R];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) xv[r] = bcast4(x.q + (r0 + r) * x.ld + b0 + 16 * t + 4 * sv);
#pragma GCC unroll 4
            for (int c = 0; c < PC; ++c) {
              __m512i wv = _mm512_and_si512(_mm512_srli_epi16(wb[c], 2 * sv), lo2);
              if constexpr (BITS == 3)
                wv = _mm512_mask_add_epi8(wv, _mm512_test_epi8_mask(pl[c], plane3_bit(sv)), wv, b2);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], wv, xv[r]);
            }
          }
        }
      } else if constexpr (BITS == 8) {
        const int steps = static_cast<int>((blen + 3) / 4);
        for (int t = 0; t < steps; ++t)
          step8<R, PC>(wbase + p * w.ld + boff + 64 * t, w.ld, x.q + r0 * x.ld + b0 + 4 * t, x.ld, iacc);
      } else {
        const int steps = static_cast<int>((blen + 7) / 8);
        for (int t = 0; t < steps; ++t)
          nibble_step<R, PC, BITS, CB>(wbase + p * w.ld + boff + 64 * t, wbase + p * w.ld + poff + PB * t,
                                       w.ld, x.q + r0 * x.ld + b0 + 8 * t, x.ld, cb, iacc);
      }
      block_update<R, PC, HZ, HM>(x, r0, bi, iacc, vs, vz, vm, facc);
    }
  }
  store_tile<R, PC>(w, bias, y, ldy, p, r0, facc);
}

template <int RR, int PC, int BITS, bool HZ, bool HM, int HS, bool CB>
FV_INLINE void panel_rows(int rows, const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                          int64_t ldy, int64_t p, int64_t r0) {
  if constexpr (RR > 1) {
    if (rows < RR) return panel_rows<RR - 1, PC, BITS, HZ, HM, HS, CB>(rows, x, w, bias, y, ldy, p, r0);
  }
  panel_tile<RR, PC, BITS, HZ, HM, HS, CB>(x, w, bias, y, ldy, p, r0);
}

template <int BITS, bool HZ, bool HM, int HS, bool CB>
void linear_panel_t(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy, int64_t p0, int64_t p1) {
  if (m == 1) {
    // Decode: 4 panels (64 rows) side by side give 4 independent vpdpbusd chains.
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4)
      panel_tile<1, 4, BITS, HZ, HM, HS, CB>(x, w, bias, y, ldy, p, 0, p + 4, min64(p + 8, p1));
    for (; p < p1; ++p) panel_tile<1, 1, BITS, HZ, HM, HS, CB>(x, w, bias, y, ldy, p, 0);
    return;
  }
  constexpr int R = 4;
  // ~8 panels (128 weight rows, L2-resident) swept by every 4-row tile of x.
  for (int64_t pp = p0; pp < p1; pp += 8) {
    const int64_t ppe = min64(pp + 8, p1);
    for (int64_t r = 0; r < m; r += R) {
      const int rows = static_cast<int>(min64(R, m - r));
      int64_t p = pp;
      for (; p + 2 <= ppe; p += 2) panel_rows<R, 2, BITS, HZ, HM, HS, CB>(rows, x, w, bias, y, ldy, p, r);
      for (; p < ppe; ++p) panel_rows<R, 1, BITS, HZ, HM, HS, CB>(rows, x, w, bias, y, ldy, p, r);
    }
  }
}

#include "cpu/qkernels_panel_dispatch.h"

// Sixteen per-block vectors to one vector of their sixteen reductions, lane b for block b: a
// tree of 128-bit and 32-bit shuffles (each level halves the vectors and the partials), then one
// permute for the 4x4 lane order the tree leaves. op is exact in any order (max, integer add).
template <typename Op>
FV_INLINE __m512 reduce16(__m512* v, Op op) {
  // v[i]: elements 0-7 reduce block 2i, 8-15 block 2i + 1.
  for (int i = 0; i < 8; ++i)
    v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  // v[i]: 128-bit lane l reduces block 4i + l.
  for (int i = 0; i < 4; ++i)
    v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xdd));
  // v[i]: in lane l, elements 0-1 reduce block 8i + l, elements 2-3 block 8i + 4 + l.
  for (int i = 0; i < 2; ++i)
    v[i] = op(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xee));
  // Element 4l + e: block 4e + l.
  const __m512 r = op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xdd));
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(perm, r);
}

// 16 values to int8 with the block's 127 / max: rounded to nearest even, clamped, stored; the
// int32 values are returned for the block's sum.
FV_INLINE __m512i quantize16(__m512 v, __m512 vinv, int8_t* out) {
  __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
  qi = _mm512_min_epi32(_mm512_max_epi32(qi, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(qi));
  return qi;
}

// One block the plain way: for the fewer-than-16 blocks left at a row's end.
template <int HALVES>
FV_INLINE void quantize_block(const float* xb, int64_t len, int8_t* qb, float* d, int32_t* s) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 v[HALVES];
  __m512 amax = _mm512_setzero_ps();
  for (int h = 0; h < HALVES; ++h) {
    const int64_t n = min64(16, len - 16 * h);
    const __mmask16 mk = n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
    v[h] = _mm512_maskz_loadu_ps(mk, xb + 16 * h);
    amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[h]));
  }
  const float am = _mm512_reduce_max_ps(amax);
  const float inv = am > 0.f ? 127.f / am : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  __m512i sum = _mm512_setzero_si512();
  for (int h = 0; h < HALVES; ++h) sum = _mm512_add_epi32(sum, quantize16(v[h], vinv, qb + 16 * h));
  *d = am / 127.f;
  *s = _mm512_reduce_add_epi32(sum);
}

// Sixteen whole blocks (none past k) at once.
template <int HALVES>
FV_INLINE void quantize_16_blocks(const float* xb, int8_t* qb, float* d, int32_t* s) {
  constexpr int block = 16 * HALVES;
  const __m512 sign = _mm512_set1_ps(-0.f), c127 = _mm512_set1_ps(127.f);
  const auto vmax = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto vadd = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  alignas(64) float inv[16];
  __m512 red[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    __m512 amax = _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + j * block));
    if constexpr (HALVES == 2)
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + j * block + 16)));
    red[j] = amax;
  }
  const __m512 am = reduce16(red, vmax);
  const __mmask16 pos = _mm512_cmp_ps_mask(am, _mm512_setzero_ps(), _CMP_GT_OQ);
  _mm512_store_ps(inv, _mm512_maskz_div_ps(pos, c127, am));
  _mm512_storeu_ps(d, _mm512_div_ps(am, c127));
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const __m512 vinv = _mm512_set1_ps(inv[j]);
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < HALVES; ++h)
      sum = _mm512_add_epi32(
          sum, quantize16(_mm512_loadu_ps(xb + j * block + 16 * h), vinv, qb + j * block + 16 * h));
    red[j] = _mm512_castsi512_ps(sum);
  }
  _mm512_storeu_si512(s, _mm512_castps_si512(reduce16(red, vadd)));
}

// quantize_rows_int8's arithmetic 16 lanes at a time: |x| max (exact in any order), the same d
// and 127 / max (IEEE division, one lane per block), x * inv in f32, vcvtps2dq under the default
// round-to-nearest-even mode (what nearbyint does), clamp, and an exact integer sum. Sixteen
// blocks share each horizontal reduction and division, which cost more than the rest when done
// one block at a time.
template <int HALVES>
void quantize_rows_t(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s) {
  constexpr int block = 16 * HALVES;
  const int64_t nb = (k + block - 1) / block, ld = nb * block, whole = k / block / 16 * 16;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    int8_t* qr = q + r * ld;
    for (int64_t b = 0; b < whole; b += 16)
      quantize_16_blocks<HALVES>(xr + b * block, qr + b * block, d + r * nb + b, s + r * nb + b);
    for (int64_t b = whole; b < nb; ++b)
      quantize_block<HALVES>(xr + b * block, min64(block, k - b * block), qr + b * block, d + r * nb + b,
                             s + r * nb + b);
  }
}

void quantize_rows(const float* x, int64_t m, int64_t k, int32_t block, int8_t* q, float* d, int32_t* s) {
  if (block == 32) quantize_rows_t<2>(x, m, k, q, d, s);
  else quantize_rows_t<1>(x, m, k, q, d, s);
}

#undef FV_INLINE

}  // namespace

LinearPanelFn avx512_vnni_linear_panel() { return linear_panel; }
QuantizeRowsFn avx512_quantize_rows_int8() { return quantize_rows; }

}  // namespace fantai::cpu

#else
namespace fantai::cpu {
LinearPanelFn avx512_vnni_linear_panel() { return nullptr; }
QuantizeRowsFn avx512_quantize_rows_int8() { return nullptr; }
}  // namespace fantai::cpu
#endif
