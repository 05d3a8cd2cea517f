// engine: the step: schedule → run → sample → postprocess (finish and free in the same step).
// Over 400 lines: add / abort / step and the postprocess they share (finish reasons, stop ids,
// n > 1 siblings, the grammar masks of constrained rows) read best together, beside the KV pools'
// sizing per attention kind.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>

#include "common/check.h"
#include "common/logging.h"
#include "engine/tp_worker.h"
#include "sampling/sampler.h"

namespace fantai::engine {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// True when a mask allows some token outside `banned`. Rare slow path: min_tokens on a grammar
// close to its end, where the mask may allow only EOS.
bool allows_unbanned(const uint32_t* allowed, int32_t words, const std::vector<int32_t>& banned) {
  for (int32_t w = 0; w < words; ++w) {
    uint32_t bits = allowed[w];
    if (bits == 0) continue;
    for (int32_t t : banned) {
      if (t / 32 == w) bits &= ~(1u << (t % 32));
    }
    if (bits != 0) return true;
  }
  return false;
}

}  // namespace

std::string kv_kind_name(int32_t window) {
  return window > 0 ? "sliding_window_" + std::to_string(window) : "full";
}

namespace {

// Blocks per kind for `bytes` of pool. Every kind gets as many blocks, so the same sequences fit in
// each (a window kind never needs more blocks than full attention does for the same tokens),
// except that a window kind gets no more than max_num_seqs sequences can hold in it at once; what
// that saves goes to the full-attention kind, when there is one.
std::vector<int32_t> split_kv_blocks(const model::ModelConfig& mc, const std::vector<int32_t>& windows,
                                     int64_t bytes, DType kv_dtype, const EngineConfig& cfg) {
  const int kinds = static_cast<int>(windows.size());
  std::vector<int64_t> per(kinds);
  int64_t all = 0;
  for (int k = 0; k < kinds; ++k) {
    per[k] = static_cast<int64_t>(model::KVCache::kind_bytes_per_block(mc, cfg.block_size, kv_dtype, k));
    all += per[k];
  }
  const int64_t cap = 1 << 30;
  const int64_t equal = std::min<int64_t>(bytes / all, cap);
  std::vector<int32_t> n(kinds, static_cast<int32_t>(equal));
  if (kinds == 1 || windows[0] != 0) return n;  // no full-attention kind to give memory to
  int64_t windows_bytes = 0;
  for (int k = 1; k < kinds; ++k) {
    const int64_t most = int64_t{cfg.max_num_seqs} *
                         BlockManager::window_peak_blocks(windows[k], cfg.block_size, cfg.max_model_len,
                                                          cfg.max_num_batched_tokens);
    n[k] = static_cast<int32_t>(std::min(equal, most));
    windows_bytes += n[k] * per[k];
  }
  n[0] = static_cast<int32_t>(std::min<int64_t>((bytes - windows_bytes) / per[0], cap));
  return n;
}

}  // namespace

namespace {

// A /proc/meminfo field in bytes (0 where unknown).
int64_t meminfo_bytes(const std::string& field) {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  while (f >> key >> kb >> unit) {
    if (key == field) return kb * 1024;
  }
  return 0;
}

}  // namespace

int64_t default_kv_cache_bytes() {
  const int64_t avail_kb = meminfo_bytes("MemAvailable:") / 1024;
  int64_t bytes = avail_kb > 0 ? avail_kb * 1024 / 4 : (int64_t{1} << 30);
  return std::min<int64_t>(bytes, int64_t{4} << 30);
}

