// cpu: the AVX2 panel kernels' linear (linear_panel and what it instantiates), written once for
// two TUs: qkernels_panel_avx2.cpp (vpmaddubsw + vpmaddwd) and, with FANTAI_PANEL_AVX_VNNI,
// qkernels_panel_avxvnni.cpp (AVX-VNNI's vpdpbusd on YMM). Include it inside the TU's anonymous
// namespace after vt_avx2.h and FV_INLINE. The two differ only in how u8 x s8 products reach int32
// (mac32, mac16 and widen16 below); every integer sum is exact either way, so both give the
// portable kernel's bits.
#pragma once

FV_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// u8 x s8 products of one vector into int32 sums, 4 adjacent pairs to a lane: vpdpbusd, or
// vpmaddubsw + vpmaddwd (exact when a pair cannot saturate int16: the callers' bounds).
FV_INLINE __m256i mac32(__m256i acc, __m256i u, __m256i s) {
#ifdef FANTAI_PANEL_AVX_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// The same into the narrow sums the nibble steps keep: int16 pair sums on AVX2, widened to int32
// by widen16 once the callers' bounds say they must; VNNI keeps int32 sums throughout (widen16
// is then the identity).
FV_INLINE __m256i mac16(__m256i acc, __m256i u, __m256i s) {
#ifdef FANTAI_PANEL_AVX_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}
FV_INLINE __m256i widen16(__m256i acc) {
#ifdef FANTAI_PANEL_AVX_VNNI
  return acc;
#else
  return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
}

// 8-bit values (and codebook levels) are u8. vpdpbusd takes them as they are, so the sum is
// sum(v x) and a zero comes off in f32 as on the AVX-512 VNNI path. vpmaddubsw could saturate on
// them, so AVX2 multiplies v - 128 by the sign trick and adds 128 sum(x) back (add_zero128), or
// leaves it off where the zero is 128 anyway (Z128).
#ifdef FANTAI_PANEL_AVX_VNNI
constexpr bool kSignTrick = false;
#else
constexpr bool kSignTrick = true;
#endif

FV_INLINE __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 lanes (rows 8u .. 8u + 7 of a panel's 16) of a scale or min at element i: f32, or f16 in the
// half-scale layout.
// One 8-column step of 4-bit (or codebook) columns for R activation rows: columns c..c+3 (the
// low nibbles' partners) and c+4..c+7 (the high ones') broadcast to every lane's 4 bytes.
template <int R>
FV_INLINE void bcast_step(const QuantizedRows& x, int64_t r0, int64_t at, __m256i* xl, __m256i* xh) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    xl[r] = bcast4(x.q + (r0 + r) * x.ld + at);
    xh[r] = bcast4(x.q + (r0 + r) * x.ld + at + 4);
  }
}

// Half u & 1 (rows 0-7 or 8-15 of the panel) of a 64-byte nibble step.
FV_INLINE __m256i load_nibble_half(const uint8_t* step, int u) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * (u & 1)));
}

template <int HS>
FV_INLINE __m256 load_scale8(const float* a, int64_t i) {
  if constexpr (HS == kScaleF16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(a) + i)));
  } else {
    return _mm256_loadu_ps(a + i);
  }
}

// The sub-scale layout's 8 lanes: the f16 factors (element si, read once per super-block), and
// a group's scale as that factor times its int8 sub-scale (element i).
FV_INLINE __m256 load_factor8(const float* f, int64_t si) {
  return _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(f) + si)));
}
FV_INLINE __m256 load_sub8(__m256 vf, const int8_t* s, int64_t i) {
  return _mm256_mul_ps(
      vf, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)))));
}

// The nibble sub-scale layout's 8 lanes from element i: factor times low (scale) or high (min) nibbles.
FV_INLINE __m256 load_sub_nibble8(__m256 vf, const int8_t* s, int64_t i, bool high) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i));
  if (high) v = _mm_srli_epi16(v, 4);
  v = _mm_and_si128(v, _mm_set1_epi8(0x0f));
  return _mm256_mul_ps(vf, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
}

