// cpu: packing of quantized matrices into the CPU layouts (row-major f32-scale layout and the
// 16-row panels of the int8-activation kernels), and reading one row back out of a panel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/types.h"
#include "cpu/qkernels.h"

namespace fantai::cpu {
namespace {

size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

int64_t packed_ld(int32_t bits, int64_t cols) {
  return bits == 8 ? (cols + 15) / 16 * 16 : (cols + 31) / 32 * 16;
}

// Whether every group of the canonical matrix has the same zero (so one constant replaces the
// array); sets *value to it.
bool uniform_zero(const QuantMatrix& m, int32_t* value) {
  if (!m.zero) {
    *value = m.zero_point;
    return true;
  }
  const int64_t n = m.rows * m.ngroups();
  for (int64_t i = 1; i < n; ++i)
    if (m.zero[i] != m.zero[0]) return false;
  *value = m.zero[0];
  return true;
}

struct Offsets {
  size_t scale, zero, min, perm, total;
  size_t fscale = 0, fmin = 0;  // the sub-scale panel layout's super-block factors
  size_t codebook = 0;          // the panel layout's 16 levels when its values are indices
};

Offsets packed_offsets(const QuantMatrix& m) {
  const size_t ng = static_cast<size_t>(m.rows * m.ngroups());
  int32_t zp;
  Offsets o;
  size_t at = align64(static_cast<size_t>(m.rows * packed_ld(m.bits, m.cols)));
  o.scale = at;
  at = align64(at + ng * sizeof(float));
  o.zero = at;
  if (!uniform_zero(m, &zp)) at = align64(at + ng);
  o.min = at;
  if (m.min) at = align64(at + ng * sizeof(float));
  o.perm = at;
  if (m.perm) at = align64(at + static_cast<size_t>(m.cols) * sizeof(int32_t));
  o.total = at;
  return o;
}

}  // namespace

size_t cpu_quant_packed_bytes(const QuantMatrix& m) {
  check_quant_matrix(m);
  return packed_offsets(m).total;
}

QuantMatrix cpu_pack_quant(const QuantMatrix& m, void* dst) {
  check_quant_matrix(m);
  const Offsets o = packed_offsets(m);
  char* base = static_cast<char*>(dst);
  std::memset(base, 0, o.total);
  QuantMatrix p = m;
  p.layout = kCpuQuantLayout;
  p.ld = packed_ld(m.bits, m.cols);
  p.fgroups = 0;  // f32 products only: the factors are the canonical form's host memory
  p.fscale = p.fmin = nullptr;
  p.iscale = p.imin = nullptr;
  const uint8_t* q = static_cast<const uint8_t*>(m.data);
  uint8_t* out = reinterpret_cast<uint8_t*>(base);
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* src = q + r * m.ld;
    uint8_t* row = out + r * p.ld;
    if (m.bits == 8) {
      std::memcpy(row, src, static_cast<size_t>(m.cols));
    } else {
      for (int64_t c = 0; c < m.cols; ++c) {
        const int64_t b = c / 32, i = c % 32;
        row[b * 16 + (i & 15)] |= static_cast<uint8_t>(src[c] << (i < 16 ? 0 : 4));
      }
    }
  }
  const size_t ng = static_cast<size_t>(m.rows * m.ngroups());
  std::memcpy(base + o.scale, m.scale, ng * sizeof(float));
  p.scale = reinterpret_cast<const float*>(base + o.scale);
  int32_t zp = 0;
  if (uniform_zero(m, &zp)) {
    p.zero = nullptr;
    p.zero_point = zp;
  } else {
    std::memcpy(base + o.zero, m.zero, ng);
    p.zero = reinterpret_cast<const uint8_t*>(base + o.zero);
    p.zero_point = 0;
  }
  if (m.min) {
    std::memcpy(base + o.min, m.min, ng * sizeof(float));
    p.min = reinterpret_cast<const float*>(base + o.min);
  }
  if (m.perm) {
    std::memcpy(base + o.perm, m.perm, static_cast<size_t>(m.cols) * sizeof(int32_t));
    p.perm = reinterpret_cast<const int32_t*>(base + o.perm);
  }
  p.data = base;
  return p;
}

// ---- panel layout (int8 activations) ----------------------------------------------------------------