Engine::Engine(std::shared_ptr<model::Model> model, EngineConfig config)
    : model_(std::move(model)), config_(std::move(config)), rng_(config_.seed) {
  const model::ModelConfig& mc = model_->config();
  if (config_.max_model_len <= 0) config_.max_model_len = mc.max_position_embeddings;
  FANTAI_REQUIRE(config_.max_model_len <= mc.max_position_embeddings,
                 "max_model_len " << config_.max_model_len << " exceeds the model's "
                                  << mc.max_position_embeddings << " positions");
  if (config_.max_num_batched_tokens <= 0) {
    config_.max_num_batched_tokens = config_.enable_chunked_prefill ? 2048
                                                                    : std::max(2048, config_.max_model_len);
  }
  FANTAI_REQUIRE(config_.max_num_seqs >= 1, "max_num_seqs must be at least 1");
  if (config_.eos_token_ids.empty()) config_.eos_token_ids = mc.eos_token_ids;
  const DType kv_dtype = dtype_from_name(config_.kv_cache_dtype);
  const std::vector<int32_t> windows = model::KVCache::kind_windows(mc);
  const int kinds = static_cast<int>(windows.size());
  const size_t per_block = model::KVCache::bytes_per_block(mc, config_.block_size, kv_dtype);
  std::vector<int32_t> num_blocks(kinds, config_.num_blocks);
  if (config_.num_blocks <= 0) {
    // A device backend sizes the pool from its own free memory (weights already loaded).
    const int64_t device_free = model_->backend()->free_memory();
    const int64_t bytes = config_.kv_cache_bytes > 0 ? config_.kv_cache_bytes
                          : device_free >= 0         ? device_free / 10 * 9
                                                     : default_kv_cache_bytes();
    // Each layer's K and V buffers start 64-byte aligned and int8 scales start aligned after the
    // values: up to 2 x 63 bytes of padding per buffer, kept out of the blocks' share.
    const int64_t padding = int64_t{2} * 2 * 64 * mc.num_layers;
    const int64_t avail = std::max<int64_t>(bytes - padding, 0);
    num_blocks = split_kv_blocks(mc, windows, avail, kv_dtype, config_);
  }
  for (int k = 0; k < kinds; ++k)
    FANTAI_REQUIRE(num_blocks[k] >= 1,
                   "kv_cache_memory is smaller than one KV block (" << per_block << " bytes)");
  std::vector<BlockPoolSpec> pools;
  for (int k = 0; k < kinds; ++k) pools.push_back({num_blocks[k], windows[k]});
  const PreemptionMode mode = preemption_mode_from_name(config_.preemption_mode);
  FANTAI_REQUIRE(config_.swap_space_bytes >= 0, "swap_space must be >= 0");
  // Swap space is host memory the sequences' KV must really fit in (pinned, on a GPU).
  const int64_t host = meminfo_bytes("MemTotal:");
  FANTAI_REQUIRE(host == 0 || config_.swap_space_bytes <= host,
                 "swap_space of " << config_.swap_space_bytes / (1 << 20) << " MiB exceeds the host memory ("
                                  << host / (1 << 20) << " MiB)");
  // A slot holds one block of each kind, so a swapped sequence fits in every kind alike.
  const int64_t swap_slots = config_.swap_space_bytes / static_cast<int64_t>(per_block);
  FANTAI_REQUIRE(config_.swap_space_bytes == 0 || swap_slots >= 1,
                 "swap_space is smaller than one KV block (" << per_block << " bytes)");
  FANTAI_REQUIRE(mode != PreemptionMode::kSwap || swap_slots >= 1,
                 "preemption_mode 'swap' needs swap space (swap_space > 0)");
  blocks_ = std::make_unique<BlockManager>(pools, config_.block_size, config_.enable_prefix_caching);
  blocks_->set_swap_slots(static_cast<int32_t>(std::min<int64_t>(swap_slots, 1 << 30)));
  cache_ = std::make_unique<model::KVCache>(mc, num_blocks, config_.block_size, kv_dtype, model_->backend());
  cache_->reserve_swap(static_cast<int32_t>(std::min<int64_t>(swap_slots, 1 << 30)), model_->backend());
  scheduler_ = std::make_unique<Scheduler>(
      SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens, config_.enable_chunked_prefill,
                      mode},
      blocks_.get());
  // Until a swap is timed: host memory moves at a few GB/s (a memcpy, or PCIe to pinned memory).
  scheduler_->set_preemption_costs({static_cast<double>(per_block) / 4e9, 0.0});
  runner_ = std::make_unique<ModelRunner>(model_, cache_.get());
  if (model_->tp_shard().active())
    tp_handshake_leader(*model_, num_blocks, config_.block_size, kv_dtype, cache_->swap_slots());
  for (int k = 0; k < kinds; ++k) {
    FANTAI_LOG(kInfo,
               "KV pool" << (kinds > 1 ? " of " + kv_kind_name(windows[k]) : std::string()) << ": "
                         << num_blocks[k] << " blocks x " << config_.block_size
                         << " tokens = " << int64_t{num_blocks[k]} * config_.block_size << " tokens over "
                         << cache_->kind_num_layers(k) << " layers"
                         << (windows[k] > 0 ? ", window " + std::to_string(windows[k]) : std::string()));
  }
  FANTAI_LOG(kInfo, "KV cache: " << cache_->bytes() / (1 << 20) << " MiB (" << dtype_name(kv_dtype) << ")");
  if (cache_->swap_slots() > 0)
    FANTAI_LOG(kInfo, "KV swap space: " << cache_->swap_slots()
                                        << " blocks = " << cache_->swap_bytes() / (1 << 20)
                                        << " MiB of host memory, preemption " << config_.preemption_mode);
}