#include "cpu/qkernels_panel_prefetch.h"

// Half h of a 64-bit plane word (at word, see qkernels.h) as the unit's 32 bytes: value where
// the byte's bit is set, else 0 (bits 32h .. 32h + 31 of the word are the unit's bytes). A byte
// mask from 32 bits: broadcast, each byte picks the word byte holding its bit (vpshufb), tests it
// (and, cmpeq).
FV_INLINE __m256i plane_bytes8(const uint8_t* word, int h, int value) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                        2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  int32_t half;
  std::memcpy(&half, word + 4 * h, 4);
  const __m256i sel = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(half), pick), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(sel, bit), _mm256_set1_epi8(static_cast<char>(value)));
}

// Bit b of each byte of a 3-bit step's plane (at plane, see qkernels.h) moved to bit 2, the rest
// cleared. 16-bit shifts are enough: the bit that lands on bit 2 of a byte comes from the same
// byte (b < 8).
FV_INLINE __m256i plane3_bit2(const uint8_t* plane, int b) {
  const __m256i m = _mm256_set1_epi8(0x04);
  const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane));
  if (b == 2) return _mm256_and_si256(pl, m);
  return _mm256_and_si256(b > 2 ? _mm256_srli_epi16(pl, b - 2) : _mm256_slli_epi16(pl, 2 - b), m);
}

// Half h of a 5- or 6-bit step's bit planes (at pl) set into the unit's nibble vectors.
template <int BITS>
FV_INLINE void add_planes8(const uint8_t* pl, int h, __m256i* wl, __m256i* wh) {
  const auto expand = [&](int off, int value) { return plane_bytes8(pl + off, h, value); };
  *wl = _mm256_or_si256(*wl, expand(0, 0x10));
  *wh = _mm256_or_si256(*wh, expand(8, 0x10));
  if constexpr (BITS == 6) {
    *wl = _mm256_or_si256(*wl, expand(16, 0x20));
    *wh = _mm256_or_si256(*wh, expand(24, 0x20));
  }
}

// 8 lanes of a group's zero from element gi, as f32.
FV_INLINE __m256 load_zero8(const QuantMatrix& w, int64_t gi) {
  return w.zero ? _mm256_cvtepi32_ps(
                      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zero + gi))))
                : _mm256_set1_ps(static_cast<float>(w.zero_point));
}

// 128 sum(x) of block bi into each row's sums: with the 8-bit weights taken as w - 128 (step8),
// sum(w x) = sum((w - 128) x) + 128 sum(x), exactly, in int32.
template <int R, int U>
FV_INLINE void add_zero128(const QuantizedRows& x, int64_t r0, int64_t bi, __m256i (&iacc)[R][U]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i s128 = _mm256_set1_epi32(128 * x.s[(r0 + r) * x.nblocks + bi]);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) iacc[r][u] = _mm256_add_epi32(iacc[r][u], s128);
  }
}

// The 8-bit and nibble steps pin each new running sum to a register (VT::pin), so it stays one
// chain: GCC otherwise rebuilt a block's steps as a tree of their products, storing and reloading
// each one (R x U x 8 a block). The sums are integers, so their order cannot change them. The
// 2-/3-bit and codebook loops ran slower pinned (Q2_K at m = 16 by ~15%) and are left free.
//
// One 4-column step of 8-bit weights for R rows x U units: unit u's 32 bytes at
// wp + (u / 2) * wld + 32 * (u & 1), row r's 4 activations at xq + r * xld. The weights are u8 with
// a zero of 128, taken as w - 128 in s8 and multiplied by the sign trick (|w - 128| as u8 times x
// with w - 128's sign): a pair is at most 2 * 128 * 127 = 32512, so vpmaddubsw never saturates.
// With VNNI the u8 weights go straight in (kSignTrick).
template <int R, int U>
FV_INLINE void step8(const uint8_t* wp, int64_t wld, const int8_t* xq, int64_t xld, __m256i (&iacc)[R][U]) {
  __m256i xv[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) xv[r] = bcast4(xq + r * xld);
  if constexpr (!kSignTrick) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256i wv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wp + (u / 2) * wld + 32 * (u & 1)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) iacc[r][u] = vt_avx2::VT::pin(mac32(iacc[r][u], wv, xv[r]));
    }
    return;
  }
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
    const __m256i ws = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (u / 2) * wld + 32 * (u & 1))), flip);
    const __m256i wa = _mm256_abs_epi8(ws);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      iacc[r][u] = vt_avx2::VT::pin(mac32(iacc[r][u], wa, _mm256_sign_epi8(xv[r], ws)));
  }
}

