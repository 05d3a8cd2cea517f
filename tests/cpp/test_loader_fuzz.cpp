// The C++ loaders fed hostile input: seeded mutants of a tiny Llama's safetensors checkpoint
// (load_safetensors_dir + Weights::finalize) and of its config.json (ModelConfig::from_json).
// Each mutant must load or be refused with an exception; never a crash. Meant for the sanitizer
// build (make test-hardening), where an out-of-bounds read or an overflow fails the run; the
// plain build runs it too. FANTAI_FUZZ_CASES sets the number of mutants per parser.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace fantai::model {
namespace {

namespace fs = std::filesystem;

constexpr int kHidden = 16, kInter = 32, kVocab = 32, kHeads = 2, kKvHeads = 1, kHeadDim = 8;

const char* kConfig = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 64,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
  "bos_token_id": 1, "eos_token_id": 2})";

int fuzz_cases() {
  const char* v = std::getenv("FANTAI_FUZZ_CASES");
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : 4000;
}

// A valid checkpoint for kConfig: every tensor f32, values from a fixed pattern.
std::string seed_checkpoint() {
  struct T {
    std::string name;
    std::vector<int64_t> shape;
  };
  const std::string l = "model.layers.0.";
  const std::vector<T> tensors = {
      {"model.embed_tokens.weight", {kVocab, kHidden}},
      {l + "input_layernorm.weight", {kHidden}},
      {l + "self_attn.q_proj.weight", {kHeads * kHeadDim, kHidden}},
      {l + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, kHidden}},
      {l + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, kHidden}},
      {l + "self_attn.o_proj.weight", {kHidden, kHeads * kHeadDim}},
      {l + "post_attention_layernorm.weight", {kHidden}},
      {l + "mlp.gate_proj.weight", {kInter, kHidden}},
      {l + "mlp.up_proj.weight", {kInter, kHidden}},
      {l + "mlp.down_proj.weight", {kHidden, kInter}},
      {"model.norm.weight", {kHidden}},
      {"lm_head.weight", {kVocab, kHidden}},
  };
  std::string header = "{";
  std::string payload;
  for (const T& t : tensors) {
    int64_t n = 1;
    std::string shape;
    for (int64_t d : t.shape) {
      n *= d;
      shape += (shape.empty() ? "" : ",") + std::to_string(d);
    }
    const size_t begin = payload.size();
    for (int64_t i = 0; i < n; ++i) {
      const float x = static_cast<float>((i * 7919) % 97) / 97.0f - 0.5f;
      payload.append(reinterpret_cast<const char*>(&x), sizeof x);
    }
    if (header.size() > 1) header += ",";
    header += "\"" + t.name + "\":{\"dtype\":\"F32\",\"shape\":[" + shape + "],\"data_offsets\":[" +
              std::to_string(begin) + "," + std::to_string(payload.size()) + "]}";
  }
  header += ",\"__metadata__\":{\"format\":\"pt\"}}";
  const uint64_t len = header.size();
  std::string file(reinterpret_cast<const char*>(&len), 8);
  return file + header + payload;
}