namespace {

// How the panels keep the values (m.bits of the packed matrix is `bits`): the narrowest of 2, 3, 4,
// a 16-entry codebook, 5, 6 and 8 bits that holds every value. GGUF's 2- and 3-bit formats reach
// the packer as nibbles and its 5- and 6-bit ones as bytes (the canonical form has only 4 and 8),
// and IQ4's non-linear levels as bytes of up to 16 distinct values, so the form is read from the
// values, as the scale modes are.
struct PanelValues {
  int32_t bits = 8;
  bool codebook = false;  // 4-bit indices into code (ascending distinct values; unused entries 0)
  uint8_t code[16] = {};
  uint8_t nibble[256] = {};  // the low 4 bits kept for each byte value (its index with a codebook)
};

PanelValues panel_values(const QuantMatrix& m) {
  PanelValues v;
  for (int i = 0; i < 256; ++i) v.nibble[i] = static_cast<uint8_t>(i & 15);
  const uint8_t* q = static_cast<const uint8_t*>(m.data);
  uint8_t any = 0;  // every bit any value sets
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* row = q + r * m.ld;
    for (int64_t c = 0; c < m.cols; ++c) any |= row[c];
  }
  if (m.bits == 4 || any < 16) {
    v.bits = any < 4 ? 2 : any < 8 ? 3 : 4;
    return v;
  }
  v.bits = any < 32 ? 5 : any < 64 ? 6 : 8;
  // The distinct values, given up at the 17th: this runs over every weight at load, and a byte or
  // 5- / 6-bit matrix shows 17 values within its first few dozen.
  bool seen[256] = {};
  int distinct = 0;
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* row = q + r * m.ld;
    for (int64_t c = 0; c < m.cols; ++c) {
      if (seen[row[c]]) continue;
      seen[row[c]] = true;
      if (++distinct > 16) return v;
    }
  }
  v.bits = 4;
  v.codebook = true;
  int n = 0;
  for (int i = 0; i < 256; ++i)
    if (seen[i]) {
      v.nibble[i] = static_cast<uint8_t>(n);
      v.code[n++] = static_cast<uint8_t>(i);
    }
  return v;
}

// Bytes of group g of one panel at value width `bits`: whole steps (4, 8 or 16 columns, see
// qkernels.h) of 64 bytes and their bit planes.
int64_t panel_group_bytes(const QuantMatrix& m, int32_t bits, int64_t g) {
  const int64_t len = std::min<int64_t>(m.group, m.cols - g * m.group);
  return (len + panel_step_cols(bits) - 1) / panel_step_cols(bits) * panel_step_bytes(bits);
}

int64_t panel_ld(const QuantMatrix& m, int32_t bits) {
  const int64_t ng = m.ngroups();
  return (ng - 1) * panel_group_bytes(m, bits, 0) + panel_group_bytes(m, bits, ng - 1);
}

// Whether v is exactly an f16 value, from its bits (a round trip per scale was a measurable part
// of start-up): normal f16 keep 10 mantissa bits; subnormals (2^-24 .. 2^-15) fewer.
bool is_half(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127;
  const uint32_t man = u & 0x7fffffu;
  if (e == -127) return man == 0;       // zero (f32 subnormals are below f16's smallest)
  if (e > 15 || e < -24) return false;  // also inf/NaN
  const int drop = e >= -14 ? 13 : 13 + (-14 - e);
  return (man & ((1u << drop) - 1u)) == 0;
}

// Whether every scale and min survives a round trip through f16.
bool half_scales(const QuantMatrix& m) {
  const int64_t n = m.rows * m.ngroups();
  for (int64_t i = 0; i < n; ++i)
    if (!is_half(m.scale[i]) || (m.min && !is_half(m.min[i]))) return false;
  return true;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Whether the matrix's factoring (QuantMatrix::fgroups) can replace its scales: complete, every
// factor an f16 value, and each product exactly the scale (or min) it stands for.
bool sub_scales(const QuantMatrix& m) {
  const int64_t ng = m.ngroups();
  if (m.fgroups <= 0 || ng % m.fgroups != 0 || !m.fscale || !m.iscale) return false;
  if (m.min && (!m.fmin || !m.imin)) return false;
  const int64_t nsup = ng / m.fgroups;
  for (int64_t i = 0; i < m.rows * nsup; ++i)
    if (!is_half(m.fscale[i]) || (m.min && !is_half(m.fmin[i]))) return false;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t i = r * ng + g, si = r * nsup + g / m.fgroups;
      if (!same_bits(m.scale[i], m.fscale[si] * static_cast<float>(m.iscale[i]))) return false;
      if (m.min && !same_bits(m.min[i], m.fmin[si] * static_cast<float>(m.imin[i]))) return false;
    }
  return true;
}

