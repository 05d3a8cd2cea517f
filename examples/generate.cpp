// examples: generate — text generation from a Hugging Face model directory with libengine alone.
//
//   generate MODEL_DIR [--prompt-ids 1,2,3 | --prompt "text"] [--max-tokens N] [--threads N]
//            [--temperature T] [--seed S] [--ignore-eos] [--keep-special] [--kv-cache-mib M]
//
// Prints "ids: ..." (the generated token ids) and "text: ..." (them decoded with the vocabulary of
// MODEL_DIR/tokenizer.json). The tokenizer here is deliberately tiny: tokenizer.json read with
// nlohmann_json (the JSON library the engine itself builds with), decoding for byte-level BPE,
// SentencePiece-style and word-level vocabularies, and encoding for word-level ones only.
// Over 400 lines: a self-contained example (its own tokenizer and chat handling), on purpose one file.
#include <sys/stat.h>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "common/check.h"
#include "engine/engine.h"
#include "model/model.h"
#include "sampling/sampling_params.h"

namespace {

// Bad command-line input: reported as "error: ..." with exit status 2 (runtime failures exit 1).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Json = nlohmann::json;

// tokenizer.json's fields are read leniently, as the Python tokenizers read them: a missing or
// mistyped field is treated as absent rather than failing the whole load.
std::string get_string(const Json& node, const char* key) {
  if (!node.is_object()) return std::string();
  auto it = node.find(key);
  return it != node.end() && it->is_string() ? it->get<std::string>() : std::string();
}

const Json* get(const Json& node, const char* key) {
  if (!node.is_object()) return nullptr;
  auto it = node.find(key);
  return it != node.end() ? &*it : nullptr;
}

// Decoded token text is UTF-8 assembled byte by byte, so the encoder is needed for the byte-level
// decoder's fallback (code points outside GPT-2's byte table).
void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// ---- the vocabulary ------------------------------------------------------------------------------

// Splits UTF-8 into code points; a stray byte becomes its own value (never throws on odd input).
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += static_cast<size_t>(n);
  }
  return out;
}

// Invalid UTF-8 -> U+FFFD per maximal invalid subpart, as Rust's from_utf8_lossy (and so the
// Python tokenizers' decode) does, so the text matches byte for byte.
std::string utf8_lossy(const std::string& in) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  const auto* b = reinterpret_cast<const unsigned char*>(in.data());
  const size_t n = in.size();
  for (size_t i = 0; i < n;) {
    unsigned char c = b[i];
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    // Well-formed sequences by lead byte (the Unicode standard's table 3-7): length and the
    // allowed range of the second byte; other lead bytes (C0, C1, F5..FF, continuations) have none.
    struct Lead {
      unsigned char first, last;
      size_t len;
      unsigned char lo, hi;
    };
    static const Lead kLeads[] = {{0xC2, 0xDF, 2, 0x80, 0xBF}, {0xE0, 0xE0, 3, 0xA0, 0xBF},
                                  {0xE1, 0xEC, 3, 0x80, 0xBF}, {0xED, 0xED, 3, 0x80, 0x9F},
                                  {0xEE, 0xEF, 3, 0x80, 0xBF}, {0xF0, 0xF0, 4, 0x90, 0xBF},
                                  {0xF1, 0xF3, 4, 0x80, 0xBF}, {0xF4, 0xF4, 4, 0x80, 0x8F}};
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    for (const Lead& l : kLeads) {
      if (c >= l.first && c <= l.last) {
        len = l.len;
        lo = l.lo;
        hi = l.hi;
        break;
      }
    }
    size_t k = 1;
    if (len > 0) {
      for (; k < len && i + k < n; ++k) {
        unsigned char d = b[i + k];
        if (k == 1 ? (d < lo || d > hi) : (d < 0x80 || d > 0xBF)) break;
      }
    }
    if (len > 0 && k == len) out.append(in, i, len);
    else out += kReplacement;
    i += k;
  }
  return out;
}

