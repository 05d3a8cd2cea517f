// cpu: pieces of the panel-layout int8 kernels shared by the VNNI file and its AMX twin, so the
// two keep the same per-block float arithmetic (their bit-equality rests on it). Include inside
// an anonymous namespace of an AVX-512-flagged file after <immintrin.h>: everything here is
// force-inlined, so no symbol compiled with one file's flags can stand in for the other's.
#pragma once

#define FP_INLINE inline __attribute__((always_inline))

// 16 lanes of scale (or min) at element i: f32, or f16 in the half-scale layout.
template <bool HS>
FP_INLINE __m512 panel_load_scale(const float* a, int64_t i) {
  if constexpr (HS) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(a) + i)));
  } else {
    return _mm512_loadu_ps(a + i);
  }
}

// Group g's scales (and zeros, mins) of panels p .. p + PC - 1.
template <int PC, bool HZ, bool HM, bool HS>
FP_INLINE void panel_group_scales(const QuantMatrix& w, int64_t p, int64_t g, __m512* vs, __m512* vz,
                                  __m512* vm) {
  const int64_t ng = w.ngroups();
#pragma GCC unroll 4
  for (int c = 0; c < PC; ++c) {
    const int64_t gi = ((p + c) * ng + g) * 16;
    vs[c] = panel_load_scale<HS>(w.scale, gi);
    if constexpr (HZ) {
      vz[c] = w.zero ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zero + gi))))
                     : _mm512_set1_ps(static_cast<float>(w.zero_point));
    }
    if constexpr (HM) vm[c] = panel_load_scale<HS>(w.min, gi);
  }
}

#undef FP_INLINE
