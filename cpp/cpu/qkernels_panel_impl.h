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

// Group g's scales (and zeros, mins) of panels p .. p + PC - 1.
template <int PC, bool HZ, bool HM, int HS>
FP_INLINE void panel_group_scales(const QuantMatrix& w, int64_t p, int64_t g, __m512* vs, __m512* vz,
                                  __m512* vm) {
  const int64_t ng = w.ngroups();
  // The super-block of group g and the super-blocks per panel row (divisions once per group,
  // not per panel: an integer division costs more than the rest of the scale set-up).
  const int64_t sg = HS == kScaleSub ? g / w.fgroups : 0, nsup = HS == kScaleSub ? ng / w.fgroups : 0;
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const int64_t gi = ((p + c) * ng + g) * 16;
    if constexpr (HS == kScaleSub) {
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

#undef FP_INLINE
