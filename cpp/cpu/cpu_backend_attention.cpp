// cpu: the CPU backend's KV store (f32 / f16 / bf16 / int8 with per-slot scales) and paged
// attention (work items of 16 query rows x one KV head, the AMX tile kernel for bf16 KV; sliding
// windows skip the blocks before them).
#include "cpu/cpu_backend_impl.h"

#include <cstdint>
#include <vector>

#include "common/check.h"
#include "cpu/kernels_amx.h"

namespace fantai::cpu {

void CpuBackend::store_kv(const float* k, const float* v, int64_t stride, const int64_t* slot_mapping,
                          int64_t num_tokens, void* k_cache, void* v_cache, const KVLayout& L) {
  FANTAI_REQUIRE(L.block_size > 0 && L.num_kv_heads > 0 && L.head_dim > 0, "store_kv: bad KV layout");
  const int64_t hd = L.head_dim, slots = static_cast<int64_t>(L.num_blocks) * L.block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    FANTAI_REQUIRE(slot_mapping[t] < slots, "store_kv: slot " << slot_mapping[t] << " of token " << t
                                                              << " is past the cache (" << slots
                                                              << " slots)");
  const size_t es = dtype_size(L.dtype);
  const bool i8 = L.dtype == DType::kI8;
  float* k_scales = i8 ? reinterpret_cast<float*>(static_cast<char*>(k_cache) + L.scales_offset()) : nullptr;
  float* v_scales = i8 ? reinterpret_cast<float*>(static_cast<char*>(v_cache) + L.scales_offset()) : nullptr;
  for_rows(num_tokens, 2 * L.num_kv_heads * hd, [&](int64_t t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;
    const int64_t blk = slot / L.block_size, off = slot % L.block_size;
    for (int h = 0; h < L.num_kv_heads; ++h) {
      const int64_t row = (blk * L.num_kv_heads + h) * L.block_size + off, dst = row * hd;
      const float* ks = k + t * stride + h * hd;
      const float* vs = v + t * stride + h * hd;
      if (i8) {
        k_scales[row] = quantize_row_i8(ks, static_cast<int8_t*>(k_cache) + dst, hd);
        v_scales[row] = quantize_row_i8(vs, static_cast<int8_t*>(v_cache) + dst, hd);
      } else {
        convert_from_f32(ks, static_cast<char*>(k_cache) + dst * es, L.dtype, hd);
        convert_from_f32(vs, static_cast<char*>(v_cache) + dst * es, L.dtype, hd);
      }
    }
  });
}

namespace {

bool same_layout(const KVLayout& a, const KVLayout& b) {
  return a.num_blocks == b.num_blocks && a.block_size == b.block_size && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.dtype == b.dtype;
}

bool same_params(const AttentionParams& a, const AttentionParams& b) {
  return a.num_seqs == b.num_seqs && a.num_tokens == b.num_tokens && a.max_query_len == b.max_query_len &&
         a.max_context_len == b.max_context_len && a.cu_seqlens_q == b.cu_seqlens_q &&
         a.context_lens == b.context_lens && a.block_tables == b.block_tables &&
         a.max_blocks_per_seq == b.max_blocks_per_seq && a.window == b.window &&
         a.logit_softcap == b.logit_softcap;
}

}  // namespace

// Work items of the step, checked once: a tile of up to kQTile query rows of one sequence against
// one KV head (query tiles share each K/V block while it is hot in L1). The per-layer pointers
// (q, out, the layer's K/V buffers) are filled in by attention(). With a window, only the blocks
// from the sequence's first query's window on are read, so only those must be valid ids.
void CpuBackend::build_attention_plan(const KVLayout& L, const AttentionParams& p, int32_t num_q_heads,
                                      AttnPlan* plan) const {
  FANTAI_REQUIRE(L.num_kv_heads > 0 && L.head_dim > 0 && L.block_size > 0, "attention: bad KV layout");
  FANTAI_REQUIRE(num_q_heads > 0 && num_q_heads % L.num_kv_heads == 0,
                 "attention: num_q_heads " << num_q_heads << " not a multiple of num_kv_heads "
                                           << L.num_kv_heads);
  FANTAI_REQUIRE(p.window >= 0 && p.logit_softcap >= 0.f,
                 "attention: bad window " << p.window << " or soft-cap " << p.logit_softcap);
  plan->layout = L;
  plan->params = p;
  plan->num_q_heads = num_q_heads;
  plan->items.clear();
  plan->first_row.clear();
  plan->split_of.clear();
  plan->splits.clear();
  plan->partial_floats = 0;
  const int group = num_q_heads / L.num_kv_heads;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.cu_seqlens_q[s], qlen = p.cu_seqlens_q[s + 1] - q0, ctx = p.context_lens[s];
    FANTAI_REQUIRE(qlen >= 0 && ctx >= qlen,
                   "attention: sequence " << s << " has q_len " << qlen << " > context_len " << ctx);
    if (qlen == 0) continue;
    const int32_t* bt = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
    const int nblocks = static_cast<int>(ceil_div(ctx, L.block_size));
    FANTAI_REQUIRE(nblocks <= p.max_blocks_per_seq, "attention: sequence " << s << " needs " << nblocks
                                                                           << " blocks > max_blocks_per_seq "
                                                                           << p.max_blocks_per_seq);
    for (int b = first_visible_block(ctx - qlen, p.window, L.block_size); b < nblocks; ++b)
      FANTAI_REQUIRE(bt[b] >= 0 && bt[b] < L.num_blocks,
                     "attention: sequence " << s << " block " << b << " -> physical " << bt[b]
                                            << " out of range [0, " << L.num_blocks << ")");
    for (int t0 = 0; t0 < qlen; t0 += kAttnQTile)
      for (int g = 0; g < L.num_kv_heads; ++g) {
        AttnItem it;
        it.out_stride = static_cast<int64_t>(num_q_heads) * L.head_dim;
        it.kv_dtype = L.dtype;
        it.block_size = L.block_size;
        it.num_kv_heads = L.num_kv_heads;
        it.head_dim = L.head_dim;
        it.block_table = bt;
        it.kv_head = g;
        it.group = group;
        it.num_q = std::min(kAttnQTile, qlen - t0);
        it.first_pos = ctx - qlen + t0;
        it.window = p.window;
        it.softcap = p.logit_softcap;
        plan->items.push_back(it);
        plan->first_row.push_back(q0 + t0);
        plan->split_of.push_back(-1);
      }
  }
  split_rows(plan);
}

