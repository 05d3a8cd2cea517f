// model: GGUF block decoding and RTN quantization into the canonical group-quantized form.
// The block layouts follow ggml's reference dequantizers (ggml-quants.c); every format maps onto
// w = scale * float(q - zero) (+ min) with the exact f32 values ggml computes.
// Over 400 lines: one short decoder per GGUF block type (a dozen of them) beside the table that
// names them; split, each would be a file of twenty lines.
#include "model/quant_formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/types.h"

namespace fantai::model {
namespace {

struct BlockInfo {
  int64_t elems;  // per block
  int64_t bytes;  // per block
};

BlockInfo block_info(int32_t type) {
  switch (type) {
    case kGgmlF32: return {1, 4};
    case kGgmlF16: return {1, 2};
    case kGgmlBF16: return {1, 2};
    case kGgmlQ4_0: return {32, 18};
    case kGgmlQ4_1: return {32, 20};
    case kGgmlQ5_0: return {32, 22};
    case kGgmlQ5_1: return {32, 24};
    case kGgmlQ8_0: return {32, 34};
    case kGgmlQ2_K: return {256, 84};
    case kGgmlQ3_K: return {256, 110};
    case kGgmlQ4_K: return {256, 144};
    case kGgmlQ5_K: return {256, 176};
    case kGgmlQ6_K: return {256, 210};
    case kGgmlIQ4_NL: return {32, 18};
    case kGgmlIQ4_XS: return {256, 136};
  }
  FANTAI_THROW("unsupported GGUF tensor type "
               << type
               << " (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, "
                  "IQ4_NL, IQ4_XS)");
}

// The canonical form a block format decodes into: every type's ggml dequantization is one f32
// multiply of a per-group scale by a small integer, then (for the types with a min) one add.
struct Canonical {
  int32_t bits;        // 4 when every value fits a nibble, so the backend may pack two per byte
  int32_t group;       // elements sharing one scale (and min)
  int32_t zero_point;  // subtracted from every stored value
  bool has_min;
};

Canonical canonical_of(int32_t type) {
  switch (type) {
    case kGgmlQ4_0: return {4, 32, 8, false};
    case kGgmlQ4_1: return {4, 32, 0, true};
    case kGgmlQ5_0: return {8, 32, 16, false};  // 5-bit values 0..31
    case kGgmlQ5_1: return {8, 32, 0, true};
    case kGgmlQ8_0: return {8, 32, 128, false};  // int8 stored offset by 128
    case kGgmlQ2_K: return {4, 16, 0, true};     // 2-bit values 0..3
    case kGgmlQ3_K: return {4, 16, 4, false};    // 3-bit values 0..7
    case kGgmlQ4_K: return {4, 32, 0, true};
    case kGgmlQ5_K: return {8, 32, 0, true};
    case kGgmlQ6_K: return {8, 16, 32, false};
    // The IQ4 types store 4-bit indices into a non-uniform table; the canonical value is the
    // table entry offset by 128, so they take a byte each.
    case kGgmlIQ4_NL: return {8, 32, 128, false};
    case kGgmlIQ4_XS: return {8, 32, 128, false};
  }
  FANTAI_THROW("GGUF type " << type << " is not a block format");
}

// llama.cpp's IQ4_NL / IQ4_XS codebook: a 4-bit index selects one of these int8 levels (denser
// near zero, where weights are). Part of the file format, so it must be exactly these values.
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

uint8_t iq4_value(int index) { return static_cast<uint8_t>(kIq4Levels[index & 0xF] + 128); }

uint32_t u32_le(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block's 12 packed bytes:
// j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 split between byte j + 4 (low 4 bits) and
// the top 2 bits of bytes j - 4 and j.
void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// The per-super-block factors of one row (QuantMatrix::fgroups), or all nullptr for the types
// that have none.
struct RowFactors {
  float* fscale = nullptr;
  int8_t* iscale = nullptr;
  float* fmin = nullptr;
  int8_t* imin = nullptr;
};

// Sub-block s of super-block b: scale = d * i (and min = dm * j), the products ggml forms, with
// the factors recorded. -(dmin * m) is stored as (-dmin) * m: the same f32 value (IEEE
// multiplication is symmetric in sign).
void put_factored(const RowFactors& f, int64_t b, int64_t per, int s, float d, int i, float* scale) {
  scale[b * per + s] = d * static_cast<float>(i);
  if (f.iscale) {
    f.fscale[b] = d;
    f.iscale[b * per + s] = static_cast<int8_t>(i);
  }
}
void put_factored_min(const RowFactors& f, int64_t b, int64_t per, int s, float dm, int j, float* min) {
  min[b * per + s] = -(dm * static_cast<float>(j));
  if (f.imin) {
    f.fmin[b] = -dm;
    f.imin[b * per + s] = static_cast<int8_t>(j);
  }
}

// Groups per super-block of the types whose scales are factored (0: none).
int32_t factor_groups(int32_t type) {
  switch (type) {
    case kGgmlQ2_K:
    case kGgmlQ3_K:
    case kGgmlQ6_K: return 16;
    case kGgmlQ4_K:
    case kGgmlQ5_K:
    case kGgmlIQ4_XS: return 8;
  }
  return 0;
}

// One row of blocks into q / scale / zero / min at element offset 0 of the row.
void decode_row(int32_t type, const uint8_t* src, int64_t cols, uint8_t* q, float* scale, uint8_t* zero,
                float* min, const RowFactors& f) {
  const BlockInfo bi = block_info(type);
  const int64_t nb = cols / bi.elems;
  for (int64_t b = 0; b < nb; ++b, src += bi.bytes) {
    uint8_t* qb = q + b * bi.elems;
    switch (type) {
      case kGgmlQ8_0: {  // f16 d, 32 x int8; y = d * int8
        scale[b] = half(src);
        for (int i = 0; i < 32; ++i) qb[i] = static_cast<uint8_t>(static_cast<int8_t>(src[2 + i]) + 128);
        break;
      }
      case kGgmlQ4_0:    // f16 d, 16 bytes: low nibbles elements 0..15, high 16..31; y = (nib - 8) d
      case kGgmlQ4_1: {  // f16 d, f16 m, nibbles; y = nib * d + m
        const int off = type == kGgmlQ4_0 ? 2 : 4;
        scale[b] = half(src);
        if (type == kGgmlQ4_1) min[b] = half(src + 2);
        for (int i = 0; i < 16; ++i) {
          qb[i] = src[off + i] & 0xF;
          qb[i + 16] = src[off + i] >> 4;
        }
        break;
      }
      case kGgmlQ5_0:    // f16 d, u32 5th bits (bit i for element i), Q4_0's nibbles; y = (q - 16) d
      case kGgmlQ5_1: {  // f16 d, f16 m, u32 5th bits, nibbles; y = q * d + m
        const int off = type == kGgmlQ5_0 ? 2 : 4;
        scale[b] = half(src);
        if (type == kGgmlQ5_1) min[b] = half(src + 2);
        const uint32_t qh = u32_le(src + off);
        const uint8_t* qs = src + off + 4;
        for (int i = 0; i < 16; ++i) {
          qb[i] = static_cast<uint8_t>((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
          qb[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        break;
      }
      case kGgmlQ2_K:
      case kGgmlQ3_K: {
        // Both keep 2-bit values the same way: per 128-element half n, element 32 t + l (t < 4)
        // is bits 2t..2t+1 of byte 32 n + l of the 64-byte array, and each 16 elements share a
        // scale.
        // Q2_K: 16 bytes (min << 4 | scale) per sub-block, 64 bytes of values, f16 d, f16 dmin;
        //   y = (d * scale) * q - dmin * min.
        // Q3_K: 32 bytes hmask, 64 bytes of values, 12 bytes of 6-bit scales, f16 d; element e's
        //   third bit is bit e / 32 of hmask[e % 32] and counts -4 when clear:
        //   y = (d * (scale - 32)) * (q + 4 hbit - 4).
        const bool q2 = type == kGgmlQ2_K;
        const uint8_t* qs = src + (q2 ? 16 : 32);
        for (int n = 0; n < 2; ++n)
          for (int t = 0; t < 4; ++t)
            for (int l = 0; l < 32; ++l) {
              const int e = 128 * n + 32 * t + l;
              int v = (qs[32 * n + l] >> (2 * t)) & 3;
              if (!q2) v |= ((src[l] >> (e / 32)) & 1) << 2;
              qb[e] = static_cast<uint8_t>(v);
            }
        if (q2) {
          const float d = half(src + 80), dmin = half(src + 82);
          for (int s = 0; s < 16; ++s) {
            put_factored(f, b, 16, s, d, src[s] & 0xF, scale);
            put_factored_min(f, b, 16, s, dmin, src[s] >> 4, min);
          }
        } else {
          // 6-bit scale s: low 4 bits in byte s (s < 8) or the high nibble of byte s - 8, high 2
          // bits at bit 2 (s / 4) of byte 8 + s % 4.
          const uint8_t* sc = src + 96;
          const float d = half(src + 108);
          for (int s = 0; s < 16; ++s) {
            const int low = s < 8 ? sc[s] & 0xF : sc[s - 8] >> 4;
            const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            put_factored(f, b, 16, s, d, (low | (high << 4)) - 32, scale);
          }
        }
        break;
      }
      case kGgmlIQ4_NL: {  // f16 d, 16 bytes of table indices in Q4_0's nibble order; y = d * level
        scale[b] = half(src);
        for (int i = 0; i < 16; ++i) {
          qb[i] = iq4_value(src[2 + i]);
          qb[i + 16] = iq4_value(src[2 + i] >> 4);
        }
        break;
      }
      case kGgmlIQ4_XS: {
        // f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of indices. Sub-block j of 32: 6-bit
        // scale from nibble j % 2 of scales_l[j / 2] and bits 2j..2j+1 of scales_h; its 16 bytes
        // hold elements 0..15 (low nibbles) and 16..31 (high). y = (d * (scale - 32)) * level.
        const float d = half(src);
        const unsigned sh = static_cast<unsigned>(src[2]) | static_cast<unsigned>(src[3]) << 8;
        const uint8_t* qs = src + 8;
        for (int j = 0; j < 8; ++j) {
          const int low = (src[4 + j / 2] >> (4 * (j % 2))) & 0xF;
          const int high = (sh >> (2 * j)) & 3;
          put_factored(f, b, 8, j, d, (low | (high << 4)) - 32, scale);
          for (int l = 0; l < 16; ++l) {
            qb[32 * j + l] = iq4_value(qs[16 * j + l]);
            qb[32 * j + 16 + l] = iq4_value(qs[16 * j + l] >> 4);
          }
        }
        break;
      }
      case kGgmlQ4_K:
      case kGgmlQ5_K: {
        // f16 d, f16 dmin, 12 bytes of scales/mins, [Q5_K: 32 bytes of 5th bits], 128 bytes of
        // nibbles: each 32 bytes hold sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles).
        // y = (d * sc) * q - dmin * m.
        const float d = half(src), dmin = half(src + 2);
        const uint8_t* sc = src + 4;
        const uint8_t* qh = src + 16;
        const uint8_t* qs = src + (type == kGgmlQ4_K ? 16 : 48);
        for (int p = 0; p < 4; ++p) {
          for (int h = 0; h < 2; ++h) {
            const int j = 2 * p + h;
            uint8_t s6, m6;
            scale_min_k4(j, sc, &s6, &m6);
            put_factored(f, b, 8, j, d, s6, scale);
            put_factored_min(f, b, 8, j, dmin, m6, min);
            for (int l = 0; l < 32; ++l) {
              int v = h ? qs[32 * p + l] >> 4 : qs[32 * p + l] & 0xF;
              if (type == kGgmlQ5_K && (qh[l] >> j) & 1) v += 16;
              qb[32 * j + l] = static_cast<uint8_t>(v);
            }
          }
        }
        break;
      }
      case kGgmlQ6_K: {
        // 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d. Per 128-element half
        // n: element l + 32 t (t < 4) takes low bits from ql[64 n + l + 32 (t & 1)] (nibble t >> 1)
        // and high bits from qh[32 n + l] bits 2t..2t+1; sub-block of 16 e uses scales[e / 16].
        // y = (d * sc) * (q - 32).
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = half(src + 208);
        for (int n = 0; n < 2; ++n)
          for (int t = 0; t < 4; ++t)
            for (int l = 0; l < 32; ++l) {
              const uint8_t lo = ql[64 * n + l + 32 * (t & 1)];
              const int low = (t >> 1) ? lo >> 4 : lo & 0xF;
              const int high = (qh[32 * n + l] >> (2 * t)) & 3;
              qb[128 * n + 32 * t + l] = static_cast<uint8_t>(low | (high << 4));
            }
        for (int s = 0; s < 16; ++s) put_factored(f, b, 16, s, d, sc[s], scale);
        break;
      }
      default: FANTAI_THROW("GGUF type " << type << " is not a block format");
    }
  }
  (void)zero;
}

float deq(float s, int qz, const float* min, int64_t i) {
  // The product is rounded to f32 before the add (volatile keeps the compiler from fusing).
  volatile float v = s * static_cast<float>(qz);
  return min ? v + min[i] : v;
}

}  // namespace

bool ggml_is_float(int32_t t) { return t == kGgmlF32 || t == kGgmlF16 || t == kGgmlBF16; }
bool ggml_is_quant(int32_t t) {
  switch (t) {
    case kGgmlQ4_0:
    case kGgmlQ4_1:
    case kGgmlQ5_0:
    case kGgmlQ5_1:
    case kGgmlQ8_0:
    case kGgmlQ2_K:
    case kGgmlQ3_K:
    case kGgmlQ4_K:
    case kGgmlQ5_K:
    case kGgmlQ6_K:
    case kGgmlIQ4_NL:
    case kGgmlIQ4_XS: return true;
  }
  return false;
}

const char* ggml_format_name(int32_t t) {
  switch (t) {
    case kGgmlF32: return "f32";
    case kGgmlF16: return "f16";
    case kGgmlBF16: return "bf16";
    case kGgmlQ4_0: return "q4_0";
    case kGgmlQ4_1: return "q4_1";
    case kGgmlQ5_0: return "q5_0";
    case kGgmlQ5_1: return "q5_1";
    case kGgmlQ8_0: return "q8_0";
    case kGgmlQ2_K: return "q2_k";
    case kGgmlQ3_K: return "q3_k";
    case kGgmlQ4_K: return "q4_k";
    case kGgmlQ5_K: return "q5_k";
    case kGgmlQ6_K: return "q6_k";
    case kGgmlIQ4_NL: return "iq4_nl";
    case kGgmlIQ4_XS: return "iq4_xs";
  }
  block_info(t);  // throws the message listing the supported types
  return "?";
}

size_t ggml_tensor_bytes(int32_t type, int64_t rows, int64_t cols) {
  const BlockInfo bi = block_info(type);
  FANTAI_REQUIRE(rows > 0 && cols > 0, "GGUF tensor: bad shape [" << rows << ", " << cols << "]");
  FANTAI_REQUIRE(cols % bi.elems == 0, "GGUF " << ggml_format_name(type) << " tensor: row length " << cols
                                               << " is not a multiple of the block size " << bi.elems);
  return static_cast<size_t>(rows) * static_cast<size_t>(cols / bi.elems * bi.bytes);
}

QuantMatrix QuantTensor::view() const {
  QuantMatrix m;
  m.bits = bits;
  m.group = group;
  m.rows = rows;
  m.cols = cols;
  m.layout = 0;
  m.ld = cols;
  m.data = q.data();
  m.scale = scale.data();
  m.zero = zero.empty() ? nullptr : zero.data();
  m.zero_point = zero_point;
  m.min = min.empty() ? nullptr : min.data();
  m.perm = perm.empty() ? nullptr : perm.data();
  if (fgroups > 0) {
    m.fgroups = fgroups;
    m.fscale = fscale.data();
    m.iscale = iscale.data();
    m.fmin = fmin.empty() ? nullptr : fmin.data();
    m.imin = imin.empty() ? nullptr : imin.data();
  }
  return m;
}

QuantTensor ggml_decode(const void* data, size_t nbytes, int32_t type, int64_t rows, int64_t cols,
                        const int32_t* row_perm) {
  FANTAI_REQUIRE(ggml_is_quant(type),
                 "GGUF type " << ggml_format_name(type) << " is not a quantized block format");
  const size_t want = ggml_tensor_bytes(type, rows, cols);
  FANTAI_REQUIRE(nbytes == want, "GGUF " << ggml_format_name(type) << " tensor [" << rows << ", " << cols
                                         << "] needs " << want << " bytes, got " << nbytes);
  QuantTensor t;
  t.rows = rows;
  t.cols = cols;
  t.format = ggml_format_name(type);
  const Canonical c = canonical_of(type);
  t.bits = c.bits;
  t.group = c.group;
  t.zero_point = c.zero_point;
  const int64_t ng = cols / t.group;
  const bool has_min = c.has_min;
  t.q.resize(static_cast<size_t>(rows * cols));
  t.scale.resize(static_cast<size_t>(rows * ng));
  if (has_min) t.min.resize(static_cast<size_t>(rows * ng));
  t.fgroups = factor_groups(type);
  const int64_t nsup = t.fgroups ? ng / t.fgroups : 0;
  if (t.fgroups) {
    t.fscale.resize(static_cast<size_t>(rows * nsup));
    t.iscale.resize(static_cast<size_t>(rows * ng));
    if (has_min) {
      t.fmin.resize(static_cast<size_t>(rows * nsup));
      t.imin.resize(static_cast<size_t>(rows * ng));
    }
  }
  const size_t row_bytes = want / static_cast<size_t>(rows);
  const uint8_t* src = static_cast<const uint8_t*>(data);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = row_perm ? row_perm[r] : r;
    FANTAI_REQUIRE(s >= 0 && s < rows, "row_perm[" << r << "] = " << s << " is outside [0, " << rows << ")");
    RowFactors f;
    if (t.fgroups) {
      f.fscale = t.fscale.data() + r * nsup;
      f.iscale = t.iscale.data() + r * ng;
      if (has_min) {
        f.fmin = t.fmin.data() + r * nsup;
        f.imin = t.imin.data() + r * ng;
      }
    }
    decode_row(type, src + static_cast<size_t>(s) * row_bytes, cols, t.q.data() + r * cols,
               t.scale.data() + r * ng, nullptr, has_min ? t.min.data() + r * ng : nullptr, f);
  }
  // A NaN or infinite block scale (a corrupt or hostile file) would poison every logit downstream.
  for (size_t i = 0; i < t.scale.size(); ++i) {
    FANTAI_REQUIRE(std::isfinite(t.scale[i]) && (t.min.empty() || std::isfinite(t.min[i])),
                   "GGUF " << t.format << " tensor [" << rows << ", " << cols << "]: block " << i % ng
                           << " of row " << i / ng << " has a non-finite scale or minimum");
  }
  return t;
}

void ggml_to_f32(const void* data, size_t nbytes, int32_t type, int64_t rows, int64_t cols,
                 const int32_t* row_perm, float* out) {
  const size_t want = ggml_tensor_bytes(type, rows, cols);
  FANTAI_REQUIRE(nbytes == want, "GGUF " << ggml_format_name(type) << " tensor [" << rows << ", " << cols
                                         << "] needs " << want << " bytes, got " << nbytes);
  if (ggml_is_float(type)) {
    const DType dt = type == kGgmlF32 ? DType::kF32 : type == kGgmlF16 ? DType::kF16 : DType::kBF16;
    const size_t row_bytes = want / static_cast<size_t>(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = row_perm ? row_perm[r] : r;
      FANTAI_REQUIRE(s >= 0 && s < rows,
                     "row_perm[" << r << "] = " << s << " is outside [0, " << rows << ")");
      convert_to_f32(static_cast<const char*>(data) + static_cast<size_t>(s) * row_bytes, dt, out + r * cols,
                     static_cast<size_t>(cols));
    }
    return;
  }
  const QuantTensor t = ggml_decode(data, nbytes, type, rows, cols, row_perm);
  dequantize(t.view(), out);
}

QuantTensor quantize_rtn(const float* w, int64_t rows, int64_t cols, int32_t bits, int32_t group,
                         bool symmetric) {
  FANTAI_REQUIRE(bits == 4 || bits == 8, "quantize: bits must be 4 or 8, got " << bits);
  FANTAI_REQUIRE(rows > 0 && cols > 0, "quantize: bad shape [" << rows << ", " << cols << "]");
  if (group <= 0 || group > cols) group = static_cast<int32_t>(cols);
  QuantTensor t;
  t.bits = bits;
  t.group = group;
  t.rows = rows;
  t.cols = cols;
  const int64_t ng = (cols + group - 1) / group;
  t.q.resize(static_cast<size_t>(rows * cols));
  t.scale.resize(static_cast<size_t>(rows * ng));
  t.zero.resize(static_cast<size_t>(rows * ng));
  const int qmax_sym = (1 << (bits - 1)) - 1, qmax = (1 << bits) - 1, mid = 1 << (bits - 1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t c0 = g * group, c1 = std::min<int64_t>(c0 + group, cols);
      const float* x = w + r * cols;
      float s;
      int zero;
      if (symmetric) {
        float amax = 0.f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[c]));
        s = amax / static_cast<float>(qmax_sym);
        if (s == 0.f) s = 1.f;
        zero = mid;
      } else {
        float lo = 0.f, hi = 0.f;
        for (int64_t c = c0; c < c1; ++c) lo = std::min(lo, x[c]), hi = std::max(hi, x[c]);
        s = (hi - lo) / static_cast<float>(qmax);
        if (hi == lo) s = 1.f;
        zero = static_cast<int>(std::clamp(std::nearbyint(-lo / s), 0.f, static_cast<float>(qmax)));
      }
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::nearbyint(x[c] / s);
        const int q = symmetric ? static_cast<int>(std::clamp(v, static_cast<float>(-qmax_sym),
                                                              static_cast<float>(qmax_sym))) +
                                      mid
                                : static_cast<int>(std::clamp(v + static_cast<float>(zero), 0.f,
                                                              static_cast<float>(qmax)));
        t.q[r * cols + c] = static_cast<uint8_t>(q);
      }
      t.scale[r * ng + g] = s;
      t.zero[r * ng + g] = static_cast<uint8_t>(zero);
    }
  return t;
}

void dequantize(const QuantMatrix& m, float* out) {
  FANTAI_REQUIRE(m.layout == 0 && m.group > 0 && m.data && m.scale, "dequantize: needs a canonical matrix");
  const int64_t ng = m.ngroups();
  const uint8_t* q = static_cast<const uint8_t*>(m.data);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const int64_t i = r * ng + c / m.group;
      const int z = m.zero ? m.zero[i] : m.zero_point;
      out[r * m.cols + (m.perm ? m.perm[c] : c)] = deq(m.scale[i], q[r * m.ld + c] - z, m.min, i);
    }
}

}  // namespace fantai::model