// One 8-column step of 4-, 5- or 6-bit weights into the int16 sums, laid out as step8's (the
// planes of unit u at pp + (u / 2) * wld, unused for 4 bits); row r's 8 activations at xq + r * xld.
template <int R, int U, int BITS>
FV_INLINE void nibble_step(const uint8_t* wp, const uint8_t* pp, int64_t wld, const int8_t* xq, int64_t xld,
                           __m256i (&acc16)[R][U]) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  __m256i xl[R], xh[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    xl[r] = bcast4(xq + r * xld);
    xh[r] = bcast4(xq + r * xld + 4);
  }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
    const __m256i wb = load_nibble_half(wp + (u / 2) * wld, u);
    __m256i wl = _mm256_and_si256(wb, lo4);
    __m256i wh = _mm256_and_si256(_mm256_srli_epi16(wb, 4), lo4);
    if constexpr (BITS != 4) add_planes8<BITS>(pp + (u / 2) * wld, u & 1, &wl, &wh);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#ifdef FANTAI_PANEL_AVX_VNNI
      const __m256i t = mac16(mac16(acc16[r][u], wl, xl[r]), wh, xh[r]);
#else
      // The two vectors' int16 pairs first, as one sum (the same integers as one at a time).
      const __m256i t = _mm256_add_epi16(
          acc16[r][u], _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl[r]), _mm256_maddubs_epi16(wh, xh[r])));
#endif
      // 5 bits: the one plane's expansion wants the registers (pinned sums ran 3-8% slower).
      acc16[r][u] = BITS == 5 ? t : vt_avx2::VT::pin(t);
    }
  }
}

// The VNNI kernel's per-block update, lane for lane: block bi of rows r0 .. r0 + R - 1 into facc.
template <int R, int U, bool HZ, bool HM, bool Z128>
FV_INLINE void block_update(const QuantizedRows& x, int64_t r0, int64_t bi, const __m256i (&iacc)[R][U],
                            const __m256* vs, const __m256* vz, const __m256* vm, __m256 (&facc)[R][U]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const float d = x.d[(r0 + r) * x.nblocks + bi];
    const float sx = static_cast<float>(x.s[(r0 + r) * x.nblocks + bi]);
    const __m256 vd = _mm256_set1_ps(d), vsx = _mm256_set1_ps(sx), vdsx = _mm256_set1_ps(d * sx);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      __m256 t = _mm256_cvtepi32_ps(iacc[r][u]);
      if constexpr (HZ && !Z128) t = _mm256_sub_ps(t, _mm256_mul_ps(vz[u], vsx));  // exact: integers < 2^24
      facc[r][u] = _mm256_fmadd_ps(t, _mm256_mul_ps(vs[u], vd), facc[r][u]);
      if constexpr (HM) facc[r][u] = _mm256_fmadd_ps(vm[u], vdsx, facc[r][u]);
    }
  }
}

// The tile's sums plus the bias into y (rows r0 .., panel p's units).
template <int R, int U>
FV_INLINE void store_tile(const QuantMatrix& w, const float* bias, float* y, int64_t ldy, int64_t p,
                          int64_t r0, const __m256 (&facc)[R][U]) {
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
    const int64_t j = p * 16 + 8 * u;
    const int n = static_cast<int>(min64(8, w.rows - j));
    if (n <= 0) continue;
    const __m256i mk = vt_avx2::VT::mask(n);
    const __m256 vb = bias ? _mm256_maskload_ps(bias + j, mk) : _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      _mm256_maskstore_ps(y + (r0 + r) * ldy + j, mk, _mm256_add_ps(facc[r][u], vb));
  }
}

