// cpu: AMX bf16 dense linear (see kernels_amx.h). Per-file flags add -mamx-*; nothing here runs
// unless amx_usable() said so. Activations are f32: x = hi + lo with both halves in bf16, so the
// two exact-bf16-weight products carry ~16 significant bits of x (error ~2^-17 of |x|).
#include "cpu/kernels_amx.h"

#include <cstring>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <cpuid.h>
#include <immintrin.h>

#include "cpu/amx_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>

namespace fantai::cpu {
namespace {

#define FA_INLINE inline __attribute__((always_inline))

constexpr int64_t kTileBytes = 1024;  // 16 rows x 64 bytes

// Tile state granted by Linux (arch_prctl ARCH_REQ_XCOMP_PERM), asked once per process.
bool tile_permission() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ok;
}

// CPUID leaf 7.0 EDX: bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8.
bool probe(int bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> bit) & 1)) return false;
  if (bit == 22 && (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1))) return false;  // AVX512-BF16
  return tile_permission();
}

// C tile B (0..3) += hi x w + lo x w for one k tile; w goes through tile T (6 or 7, alternating
// so the next load overlaps this product). Tile numbers must be literals for the intrinsics.
#define FA_STEP(B, T, wt)            \
  do {                               \
    _tile_loadd(T, (wt), 64);        \
    _tile_dpbf16ps(B, 4, T);         \
    _tile_dpbf16ps(B, 5, T);         \
  } while (0)

// One 16-row tile of x against NB (1..4) consecutive column blocks starting at wb.
template <int NB>
FA_INLINE void tile_rows(const uint16_t* hi, const uint16_t* lo, int64_t ldx_bytes, const uint8_t* wb,
                         int64_t kt, float* c, int64_t ldc_bytes) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t block_bytes = kt * kTileBytes;
  for (int64_t kb = 0; kb < kt; ++kb) {
    _tile_loadd(4, hi + kb * 32, ldx_bytes);
    _tile_loadd(5, lo + kb * 32, ldx_bytes);
    const uint8_t* w = wb + kb * kTileBytes;
    FA_STEP(0, 6, w);
    if constexpr (NB > 1) FA_STEP(1, 7, w + block_bytes);
    if constexpr (NB > 2) FA_STEP(2, 6, w + 2 * block_bytes);
    if constexpr (NB > 3) FA_STEP(3, 7, w + 3 * block_bytes);
  }
  _tile_stored(0, c, ldc_bytes);
  if constexpr (NB > 1) _tile_stored(1, c + 16, ldc_bytes);
  if constexpr (NB > 2) _tile_stored(2, c + 32, ldc_bytes);
  if constexpr (NB > 3) _tile_stored(3, c + 48, ldc_bytes);
}

}  // namespace

bool amx_usable() {
  static const bool ok = probe(22);
  return ok;
}

bool amx_int8_usable() {
  static const bool ok = probe(25);
  return ok;
}

size_t amx_packed_bytes(int64_t n, int64_t k) {
  return static_cast<size_t>((n + 15) / 16) * static_cast<size_t>(amx_k_pad(k) / 32) * kTileBytes;
}

void amx_pack_bf16(const uint16_t* w, int64_t n, int64_t k, void* dst) {
  const int64_t kt = amx_k_pad(k) / 32, nb = (n + 15) / 16;
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t jb = 0; jb < nb; ++jb)
    for (int64_t kb = 0; kb < kt; ++kb) {
      uint16_t* t = out + (jb * kt + kb) * (kTileBytes / 2);
      for (int p = 0; p < 16; ++p)
        for (int c = 0; c < 16; ++c)
          for (int s = 0; s < 2; ++s) {
            const int64_t j = jb * 16 + c, i = kb * 32 + 2 * p + s;
            t[p * 32 + c * 2 + s] = j < n && i < k ? w[j * k + i] : 0;
          }
    }
}

