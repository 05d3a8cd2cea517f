// cpu: software prefetch for the panel-layout kernels: weights in the decode (m = 1) path, and in
// prefill the output lines a tile will write (panel_prefetch_out, below). Decode streams each
// weight byte once, panel after panel; a panel is a few KiB spread over 4 KiB pages, too short for
// the hardware prefetcher to ramp up on each one (the AVX2 Q4_1 decode ran 107-121 tok/s without
// it, 151-156 with it, on SmolLM2-135M). So while a tile computes group g, it asks for group g of
// the panels it will compute next: weights, scales, mins and zeros. No intrinsics: include it
// inside the anonymous namespace of any panel kernel file.
#pragma once

#define FPF_INLINE inline __attribute__((always_inline))

FPF_INLINE void panel_prefetch_bytes(const void* base, int64_t lo, int64_t hi) {
  const char* b = static_cast<const char*>(base);
  for (int64_t o = lo & ~int64_t{63}; o < hi; o += 64) __builtin_prefetch(b + o, 0, 3);
}

// Group g of panels q0 .. q1 - 1 (an empty range asks for nothing).
template <int BITS, bool HZ, bool HM, int HS>
FPF_INLINE void panel_prefetch_group(const QuantMatrix& w, int64_t q0, int64_t q1, int64_t g) {
  const int64_t ng = w.ngroups();
  const int64_t gbytes = w.group * 2 * BITS;  // a full group's values and bit planes
  constexpr int64_t sbytes = HS == kScaleF32 ? 4 : HS == kScaleF16 ? 2 : 1;
  if (q0 >= q1) return;
  // Sub-scale layout: the super-block factors are asked for at a super-block's first group.
  const bool first = is_sub_scale_mode(HS) && g % w.fgroups == 0;
  const int64_t sg = first ? g / w.fgroups : 0, nsup = first ? ng / w.fgroups : 0;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t gi = (q * ng + g) * 16;
    panel_prefetch_bytes(w.data, q * w.ld + g * gbytes, q * w.ld + (g + 1) * gbytes);
    panel_prefetch_bytes(w.scale, gi * sbytes, (gi + 16) * sbytes);
    // (The nibble layout's mins share the scales' bytes.)
    if constexpr (HM && HS != kScaleSubNibble) panel_prefetch_bytes(w.min, gi * sbytes, (gi + 16) * sbytes);
    if constexpr (is_sub_scale_mode(HS)) {
      // The super-block factors (32 bytes per panel), once per super-block.
      if (first) {
        const int64_t si = (q * nsup + sg) * 16;
        panel_prefetch_bytes(w.fscale, si * 2, (si + 16) * 2);
        if constexpr (HM) panel_prefetch_bytes(w.fmin, si * 2, (si + 16) * 2);
      }
    }
    if constexpr (HZ) {
      if (w.zero) panel_prefetch_bytes(w.zero, gi, gi + 16);
    }
  }
}

// Prefill: the output lines a row tile will write, columns c0 .. c1 - 1 of rows r0 .. r0 + rows - 1,
// asked for with intent to write before the tile computes. Without it each tile's stores missed
// (a prefill's y is megabytes, not cached when a row block starts), and a store waiting for its
// line holds every later store in the store buffer, the AVX2 tiles' spilled sums included, so the
// kernel stalls. AVX2, m = 2048, 2 threads, best of 4 (bench_kernels --only qlinear, SmolLM2's
// shapes): Q8_0 134-153 GFLOP/s before, 160-170 after; Q4_1 up to 1.4x on the 576-column outputs;
// m = 64, whose y stays in L2, unchanged. The AVX-512 VNNI tiles keep their sums in 32 registers,
// spill nothing, and measured the same with it and without.
FPF_INLINE void panel_prefetch_out(const float* y, int64_t ldy, int64_t r0, int rows, int64_t c0,
                                   int64_t c1) {
  for (int i = 0; i < rows; ++i) {
    const float* yr = y + (r0 + i) * ldy;
    for (int64_t c = c0; c < c1; c += 16) __builtin_prefetch(yr + c, 1, 3);
  }
}

#undef FPF_INLINE