Engine::~Engine() {
  if (!model_->tp_shard().active()) return;
  try {
    tp_send_stop(*model_);
  } catch (const std::exception& e) {  // the group already failed and said why
    FANTAI_LOG(kWarning, "tensor-parallel ranks not stopped: " << e.what());
  }
}

void Engine::validate_request(const std::vector<int32_t>& prompt, const sampling::SamplingParams& p) const {
  const int32_t vocab = model_->config().vocab_size;
  FANTAI_REQUIRE(!prompt.empty(), "the prompt is empty");
  for (int32_t t : prompt) {
    FANTAI_REQUIRE(t >= 0 && t < vocab,
                   "prompt token id " << t << " is outside the vocabulary [0, " << vocab << ")");
  }
  p.validate(vocab);
  FANTAI_REQUIRE(!p.constrained || grammar_ != nullptr,
                 "a constrained request needs the engine's mask provider (none is set)");
  const int64_t n = static_cast<int64_t>(prompt.size());
  FANTAI_REQUIRE(n + 1 <= config_.max_model_len,
                 "the prompt has " << n << " tokens; this model's context (max_model_len) is "
                                   << config_.max_model_len << " tokens");
  // Every kind must hold the sequence's peak: all its blocks (full attention), or the largest
  // chunk and the window before it (a window kind, which gives back what the window passed).
  const int32_t chunk = static_cast<int32_t>(std::min<int64_t>(n + 1, config_.max_num_batched_tokens));
  for (int k = 0; k < blocks_->num_kinds(); ++k) {
    const int32_t need = blocks_->peak_blocks(k, static_cast<int32_t>(n + 1), chunk);
    const int64_t pool_tokens = int64_t{blocks_->pool(k).num_blocks()} * blocks_->block_size();
    FANTAI_REQUIRE(
        need <= blocks_->pool(k).num_blocks(),
        "the prompt has " << n << " tokens but the KV pool"
                          << (blocks_->num_kinds() > 1 ? " of " + kv_kind_name(blocks_->window(k)) : "")
                          << " holds only " << pool_tokens << " tokens");
  }
}

void Engine::add_request(uint64_t id, std::vector<int32_t> prompt, const sampling::SamplingParams& params,
                         const std::vector<std::pair<uint64_t, sampling::SamplingParams>>& siblings) {
  FANTAI_REQUIRE(requests_.find(id) == requests_.end() &&
                     pending_siblings_.find(id) == pending_siblings_.end(),
                 "request id " << id << " is already in use");
  validate_request(prompt, params);
  for (const auto& [sid, sp] : siblings) {
    FANTAI_REQUIRE(sid != id && requests_.find(sid) == requests_.end(),
                   "request id " << sid << " is already in use");
    sp.validate(model_->config().vocab_size);
  }
  auto r = std::make_unique<Request>();
  r->id = id;
  r->prompt = std::move(prompt);
  r->params = params;
  r->rng.seed(params.seed >= 0 ? static_cast<uint64_t>(params.seed) : rng_());
  r->arrival_time = now_seconds();
  scheduler_->add(r.get());
  requests_.emplace(id, std::move(r));
  if (!siblings.empty()) pending_siblings_[id] = siblings;
}

bool Engine::abort_request(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    // A sibling not yet forked from its parent: drop it from the parent's list.
    for (auto& [parent, list] : pending_siblings_) {
      for (auto s = list.begin(); s != list.end(); ++s) {
        if (s->first == id) {
          list.erase(s);
          return true;
        }
      }
    }
    return false;
  }
  scheduler_->abort(it->second.get());
  requests_.erase(it);
  pending_siblings_.erase(id);  // never forked: they go with their parent
  return true;
}

