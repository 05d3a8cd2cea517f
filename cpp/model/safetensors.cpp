// model: safetensors reader (memory-mapped; tensors are converted one at a time into Weights).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/check.h"
#include "common/logging.h"
#include "model/weights.h"

namespace fantai::model {
namespace {

using nlohmann::json;

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY);
    FANTAI_REQUIRE(fd_ >= 0, "cannot open " << path);
    struct stat st;
    ::fstat(fd_, &st);
    size_ = static_cast<size_t>(st.st_size);
    data_ = size_ ? ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0) : nullptr;
    FANTAI_REQUIRE(data_ != MAP_FAILED, "cannot mmap " << path);
  }
  ~MappedFile() {
    if (data_ && data_ != MAP_FAILED) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
  }
  const char* data() const { return static_cast<const char*>(data_); }
  size_t size() const { return size_; }

 private:
  int fd_ = -1;
  void* data_ = nullptr;
  size_t size_ = 0;
};

DType safetensors_dtype(const std::string& s, const std::string& name) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  FANTAI_THROW("tensor " << name << " has dtype " << s << "; supported: F32, F16, BF16");
}

void load_file(const std::string& path, Weights* weights) {
  MappedFile file(path);
  FANTAI_REQUIRE(file.size() >= 8, path << " is not a safetensors file");
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  FANTAI_REQUIRE(8 + header_len <= file.size(), path << " has a truncated header");
  json header = json::parse(std::string(file.data() + 8, header_len));
  const char* base = file.data() + 8 + header_len;
  const size_t payload = file.size() - 8 - header_len;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    auto offsets = info["data_offsets"].get<std::vector<uint64_t>>();
    FANTAI_REQUIRE(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= payload,
                   "tensor " << name << " in " << path << " points outside the file");
    std::vector<int64_t> shape = info["shape"].get<std::vector<int64_t>>();
    const std::string dt = info["dtype"].get<std::string>();
    if (name.find("rotary_emb") != std::string::npos) continue;  // recomputed from config
    const char* begin = base + offsets[0];
    weights->set(name, begin, safetensors_dtype(dt, name), shape);
    // Drop the mapped pages once copied so a large checkpoint never doubles resident memory.
    const uintptr_t page_start = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{4095};
    const uintptr_t end = reinterpret_cast<uintptr_t>(base + offsets[1]);
    if (end > page_start) ::madvise(reinterpret_cast<void*>(page_start), end - page_start, MADV_DONTNEED);
  }
}

}  // namespace

void load_safetensors_dir(const std::string& dir, Weights* weights) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream f(index);
    json j = json::parse(f);
    std::set<std::string> unique;
    for (auto& [name, file] : j["weight_map"].items()) unique.insert(file.get<std::string>());
    for (const auto& f2 : unique) files.push_back((fs::path(dir) / f2).string());
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    files.push_back((fs::path(dir) / "model.safetensors").string());
  } else {
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    }
  }
  FANTAI_REQUIRE(!files.empty(), "no .safetensors files in " << dir);
  for (const auto& f : files) load_file(f, weights);
}

}  // namespace fantai::model
