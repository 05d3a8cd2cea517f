// backend: the registry that picks a backend by name (one of the three dispatch points).
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "common/check.h"
#include "cpu/cpu_backend.h"
#ifdef FANTAI_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace fantai {

void Communicator::all_gather(const float* in, float* out, int64_t n) {
  if (in != out) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

void check_quant_matrix(const QuantMatrix& m) {
  FANTAI_REQUIRE(m.layout == 0, "quantized matrix: expected the canonical layout");
  FANTAI_REQUIRE(m.bits == 4 || m.bits == 8, "quantized matrix: bits must be 4 or 8, got " << m.bits);
  FANTAI_REQUIRE(m.rows > 0 && m.cols > 0, "quantized matrix: bad shape [" << m.rows << ", " << m.cols << "]");
  FANTAI_REQUIRE(m.group > 0 && (m.group % 16 == 0 || m.group >= m.cols),
                 "quantized matrix: group " << m.group << " must be a multiple of 16 or cover all "
                                            << m.cols << " columns");
  FANTAI_REQUIRE(m.data && m.scale, "quantized matrix: q and scale are required");
  FANTAI_REQUIRE(m.ld >= m.cols, "quantized matrix: row stride " << m.ld << " < cols " << m.cols);
  FANTAI_REQUIRE(m.zero_point >= 0 && m.zero_point < (1 << m.bits), "quantized matrix: zero point out of range");
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
      FANTAI_REQUIRE(p >= 0 && p < m.cols && !seen[p], "quantized matrix: perm is not a permutation of [0, " << m.cols << ")");
      seen[p] = 1;
    }
  }
}

// Quantized ops are optional per backend: the defaults say so plainly.
size_t Backend::quant_packed_bytes(const QuantMatrix&) const {
  FANTAI_THROW("quantized weights are not supported on the " << name() << " backend");
}
QuantMatrix Backend::pack_quant(const QuantMatrix&, void*) {
  FANTAI_THROW("quantized weights are not supported on the " << name() << " backend");
}
void Backend::linear_q(const float*, const QuantMatrix&, const float*, float*, int64_t, int64_t) {
  FANTAI_THROW("quantized linear is not supported on the " << name() << " backend");
}
size_t Backend::dense_packed_bytes(DType, int64_t, int64_t) const { return 0; }
void Backend::pack_dense(const void*, DType, int64_t, int64_t, void*) {
  FANTAI_THROW("packed dense weights are not supported on the " << name() << " backend");
}
void Backend::linear_packed(const float*, const void*, DType, const float*, float*, int64_t, int64_t, int64_t) {
  FANTAI_THROW("packed dense weights are not supported on the " << name() << " backend");
}
bool Backend::mlp_packed(const float*, const void*, const void*, DType, float*, int64_t, int64_t, int64_t) {
  return false;
}
void Backend::embedding_q(const int32_t*, int64_t, const QuantMatrix&, float*) {
  FANTAI_THROW("quantized embedding is not supported on the " << name() << " backend");
}

bool Backend::set_matmul_precision(DType precision) {
  FANTAI_REQUIRE(precision == DType::kF32 || precision == DType::kBF16,
                 "matmul precision must be float32 or bfloat16, got " << dtype_name(precision));
  return false;
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef FANTAI_WITH_CUDA
  if (cuda::device_count() > 0) names.push_back("cuda");
#endif
  return names;
}

std::shared_ptr<Backend> create_backend(const std::string& name, int num_threads) {
  if (name == "cpu" || name.empty()) return cpu::create_cpu_backend(num_threads);
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
#ifdef FANTAI_WITH_CUDA
    int device = 0;
    if (name.size() > 5) {
      const std::string idx = name.substr(5);
      FANTAI_REQUIRE(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
                     "bad CUDA device '" << name << "' (use cuda or cuda:N)");
      device = std::stoi(idx);
    }
    return cuda::create_cuda_backend(device);
#else
    FANTAI_THROW("backend '" << name << "' is unavailable: this fantai was built without CUDA "
                             "(rebuild with nvcc on PATH, or -C cmake.define.FANTAI_CUDA=ON to require it)");
#endif
  }
  FANTAI_THROW("unknown backend '" << name << "' (known: cpu, cuda)");
}

}  // namespace fantai
