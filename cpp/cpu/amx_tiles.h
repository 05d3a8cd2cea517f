// cpu: the AMX tile configuration shared by the *_amx.cpp kernels. Include only from files built
// with the AMX flags, after <immintrin.h>.
#pragma once

#include <cstdint>

namespace fantai::cpu::amx {

// ldtilecfg's 64-byte operand, palette 1: per tile its bytes per row and row count.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC does not see ldtilecfg read the whole 64 bytes and may drop the colsb/rows stores before
// it (it did in the int8 kernel): the empty asm makes every store to cfg happen first.
inline __attribute__((always_inline)) void load_config(const TileConfig& cfg) {
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace fantai::cpu::amx
