// cpu: quantized-weight kernel bodies, written once over a traits type QT that each
// qkernels_<isa>.cpp defines (lane width W, f32 loads, FMA, the same fixed horizontal sum as the
// dense kernels' VT, and loads of W unsigned 8-bit or 4-bit weights as float lanes), then
// includes inside its own namespace. No #include and no std:: here (see kernels_impl.h).
//
// Weights are dequantized in registers: w = scale * (float(q) - float(zero)) (+ min), a multiply
// and then an add (never fused: QT::mul_exact keeps the product rounded), which equals the
// QuantMatrix formula exactly since q - zero is a small integer. A dequantized vector then feeds
// the same per-element chain as the dense linear (kernels_impl.h), so batch invariance holds for
// the same reason, and for m > 1 each dequantized weight vector is reused across a tile of rows.

using QV = QT::V;
constexpr int QW = QT::W;

#define FQ_INLINE inline __attribute__((always_inline))

// QW stored weights of a packed row from column c (c % QW == 0) as float lanes of q.
template <int BITS>
FQ_INLINE QV loadq(const uint8_t* row, int64_t c) {
  if constexpr (BITS == 8) {
    return QT::u8(row + c);
  } else {
    const uint8_t* p = row + (c >> 5) * 16 + (c & 15);
    return (c & 16) ? QT::nib_hi(p) : QT::nib_lo(p);
  }
}

struct GroupConst {
  QV s, z, mn;
};

template <bool HZ, bool HM>
FQ_INLINE GroupConst group_const(const QuantMatrix& w, int64_t j, int64_t g, int64_t ng) {
  GroupConst gc;
  const int64_t i = j * ng + g;
  gc.s = QT::set1(w.scale[i]);
  if constexpr (HZ) gc.z = QT::set1(static_cast<float>(w.zero ? w.zero[i] : w.zero_point));
  else gc.z = QT::zero();
  if constexpr (HM) gc.mn = QT::set1(w.min[i]);
  else gc.mn = QT::zero();
  return gc;
}

template <bool HZ, bool HM>
FQ_INLINE QV dequant(QV q, const GroupConst& gc) {
  if constexpr (HZ) q = QT::sub(q, gc.z);
  QV v = QT::mul_exact(q, gc.s);
  if constexpr (HM) v = QT::add(v, gc.mn);
  return v;
}

