// tests: helpers the kernel test binaries share.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/cpu_features.h"

namespace fantai::test {

// Every ISA level this CPU can run, portable first: each kernel test sweeps them all.
inline std::vector<cpu::Isa> isa_levels() {
  std::vector<cpu::Isa> v;
  for (int i = 0; i <= static_cast<int>(cpu::detected_isa()); ++i) v.push_back(static_cast<cpu::Isa>(i));
  return v;
}

// n seeded normal values of standard deviation `scale`.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace fantai::test
