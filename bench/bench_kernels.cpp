// bench: CPU kernel figures (µs, GFLOP/s, GB/s) for the shapes the model runs: linear at decode
// and prefill sizes incl. the lm_head, and paged attention decode / prefill. Warm caches.
//   bench_kernels [--threads N] [--isa avx512|avx2|scalar] [--min-ms T]
// Figures are best-of-N wall time; weights of the small shapes stay cache-resident.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"

using namespace fantai;

namespace {

double g_min_ms = 300;

// Best µs per call over repetitions lasting at least g_min_ms (after one warm-up call). The best,
// not the median: on a shared machine the other tenants only ever add time.
double time_us(const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  const auto start = std::chrono::steady_clock::now();
  do {
    const auto a = std::chrono::steady_clock::now();
    fn();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() < g_min_ms ||
           t.size() < 5);
  std::sort(t.begin(), t.end());
  return t.front();
}

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void report(const char* what, double us, double flops, double bytes) {
  std::printf("%-44s %10.1f us %9.1f GFLOP/s %8.1f GB/s\n", what, us, flops / us * 1e-3, bytes / us * 1e-3);
}

void bench_linear(Backend& b, int64_t m, int64_t n, int64_t k, DType wt) {
  auto x = randn(m * k, 1), wf = randn(n * k, 2);
  std::vector<uint16_t> wh;
  const void* w = wf.data();
  if (wt != DType::kF32) {
    wh.resize(wf.size());
    convert_from_f32(wf.data(), wh.data(), wt, wf.size());
    w = wh.data();
  }
  std::vector<float> y(m * n);
  const double us = time_us([&] { b.linear(x.data(), w, wt, nullptr, y.data(), m, n, k); });
  char name[96];
  std::snprintf(name, sizeof(name), "linear %-5s m=%-4lld n=%-6lld k=%lld", dtype_name(wt) + 0,
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
  const double bytes = static_cast<double>(n) * k * dtype_size(wt) + 4.0 * (m * k + m * n);
  report(name, us, 2.0 * m * n * k, bytes);
}

// num_seqs sequences, each with context ctx of which q_len are new queries this step.
void bench_attention(Backend& b, const char* label, int num_seqs, int q_len, int ctx, DType kv) {
  const int hd = 64, nkv = 3, nqh = 9, bs = 16;
  const int blocks_per_seq = (ctx + bs - 1) / bs;
  KVLayout L;
  L.num_blocks = num_seqs * blocks_per_seq;
  L.block_size = bs;
  L.num_kv_heads = nkv;
  L.head_dim = hd;
  L.dtype = kv;
  const size_t cache_elems = static_cast<size_t>(L.num_blocks) * nkv * bs * hd;
  std::vector<uint8_t> kc(cache_elems * dtype_size(kv)), vc(kc.size());
  auto kf = randn(cache_elems, 3), vf = randn(cache_elems, 4);
  convert_from_f32(kf.data(), kc.data(), kv, cache_elems);
  convert_from_f32(vf.data(), vc.data(), kv, cache_elems);
  std::vector<int32_t> tables(num_seqs * blocks_per_seq), ctxs(num_seqs, ctx), cu(num_seqs + 1);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  for (int s = 0; s <= num_seqs; ++s) cu[s] = s * q_len;
  AttentionParams p;
  p.num_seqs = num_seqs;
  p.num_tokens = num_seqs * q_len;
  p.max_query_len = q_len;
  p.max_context_len = ctx;
  p.cu_seqlens_q = cu.data();
  p.context_lens = ctxs.data();
  p.block_tables = tables.data();
  p.max_blocks_per_seq = blocks_per_seq;
  const int64_t q_stride = static_cast<int64_t>(nqh) * hd;
  auto q = randn(p.num_tokens * q_stride, 5);
  std::vector<float> out(p.num_tokens * q_stride);
  const double us = time_us([&] {
    b.attention(q.data(), q_stride, kc.data(), vc.data(), L, p, nqh, 0.125f, out.data());
  });
  // Keys visited: query j of a sequence sees ctx - q_len + j + 1 keys.
  double keys = 0;
  for (int j = 0; j < q_len; ++j) keys += ctx - q_len + j + 1;
  keys *= num_seqs;
  char name[96];
  std::snprintf(name, sizeof(name), "attention %s seqs=%d q=%d ctx=%d %s", label, num_seqs, q_len, ctx,
                dtype_name(kv));
  report(name, us, 4.0 * hd * nqh * keys, 2.0 * cache_elems * dtype_size(kv));
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  cpu::Isa isa = cpu::active_isa();
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--isa") && i + 1 < argc) {
      if (!cpu::parse_isa(argv[++i], &isa)) { std::fprintf(stderr, "unknown isa %s\n", argv[i]); return 2; }
    } else if (!std::strcmp(argv[i], "--min-ms") && i + 1 < argc) g_min_ms = std::atof(argv[++i]);
    else { std::fprintf(stderr, "usage: %s [--threads N] [--isa avx512|avx2|scalar] [--min-ms T]\n", argv[0]); return 2; }
  }
  auto b = cpu::make_cpu_backend(isa, threads);
  std::printf("cpu backend: isa=%s (detected %s) threads=%d\n", cpu::isa_name(isa),
              cpu::isa_name(cpu::detected_isa()), b->num_threads());
  for (DType wt : {DType::kBF16, DType::kF32}) {
    for (int64_t m : {1, 16, 256}) bench_linear(*b, m, 1536, 576, wt);
    for (int64_t m : {1, 16}) bench_linear(*b, m, 49152, 576, wt);
  }
  bench_attention(*b, "decode ", 16, 1, 512, DType::kF32);
  bench_attention(*b, "decode ", 16, 1, 512, DType::kBF16);
  bench_attention(*b, "prefill", 1, 512, 512, DType::kF32);
  bench_attention(*b, "chunk  ", 4, 64, 1024, DType::kF32);
  return 0;
}