std::vector<uint64_t> Engine::abort_all() {
  std::vector<uint64_t> ids;
  for (auto& [id, r] : requests_) {
    scheduler_->abort(r.get());
    ids.push_back(id);
  }
  for (auto& [parent, list] : pending_siblings_) {
    for (auto& sib : list) ids.push_back(sib.first);
  }
  requests_.clear();
  pending_siblings_.clear();
  return ids;
}

int32_t Engine::reset_prefix_cache() { return blocks_->reset_prefix_cache(); }

int32_t Engine::release_memory() {
  const int32_t keep = config_.release_keep_cached_blocks >= 0 ? config_.release_keep_cached_blocks
                                                               : blocks_->num_blocks() / 8;
  int32_t released = 0;
  std::vector<int32_t> runs;  // (kind, first, count): the same runs on every tensor-parallel rank
  for (int k = 0; k < blocks_->num_kinds(); ++k) {
    BlockPool& pool = blocks_->pool(k);
    // Each kind keeps its share of `keep` (all of it when there is one kind).
    pool.trim_cache(static_cast<int32_t>(int64_t{keep} * pool.num_blocks() / blocks_->num_blocks()));
    // Runs of consecutive clean blocks: one release per run and layer.
    int32_t run_start = -1, prev = -2;
    auto flush = [&] {
      if (run_start < 0) return;
      cache_->release_blocks(k, run_start, prev - run_start + 1, model_->backend());
      runs.insert(runs.end(), {k, run_start, prev - run_start + 1});
    };
    for (int32_t b : pool.clean_blocks()) {
      if (b != prev + 1) {
        flush();
        run_start = b;
      }
      prev = b;
      ++released;
    }
    flush();
    // Free swap slots too (a device backend's pinned slots stay: release_pages is a no-op there);
    // on the wire their kind is offset by kMaxKvKinds.
    run_start = -1, prev = -2;
    auto flush_swap = [&] {
      if (run_start < 0) return;
      cache_->release_swap_slots(k, run_start, prev - run_start + 1, model_->backend());
      runs.insert(runs.end(), {k + model::kMaxKvKinds, run_start, prev - run_start + 1});
    };
    for (int32_t s : blocks_->free_swap_slots(k)) {
      if (s != prev + 1) {
        flush_swap();
        run_start = s;
      }
      prev = s;
    }
    flush_swap();
  }
  if (model_->tp_shard().active()) tp_send_release(*model_, runs);
  counters_.num_releases++;
  return released;
}

void Engine::fork_siblings(Request* parent, std::vector<Request*>* children) {
  auto it = pending_siblings_.find(parent->id);
  if (it == pending_siblings_.end()) return;
  for (const auto& [sid, sp] : it->second) {
    auto c = std::make_unique<Request>();
    c->id = sid;
    c->prompt = parent->prompt;
    c->params = sp;
    c->rng.seed(sp.seed >= 0 ? static_cast<uint64_t>(sp.seed) : rng_());
    c->arrival_time = parent->arrival_time;
    c->first_scheduled_time = parent->first_scheduled_time;
    c->num_computed_tokens = parent->num_computed_tokens;
    blocks_->fork(parent->block_tables, c->block_tables);
    scheduler_->add_running(c.get());
    children->push_back(c.get());
    requests_.emplace(sid, std::move(c));
  }
  pending_siblings_.erase(it);
}

void Engine::finish_pending_siblings(uint64_t parent, FinishReason reason, std::vector<StepOutput>* outs) {
  auto it = pending_siblings_.find(parent);
  if (it == pending_siblings_.end()) return;
  for (const auto& sib : it->second) {
    StepOutput o;
    o.request_id = sib.first;
    o.finished = true;
    o.finish_reason = reason;
    outs->push_back(o);
  }
  pending_siblings_.erase(it);
}