// unit_tile where every group is one full 32-column block (G == 32, k % 32 == 0: Q4_0, Q4_1,
// Q8_0, 32-groups of GPTQ / AWQ), with plain f32 or f16 scales: the same arithmetic in the same
// order, with the block loop, its steps and the addresses fixed at compile time. The general
// loop's per-group bookkeeping was ~25% of Q8_0's instructions.
template <int R, int U, int BITS, bool HZ, bool HM, int HS, bool Z128>
FV_INLINE void unit_tile_g32(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                             int64_t ldy, int64_t p, int64_t r0, int64_t pf0, int64_t pf1) {
  static_assert(BITS == 4 || BITS == 8, "");
  const int64_t ng = w.ngroups();
  constexpr int64_t gbytes = 32 * 2 * BITS;  // a group's bytes in a panel
  const uint8_t* wp = static_cast<const uint8_t*>(w.data) + p * w.ld;
  const int8_t* xq = x.q + r0 * x.ld;
  const int64_t gi0 = p * ng * 16;  // panel p's scales; panel p + 1's are ng * 16 on
  __m256 facc[R][U];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) facc[r][u] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, wp += gbytes, xq += 32) {
    panel_prefetch_group<BITS, HZ, HM, HS>(w, pf0, pf1, g);
    __m256 vs[U], vz[U], vm[U];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const int64_t gi = gi0 + (u / 2) * ng * 16 + g * 16 + 8 * (u & 1);
      vs[u] = load_scale8<HS>(w.scale, gi);
      if constexpr (HM) vm[u] = load_scale8<HS>(w.min, gi);
      if constexpr (HZ) vz[u] = load_zero8(w, gi);
    }
    __m256i iacc[R][U];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) iacc[r][u] = _mm256_setzero_si256();
    if constexpr (BITS == 8) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) step8<R, U>(wp + 64 * t, w.ld, xq + 4 * t, x.ld, iacc);
      if constexpr (kSignTrick && !Z128) add_zero128<R, U>(x, r0, g, iacc);
    } else {
      // See unit_tile: a block's four steps cannot overflow the int16 sums.
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) nibble_step<R, U, 4>(wp + 64 * t, nullptr, w.ld, xq + 8 * t, x.ld, iacc);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) iacc[r][u] = widen16(iacc[r][u]);
    }
    block_update<R, U, HZ, HM, Z128>(x, r0, g, iacc, vs, vz, vm, facc);
  }
  store_tile<R, U>(w, bias, y, ldy, p, r0, facc);
}