// One mutant of `data`; `hot` bytes at the start (the header) take most of the hits.
std::string mutate(const std::string& data, size_t hot, std::mt19937_64& rng) {
  std::string m = data;
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  const char* numbers[] = {"0",
                           "-1",
                           "4294967296",
                           "9223372036854775807",
                           "18446744073709551615",
                           "1e308",
                           "99999999999999999999",
                           "3.5",
                           "null",
                           "\"x\"",
                           "[]",
                           "{}"};
  const int kinds = 6;
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % kinds) {
      case 0:  // flip bits in the header
        if (!m.empty()) m[pick(std::min(hot, m.size()))] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1: {  // a lying header length
        const uint64_t lens[] = {0,    1, 7, hot - 9, hot + 1, data.size(), ~uint64_t{0}, uint64_t{1} << 62,
                                 rng()};
        const uint64_t v = lens[rng() % (sizeof lens / sizeof lens[0])];
        if (m.size() >= 8) std::memcpy(&m[0], &v, 8);
        break;
      }
      case 2:  // truncate
        m.resize(pick(m.size() + 1));
        break;
      case 3: {  // a digit run in the header replaced by a hostile number or value
        const size_t limit = std::min(hot, m.size());
        size_t at = 8 + pick(limit > 8 ? limit - 8 : 1);
        while (at < limit && !(m[at] >= '0' && m[at] <= '9')) ++at;
        if (at >= limit) break;
        size_t end = at;
        while (end < limit && m[end] >= '0' && m[end] <= '9') ++end;
        const std::string v = numbers[rng() % (sizeof numbers / sizeof numbers[0])];
        m.replace(at, end - at, v);
        const uint64_t len = hot - 8 + v.size() - (end - at);  // keep the length consistent
        if (m.size() >= 8 && (rng() % 2) == 0) std::memcpy(&m[0], &len, 8);
        break;
      }
      case 4:  // random bytes anywhere
        if (!m.empty()) m[pick(m.size())] = static_cast<char>(rng());
        break;
      default: {  // a dtype swapped for another (or an unknown one)
        const char* dtypes[] = {"F16", "BF16", "I8", "U8", "F64", "I64", "BOOL", "F8_E4M3", "Q4"};
        const size_t at = m.find("\"F32\"", 8 + pick(hot > 8 ? hot - 8 : 1));
        if (at != std::string::npos && at < hot) m.replace(at + 1, 3, dtypes[rng() % 9]);
        break;
      }
    }
  }
  return m;
}

class LoaderFuzz : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fantai_loader_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    backend_ = create_backend("cpu", 1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // true: loaded and finalized; false: refused with an exception (anything else fails the run).
  bool load(const std::string& file, const ModelConfig& config) {
    {
      std::ofstream out(dir_ / "model.safetensors", std::ios::binary | std::ios::trunc);
      out.write(file.data(), static_cast<std::streamsize>(file.size()));
    }
    try {
      Weights w(config, DType::kF32, backend_.get());
      load_safetensors_dir(dir_.string(), &w);
      w.finalize();
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  fs::path dir_;
  std::shared_ptr<Backend> backend_;
};

TEST_F(LoaderFuzz, MutatedSafetensorsLoadOrAreRefused) {
  const ModelConfig config = ModelConfig::from_json(kConfig);
  const std::string seed = seed_checkpoint();
  uint64_t hot;
  std::memcpy(&hot, seed.data(), 8);
  hot += 8;
  ASSERT_TRUE(load(seed, config)) << "the seed checkpoint itself must load";
  std::mt19937_64 rng(1);
  int refused = 0;
  const int n = fuzz_cases();
  for (int i = 0; i < n; ++i) refused += load(mutate(seed, hot, rng), config) ? 0 : 1;
  std::printf("safetensors: %d mutants, %d refused, %d loaded\n", n, refused, n - refused);
  EXPECT_GE(refused, n / 4);  // the mutations do reach the parser's checks
}

TEST_F(LoaderFuzz, MutatedConfigsParseOrAreRefused) {
  const std::string seed = kConfig;
  std::mt19937_64 rng(2);
  int refused = 0;
  const int n = fuzz_cases();
  const char* values[] = {"0",    "-1",   "2147483648", "1e308", "-1e308", "NaN",
                          "null", "\"\"", "[]",         "{}",    "true"};
  for (int i = 0; i < n; ++i) {
    std::string m = seed;
    const int rounds = 1 + static_cast<int>(rng() % 3);
    for (int r = 0; r < rounds; ++r) {
      const size_t colon = m.find(':', rng() % m.size());
      if (rng() % 3 == 0 || colon == std::string::npos) {
        m[rng() % m.size()] = static_cast<char>(rng());
      } else {  // a field's value replaced by a hostile one
        size_t end = colon + 1;
        while (end < m.size() && m[end] != ',' && m[end] != '}') ++end;
        m.replace(colon + 1, end - colon - 1, values[rng() % (sizeof values / sizeof values[0])]);
      }
    }
    try {
      const ModelConfig c = ModelConfig::from_json(m);
      // What parsed must describe a model the loader can size without overflowing.
      EXPECT_GT(c.hidden_size, 0);
      EXPECT_GT(c.num_layers, 0);
      EXPECT_GT(c.vocab_size, 0);
    } catch (const std::exception&) {
      ++refused;
    }
  }
  std::printf("config.json: %d mutants, %d refused, %d parsed\n", n, refused, n - refused);
  EXPECT_GE(refused, n / 4);
}

}  // namespace
}  // namespace fantai::model
