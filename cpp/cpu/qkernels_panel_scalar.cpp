// cpu: the panel-layout int8 kernel in portable C++ — the exact reference of the SIMD panel kernels
// (VNNI, AMX, AVX2 are tested bit-equal to it) and the path of CPUs without them. Each output
// element is one lane of the SIMD kernels: exact integer block sums, then the same f32 operations
// per block in the same order (std::fma where they fuse).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/types.h"
#include "cpu/qkernels.h"

namespace fantai::cpu {
namespace {

void linear_panel(const QuantizedRows& x, const QuantMatrix& w, const float* bias, float* y, int64_t m,
                  int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t k = w.cols, G = w.group, ng = w.ngroups();
  const int B = xq_block(w);
  const int64_t gbytes = G * 2 * w.bits;  // a full group's bytes in a panel (see qkernels.h)
  const int planes = w.bits > 4 && w.bits < 8 ? w.bits - 4 : 0;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const bool hz = w.zero != nullptr || w.zero_point != 0;
  for (int64_t p = p0; p < p1; ++p)
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t j = p * 16 + lane;
      if (j >= w.rows) break;
      // Lane `lane`'s 4 bytes of every 64-byte step of panel p.
      const uint8_t* wl = data + p * w.ld + lane * 4;
      for (int64_t r = 0; r < m; ++r) {
        const int8_t* xr = x.q + r * x.ld;
        float acc = 0.f;
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t gi = (p * ng + g) * 16 + lane;
          const float s = panel_scale_at(w, false, j, g);
          const float z = static_cast<float>(w.zero ? w.zero[gi] : w.zero_point);
          const float mn = w.min ? panel_scale_at(w, true, j, g) : 0.f;
          const int64_t g0 = g * G, g1 = std::min<int64_t>(g0 + G, k);
          // This lane's part of group g's bit planes, after the group's nibble steps.
          const uint8_t* gp = data + p * w.ld + g * gbytes + panel_planes_at(w.bits, g1 - g0);
          for (int64_t b0 = g0; b0 < g1; b0 += B) {
            const int64_t b1 = std::min<int64_t>(b0 + B, g1), bi = b0 / B;
            int32_t isum = 0;
            for (int64_t c = b0; c < b1; ++c) {
              const int64_t cg = c - g0;
              int q;
              if (w.bits == 8) {
                q = wl[g * gbytes + (cg >> 2) * 64 + (cg & 3)];
              } else if (w.bits < 4) {
                const int64_t s = (cg >> 2) & 3;
                q = (wl[g * gbytes + (cg >> 4) * 64 + (cg & 3)] >> (2 * s)) & 3;
                if (w.bits == 3) {
                  const int j = lane * 4 + static_cast<int>(cg & 3);  // the step byte
                  const uint8_t* plane = gp + (cg >> 4) * panel_plane_bytes(3);
                  q |= ((plane[j & 31] >> (4 * (j >> 5) + s)) & 1) << 2;
                }
              } else {
                const uint8_t byte = wl[g * gbytes + (cg >> 3) * 64 + (cg & 3)];
                const bool high = (cg & 7) >= 4;
                q = high ? byte >> 4 : byte & 15;
                const int bit = lane * 4 + static_cast<int>(cg & 3);
                for (int i = 0; i < planes; ++i) {
                  const uint8_t* word = gp + (cg >> 3) * panel_plane_bytes(w.bits) + 16 * i + (high ? 8 : 0);
                  q |= ((word[bit >> 3] >> (bit & 7)) & 1) << (4 + i);
                }
                if (w.codebook) q = w.codebook[q];
              }
              isum += q * xr[c];
            }
            const float d = x.d[r * x.nblocks + bi];
            const float sx = static_cast<float>(x.s[r * x.nblocks + bi]);
            float t = static_cast<float>(isum);
            if (hz) {
              const float zs = z * sx;  // exact: integers < 2^24
              t = t - zs;
            }
            const float sd = s * d;
            acc = std::fma(t, sd, acc);
            if (w.min) {
              const float dsx = d * sx;
              acc = std::fma(mn, dsx, acc);
            }
          }
        }
        y[r * ldy + j] = acc + (bias ? bias[j] : 0.f);
      }
    }
}

}  // namespace

LinearPanelFn scalar_linear_panel() { return linear_panel; }

// The portable activation quantizer (the SIMD quantizers are tested bit-equal to it).
void quantize_rows_int8(const float* x, int64_t m, int64_t k, int32_t block, int8_t* q, float* d,
                        int32_t* s) {
  const int64_t nb = (k + block - 1) / block, ld = nb * block;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * block;
      int8_t* qb = q + r * ld + b * block;
      const int64_t len = std::min<int64_t>(block, k - b * block);
      float amax = 0.f;
      for (int64_t i = 0; i < len; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float db = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < block; ++i) {
        const int v = i < len ? static_cast<int>(std::nearbyint(xb[i] * inv)) : 0;
        qb[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
        sum += qb[i];
      }
      d[r * nb + b] = db;
      s[r * nb + b] = sum;
    }
}

}  // namespace fantai::cpu
