// cpu: the entry point every SIMD panel kernel file shares: linear_panel switches at run time on
// bits (2 | 3 | 4 | 5 | 6 | 8: the value width the panels keep), whether the 4-bit values are codebook
// indices (CB: QuantMatrix::codebook), whether groups have a zero (HZ) and a min (HM), and how
// scales are kept (HS: kScaleF32 / kScaleF16 / kScaleSub), to the file's compile-time
// instantiation linear_panel_t<BITS, HZ, HM, HS, CB>. No intrinsics here; include it inside the
// anonymous namespace of the kernel file, after linear_panel_t.
#pragma once

template <int BITS, bool HZ, bool HM, bool CB = false>
void panel_dispatch_hs(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                       int64_t ldy, int64_t p0, int64_t p1) {
  switch (panel_scale_mode(w.layout)) {
    case kScaleF16: return linear_panel_t<BITS, HZ, HM, kScaleF16, CB>(x, w, bias, y, m, ldy, p0, p1);
    case kScaleSub: return linear_panel_t<BITS, HZ, HM, kScaleSub, CB>(x, w, bias, y, m, ldy, p0, p1);
    case kScaleSubNibble:
      // The packer keeps nibble sub-scales for 2-bit values with a min alone (qkernels.h).
      if constexpr (BITS == 2 && HM && !CB)
        return linear_panel_t<BITS, HZ, HM, kScaleSubNibble, CB>(x, w, bias, y, m, ldy, p0, p1);
      __builtin_trap();
    default: return linear_panel_t<BITS, HZ, HM, kScaleF32, CB>(x, w, bias, y, m, ldy, p0, p1);
  }
}

using PanelFn = void (*)(const QuantizedRows&, const QuantMatrix&, const float*, float*, int64_t, int64_t,
                         int64_t, int64_t);
// One value width's four instantiations, [hz][hm].
struct PanelFns {
  PanelFn f[2][2];
};
template <int BITS, bool CB = false>
constexpr PanelFns panel_fns() {
  return {{{panel_dispatch_hs<BITS, false, false, CB>, panel_dispatch_hs<BITS, false, true, CB>},
           {panel_dispatch_hs<BITS, true, false, CB>, panel_dispatch_hs<BITS, true, true, CB>}}};
}

void linear_panel(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                  int64_t ldy, int64_t p0, int64_t p1) {
  const bool hz = w.zero != nullptr || w.zero_point != 0, hm = w.min != nullptr;
  // 2, 3, 4, 5, 6, 8 bits, then 4-bit codebook indices.
  static constexpr PanelFns kFns[7] = {panel_fns<2>(), panel_fns<3>(), panel_fns<4>(),      panel_fns<5>(),
                                       panel_fns<6>(), panel_fns<8>(), panel_fns<4, true>()};
  const int bi = w.codebook ? 6 : w.bits == 8 ? 5 : w.bits - 2;
  kFns[bi].f[hz][hm](x, w, bias, y, m, ldy, p0, p1);
}