// Whether factored 2-bit values' sub-scales and sub-mins all fit a nibble (Q2_K's do): only then
// the nibble mode, which the kernels instantiate for 2-bit values with a min alone.
bool nibble_sub_scales(const QuantMatrix& m, const PanelValues& pv) {
  if (pv.bits != 2 || !m.min) return false;
  const int64_t n = m.rows * m.ngroups();
  for (int64_t i = 0; i < n; ++i)
    if (m.iscale[i] < 0 || m.iscale[i] > 15 || m.imin[i] < 0 || m.imin[i] > 15) return false;
  return true;
}

int panel_mode(const QuantMatrix& m, const PanelValues& pv) {
  if (sub_scales(m)) return nibble_sub_scales(m, pv) ? kScaleSubNibble : kScaleSub;
  return half_scales(m) ? kScaleF16 : kScaleF32;
}

Offsets panel_offsets(const QuantMatrix& m, const PanelValues& pv, int mode) {
  const int32_t bits = pv.bits;
  const int64_t panels = (m.rows + 15) / 16;
  const size_t n = static_cast<size_t>(panels * m.ngroups() * 16);
  const size_t es = mode == kScaleF32 ? 4 : mode == kScaleF16 ? 2 : 1;
  int32_t zp;
  Offsets o;
  size_t at = align64(static_cast<size_t>(panels * panel_ld(m, bits)));
  o.scale = at;
  at = align64(at + n * es);
  o.zero = at;
  if (!uniform_zero(m, &zp)) at = align64(at + n);
  o.min = mode == kScaleSubNibble ? o.scale : at;  // the scale bytes' high nibbles
  if (m.min && mode != kScaleSubNibble) at = align64(at + n * es);
  o.perm = at;
  if (m.perm) at = align64(at + static_cast<size_t>(m.cols) * sizeof(int32_t));
  if (is_sub_scale_mode(mode)) {
    const size_t nf = static_cast<size_t>(panels * (m.ngroups() / m.fgroups) * 16) * 2;
    o.fscale = at;
    at = align64(at + nf);
    o.fmin = at;
    if (m.min) at = align64(at + nf);
  }
  o.codebook = at;
  if (pv.codebook) at = align64(at + sizeof(pv.code));
  o.total = at;
  return o;
}

// The value of (row r, stored column c) of a panel matrix, from its nibble (or byte) and bit planes,
// or its codebook entry.
int panel_value(const QuantMatrix& w, int64_t r, int64_t c) {
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const int64_t g = c / w.group, cg = c - g * w.group;
  const uint8_t* base = data + (r / 16) * w.ld + g * panel_group_bytes(w, w.bits, 0);
  const int64_t lane = r % 16;
  if (w.bits == 8) return base[(cg / 4) * 64 + lane * 4 + cg % 4];
  if (w.bits < 4) {
    const int64_t t = cg / 16, s = cg % 16 / 4, i = cg % 4;
    int q = (base[t * 64 + lane * 4 + i] >> (2 * s)) & 3;
    if (w.bits == 3) {
      const int64_t len = std::min<int64_t>(w.group, w.cols - g * w.group);
      const uint8_t* plane = base + panel_planes_at(3, len) + t * panel_plane_bytes(3);
      const int64_t j = lane * 4 + i;  // the step byte
      q |= ((plane[j % 32] >> (4 * (j / 32) + s)) & 1) << 2;
    }
    return q;
  }
  const int64_t j = cg % 8, t = cg / 8;
  const uint8_t b = base[t * 64 + lane * 4 + j % 4];
  int q = j >= 4 ? b >> 4 : b & 15;
  if (w.bits > 4) {
    const int64_t len = std::min<int64_t>(w.group, w.cols - g * w.group);
    const uint8_t* planes = base + (len + 7) / 8 * 64 + t * panel_plane_bytes(w.bits);
    const int64_t bit = lane * 4 + j % 4;  // of the step's low- or high-nibble word
    for (int i = 0; i < w.bits - 4; ++i) {
      const uint8_t* word = planes + 16 * i + (j >= 4 ? 8 : 0);
      q |= ((word[bit / 8] >> (bit % 8)) & 1) << (4 + i);
    }
  }
  return w.codebook ? w.codebook[q] : q;
}

}  // namespace

size_t cpu_quant_panel_bytes(const QuantMatrix& m) {
  check_quant_matrix(m);
  const PanelValues pv = panel_values(m);
  return panel_offsets(m, pv, panel_mode(m, pv)).total;
}

