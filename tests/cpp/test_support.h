// tests: helpers the kernel test binaries share.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "cpu/cpu_features.h"

namespace fantai::test {

// A scratch directory under /tmp, removed with the object: the fake sysfs and cgroup trees the
// CPU topology and quota readers are tested on.
struct TempTree {
  std::filesystem::path root;
  TempTree() {
    char tmpl[] = "/tmp/fantai_tree_XXXXXX";
    root = mkdtemp(tmpl);
  }
  TempTree(const TempTree&) = delete;
  TempTree& operator=(const TempTree&) = delete;
  ~TempTree() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  // rel's file (and its directories) holding exactly text.
  void put(const std::string& rel, const std::string& text) const {
    const std::filesystem::path p = root / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
};

// An environment variable set (or unset, value nullptr) for the object's life, then put back as it
// was, also when an ASSERT returns early: the FANTAI_* switches are read when a backend is made.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    set(value);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() { set(had_ ? old_.c_str() : nullptr); }
  void set(const char* value) const {
    if (value) setenv(name_.c_str(), value, 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

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