bool has_type(const Json* node, const std::string& type) {
  if (!node || !node->is_object()) return false;
  if (get_string(*node, "type") == type) return true;
  for (const char* list : {"decoders", "pretokenizers"}) {  // Sequence decoders / pre-tokenizers
    const Json* items = get(*node, list);
    if (!items || !items->is_array()) continue;
    for (const Json& item : *items) {
      if (has_type(&item, type)) return true;
    }
  }
  return false;
}

class Vocab {
 public:
  static Vocab load(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read " + path);
    Json root;
    try {
      root = Json::parse(f);
    } catch (const Json::exception& e) {
      throw std::runtime_error(path + ": " + e.what());
    }
    Vocab v;
    const Json* model = get(root, "model");
    if (!model || !model->is_object()) throw std::runtime_error(path + ": no \"model\" object");
    v.model_type_ = get_string(*model, "type");
    if (const Json* vocab = get(*model, "vocab")) {
      if (vocab->is_object()) {  // BPE, WordLevel, WordPiece: {"token": id}
        for (const auto& kv : vocab->items()) {
          if (kv.value().is_number()) v.set(static_cast<int32_t>(kv.value().get<double>()), kv.key(), false);
        }
      } else if (vocab->is_array()) {  // Unigram: [["piece", score], ...], id = index
        for (size_t i = 0; i < vocab->size(); ++i) {
          const Json& e = (*vocab)[i];
          if (e.is_array() && !e.empty() && e[0].is_string()) {
            v.set(static_cast<int32_t>(i), e[0].get<std::string>(), false);
          }
        }
      }
    }
    const Json* added = get(root, "added_tokens");
    if (added && added->is_array()) {
      for (const Json& t : *added) {
        const Json* id = get(t, "id");
        const Json* special = get(t, "special");
        if (id && id->is_number()) {
          bool is_special = special && special->is_boolean() && special->get<bool>();
          v.set(static_cast<int32_t>(id->get<double>()), get_string(t, "content"), is_special);
        }
      }
    }
    v.unk_token_ = get_string(*model, "unk_token");
    const Json* decoder = get(root, "decoder");
    v.byte_level_ = has_type(decoder, "ByteLevel") || has_type(get(root, "pre_tokenizer"), "ByteLevel");
    v.byte_fallback_ = has_type(decoder, "ByteFallback");
    v.metaspace_ = has_type(decoder, "Metaspace") || has_type(decoder, "Replace");
    if (v.byte_level_) v.build_byte_decoder();
    return v;
  }

  bool word_level() const { return model_type_ == "WordLevel"; }
  const std::string& model_type() const { return model_type_; }

  // Word-level encoding: the WhitespaceSplit pre-tokenizer, then one lookup per word.
  std::vector<int32_t> encode_words(const std::string& text) const {
    std::vector<int32_t> ids;
    std::istringstream in(text);
    std::string word;
    while (in >> word) {
      auto it = ids_.find(word);
      if (it == ids_.end()) {
        throw UsageError(
            "the word \"" + word + "\" is not in the vocabulary" +
            (unk_token_.empty() ? "" : " (this tool does not map unknown words to " + unk_token_ + ")"));
      }
      ids.push_back(it->second);
    }
    if (ids.empty()) throw UsageError("--prompt is empty");
    return ids;
  }