void amx_split_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int64_t r_pad, uint16_t* hi,
                    uint16_t* lo) {
  const int64_t kp = amx_k_pad(k);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * k;
    for (int64_t i = 0; i < kp; i += 16) {
      const int64_t left = k - i;
      const __mmask16 mask = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, xr + i);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
      const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * kp + i), (__m256i)h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * kp + i), (__m256i)l);
    }
  }
  if (r_pad > r1) {
    std::memset(hi + r1 * kp, 0, static_cast<size_t>((r_pad - r1) * kp) * 2);
    std::memset(lo + r1 * kp, 0, static_cast<size_t>((r_pad - r1) * kp) * 2);
  }
}

void amx_linear_bf16(const uint16_t* hi, const uint16_t* lo, int64_t m, int64_t k, const void* packed,
                     int64_t n, const float* bias, float* y, int64_t ldy, int64_t r0, int64_t r1, int64_t b0,
                     int64_t b1) {
  const int64_t kp = amx_k_pad(k), kt = kp / 32, nb = (n + 15) / 16;
  if (r1 > m) r1 = m;
  if (b1 > nb) b1 = nb;
  // A call of fewer than 16 rows runs tiles of just those rows: a tile product costs per row, and
  // a row's arithmetic is the same in a short tile as in a full one (rows are independent).
  const uint8_t trows = static_cast<uint8_t>(m < 16 ? m : 16);
  amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = t < 6 ? trows : 16;
  amx::load_config(cfg);
  alignas(64) float c[16 * 64];
  const uint8_t* w = static_cast<const uint8_t*>(packed);
  // Column groups of 4 blocks (4 x kt KiB of weights, L2-resident) swept by every row tile.
  for (int64_t g = b0; g < b1; g += 4) {
    const int nbk = static_cast<int>(b1 - g < 4 ? b1 - g : 4);
    const uint8_t* wg = w + g * kt * kTileBytes;
    for (int64_t r = r0; r < r1; r += 16) {
      const uint16_t* h = hi + r * kp;
      const uint16_t* l = lo + r * kp;
      switch (nbk) {
        case 4: tile_rows<4>(h, l, kp * 2, wg, kt, c, 64 * 4); break;
        case 3: tile_rows<3>(h, l, kp * 2, wg, kt, c, 64 * 4); break;
        case 2: tile_rows<2>(h, l, kp * 2, wg, kt, c, 64 * 4); break;
        default: tile_rows<1>(h, l, kp * 2, wg, kt, c, 64 * 4); break;
      }
      const int rows = static_cast<int>(r1 - r < 16 ? r1 - r : 16);
      const int64_t j0 = g * 16, cols = (n - j0 < nbk * 16 ? n - j0 : nbk * 16);
      for (int i = 0; i < rows; ++i) {
        float* yr = y + (r + i) * ldy + j0;
        const float* cr = c + i * 64;
        if (bias) {
          for (int64_t j = 0; j < cols; ++j) yr[j] = cr[j] + bias[j0 + j];
        } else {
          std::memcpy(yr, cr, static_cast<size_t>(cols) * sizeof(float));
        }
      }
    }
  }
  _tile_release();
}

}  // namespace fantai::cpu

#else  // no AMX in this build: the probe says no and nothing else is ever called.

#include <cstdlib>

namespace fantai::cpu {
bool amx_usable() { return false; }
bool amx_int8_usable() { return false; }
size_t amx_packed_bytes(int64_t, int64_t) { return 0; }
void amx_pack_bf16(const uint16_t*, int64_t, int64_t, void*) { std::abort(); }
void amx_split_rows(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*, uint16_t*) { std::abort(); }
void amx_linear_bf16(const uint16_t*, const uint16_t*, int64_t, int64_t, const void*, int64_t, const float*,
                     float*, int64_t, int64_t, int64_t, int64_t, int64_t) {
  std::abort();
}
}  // namespace fantai::cpu

#endif