FinishReason Engine::check_stop(const Request& r, int32_t token, int32_t* stop_id) const {
  const sampling::SamplingParams& p = r.params;
  const int32_t n_out = static_cast<int32_t>(r.output.size());
  if (n_out >= p.min_tokens) {
    const bool eos = !p.ignore_eos && std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(),
                                                token) != config_.eos_token_ids.end();
    const bool stop = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
                      p.stop_token_ids.end();
    if (eos || stop) {
      *stop_id = token;
      return FinishReason::kStop;
    }
  }
  if (n_out >= p.max_tokens || r.num_tokens() >= config_.max_model_len) return FinishReason::kLength;
  return FinishReason::kNone;
}

StepOutput Engine::finish_output(Request& r, FinishReason reason) {
  StepOutput o;
  o.request_id = r.id;
  o.finished = true;
  o.finish_reason = reason;
  o.num_prompt_tokens = static_cast<int32_t>(r.prompt.size());
  o.num_output_tokens = static_cast<int32_t>(r.output.size());
  return o;
}

std::vector<StepOutput> Engine::step() {
  std::vector<StepOutput> outs;
  const double t_start = now_seconds();
  ScheduledBatch batch = scheduler_->schedule();
  for (Request* r : batch.finished_out_of_blocks) {
    FANTAI_LOG(kWarning, "request " << r->id << " needs more KV blocks than the pool has; finished (length)");
    outs.push_back(finish_output(*r, FinishReason::kLength));
    finish_pending_siblings(r->id, FinishReason::kLength, &outs);
    requests_.erase(r->id);
  }
  if (!batch.preempted.empty()) {
    FANTAI_LOG(kDebug, "preempted " << batch.preempted.size() << " request(s) (KV pool full), "
                                    << batch.num_swapped_out << " swapped out");
  }
  if (batch.empty()) {
    // Swapped-out blocks are free from now on: their KV must reach the swap slots before any
    // later step reuses them.
    if (!batch.block_copies.empty()) {
      runner_->run_copies(batch.block_copies);
      counters_.time_swap_s += runner_->last_swap_seconds();
    }
    return outs;
  }
  const double t = now_seconds();
  counters_.time_schedule_s += t - t_start;
  for (const ScheduledSeq& s : batch.seqs) {
    if (s.request->first_scheduled_time < 0) s.request->first_scheduled_time = t;
  }
  masking_ = grammar_ != nullptr && begin_masks(batch);  // overlaps the forward below
  std::vector<int32_t> greedy_tokens;
  std::vector<float> greedy_logprobs;
  // A host backend declines both probes at no cost, so the CPU path below is untouched.
  bool all_greedy = false;
  bool sampled_on_backend = false;
  if ((model_->samples_greedy_on_backend() || model_->samples_top_k_top_p_on_backend()) &&
      plain_step(batch, &all_greedy)) {
    if (all_greedy && model_->samples_greedy_on_backend()) {
      sampled_on_backend = runner_->run_greedy(batch, &greedy_tokens, &greedy_logprobs);
    } else if (model_->samples_top_k_top_p_on_backend()) {
      // The uniforms are drawn here, so the step must not fall back to the host sampler (which
      // would draw again): the probe above said yes, and a backend that says yes takes the step.
      device_sampling_rows(batch);
      const model::DeviceSampling ds{ds_temperature_.data(), ds_top_k_.data(), ds_top_p_.data(),
                                     ds_uniform_.data()};
      FANTAI_CHECK(runner_->run_sampled(batch, ds, &greedy_tokens, &greedy_logprobs),
                   "the backend accepted top-k / top-p sampling, then declined it");
      sampled_on_backend = true;
    }
  }
  const std::vector<float>& logits = sampled_on_backend ? empty_logits_ : runner_->run(batch);
  const double t_run = now_seconds();
  counters_.time_prepare_s += runner_->last_prepare_seconds();
  counters_.time_forward_s += t_run - t - runner_->last_prepare_seconds();
  counters_.time_swap_s += runner_->last_swap_seconds();
  update_preemption_costs(batch, t_run - t - runner_->last_prepare_seconds());
  scheduler_->on_step_done(batch);
  counters_.num_steps++;
  counters_.last_batch_tokens = batch.num_tokens;
  counters_.last_batch_decode = batch.num_decode_tokens;
  counters_.last_batch_prefill = batch.num_prefill_tokens;
  counters_.prompt_tokens += batch.num_prefill_tokens;
  if (!sampled_on_backend) {
    sample_and_postprocess(batch, logits, &outs);
  } else {
    size_t i = 0;
    for (const ScheduledSeq& s : batch.seqs) {
      if (!s.sample) continue;
      sampling::SampleResult res;
      res.token = greedy_tokens[i];
      res.logprob = greedy_logprobs[i++];
      FANTAI_CHECK(res.token >= 0, "sample: request " << s.request->id << ": logits contain NaN");
      postprocess(s.request, res, &outs);
    }
    last_sample_s_ = 0;  // sampled inside the forward on the device
  }
  const double t_end = now_seconds();
  counters_.time_postprocess_s += t_end - t_run - last_sample_s_;
  counters_.time_sample_s += last_sample_s_;
  counters_.time_step_s += t_end - t_start;
  return outs;
}