  // Like tokenizers' decode(ids, skip_special_tokens): drop specials, then run the decoder.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    std::vector<const Entry*> tokens;
    for (int32_t id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= entries_.size() || !entries_[id].known) continue;
      if (skip_special && entries_[id].special) continue;
      tokens.push_back(&entries_[id]);
    }
    std::string out;
    if (byte_level_) {
      for (const Entry* t : tokens) {
        for (uint32_t cp : code_points(t->text)) {
          auto it = byte_decoder_.find(cp);
          if (it != byte_decoder_.end()) out.push_back(static_cast<char>(it->second));
          else append_utf8(&out, cp);
        }
      }
      return utf8_lossy(out);  // a cut multi-byte character must not reach the terminal raw
    }
    if (byte_fallback_ || metaspace_) {  // SentencePiece style: "▁" is a space, <0x0A> a raw byte
      for (const Entry* t : tokens) {
        const std::string& s = t->text;
        if (byte_fallback_ && s.size() == 6 && s.compare(0, 3, "<0x") == 0 && s[5] == '>') {
          out.push_back(static_cast<char>(std::strtol(s.substr(3, 2).c_str(), nullptr, 16)));
          continue;
        }
        for (size_t p = 0; p < s.size();) {
          if (s.compare(p, 3, "\xE2\x96\x81") == 0) {
            out.push_back(' ');
            p += 3;
          } else out.push_back(s[p++]);
        }
      }
      if (!out.empty() && out[0] == ' ') out.erase(0, 1);  // the prefix space the encoder added
      return utf8_lossy(out);
    }
    // WordLevel / no decoder: tokenizers joins the tokens with single spaces.
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out.push_back(' ');
      out += tokens[i]->text;
    }
    return out;
  }

 private:
  struct Entry {
    std::string text;
    bool known = false, special = false;
  };

  void set(int32_t id, const std::string& text, bool special) {
    if (id < 0 || id > (1 << 24)) return;  // nonsense ids are ignored rather than allocated
    if (static_cast<size_t>(id) >= entries_.size()) entries_.resize(static_cast<size_t>(id) + 1);
    Entry& e = entries_[id];
    e.text = text;
    e.known = true;
    e.special = special;
    ids_[text] = id;
  }

  // GPT-2's bytes_to_unicode, inverted: printable bytes map to themselves, the rest to U+0100...
  void build_byte_decoder() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      byte_decoder_[cp] = static_cast<uint8_t>(b);
    }
  }

  std::string model_type_, unk_token_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, int32_t> ids_;
  std::map<uint32_t, uint8_t> byte_decoder_;
  bool byte_level_ = false, byte_fallback_ = false, metaspace_ = false;
};

// ---- command line --------------------------------------------------------------------------------

struct Args {
  std::string model_dir;
  std::vector<int32_t> prompt_ids;
  std::string prompt_text;
  bool have_ids = false, have_text = false;
  int32_t max_tokens = 16;
  int threads = 0;
  float temperature = 0.0f;  // greedy unless asked, so runs are reproducible
  int64_t seed = -1;
  bool ignore_eos = false;
  bool keep_special = false;
  int64_t kv_cache_mib = 64;
};

const char* kUsage =
    "usage: generate MODEL_DIR [--prompt-ids 1,2,3 | --prompt \"text\"] [--max-tokens N]\n"
    "                [--threads N] [--temperature T] [--seed S] [--ignore-eos] [--keep-special]\n"
    "                [--kv-cache-mib M]\n"
    "  MODEL_DIR        a Hugging Face directory (config.json, *.safetensors, tokenizer.json)\n"
    "  --prompt-ids     comma-separated token ids\n"
    "  --prompt         text; word-level vocabularies only (use --prompt-ids for BPE models)\n"
    "  --max-tokens     tokens to generate (default 16)\n"
    "  --threads        CPU threads (default: all cores this process may use)\n"
    "  --temperature    0 (default) is greedy; with --seed S sampling is reproducible\n"
    "  --ignore-eos     keep generating past EOS until --max-tokens\n"
    "  --keep-special   keep special tokens in the decoded text\n"
    "  --kv-cache-mib   KV cache pool size (default 64)\n";

