// model: safetensors reader (memory-mapped; tensors are converted one at a time into Weights).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

// The safetensors format caps its JSON header at 100 MB; a larger length is a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// One tensor's entry of the header, checked against the payload: a known dtype, a shape whose
// byte size is exactly its data range, inside the file.
struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& info, uint64_t payload) {
  Entry e;
  e.name = name;
  FANTAI_REQUIRE(info.is_object() && info.contains("dtype") && info["dtype"].is_string() &&
                     info.contains("shape") && info["shape"].is_array() && info.contains("data_offsets") &&
                     info["data_offsets"].is_array(),
                 path << ": tensor " << name << " needs dtype (string), shape and data_offsets (arrays)");
  e.dtype = safetensors_dtype(info["dtype"].get<std::string>(), name);
  const json& off = info["data_offsets"];
  FANTAI_REQUIRE(off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                 path << ": tensor " << name << " data_offsets must be two unsigned integers");
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  FANTAI_REQUIRE(e.begin <= e.end && e.end <= payload,
                 path << ": tensor " << name << " data_offsets [" << e.begin << ", " << e.end
                      << "] point outside the file's " << payload << " data bytes");
  uint64_t bytes = dtype_size(e.dtype);
  FANTAI_REQUIRE(info["shape"].size() <= 8, path << ": tensor " << name << " has more than 8 dimensions");
  for (const json& d : info["shape"]) {
    FANTAI_REQUIRE(d.is_number_unsigned(), path << ": tensor " << name << " has a shape entry " << d.dump()
                                                << " that is not a non-negative integer");
    const uint64_t v = d.get<uint64_t>();
    // bytes stays <= payload, so this never overflows before it is caught
    FANTAI_REQUIRE(v == 0 || bytes <= payload / v,
                   path << ": tensor " << name << " shape is larger than the file's data");
    bytes *= v;
    e.shape.push_back(static_cast<int64_t>(v));
  }
  FANTAI_REQUIRE(bytes == e.end - e.begin, path << ": tensor " << name << " of shape " << info["shape"].dump()
                                                << " needs " << bytes << " bytes, its data_offsets give "
                                                << e.end - e.begin);
  return e;
}

void load_file(const std::string& path, Weights* weights) {
  MappedFile file(path);
  FANTAI_REQUIRE(file.size() >= 8, path << " is not a safetensors file");
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), 8);
  FANTAI_REQUIRE(header_len <= kMaxHeaderBytes && header_len <= file.size() - 8,
                 path << " has a truncated or corrupt header (length " << header_len << ")");
  json header;
  try {
    header = json::parse(std::string(file.data() + 8, header_len));
  } catch (const json::exception& e) {
    FANTAI_THROW(path << ": the safetensors header is not valid JSON (" << e.what() << ")");
  }
  FANTAI_REQUIRE(header.is_object(), path << ": the safetensors header is not a JSON object");
  const char* base = file.data() + 8 + header_len;
  const uint64_t payload = file.size() - 8 - header_len;
  std::vector<Entry> entries;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    entries.push_back(parse_entry(path, name, info, payload));
  }
  // Tensors may not share bytes: a lying header could otherwise alias one tensor into another.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    FANTAI_REQUIRE(
        by_offset[i]->begin >= by_offset[i - 1]->end || by_offset[i - 1]->begin == by_offset[i - 1]->end,
        path << ": tensors " << by_offset[i - 1]->name << " and " << by_offset[i]->name << " overlap");
  }
  for (const Entry& e : entries) {
    if (e.name.find("rotary_emb") != std::string::npos) continue;  // recomputed from config
    const char* begin = base + e.begin;
    try {
      weights->set(e.name, begin, e.dtype, e.shape);
    } catch (const InvalidArgument& err) {
      FANTAI_THROW(path << ": " << err.what());
    }
    // Drop the mapped pages once copied so a large checkpoint never doubles resident memory.
    const uintptr_t page_start = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{4095};
    const uintptr_t end = reinterpret_cast<uintptr_t>(base + e.end);
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
    json j;
    try {
      j = json::parse(f);
    } catch (const json::exception& e) {
      FANTAI_THROW(index.string() << " is not valid JSON (" << e.what() << ")");
    }
    FANTAI_REQUIRE(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                   index.string() << " has no weight_map object");
    std::set<std::string> unique;
    for (auto& [name, file] : j["weight_map"].items()) {
      FANTAI_REQUIRE(file.is_string(), index.string() << ": weight_map[" << name << "] is not a file name");
      const std::string f2 = file.get<std::string>();
      // A plain file name beside the index: never a path that leaves the model directory.
      FANTAI_REQUIRE(!f2.empty() && f2.find('/') == std::string::npos && f2.find('\\') == std::string::npos &&
                         f2 != "." && f2 != "..",
                     index.string() << ": weight_map[" << name << "] = '" << f2
                                    << "' is not a file name in the model directory");
      unique.insert(f2);
    }
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