void Engine::update_preemption_costs(const ScheduledBatch& batch, double forward_s) {
  if (cache_->swap_slots() == 0) return;
  // Moving averages, so a slow step (a page fault storm, a busy neighbour) does not flip the
  // policy alone. A step's forward over its tokens is what recomputing them costs (a prefill
  // step's tokens are nearly all prompt tokens; a decode step prices tokens far higher, which
  // recompute would batch, so only steps that are mostly prefill are taken).
  PreemptionCosts c = scheduler_->preemption_costs();
  constexpr double kKeep = 0.8;
  if (batch.num_prefill_tokens >= 16 && batch.num_prefill_tokens * 2 >= batch.num_tokens) {
    const double per_token = forward_s / batch.num_tokens;
    c.recompute_s_per_token = c.recompute_s_per_token > 0
                                  ? kKeep * c.recompute_s_per_token + (1 - kKeep) * per_token
                                  : per_token;
  }
  // A device backend only queues its copies; the wall time would flatter it, so keep the
  // bandwidth guess there.
  if (runner_->last_swap_blocks() > 0 && !model_->backend()->is_device()) {
    const double per_block = runner_->last_swap_seconds() / runner_->last_swap_blocks();
    c.swap_s_per_block = kKeep * c.swap_s_per_block + (1 - kKeep) * per_block;
  }
  scheduler_->set_preemption_costs(c);
}

void Engine::set_mask_provider(std::shared_ptr<TokenMaskProvider> provider) {
  FANTAI_REQUIRE(grammar_ == nullptr, "the engine's mask provider is already set");
  grammar_ = std::make_unique<GrammarHook>(std::move(provider), model_->config().vocab_size);
}

bool Engine::begin_masks(const ScheduledBatch& batch) {
  std::vector<MaskRow> rows;
  mask_row_.clear();
  for (const ScheduledSeq& s : batch.seqs) {
    if (!s.sample) continue;
    Request* r = s.request;
    if (!r->params.constrained) {
      mask_row_.push_back(-1);
      continue;
    }
    mask_row_.push_back(static_cast<int32_t>(rows.size()));
    MaskRow row;
    row.request_id = r->id;
    row.num_fed = r->grammar_fed;
    row.new_tokens.assign(r->output.begin() + r->grammar_fed, r->output.end());
    r->grammar_fed = static_cast<int32_t>(r->output.size());
    rows.push_back(std::move(row));
  }
  if (rows.empty()) return false;
  grammar_->begin(std::move(rows));
  return true;
}

bool Engine::plain_step(const ScheduledBatch& batch, bool* all_greedy) const {
  *all_greedy = true;
  if (!pending_siblings_.empty() || masking_) return false;
  for (const ScheduledSeq& s : batch.seqs) {
    if (!s.sample) continue;
    const Request& r = *s.request;
    const sampling::SamplingParams& p = r.params;
    // The bans sample_and_postprocess would add this step.
    const bool bans = static_cast<int32_t>(r.output.size()) < p.min_tokens &&
                      (!p.ignore_eos || !p.stop_token_ids.empty());
    if (!sampling::plain_row(p, bans)) return false;
    *all_greedy = *all_greedy && p.greedy();
  }
  return true;
}