QuantMatrix cpu_pack_quant_panel(const QuantMatrix& m, void* dst) {
  check_quant_matrix(m);
  const PanelValues pv = panel_values(m);
  const int mode = panel_mode(m, pv);
  const int32_t bits = pv.bits;
  const bool half = mode == kScaleF16, sub = is_sub_scale_mode(mode), nib = mode == kScaleSubNibble;
  const Offsets o = panel_offsets(m, pv, mode);
  char* base = static_cast<char*>(dst);
  std::memset(base, 0, o.total);
  QuantMatrix p = m;
  p.layout = nib    ? kCpuQuantPanelSubNibbleLayout
             : sub  ? kCpuQuantPanelSubLayout
             : half ? kCpuQuantPanelHalfLayout
                    : kCpuQuantPanelLayout;
  p.fgroups = sub ? m.fgroups : 0;
  p.fscale = p.fmin = nullptr;
  p.iscale = p.imin = nullptr;
  p.bits = bits;
  p.ld = panel_ld(m, bits);
  uint8_t* out = reinterpret_cast<uint8_t*>(base);
  const uint8_t* q = static_cast<const uint8_t*>(m.data);
  const int64_t ng = m.ngroups(), gb0 = panel_group_bytes(m, bits, 0);
  const int64_t pb = panel_plane_bytes(bits);
  // Walks panel_value's layout a step (4 or 8 columns) at a time: this runs over every weight at
  // load, and per-element divisions made it most of the start-up time.
  for (int64_t r = 0; r < m.rows; ++r) {
    const uint8_t* qr = q + r * m.ld;
    uint8_t* lane = out + (r / 16) * p.ld + (r % 16) * 4;
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t c0 = g * m.group, len = std::min<int64_t>(m.group, m.cols - c0);
      const uint8_t* qg = qr + c0;
      uint8_t* dg = lane + g * gb0;
      if (bits == 8) {
        for (int64_t c = 0; c < len; ++c) dg[(c >> 2) * 64 + (c & 3)] = qg[c];
      } else if (bits < 4) {
        // Column c of step c / 16: bits 2 (c % 16 / 4) of lane byte c % 4; 3-bit: bit 2 to bit
        // 4 (j / 32) + c % 16 / 4 of the step's plane byte j % 32, j = 4l + c % 4 the step byte.
        const int64_t lb = (r % 16) * 4;
        uint8_t* planes = out + (r / 16) * p.ld + g * gb0 + panel_planes_at(bits, len);
        for (int64_t c = 0; c < len; ++c) {
          dg[(c >> 4) * 64 + (c & 3)] |= static_cast<uint8_t>((qg[c] & 3) << (2 * ((c >> 2) & 3)));
          if (bits == 3) {
            const int64_t j = lb + (c & 3);
            planes[(c >> 4) * pb + (j & 31)] |= static_cast<uint8_t>(((qg[c] >> 2) & 1)
                                                                     << (4 * (j >> 5) + ((c >> 2) & 3)));
          }
        }
      } else {
        int64_t c = 0;
        for (; c + 8 <= len; c += 8) {
          uint8_t* d = dg + (c >> 3) * 64;
          for (int j = 0; j < 4; ++j)
            d[j] = static_cast<uint8_t>(pv.nibble[qg[c + j]] | (pv.nibble[qg[c + 4 + j]] << 4));
        }
        for (; c < len; ++c)
          dg[(c >> 3) * 64 + (c & 3)] |= static_cast<uint8_t>(pv.nibble[qg[c]] << ((c & 7) >= 4 ? 4 : 0));
        if (bits > 4) {
          // Bit 4 + i of lane l's column c of step t: bit 4l + c % 4 of plane i's low-nibble word
          // (c % 8 < 4) or high-nibble word; the planes follow the group's nibble steps.
          const int64_t lb = (r % 16) * 4;
          uint8_t* planes = out + (r / 16) * p.ld + g * gb0 + (len + 7) / 8 * 64;
          for (c = 0; c < len; ++c) {
            const int64_t bit = lb + (c & 3);
            uint8_t* word = planes + (c >> 3) * pb + ((c & 7) >= 4 ? 8 : 0);
            for (int i = 0; i < bits - 4; ++i)
              word[16 * i + bit / 8] |= static_cast<uint8_t>(((qg[c] >> (4 + i)) & 1) << (bit % 8));
          }
        }
      }
    }
  }
  int32_t zp = 0;
  const bool uniform = uniform_zero(m, &zp);
  uint8_t* zero = uniform ? nullptr : reinterpret_cast<uint8_t*>(base + o.zero);
  auto put = [&](size_t region, size_t at, float v) {
    if (half) {
      const uint16_t h = f32_to_f16(v);
      std::memcpy(base + region + at * 2, &h, 2);
    } else {
      std::memcpy(base + region + at * 4, &v, 4);
    }
  };
  const int64_t nsup = sub ? ng / m.fgroups : 0;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const size_t at = static_cast<size_t>(((r / 16) * ng + g) * 16 + r % 16);
      if (nib) {
        base[o.scale + at] = static_cast<char>(m.iscale[r * ng + g] | (m.imin[r * ng + g] << 4));
      } else if (sub) {
        base[o.scale + at] = static_cast<char>(m.iscale[r * ng + g]);
        if (m.min) base[o.min + at] = static_cast<char>(m.imin[r * ng + g]);
      } else {
        put(o.scale, at, m.scale[r * ng + g]);
        if (m.min) put(o.min, at, m.min[r * ng + g]);
      }
      if (zero) zero[at] = m.zero[r * ng + g];
    }
  if (sub) {
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t s = 0; s < nsup; ++s) {
        const size_t at = static_cast<size_t>(((r / 16) * nsup + s) * 16 + r % 16);
        const uint16_t h = f32_to_f16(m.fscale[r * nsup + s]);
        std::memcpy(base + o.fscale + at * 2, &h, 2);
        if (m.min) {
          const uint16_t hm = f32_to_f16(m.fmin[r * nsup + s]);
          std::memcpy(base + o.fmin + at * 2, &hm, 2);
        }
      }
    p.fscale = reinterpret_cast<const float*>(base + o.fscale);
    p.iscale = reinterpret_cast<const int8_t*>(base + o.scale);
    if (m.min) {
      p.fmin = reinterpret_cast<const float*>(base + o.fmin);
      p.imin = reinterpret_cast<const int8_t*>(base + o.min);
    }
  }
  p.scale = reinterpret_cast<const float*>(base + o.scale);
  p.min = m.min ? reinterpret_cast<const float*>(base + o.min) : nullptr;
  p.zero = zero;
  p.zero_point = uniform ? zp : 0;
  if (m.perm) {
    std::memcpy(base + o.perm, m.perm, static_cast<size_t>(m.cols) * sizeof(int32_t));
    p.perm = reinterpret_cast<const int32_t*>(base + o.perm);
  }
  if (pv.codebook) {
    std::memcpy(base + o.codebook, pv.code, sizeof(pv.code));
    p.codebook = reinterpret_cast<const uint8_t*>(base + o.codebook);
  }
  p.data = base;
  return p;
}

