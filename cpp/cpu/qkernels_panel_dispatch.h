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
    default: return linear_panel_t<BITS, HZ, HM, kScaleF32, CB>(x, w, bias, y, m, ldy, p0, p1);
  }
}

void linear_panel(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                  int64_t ldy, int64_t p0, int64_t p1) {
  const bool hz = w.zero != nullptr || w.zero_point != 0, hm = w.min != nullptr;
  using Fn = void (*)(const QuantizedRows&, const QuantMatrix&, const float*, float*, int64_t, int64_t,
                      int64_t, int64_t);
  // [4, 5, 6, 8 bits, 4-bit codebook indices, 2, 3 bits][hz][hm]
  static constexpr Fn kFns[7][2][2] = {
      {{panel_dispatch_hs<4, false, false>, panel_dispatch_hs<4, false, true>},
       {panel_dispatch_hs<4, true, false>, panel_dispatch_hs<4, true, true>}},
      {{panel_dispatch_hs<5, false, false>, panel_dispatch_hs<5, false, true>},
       {panel_dispatch_hs<5, true, false>, panel_dispatch_hs<5, true, true>}},
      {{panel_dispatch_hs<6, false, false>, panel_dispatch_hs<6, false, true>},
       {panel_dispatch_hs<6, true, false>, panel_dispatch_hs<6, true, true>}},
      {{panel_dispatch_hs<8, false, false>, panel_dispatch_hs<8, false, true>},
       {panel_dispatch_hs<8, true, false>, panel_dispatch_hs<8, true, true>}},
      {{panel_dispatch_hs<4, false, false, true>, panel_dispatch_hs<4, false, true, true>},
       {panel_dispatch_hs<4, true, false, true>, panel_dispatch_hs<4, true, true, true>}},
      {{panel_dispatch_hs<2, false, false>, panel_dispatch_hs<2, false, true>},
       {panel_dispatch_hs<2, true, false>, panel_dispatch_hs<2, true, true>}},
      {{panel_dispatch_hs<3, false, false>, panel_dispatch_hs<3, false, true>},
       {panel_dispatch_hs<3, true, false>, panel_dispatch_hs<3, true, true>}}};
  const int bi = w.codebook    ? 4
                 : w.bits == 2 ? 5
                 : w.bits == 3 ? 6
                 : w.bits == 4 ? 0
                 : w.bits == 5 ? 1
                 : w.bits == 6 ? 2
                               : 3;
  kFns[bi][hz][hm](x, w, bias, y, m, ldy, p0, p1);
}
