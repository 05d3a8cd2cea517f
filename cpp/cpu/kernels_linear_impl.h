// cpu: the dense linear kernel (register tiles of x rows x weight rows, prefetch), written once over VT; included by kernels_impl.h inside each ISA's
// namespace (see there for the rules: no #include, no std:: templates, batch invariance).
#pragma once

// ---- linear ------------------------------------------------------------------------------------

// y[r, j + c] for r < R, c < C. x: [R, k] (row stride k); w: element (j + c) * k + i; y: row
// stride ldy.
// pf: when not null, the next tile's weight rows (contiguous bytes); each k step prefetches as
// many bytes of it as it consumes of this tile, so DRAM streams ahead of the FMAs (rows are only
// k long, too short for the hardware prefetcher to ramp up on C interleaved streams). Into L1,
// unless a tile is over 16 KiB (bf16 past 2048 columns at 4 rows, past 1024 at 8): this tile
// and the next would then not both fit a 32-48 KiB L1, and the prefetched lines would push out
// the ones being read, so they go to L2 (bench/README.md, 2026-12-06: bf16 decode 1.11-1.23x).
// A group layout's decode tile reads one stream: pf is then a fixed distance ahead in it
// (kGroupPrefetchBytes), into L2, past the chunk's or the matrix's end at its last tile (a
// prefetch never faults). Its prefill tiles pass the bytes the next C rows would take row-major:
// the same stretch of the group layout, read about then.
// Pairs (bf16 only): each row's first k - k % (2W) elements are in the pair layout
// (pack_bf16_pairs). G > 1 (bf16 only): the group layout (pack_bf16_groups), whose weight row jj
// has its W-element chunk i / W at col_off + i * G and its tail at tail_off (below); G = 1 is
// row-major. Either way the chains are the same, so are the bits.
template <int G>
FT_INLINE int64_t col_off(int64_t jj, int64_t k) {
  return jj / G * G * k + jj % G * W;
}
template <int G>
FT_INLINE int64_t tail_off(int64_t jj, int64_t k) {
  const int64_t kv = k - k % W;
  return jj / G * G * k + kv * G + jj % G * (k - kv);
}
template <int R, int C, int DT, bool Pairs = false, int G = 1>
FT_INLINE void lin_tile(const float* x, const void* w, const float* bias, float* y, int64_t ldy, int64_t k,
                        int64_t j, const char* pf = nullptr) {
  constexpr int kEs = elem_bytes<DT>(), kPfStep = C * W * kEs;
  static_assert(!Pairs || DT == 2, "the pair layout is bf16's");
  static_assert(G == 1 || (DT == 2 && !Pairs), "the group layout is bf16's, without pairs");
  V acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = VT::zero();
  const bool to_l2 = (G > 1 && R == 1) || static_cast<int64_t>(C) * k * kEs > 16384;
  // bytes of the next tile, 64 at a time (the locality hint must be a constant).
  auto prefetch = [&](int bytes) __attribute__((always_inline)) {
    if (to_l2) {
      for (int b = 0; b < bytes; b += 64) __builtin_prefetch(pf + b, 0, 2);
    } else {
      for (int b = 0; b < bytes; b += 64) __builtin_prefetch(pf + b, 0, 3);
    }
    pf += bytes;
  };
  const int64_t kv = k - k % W;
  int64_t i = 0;
  if constexpr (Pairs) {
    // Each half of 2W weights widens with one op, off the FMA ports where the ISA has one (AVX2: a
    // byte shuffle); the row-major loads take a widening load and a shift per W, and on Intel the
    // shift competes with the FMAs.
    const int64_t kp = k - k % (2 * W);
    for (; i < kp; i += 2 * W) {
      if (pf) prefetch(2 * kPfStep);
      // The two halves one after the other, as two W steps: a tile's registers hold one step's x.
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        V xv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xv[r] = VT::pin(VT::load(x + r * k + i + h * W));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const uint16_t* p = static_cast<const uint16_t*>(w) + (j + c) * k + i;
          const V wv = h == 0 ? VT::bf16_pair_lo(p) : VT::bf16_pair_hi(p);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(xv[r], wv, acc[r][c]);
        }
      }
    }
  }
  for (; i < kv; i += W) {
    if (pf) prefetch(kPfStep);
    V xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = VT::load(x + r * k + i);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const V wv = loadw<DT>(w, col_off<G>(j + c, k) + i * G);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(xv[r], wv, acc[r][c]);
    }
  }
  if (kv < k) {
    const int t = static_cast<int>(k - kv);
    V xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = VT::load_n(x + r * k + kv, t);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const V wv = loadw_n<DT>(w, tail_off<G>(j + c, k), t);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = VT::fma(xv[r], wv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = VT::hsum(acc[r][c]);
      y[r * ldy + j + c] = bias ? s + bias[j + c] : s;
    }
}

// lin_tile with a run-time row count in [1, RR] (the last, partial row tile of a batch).
template <int RR, int C, int DT, bool Pairs, int G>
FT_INLINE void lin_rows(int rows, const float* x, const void* w, const float* bias, float* y, int64_t ldy,
                        int64_t k, int64_t j, const char* pf) {
  if constexpr (RR > 1) {
    if (rows < RR) return lin_rows<RR - 1, C, DT, Pairs, G>(rows, x, w, bias, y, ldy, k, j, pf);
  }
  lin_tile<RR, C, DT, Pairs, G>(x, w, bias, y, ldy, k, j, pf);
}