float panel_scale_at(const QuantMatrix& w, bool of_min, int64_t r, int64_t g) {
  const int64_t ng = w.ngroups();
  const size_t i = static_cast<size_t>(((r / 16) * ng + g) * 16 + r % 16);
  const float* a = of_min ? w.min : w.scale;
  switch (panel_scale_mode(w.layout)) {
    case kScaleF16: return f16_to_f32(reinterpret_cast<const uint16_t*>(a)[i]);
    case kScaleSub:
    case kScaleSubNibble: {
      const int64_t nsup = ng / w.fgroups;
      const size_t si = static_cast<size_t>(((r / 16) * nsup + g / w.fgroups) * 16 + r % 16);
      const float f = f16_to_f32(reinterpret_cast<const uint16_t*>(of_min ? w.fmin : w.fscale)[si]);
      int sub = (of_min ? w.imin : w.iscale)[i];
      if (panel_scale_mode(w.layout) == kScaleSubNibble)
        sub = (static_cast<uint8_t>(sub) >> (of_min ? 4 : 0)) & 15;
      return f * static_cast<float>(sub);
    }
    default: return a[i];
  }
}

void panel_dequant_row(const QuantMatrix& w, int64_t r, float* out) {
  const int64_t ng = w.ngroups();
  for (int64_t c = 0; c < w.cols; ++c) {
    const int q = panel_value(w, r, c);
    const int64_t g = c / w.group;
    const size_t i = static_cast<size_t>(((r / 16) * ng + g) * 16 + r % 16);
    const int z = w.zero ? w.zero[i] : w.zero_point;
    volatile float v = panel_scale_at(w, false, r, g) * static_cast<float>(q - z);
    out[c] = w.min ? v + panel_scale_at(w, true, r, g) : v;
  }
}

}  // namespace fantai::cpu