int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size()) throw UsageError(flag + " expects an integer, got \"" + s + "\"");
  if (v < lo || v > hi) {
    throw UsageError(flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + s);
  }
  return v;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, ',')) {
    size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) continue;  // tolerates "1,2," and "1, 2"
    ids.push_back(static_cast<int32_t>(parse_int("--prompt-ids", item.substr(b, e - b + 1), 0, INT32_MAX)));
  }
  if (ids.empty()) throw UsageError("--prompt-ids is empty");
  return ids;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (arg == "--prompt-ids") {
      a.prompt_ids = parse_ids(next());
      a.have_ids = true;
    } else if (arg == "--prompt") {
      a.prompt_text = next();
      a.have_text = true;
    } else if (arg == "--max-tokens") {
      a.max_tokens = static_cast<int32_t>(parse_int(arg, next(), 1, 1 << 20));
    } else if (arg == "--threads") {
      a.threads = static_cast<int>(parse_int(arg, next(), 0, 4096));
    } else if (arg == "--temperature") {
      std::string s = next();
      char* end = nullptr;
      a.temperature = std::strtof(s.c_str(), &end);
      if (s.empty() || *end != '\0' || !(a.temperature >= 0.0f)) {
        throw UsageError("--temperature expects a number >= 0, got \"" + s + "\"");
      }
    } else if (arg == "--seed") {
      a.seed = parse_int(arg, next(), 0, INT64_MAX);
    } else if (arg == "--ignore-eos") {
      a.ignore_eos = true;
    } else if (arg == "--keep-special") {
      a.keep_special = true;
    } else if (arg == "--kv-cache-mib") {
      a.kv_cache_mib = parse_int(arg, next(), 1, 1 << 20);
    } else if (!arg.empty() && arg[0] == '-') {
      throw UsageError("unknown option " + arg);
    } else if (a.model_dir.empty()) {
      a.model_dir = arg;
    } else {
      throw UsageError("unexpected argument \"" + arg + "\" (one MODEL_DIR only)");
    }
  }
  if (a.model_dir.empty()) throw UsageError("MODEL_DIR is required");
  if (a.have_ids && a.have_text) throw UsageError("pass either --prompt-ids or --prompt, not both");
  if (!a.have_ids && !a.have_text)
    throw UsageError("a prompt is required: --prompt-ids 1,2,3 or --prompt \"text\"");
  return a;
}

bool is_file(const std::string& p) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
bool is_dir(const std::string& p) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int run(const Args& a) {
  // Checked here so a wrong path reads as such, not as a loader error deep inside.
  if (!is_dir(a.model_dir)) throw std::runtime_error("model directory not found: " + a.model_dir);
  if (!is_file(a.model_dir + "/config.json")) {
    throw std::runtime_error(a.model_dir + " is not a Hugging Face model directory (no config.json)");
  }
  const std::string tok_path = a.model_dir + "/tokenizer.json";
  std::unique_ptr<Vocab> vocab;
  if (is_file(tok_path)) {
    vocab = std::make_unique<Vocab>(Vocab::load(tok_path));
  } else if (a.have_text) {
    throw UsageError("--prompt needs " + tok_path + "; pass --prompt-ids instead");
  } else {
    std::cerr << "warning: no tokenizer.json in " << a.model_dir << "; printing ids only\n";
  }

  std::vector<int32_t> prompt = a.prompt_ids;
  if (a.have_text) {
    if (!vocab->word_level()) {
      throw UsageError("--prompt encodes word-level vocabularies only; this tokenizer is \"" +
                       vocab->model_type() + "\": pass token ids with --prompt-ids");
    }
    prompt = vocab->encode_words(a.prompt_text);
  }

  auto model = fantai::model::Model::from_pretrained(a.model_dir, "auto",
                                                     fantai::create_backend("cpu", a.threads));
  fantai::engine::EngineConfig cfg;
  cfg.kv_cache_bytes = a.kv_cache_mib << 20;  // small: one request, and the pool is sized up front
  cfg.max_num_seqs = 1;
  fantai::engine::Engine engine(model, cfg);

  fantai::sampling::SamplingParams params;
  params.temperature = a.temperature;
  params.seed = a.seed;
  params.max_tokens = a.max_tokens;
  params.ignore_eos = a.ignore_eos;
  engine.add_request(0, prompt, params);  // throws InvalidArgument for bad ids or too long a prompt

  std::vector<int32_t> out;
  const char* reason = "";
  while (engine.has_unfinished()) {
    for (const auto& o : engine.step()) {
      out.insert(out.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) reason = fantai::engine::finish_reason_name(o.finish_reason);
    }
  }

  std::cout << "ids:";
  for (int32_t t : out) std::cout << ' ' << t;
  std::cout << '\n';
  if (vocab) std::cout << "text: " << vocab->decode(out, !a.keep_special) << '\n';
  std::cerr << "prompt tokens: " << prompt.size() << ", generated: " << out.size()
            << ", finish reason: " << reason << '\n';
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const UsageError& e) {
    std::cerr << "error: " << e.what() << "\n\n" << kUsage;
    return 2;
  } catch (const fantai::InvalidArgument& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}