// How far ahead of its reads a group layout's decode tile prefetches. Its hardware prefetcher
// follows the one stream, but not far enough ahead. AVX2 Zen 3, SmolLM2-135M bf16 decode, 2
// threads, medians of 5 alternated runs: 2048 bytes into L2 ran 1.01-1.06x the other distances
// tried (1024 into L1 or L2, 3072, 4096) and 1.02-1.09x the row-major tiles' next-tile prefetch.
constexpr int64_t kGroupPrefetchBytes = 2048;

template <int DT, bool Pairs = false, int G = 1>
void linear_t(const float* x, const void* w, const float* bias, float* y, int64_t m, int64_t ldy, int64_t k,
              int64_t j0, int64_t j1) {
  // A group layout's tiles take whole quarters or halves of a group (kGroupTileCols divides G),
  // so each line a tile reads is all its own: a 3-column tile would read 3 of every 8 rows'
  // chunks and pull each line into L1 about 3 times per panel sweep.
  constexpr int R = G > 1 ? VT::kGroupTileRows : Pairs ? VT::kPairTileRows : VT::kTileRows;
  constexpr int C = G > 1 ? VT::kGroupTileCols : Pairs ? VT::kPairTileCols : VT::kTileCols;
  static_assert(G % C == 0 || G == 1, "a group tile must not straddle groups");
  // A group layout's decode tile is one whole group: its bytes are one stream.
  constexpr int C1 = G > 1 ? G : VT::kDecodeCols;
  constexpr int kEs = elem_bytes<DT>();
  const char* wb = static_cast<const char*>(w);
  int64_t j = j0;
  if (m == 1) {
    // Decode: memory-bound; C1 weight rows stream side by side against one x row (a group's
    // first rows, when j0 starts inside one, one at a time).
    for (; G > 1 && j % G != 0 && j < j1; ++j) lin_tile<1, 1, DT, Pairs, G>(x, w, bias, y, ldy, k, j);
    for (; j + C1 <= j1; j += C1) {
      const char* pf = G > 1              ? wb + j * k * kEs + kGroupPrefetchBytes
                       : j + 2 * C1 <= j1 ? wb + (j + C1) * k * kEs
                                          : nullptr;
      lin_tile<1, C1, DT, Pairs, G>(x, w, bias, y, ldy, k, j, pf);
    }
    for (; j < j1; ++j) lin_tile<1, 1, DT, Pairs, G>(x, w, bias, y, ldy, k, j);
    return;
  }
  // Prefill: a panel of P weight rows (~64: L2-resident) is swept by every R-row tile of x (L1-
  // resident while it crosses the panel), so x and w are each read from L2 at most once per
  // panel x row tile. The first row tile prefetches the next C weight rows from DRAM.
  constexpr int64_t P = (64 + C - 1) / C * C;
  // A group layout's columns before the first tile-aligned one, one at a time.
  for (; G > 1 && j % C != 0 && j < j1; ++j)
    for (int64_t r = 0; r < m; r += R)
      lin_rows<R, 1, DT, Pairs, G>(m - r < R ? static_cast<int>(m - r) : R, x + r * k, w, bias, y + r * ldy,
                                   ldy, k, j, nullptr);
  for (int64_t jp = j; jp < j1; jp += P) {
    const int64_t jpe = jp + P < j1 ? jp + P : j1;
    int64_t r = 0;
    for (; r < m; r += R) {
      const int rows = m - r < R ? static_cast<int>(m - r) : R;
      const float* xr = x + r * k;
      float* yr = y + r * ldy;
      for (j = jp; j + C <= jpe; j += C) {
        const char* pf = r == 0 && j + 2 * C <= j1 ? wb + (j + C) * k * kEs : nullptr;
        lin_rows<R, C, DT, Pairs, G>(rows, xr, w, bias, yr, ldy, k, j, pf);
      }
      for (; j < jpe; ++j) lin_rows<R, 1, DT, Pairs, G>(rows, xr, w, bias, yr, ldy, k, j, nullptr);
    }
  }
}

void linear(const float* x, const void* w, DType wt, const float* bias, float* y, int64_t m, int64_t ldy,
            int64_t k, int64_t j0, int64_t j1) {
  switch (wt) {
    case DType::kF32: linear_t<0>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kF16: linear_t<1>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kBF16: linear_t<2>(x, w, bias, y, m, ldy, k, j0, j1); return;
    case DType::kI8: return;  // KV-cache-only type; the backend rejects it before this
  }
}

void linear_bf16_pairs(const float* x, const void* w, const float* bias, float* y, int64_t m, int64_t ldy,
                       int64_t k, int64_t j0, int64_t j1) {
  linear_t<2, true>(x, w, bias, y, m, ldy, k, j0, j1);
}

void linear_bf16_groups(const float* x, const void* w, const float* bias, float* y, int64_t m, int64_t ldy,
                        int64_t k, int64_t j0, int64_t j1) {
  linear_t<2, false, kBf16GroupRows>(x, w, bias, y, m, ldy, k, j0, j1);
}
