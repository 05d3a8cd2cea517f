// common: check_quant_matrix, the one validation of a canonical quantized matrix, and the grouping
// of a mixture-of-experts step's rows by expert.
#include "common/op_types.h"

#include <algorithm>
#include <vector>

#include "common/check.h"

namespace fantai {

void check_quant_matrix(const QuantMatrix& m) {
  FANTAI_REQUIRE(m.layout == 0, "quantized matrix: expected the canonical layout");
  FANTAI_REQUIRE(!m.codebook, "quantized matrix: a canonical matrix holds its values, not codebook indices");
  FANTAI_REQUIRE(m.bits == 4 || m.bits == 8, "quantized matrix: bits must be 4 or 8, got " << m.bits);
  FANTAI_REQUIRE(m.rows > 0 && m.cols > 0,
                 "quantized matrix: bad shape [" << m.rows << ", " << m.cols << "]");
  FANTAI_REQUIRE(m.group > 0 && (m.group % 16 == 0 || m.group >= m.cols),
                 "quantized matrix: group " << m.group << " must be a multiple of 16 or cover all " << m.cols
                                            << " columns");
  FANTAI_REQUIRE(m.data && m.scale, "quantized matrix: q and scale are required");
  FANTAI_REQUIRE(m.ld >= m.cols, "quantized matrix: row stride " << m.ld << " < cols " << m.cols);
  FANTAI_REQUIRE(m.zero_point >= 0 && m.zero_point < (1 << m.bits),
                 "quantized matrix: zero point out of range");
  if (m.bits == 4) {
    const uint8_t* q = static_cast<const uint8_t*>(m.data);
    uint8_t any = 0;
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = 0; c < m.cols; ++c) any |= q[r * m.ld + c];
    FANTAI_REQUIRE(any < 16, "quantized matrix: 4-bit q values must be < 16");
    if (m.zero) {
      uint8_t z = 0;
      for (int64_t i = 0; i < m.rows * m.ngroups(); ++i) z |= m.zero[i];
      FANTAI_REQUIRE(z < 16, "quantized matrix: 4-bit zero points must be < 16");
    }
  }
  if (m.perm) {
    std::vector<char> seen(static_cast<size_t>(m.cols), 0);
    for (int64_t c = 0; c < m.cols; ++c) {
      const int32_t p = m.perm[c];
      FANTAI_REQUIRE(p >= 0 && p < m.cols && !seen[p],
                     "quantized matrix: perm is not a permutation of [0, " << m.cols << ")");
      seen[p] = 1;
    }
  }
}

void moe_group_slots(const int32_t* ids, int64_t rows, int32_t top_k, int32_t num_experts, int64_t* offsets,
                     int64_t* slots) {
  std::fill(offsets, offsets + num_experts + 1, int64_t{0});
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[r * top_k + j];
      FANTAI_REQUIRE(e >= 0 && e < num_experts, "moe_experts: expert id " << e << " of row " << r
                                                                          << " is outside [0, " << num_experts
                                                                          << ")");
      for (int32_t i = 0; i < j; ++i)
        FANTAI_REQUIRE(ids[r * top_k + i] != e,
                       "moe_experts: row " << r << " names expert " << e << " twice");
      ++offsets[e + 1];
    }
  for (int32_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets, offsets + num_experts);
  for (int64_t s = 0; s < rows * top_k; ++s) slots[fill[ids[s]]++] = s;  // s ascending: rows ascending
}

}  // namespace fantai