// A tile is R activation rows x U units (pf0 .. pf1: the panels to prefetch, see
// qkernels_panel_prefetch.h), a unit being 8 consecutive rows of W (half a panel): unit
// u of the tile is half (u & 1) of panel p + u / 2. A 64-byte panel step is two 32-byte unit steps.
// Z128: 8-bit weights whose every zero is 128 (Q8_0, online int8). The sign trick's integer sum is
// then sum((w - 128) x) already, and adding 128 sum(x) only for the zero's 128 sum(x) to come off
// again in f32 leaves the same integer (both steps exact below 2^24): the block skips both.
template <int R, int U, int BITS, bool HZ, bool HM, int HS, bool CB, bool Z128 = false>
FV_INLINE void unit_tile(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                         int64_t ldy, int64_t p, int64_t r0, int64_t pf0 = 0, int64_t pf1 = 0) {
  if constexpr ((BITS == 4 || BITS == 8) && !CB && !is_sub_scale_mode(HS)) {
    if (w.group == 32 && w.cols % 32 == 0)
      return unit_tile_g32<R, U, BITS, HZ, HM, HS, Z128>(x, w, bias, y, ldy, p, r0, pf0, pf1);
  }
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  const int B = xq_block(w);
  // B is 32 or 16 (xq_block): a shift, not the 64-bit idiv b0 / B compiled to once per block.
  const int bshift = B == 32 ? 5 : 4;
  const int64_t gbytes = G * 2 * BITS;  // a full group's bytes in a panel (see qkernels.h)
  constexpr int64_t SC = panel_step_cols(BITS), PB = panel_plane_bytes(BITS);
  const uint8_t* wbase = static_cast<const uint8_t*>(w.data);
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  // The codebook in both 128-bit lanes (vpshufb looks up within each lane): as u8 for VNNI, as
  // v - 128 in s8 for the sign trick.
  const __m256i cbs = CB ? _mm256_broadcastsi128_si256(
                               _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codebook)),
                                             _mm_set1_epi8(kSignTrick ? -128 : 0)))
                         : _mm256_setzero_si256();
  __m256 facc[R][U];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) facc[r][u] = _mm256_setzero_ps();
  __m256 vfs[U], vfm[U];  // the sub-scale layout's super-block factors
  for (int64_t g = 0; g < ng; ++g) {
    panel_prefetch_group<BITS, HZ, HM, HS>(w, pf0, pf1, g);
    __m256 vs[U], vz[U], vm[U];
    if constexpr (is_sub_scale_mode(HS)) {
      if (g % w.fgroups == 0) {
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
          const int64_t si = ((p + u / 2) * (ng / w.fgroups) + g / w.fgroups) * 16 + 8 * (u & 1);
          vfs[u] = load_factor8(w.fscale, si);
          if constexpr (HM) vfm[u] = load_factor8(w.fmin, si);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const int64_t gi = ((p + u / 2) * ng + g) * 16 + 8 * (u & 1);
      if constexpr (HS == kScaleSubNibble) {
        vs[u] = load_sub_nibble8(vfs[u], w.iscale, gi, false);
        if constexpr (HM) vm[u] = load_sub_nibble8(vfm[u], w.iscale, gi, true);
      } else if constexpr (HS == kScaleSub) {
        vs[u] = load_sub8(vfs[u], w.iscale, gi);
        if constexpr (HM) vm[u] = load_sub8(vfm[u], w.imin, gi);
      } else {
        vs[u] = load_scale8<HS>(w.scale, gi);
        if constexpr (HM) vm[u] = load_scale8<HS>(w.min, gi);
      }
      if constexpr (HZ) vz[u] = load_zero8(w, gi);
    }
    const int64_t g0 = g * G, g1 = min64(g0 + G, k);
    for (int64_t b0 = g0; b0 < g1; b0 += B) {
      const int64_t blen = min64(B, g1 - b0), bi = b0 >> bshift;
      const int64_t boff = g * gbytes + (b0 - g0) / SC * 64;
      const int64_t poff = PB ? g * gbytes + panel_planes_at(BITS, g1 - g0) + (b0 - g0) / SC * PB : 0;
      __m256i iacc[R][U];
      if constexpr (CB) {
        // Codebook indices; VNNI multiplies the u8 levels as they are. As u8, a level times x
        // could make a vpmaddubsw pair 2 * 241 * 127 = 61214
        // (IQ4's top level), past int16, so vpshufb gives v - 128 in s8 (cbs) and the 8-bit path's
        // sign trick multiplies it (|v - 128| as u8 times x with v - 128's sign): a pair is then at
        // most 2 * 128 * 127 = 32512 and never saturates. Two vectors' pairs added could reach
        // 65024 (IQ4's |v - 128| <= 127: 64516), so each vector widens to int32 on its own.
        // sum(v x) = sum((v - 128) x) + 128 sum(x), exactly, in int32, as on the 8-bit path.
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) iacc[r][u] = _mm256_setzero_si256();
        const int steps = static_cast<int>((blen + 7) / 8);
        for (int t = 0; t < steps; ++t) {
          __m256i xl[R], xh[R];
          bcast_step<R>(x, r0, b0 + 8 * t, xl, xh);
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) {
            const __m256i wb = load_nibble_half(wbase + (p + u / 2) * w.ld + boff + 64 * t, u);
            const __m256i sl = _mm256_shuffle_epi8(cbs, _mm256_and_si256(wb, lo4));
            const __m256i sh = _mm256_shuffle_epi8(cbs, _mm256_and_si256(_mm256_srli_epi16(wb, 4), lo4));
            if constexpr (!kSignTrick) {
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) iacc[r][u] = mac32(mac32(iacc[r][u], sl, xl[r]), sh, xh[r]);
              continue;
            }
            const __m256i al = _mm256_abs_epi8(sl), ah = _mm256_abs_epi8(sh), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(xl[r], sl)),
                                                   ones);
              const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(xh[r], sh)),
                                                   ones);
              iacc[r][u] = _mm256_add_epi32(iacc[r][u], _mm256_add_epi32(pl, ph));
            }
          }
        }
        if constexpr (kSignTrick) add_zero128<R, U>(x, r0, bi, iacc);
      } else if constexpr (BITS < 4) {
        // 16-column steps, vector s = bits 2s, 2s + 1 of the step's bytes (3-bit: bit 2 from bit
        // 4h + s of the plane, h the unit's half) against activations 4s .. 4s + 3. u2 x s8 pairs
        // are at most 2 * 3 * 127 = 762, u3 x s8 ones 2 * 7 * 127 = 1778, so a step's four at most
        // 7112 and a block's two steps (32 columns) 14224: the int16 sums cannot overflow, so
        // widen once per block.
        const __m256i lo2 = _mm256_set1_epi8(0x03);
        __m256i acc16[R][U];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) acc16[r][u] = _mm256_setzero_si256();
        const int steps = static_cast<int>((blen + 15) / 16);
        for (int t = 0; t < steps; ++t) {
#pragma GCC unroll 4
          for (int sv = 0; sv < 4; ++sv) {
            __m256i xv[R];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) xv[r] = bcast4(x.q + (r0 + r) * x.ld + b0 + 16 * t + 4 * sv);
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) {
              const __m256i wb = load_nibble_half(wbase + (p + u / 2) * w.ld + boff + 64 * t, u);
              __m256i wv = _mm256_and_si256(_mm256_srli_epi16(wb, 2 * sv), lo2);
              // The plane is loaded at each use, not held: U more live registers would spill.
              if constexpr (BITS == 3)
                wv = _mm256_or_si256(
                    wv, plane3_bit2(wbase + (p + u / 2) * w.ld + poff + PB * t, 4 * (u & 1) + sv));
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) acc16[r][u] = mac16(acc16[r][u], wv, xv[r]);
            }
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) iacc[r][u] = widen16(acc16[r][u]);
      } else if constexpr (BITS != 8) {
        // u4 x s8 pairs are at most 2 * 15 * 127 = 3810, a step's two at most 7620, and a block has
        // at most 4 steps (32 columns): the int16 sums cannot overflow, so widen once per block.
        // u5: a step's sum is at most 4 * 31 * 127 = 15748, so widen every 2 steps; u6: at most
        // 4 * 63 * 127 = 32004 (each vpmaddubsw pair 16002: no saturation), so every step.
        constexpr int kWiden = BITS == 4 ? 4 : BITS == 5 ? 2 : 1;
        __m256i acc16[R][U];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) {
            acc16[r][u] = _mm256_setzero_si256();
            if constexpr (BITS != 4) iacc[r][u] = _mm256_setzero_si256();
          }
        const int steps = static_cast<int>((blen + 7) / 8);
        for (int t = 0; t < steps; ++t) {
          nibble_step<R, U, BITS>(wbase + p * w.ld + boff + 64 * t, wbase + p * w.ld + poff + PB * t, w.ld,
                                  x.q + r0 * x.ld + b0 + 8 * t, x.ld, acc16);
          if constexpr (BITS != 4) {
            if ((t + 1) % kWiden == 0 || t + 1 == steps) {
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
                for (int u = 0; u < U; ++u) {
                  iacc[r][u] = _mm256_add_epi32(iacc[r][u], widen16(acc16[r][u]));
                  acc16[r][u] = _mm256_setzero_si256();
                }
            }
          }
        }
        if constexpr (BITS == 4) {
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
            for (int u = 0; u < U; ++u) iacc[r][u] = widen16(acc16[r][u]);
        }
      } else {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u) iacc[r][u] = _mm256_setzero_si256();
        const int steps = static_cast<int>((blen + 3) / 4);
        for (int t = 0; t < steps; ++t)
          step8<R, U>(wbase + p * w.ld + boff + 64 * t, w.ld, x.q + r0 * x.ld + b0 + 4 * t, x.ld, iacc);
        if constexpr (kSignTrick && !Z128) add_zero128<R, U>(x, r0, bi, iacc);
      }
      block_update<R, U, HZ, HM, Z128>(x, r0, bi, iacc, vs, vz, vm, facc);
    }
  }
  store_tile<R, U>(w, bias, y, ldy, p, r0, facc);
}