FQ_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// y[r, j + c] for r < R, c < C; x rows of stride k.
template <int R, int C, int BITS, bool HZ, bool HM>
FQ_INLINE void qlin_tile(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t ldy,
                         int64_t j, const char* pf) {
  constexpr int kPfStep = C * QW * BITS / 8;
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  const uint8_t* rows[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) rows[c] = static_cast<const uint8_t*>(w.data) + (j + c) * w.ld;
  QV acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = QT::zero();
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t c1 = min64((g + 1) * G, k);
    GroupConst gc[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) gc[c] = group_const<HZ, HM>(w, j + c, g, ng);
    int64_t i = g * G;
    for (; i + QW <= c1; i += QW) {
      if (pf) {
#pragma GCC unroll 8
        for (int b = 0; b < kPfStep; b += 64) __builtin_prefetch(pf + b, 0, 3);
        pf += kPfStep;
      }
      QV xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = QT::load(x + r * k + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const QV wv = dequant<HZ, HM>(loadq<BITS>(rows[c], i), gc[c]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = QT::fma(xv[r], wv, acc[r][c]);
      }
    }
    if (i < c1) {  // only the last group can end off a vector boundary
      const int t = static_cast<int>(c1 - i);
      QV xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = QT::load_n(x + r * k + i, t);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        // Padding lanes of q are zero but dequantize to -scale*zero (+min): mask them out.
        const QV wv = QT::keep_n(dequant<HZ, HM>(loadq<BITS>(rows[c], i), gc[c]), t);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = QT::fma(xv[r], wv, acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = QT::hsum(acc[r][c]);
      y[r * ldy + j + c] = bias ? s + bias[j + c] : s;
    }
}

template <int RR, int C, int BITS, bool HZ, bool HM>
FQ_INLINE void qlin_rows(int rows, const float* x, const QuantMatrix& w, const float* bias, float* y,
                         int64_t ldy, int64_t j, const char* pf) {
  if constexpr (RR > 1) {
    if (rows < RR) return qlin_rows<RR - 1, C, BITS, HZ, HM>(rows, x, w, bias, y, ldy, j, pf);
  }
  qlin_tile<RR, C, BITS, HZ, HM>(x, w, bias, y, ldy, j, pf);
}

template <int BITS, bool HZ, bool HM>
void linear_q_t(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy,
                int64_t j0, int64_t j1) {
  constexpr int R = QT::kTileRows, C = QT::kTileCols, C1 = QT::kDecodeCols;
  const int64_t k = w.cols;
  const char* wb = static_cast<const char*>(w.data);
  int64_t j = j0;
  if (m == 1) {
    // Decode: memory-bound; C1 weight rows stream side by side, the next C1 rows prefetched.
    for (; j + C1 <= j1; j += C1)
      qlin_tile<1, C1, BITS, HZ, HM>(x, w, bias, y, ldy, j,
                                     j + 2 * C1 <= j1 ? wb + (j + C1) * w.ld : nullptr);
    for (; j < j1; ++j) qlin_tile<1, 1, BITS, HZ, HM>(x, w, bias, y, ldy, j, nullptr);
    return;
  }
  // Prefill: a panel of ~64 weight rows (L2-resident) is swept by every R-row tile of x.
  constexpr int64_t P = (64 + C - 1) / C * C;
  for (int64_t jp = j0; jp < j1; jp += P) {
    const int64_t jpe = jp + P < j1 ? jp + P : j1;
    for (int64_t r = 0; r < m; r += R) {
      const int rows = m - r < R ? static_cast<int>(m - r) : R;
      const float* xr = x + r * k;
      float* yr = y + r * ldy;
      for (j = jp; j + C <= jpe; j += C) {
        const char* pf = r == 0 && j + 2 * C <= j1 ? wb + (j + C) * w.ld : nullptr;
        qlin_rows<R, C, BITS, HZ, HM>(rows, xr, w, bias, yr, ldy, j, pf);
      }
      for (; j < jpe; ++j) qlin_rows<R, 1, BITS, HZ, HM>(rows, xr, w, bias, yr, ldy, j, nullptr);
    }
  }
}

void linear_q(const float* x, const QuantMatrix& w, const float* bias, float* y, int64_t m, int64_t ldy,
              int64_t j0, int64_t j1) {
  const bool hz = w.zero != nullptr || w.zero_point != 0, hm = w.min != nullptr;
  if (w.bits == 4) {
    if (hz) {
      if (hm) linear_q_t<4, true, true>(x, w, bias, y, m, ldy, j0, j1);
      else linear_q_t<4, true, false>(x, w, bias, y, m, ldy, j0, j1);
    } else {
      if (hm) linear_q_t<4, false, true>(x, w, bias, y, m, ldy, j0, j1);
      else linear_q_t<4, false, false>(x, w, bias, y, m, ldy, j0, j1);
    }
  } else {
    if (hz) {
      if (hm) linear_q_t<8, true, true>(x, w, bias, y, m, ldy, j0, j1);
      else linear_q_t<8, true, false>(x, w, bias, y, m, ldy, j0, j1);
    } else {
      if (hm) linear_q_t<8, false, true>(x, w, bias, y, m, ldy, j0, j1);
      else linear_q_t<8, false, false>(x, w, bias, y, m, ldy, j0, j1);
    }
  }
}

template <int BITS, bool HM>
void dequant_row_t(const QuantMatrix& w, int64_t r, float* out) {
  const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * w.ld;
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  for (int64_t g = 0; g < ng; ++g) {
    const GroupConst gc = group_const<true, HM>(w, r, g, ng);
    const int64_t c1 = min64((g + 1) * G, k);
    for (int64_t i = g * G; i < c1; i += QW) {
      const QV v = dequant<true, HM>(loadq<BITS>(row, i), gc);
      if (i + QW <= c1) QT::store(out + i, v);
      else QT::store_n(out + i, v, static_cast<int>(c1 - i));
    }
  }
}

void dequant_row(const QuantMatrix& w, int64_t r, float* out) {
  const bool hm = w.min != nullptr;
  if (w.bits == 4) hm ? dequant_row_t<4, true>(w, r, out) : dequant_row_t<4, false>(w, r, out);
  else hm ? dequant_row_t<8, true>(w, r, out) : dequant_row_t<8, false>(w, r, out);
}

const QKernelTable kQTable = {QT::kName, linear_q, dequant_row};

#undef FQ_INLINE