bool CpuBackend::amx_attention(const KVLayout& L) const {
  return amx_ && L.dtype == DType::kBF16 && amx_attention_supported(L.head_dim, L.block_size);
}

// Too few items for the threads (one sequence's decode has an item per KV head: 3 for SmolLM2,
// so on 2 threads one does two thirds of the work and on 16 threads 13 wait): decode rows whose
// keys span several partitions are cut into runs of partitions, each an item that writes its
// partitions' states, folded per (row, head) afterwards by attention_merge in the order one item
// folds them: the same bits (kernels.h). Splitting the heads of a group instead would read each
// K and V block once per part: twice the traffic for a row that streams them from memory. Not
// for the AMX kernel, which visits a row's keys in one pass.
void CpuBackend::split_rows(AttnPlan* plan) const {
  const int64_t n = static_cast<int64_t>(plan->items.size()), want = 2 * static_cast<int64_t>(pool_.size());
  if (pool_.size() < 2 || n == 0 || n >= want || amx_attention(plan->layout)) return;
  const KVLayout& L = plan->layout;
  const int pb = attn_partition_blocks(L.block_size), sf = attn_state_floats(L.head_dim);
  const int64_t cuts = ceil_div(want, n);
  plan->spare_items.clear();
  plan->spare_rows.clear();
  plan->spare_split.clear();
  for (int64_t i = 0; i < n; ++i) {
    const AttnItem& it = plan->items[i];
    const int64_t row = plan->first_row[i];
    // The kernel's block range for the row: from its window's first block to its own.
    const int p0 = first_visible_block(it.first_pos, it.window, L.block_size) / pb;
    const int p1 = it.first_pos / L.block_size / pb + 1;
    const int nparts = p1 - p0;
    if (it.num_q != 1 || nparts < 2) {
      plan->spare_items.push_back(it);
      plan->spare_rows.push_back(row);
      plan->spare_split.push_back(-1);
      continue;
    }
    const int runs = static_cast<int>(std::min<int64_t>(nparts, cuts));
    AttnPlan::Split sp;
    sp.parts = plan->partial_floats;
    sp.head_stride = static_cast<int64_t>(nparts) * sf;
    sp.out = row * it.out_stride + static_cast<int64_t>(it.kv_head) * it.group * it.head_dim;
    sp.nparts = nparts;
    sp.heads = it.group;
    sp.runs = runs;
    plan->partial_floats += it.group * sp.head_stride;
    const int32_t sid = static_cast<int32_t>(plan->splits.size());
    plan->splits.push_back(sp);
    for (int r = 0; r < runs; ++r) {
      AttnItem part = it;
      part.part_begin = p0 + r * nparts / runs;
      part.part_end = p0 + (r + 1) * nparts / runs;
      part.partial_head_stride = sp.head_stride;
      part.partial_part0 = p0;
      plan->spare_items.push_back(part);
      plan->spare_rows.push_back(row);
      plan->spare_split.push_back(sid);
    }
  }
  plan->items.swap(plan->spare_items);
  plan->first_row.swap(plan->spare_rows);
  plan->split_of.swap(plan->spare_split);
}