void Engine::device_sampling_rows(const ScheduledBatch& batch) {
  ds_temperature_.clear();
  ds_top_k_.clear();
  ds_top_p_.clear();
  ds_uniform_.clear();
  for (const ScheduledSeq& s : batch.seqs) {
    if (!s.sample) continue;
    Request* r = s.request;
    const sampling::SamplingParams& p = r->params;
    if (p.greedy()) {
      // The host sampler's greedy is the argmax with ties to the lowest id, which is top_k = 1
      // under the device's order; it draws nothing, so neither do we.
      ds_temperature_.push_back(1.0f);
      ds_top_k_.push_back(1);
      ds_top_p_.push_back(1.0f);
      ds_uniform_.push_back(0.0f);
      continue;
    }
    ds_temperature_.push_back(p.temperature);
    ds_top_k_.push_back(p.top_k);
    ds_top_p_.push_back(p.top_p);
    ds_uniform_.push_back(sampling::device_uniform(sampling::draw_uniform(r->rng)));
  }
}

void Engine::sample_and_postprocess(const ScheduledBatch& batch, const std::vector<float>& logits,
                                    std::vector<StepOutput>* outs) {
  const int32_t vocab = model_->config().vocab_size;
  std::vector<Request*> sampled;
  for (const ScheduledSeq& s : batch.seqs) {
    if (s.sample) sampled.push_back(s.request);
  }
  // Siblings fork at their parent's first sample and draw from the same logits row.
  std::vector<float> expanded;
  const float* rows_data = logits.data();
  const size_t num_parents = sampled.size();
  std::vector<size_t> fork_parent;  // for each forked child (after the parents): its parent's row
  if (!pending_siblings_.empty()) {
    expanded.assign(logits.begin(), logits.end());
    for (size_t i = 0; i < num_parents; ++i) {
      std::vector<Request*> children;
      if (sampled[i]->output.empty()) fork_siblings(sampled[i], &children);
      for (Request* c : children) {
        sampled.push_back(c);
        fork_parent.push_back(i);
        expanded.insert(expanded.end(), logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
      }
    }
    rows_data = expanded.data();
  }
  const uint32_t* masks = nullptr;
  if (masking_) {
    const double w0 = now_seconds();
    masks = grammar_->wait();
    counters_.time_mask_wait_s += now_seconds() - w0;
  }
  std::vector<sampling::SampleRow> rows;
  std::vector<std::vector<int32_t>> banned(sampled.size());
  for (size_t i = 0; i < sampled.size(); ++i) {
    Request* r = sampled[i];
    if (static_cast<int32_t>(r->output.size()) < r->params.min_tokens) {
      if (!r->params.ignore_eos) banned[i] = config_.eos_token_ids;
      banned[i].insert(banned[i].end(), r->params.stop_token_ids.begin(), r->params.stop_token_ids.end());
    }
    sampling::SampleRow row{&r->params, &r->prompt, &r->output, &r->rng,
                            banned[i].empty() ? nullptr : &banned[i]};
    if (masks != nullptr) {
      // A forked sibling has its parent's (empty) output, hence its parent's mask.
      const size_t parent = i < num_parents ? i : fork_parent[i - num_parents];
      const int32_t m = mask_row_[parent];
      if (m >= 0) {
        row.allowed = masks + static_cast<size_t>(m) * grammar_->words();
        // min_tokens must not leave a grammar that can only end with nothing to sample.
        if (row.banned != nullptr && !allows_unbanned(row.allowed, grammar_->words(), banned[i]))
          row.banned = nullptr;
      }
    }
    rows.push_back(row);
  }
  masking_ = false;
  std::vector<sampling::SampleResult> results;
  const double t0 = now_seconds();
  sampling::sample(const_cast<float*>(rows_data), vocab, rows, &results);
  last_sample_s_ = now_seconds() - t0;
  for (size_t i = 0; i < sampled.size(); ++i) postprocess(sampled[i], results[i], outs);
}

void Engine::postprocess(Request* r, const sampling::SampleResult& res, std::vector<StepOutput>* outs) {
  r->output.push_back(res.token);
  counters_.generation_tokens++;
  StepOutput o;
  o.request_id = r->id;
  o.token_ids.push_back(res.token);
  o.logprobs.push_back(
      {res.logprob, r->params.logprobs >= 0 ? res.top : std::vector<std::pair<int32_t, float>>{}});
  if (r->output.size() == 1) o.queue_seconds = r->first_scheduled_time - r->arrival_time;
  o.finish_reason = check_stop(*r, res.token, &o.stop_token_id);
  o.finished = o.finish_reason != FinishReason::kNone;
  o.num_prompt_tokens = static_cast<int32_t>(r->prompt.size());
  o.num_output_tokens = static_cast<int32_t>(r->output.size());
  if (o.finished) {
    scheduler_->finish(r, o.finish_reason);
    requests_.erase(r->id);
  }
  outs->push_back(std::move(o));
}

EngineStats Engine::stats() const {
  EngineStats s = counters_;
  s.num_running = static_cast<int64_t>(scheduler_->num_running());
  s.num_waiting = static_cast<int64_t>(scheduler_->num_waiting());
  s.num_free_blocks = blocks_->num_free_blocks();
  s.num_total_blocks = blocks_->num_blocks();
  s.block_size = blocks_->block_size();
  s.used_slots = blocks_->used_slots();
  s.allocated_slots = blocks_->allocated_slots();
  s.num_preemptions = scheduler_->num_preemptions();
  s.num_swap_outs = scheduler_->num_swap_outs();
  s.num_swap_ins = scheduler_->num_swap_ins();
  s.num_swap_slots = blocks_->num_swap_slots();
  s.num_free_swap_slots = blocks_->num_free_swap_slots();
  for (const Request* r : scheduler_->waiting()) s.num_swapped += !r->swapped.empty();
  for (int k = 0; k < blocks_->num_kinds(); ++k) {
    const BlockPool& pool = blocks_->pool(k);
    KVKindStats ks;
    ks.window = blocks_->window(k);
    ks.num_layers = cache_->kind_num_layers(k);
    ks.num_total_blocks = pool.num_blocks();
    ks.num_free_blocks = pool.num_free_blocks();
    ks.num_cached_blocks = pool.num_cached_blocks();
    ks.used_slots = pool.used_slots();
    s.kv_kinds.push_back(ks);
  }
  const BlockStats b = blocks_->stats();
  s.num_cached_blocks = blocks_->num_cached_blocks();
  s.prefix_queries = b.prefix_queries;
  s.prefix_hits = b.prefix_hits;
  s.evictions = b.evictions;
  s.copy_on_writes = b.copy_on_writes;
  s.bytes_per_block = static_cast<int64_t>(
      model::KVCache::bytes_per_block(model_->config(), blocks_->block_size(), cache_->layout().dtype));
  return s;
}

EngineSnapshot Engine::snapshot() const {
  EngineSnapshot snap;
  const int32_t n = blocks_->num_blocks();
  snap.ref_counts.resize(n);
  snap.block_states.resize(n);
  // The kinds' pools side by side: kind k's block b is entry offset[k] + b.
  std::vector<int32_t> offset(blocks_->num_kinds(), 0);
  for (int k = 0; k < blocks_->num_kinds(); ++k) {
    const BlockPool& pool = blocks_->pool(k);
    offset[k] = k ? offset[k - 1] + blocks_->pool(k - 1).num_blocks() : 0;
    for (int32_t b = 0; b < pool.num_blocks(); ++b) {
      const int32_t refs = pool.ref_count(b);
      snap.ref_counts[offset[k] + b] = refs;
      snap.block_states[offset[k] + b] = refs > 0 ? EngineSnapshot::kUsed : EngineSnapshot::kCached;
    }
    // Unowned blocks are cached unless clean: one pass over the clean set, no per-block lookup.
    for (int32_t b : pool.clean_blocks()) snap.block_states[offset[k] + b] = EngineSnapshot::kClean;
  }
  auto add = [&snap, &offset](const Request* r, bool running) {
    RequestSnapshot rs;
    rs.id = r->id;
    rs.running = running;
    for (size_t k = 0; k < r->block_tables.kinds.size(); ++k)
      for (int32_t b : r->block_tables.kinds[k].blocks)
        if (b >= 0) rs.block_table.push_back(offset[k] + b);
    rs.num_tokens = r->num_tokens();
    rs.num_prompt_tokens = static_cast<int32_t>(r->prompt.size());
    rs.num_computed_tokens = r->num_computed_tokens;
    rs.num_preemptions = r->num_preemptions;
    rs.swapped = !r->swapped.empty();
    snap.requests.push_back(std::move(rs));
  };
  for (const Request* r : scheduler_->running()) add(r, true);
  for (const Request* r : scheduler_->waiting()) add(r, false);
  snap.stats = stats();
  return snap;
}

}  // namespace fantai::engine