template <int RR, int U, int BITS, bool HZ, bool HM, int HS, bool CB, bool Z128>
FV_INLINE void unit_rows(int rows, const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y,
                         int64_t ldy, int64_t p, int64_t r0) {
  if constexpr (RR > 1) {
    if (rows < RR) return unit_rows<RR - 1, U, BITS, HZ, HM, HS, CB, Z128>(rows, x, w, bias, y, ldy, p, r0);
  }
  unit_tile<RR, U, BITS, HZ, HM, HS, CB, Z128>(x, w, bias, y, ldy, p, r0);
}

template <int BITS, bool HZ, bool HM, int HS, bool CB, bool Z128>
void panel_rows_t(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                  int64_t ldy, int64_t p0, int64_t p1) {
  if (m == 1) {
    // Decode: 2 panels (4 units, 32 weight rows) side by side give 4 independent chains.
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2)
      unit_tile<1, 4, BITS, HZ, HM, HS, CB, Z128>(x, w, bias, y, ldy, p, 0, p + 2, min64(p + 4, p1));
    for (; p < p1; ++p) unit_tile<1, 2, BITS, HZ, HM, HS, CB, Z128>(x, w, bias, y, ldy, p, 0);
    return;
  }
  // 4 rows x 2 units: their 16 float and integer sums do not all fit the 16 YMM registers, but
  // each weight vector's unpacking (nibble masks, 8-bit sign work) now serves 4 rows instead of
  // 3, which outweighs the sums that live in L1. One thread, m = 512, n = 3072, k = 576
  // (bench_kernels --only qlinear, Zen 3): Q4_1 126 -> 134 GFLOP/s, Q8_0 90 -> 96, Q6_K 48 -> 55;
  // m = 16 and 64 gain as much. ~8 panels (128 weight rows, L2-resident) are swept by every row
  // tile of x. The tile's shape never changes a row's arithmetic.
  constexpr int R = 4;
  for (int64_t pp = p0; pp < p1; pp += 8) {
    const int64_t ppe = min64(pp + 8, p1);
    for (int64_t r = 0; r < m; r += R) {
      const int rows = static_cast<int>(min64(R, m - r));
      panel_prefetch_out(y, ldy, r, rows, pp * 16, min64(ppe * 16, w.rows));
      for (int64_t p = pp; p < ppe; ++p)
        unit_rows<R, 2, BITS, HZ, HM, HS, CB, Z128>(rows, x, w, bias, y, ldy, p, r);
    }
  }
}

template <int BITS, bool HZ, bool HM, int HS, bool CB>
void linear_panel_t(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                    int64_t ldy, int64_t p0, int64_t p1) {
  if constexpr (BITS == 8 && HZ && !CB && kSignTrick) {
    if (!w.zero && w.zero_point == 128)
      return panel_rows_t<BITS, HZ, HM, HS, CB, true>(x, w, bias, y, m, ldy, p0, p1);
  }
  panel_rows_t<BITS, HZ, HM, HS, CB, false>(x, w, bias, y, m, ldy, p0, p1);
}

#include "cpu/qkernels_panel_dispatch.h"