void CpuBackend::plan_attention(const KVLayout& L, const AttentionParams& p, int32_t num_q_heads) {
  for (size_t i = 0; i < num_plans_; ++i)
    if (same_layout(plans_[i].layout, L) && same_params(plans_[i].params, p) &&
        plans_[i].num_q_heads == num_q_heads)
      return;
  if (plans_.size() == num_plans_) plans_.emplace_back();
  AttnPlan& plan = plans_[num_plans_];
  plan.active = false;
  build_attention_plan(L, p, num_q_heads, &plan);
  plan.active = true;
  ++num_plans_;
}

void CpuBackend::end_attention_plan() {
  for (size_t i = 0; i < num_plans_; ++i) plans_[i].active = false;
  num_plans_ = 0;
}

void CpuBackend::attention(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                           const KVLayout& L, const AttentionParams& p, int32_t num_q_heads, float scale,
                           float* out) {
  // The step's plan when this call is one of its layers; otherwise (a direct call) a plan of its own.
  const AttnPlan* planned = nullptr;
  for (size_t i = 0; i < num_plans_ && !planned; ++i)
    if (same_layout(plans_[i].layout, L) && same_params(plans_[i].params, p) &&
        plans_[i].num_q_heads == num_q_heads)
      planned = &plans_[i];
  AttnPlan local;
  if (!planned) build_attention_plan(L, p, num_q_heads, &local);
  const AttnPlan& plan = planned ? *planned : local;
  if (plan.items.empty()) return;
  const int group = num_q_heads / L.num_kv_heads;
  const int hd = L.head_dim;
  const float* k_scales = L.dtype == DType::kI8 ? reinterpret_cast<const float*>(
                                                      static_cast<const char*>(k_cache) + L.scales_offset())
                                                : nullptr;
  const float* v_scales = L.dtype == DType::kI8 ? reinterpret_cast<const float*>(
                                                      static_cast<const char*>(v_cache) + L.scales_offset())
                                                : nullptr;
  // bf16 KV with AMX: tile kernel for every item of the call (and of every call: the choice
  // depends only on the layout).
  const bool amx_attn = amx_attention(L);
  const int64_t need = amx_attn ? amx_attn_scratch_floats(hd)
                                : attn_scratch_floats(kAttnQTile, group, hd, L.block_size);
  // Per-thread scratch (a few KiB per thread), grow-only: the step thread is the only caller, and
  // a fresh vector per layer was an allocation per layer per step.
  const int64_t per = (need + 16 + 15) / 16 * 16;
  const size_t total = static_cast<size_t>(per * pool_.size() + 16);
  if (attn_scratch_.size() < total) attn_scratch_.resize(total);
  float* const scratch = attn_scratch_.data();
  if (attn_partial_.size() < static_cast<size_t>(plan.partial_floats))
    attn_partial_.resize(plan.partial_floats);
  float* const partial = attn_partial_.data();
  const size_t nsplits = plan.splits.size();
  if (attn_done_size_ < nsplits) {
    attn_done_.reset(new std::atomic<int32_t>[nsplits]);
    attn_done_size_ = nsplits;
  }
  for (size_t i = 0; i < nsplits; ++i) attn_done_[i].store(0, std::memory_order_relaxed);
  const auto fn = amx_attn ? (bf16_act_ ? amx_attention_bf16_act : amx_attention_bf16) : k_.attention;
  // Causal work grows with a tile's position: hand out the last tiles first (longest first), so
  // the pool does not end on one thread finishing a long tile while the others wait.
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  pool_.parallel_for(n_items, [&](int64_t task, int tid) {
    const int64_t i = n_items - 1 - task;
    AttnItem it = plan.items[i];
    const int64_t row = plan.first_row[i];
    it.q = q + row * q_stride;
    it.q_stride = q_stride;
    it.out = out + row * it.out_stride;
    it.k_cache = k_cache;
    it.v_cache = v_cache;
    it.k_scales = k_scales;
    it.v_scales = v_scales;
    it.scale = scale;
    const int32_t sid = plan.split_of[i];
    it.partial = sid >= 0 ? partial + plan.splits[sid].parts : nullptr;
    // 64-byte align each thread's scratch (vector<float> only promises 16).
    float* base = scratch + per * tid;
    const uintptr_t a = (reinterpret_cast<uintptr_t>(base) + 63) & ~uintptr_t{63};
    fn(it, reinterpret_cast<float*>(a));
    // A split's last item folds its partitions (acq_rel: it sees the others' states), in the
    // same order whichever thread that is.
    if (sid >= 0) {
      const AttnPlan::Split& sp = plan.splits[sid];
      if (attn_done_[sid].fetch_add(1, std::memory_order_acq_rel) + 1 == sp.runs)
        for (int h = 0; h < sp.heads; ++h)
          k_.attention_merge(partial + sp.parts + h * sp.head_stride, sp.nparts, hd, out + sp.out + h * hd);
    }
  });
}

}  // namespace fantai::cpu
