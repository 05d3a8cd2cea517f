// cpu: pieces of the panel-layout int8 kernels shared by the VNNI file and its AMX twin, so the
// two keep the same per-block float arithmetic (their bit-equality rests on it). Include inside
// an anonymous namespace of an AVX-512-flagged file after <immintrin.h>: everything here is
// force-inlined, so no symbol compiled with one file's flags can stand in for the other's.
#pragma once

#define FP_INLINE inline __attribute__((always_inline))

// 16 lanes of scale (or min) at element i: f32, or f16 in the half-scale layout.
template <int HS>
FP_INLINE __m512 panel_load_scale(const float* a, int64_t i) {
  if constexpr (HS == kScaleF16) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(a) + i)));
  } else {
    return _mm512_loadu_ps(a + i);
  }
}

// The sub-scale layout's 16 lanes: f16 factor (element si) times int8 sub-scale (element i).
FP_INLINE __m512 panel_load_sub(const float* f, const int8_t* s, int64_t si, int64_t i) {
  const __m512 vf = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(f) + si)));
  const __m512 vi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  return _mm512_mul_ps(vf, vi);
}

// The nibble sub-scale layout's 16 lanes: f16 factor times the low (scale) or high (min) nibbles.
FP_INLINE __m512 panel_load_sub_nibble(const float* f, const int8_t* s, int64_t si, int64_t i, bool high) {
  const __m512 vf = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(f) + si)));
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
  if (high) v = _mm_srli_epi16(v, 4);
  v = _mm_and_si128(v, _mm_set1_epi8(0x0f));
  return _mm512_mul_ps(vf, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)));
}

// Group g's scales (and zeros, mins) of panels p .. p + PC - 1.
template <int PC, bool HZ, bool HM, int HS>
FP_INLINE void panel_group_scales(const QuantMatrix& w, int64_t p, int64_t g, __m512* vs, __m512* vz,
                                  __m512* vm) {
  const int64_t ng = w.ngroups();
  // The super-block of group g and the super-blocks per panel row (divisions once per group,
  // not per panel: an integer division costs more than the rest of the scale set-up).
  constexpr bool sub = is_sub_scale_mode(HS);
  const int64_t sg = sub ? g / w.fgroups : 0, nsup = sub ? ng / w.fgroups : 0;
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const int64_t gi = ((p + c) * ng + g) * 16;
    if constexpr (HS == kScaleSubNibble) {
      const int64_t si = ((p + c) * nsup + sg) * 16;
      vs[c] = panel_load_sub_nibble(w.fscale, w.iscale, si, gi, false);
      if constexpr (HM) vm[c] = panel_load_sub_nibble(w.fmin, w.iscale, si, gi, true);
    } else if constexpr (HS == kScaleSub) {
      const int64_t si = ((p + c) * nsup + sg) * 16;
      vs[c] = panel_load_sub(w.fscale, w.iscale, si, gi);
      if constexpr (HM) vm[c] = panel_load_sub(w.fmin, w.imin, si, gi);
    } else {
      vs[c] = panel_load_scale<HS>(w.scale, gi);
      if constexpr (HM) vm[c] = panel_load_scale<HS>(w.min, gi);
    }
    if constexpr (HZ) {
      vz[c] = w.zero ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zero + gi))))
                     : _mm512_set1_ps(static_cast<float>(w.zero_point));
    }
  }
}

// A 5- or 6-bit step's bit planes (at pl, see qkernels.h) added into its nibble vectors: each
// 64-bit word is the byte mask of one vector, and the nibbles are below 16, so adding 16 (32)
// where a bit is set is setting bit 4 (5).
template <int BITS>
FP_INLINE void add_planes(const uint8_t* pl, __m512i* wl, __m512i* wh) {
  uint64_t m[4];
  std::memcpy(m, pl, 8 * 2 * (BITS - 4));
  const __m512i b4 = _mm512_set1_epi8(0x10);
  *wl = _mm512_mask_add_epi8(*wl, _cvtu64_mask64(m[0]), *wl, b4);
  *wh = _mm512_mask_add_epi8(*wh, _cvtu64_mask64(m[1]), *wh, b4);
  if constexpr (BITS == 6) {
    const __m512i b5 = _mm512_set1_epi8(0x20);
    *wl = _mm512_mask_add_epi8(*wl, _cvtu64_mask64(m[2]), *wl, b5);
    *wh = _mm512_mask_add_epi8(*wh, _cvtu64_mask64(m[3]), *wh, b5);
  }
}

// A 3-bit step's 32-byte plane (at pl, see qkernels.h) in both halves of a vector, and the
// bit that vector s tests in it: s in the step's first 32 bytes, 4 + s in the second.
FP_INLINE __m512i plane3(const uint8_t* pl) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pl)));
}
FP_INLINE __m512i plane3_bit(int s) {
  return _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << s)),
                            _mm256_set1_epi8(static_cast<char>(16 << s)), 1);
}

#undef FP_INLINE
