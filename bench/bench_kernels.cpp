// bench: CPU kernel figures (µs, GFLOP/s, GB/s) for the shapes the model runs: linear at decode
// and prefill sizes incl. the lm_head, and paged attention decode / prefill. Warm caches.
//   bench_kernels [--threads N] [--isa avx512|avxvnni|avx2|scalar] [--min-ms T] [--short]
// Figures are best-of-N wall time; weights of the small shapes stay cache-resident.
// --short (CI): a few seconds, a subset of shapes, each kernel's output checked against the
// double-precision reference (cpu::ref) within its arithmetic's error bound; exits 1 on a miss,
// never on a time.
// Over 400 lines: one binary with a section per op family (probe, linear, qlinear, attention,
// step, moe), each short, sharing the timing and roofline helpers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the reduce intrinsics' own _mm512_undefined_* placeholders (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

#include "backend/backend.h"
#include "common/types.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_features.h"
#include "cpu/kernels.h"
#include "cpu/qkernels.h"
#include "cpu/thread_pool.h"
#include "model/quant_formats.h"

using namespace fantai;

namespace {

double g_min_ms = 300;

// Best µs per call over repetitions lasting at least g_min_ms (after one warm-up call). The best,
// not the median: on a shared machine the other tenants only ever add time.
// --cpu-time: time on the calling thread's CPU clock instead of the wall clock (only meaningful
// with --threads 1; it leaves out the time other tenants hold the core).
bool g_cpu_time = false;

double now_us() {
  if (g_cpu_time) {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A figure's runs after one warm-up: at least 5, and at least --min-ms in all. best is what the
// figures print, as the probes do; median says how far a typical run sits from it (a shared VM's
// decode linears ran 18-25% slower at the median than at the best).
struct Runs {
  double best_us, median_us;
  size_t count;
};

Runs time_runs(const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  const auto start = std::chrono::steady_clock::now();
  do {
    const double a = now_us();
    fn();
    t.push_back(now_us() - a);
  } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() <
               g_min_ms ||
           t.size() < 5);
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2], t.size()};
}

double time_us(const std::function<void()>& fn) { return time_runs(fn).best_us; }

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

bool g_amx_packs = false;  // the backend packs bf16 into AMX tiles (avx512, AMX usable, FANTAI_AMX)

// --short: the probes' peaks, so each figure can be printed as a share of its roofline.
bool g_short = false;
double g_peak_gflops = 0;  // the widest f32 FMA probe
double g_read_gbs = 0;     // the largest read-bandwidth probe

void report(const char* what, double us, double flops, double bytes) {
  std::printf("%-44s %10.1f us %9.1f GFLOP/s %8.1f GB/s", what, us, flops / us * 1e-3, bytes / us * 1e-3);
  if (g_short && g_peak_gflops > 0 && g_read_gbs > 0)
    std::printf("  (%3.0f%% of f32 FMA, %3.0f%% of read BW)", 100.0 * flops / us * 1e-3 / g_peak_gflops,
                100.0 * bytes / us * 1e-3 / g_read_gbs);
  std::printf("\n");
}

// ---- --short: results against the reference ----------------------------------------------------
// Worst-case relative error of a sum of n floating-point terms in any order (Higham's gamma_n,
// unit roundoff 2^-24): the bound every f32 accumulation below is held to.
double gamma_f32(double n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1 - n * u);
}

int g_checks = 0, g_failed = 0;

// |got - want| <= bound elementwise; prints the worst error / bound so a kernel drifting toward
// its bound shows before it crosses it.
void check(const char* what, const float* got, const float* want, const std::vector<double>& bound) {
  double worst = 0;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < bound.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= bound[i])) {  // NaN fails too
      if (bad++ == 0) first = i;
    }
    if (bound[i] > 0) worst = std::max(worst, err / bound[i]);
  }
  ++g_checks;
  if (bad) {
    ++g_failed;
    std::printf(
        "    FAIL %s: %zu of %zu outputs out of bound (first at %zu: got %.9g want %.9g bound %.3g)\n", what,
        bad, bound.size(), first, got[first], want[first], bound[first]);
  } else {
    std::printf("    ok   %s: worst error %.2g of its bound\n", what, worst);
  }
}

// sum_k |x[r, k]| * |w[j, k]| for every output: the cancellation-free magnitude the f32 error
// bounds scale with.
std::vector<double> magnitude(const float* x, const float* w, int64_t m, int64_t n, int64_t k) {
  std::vector<double> mag(m * n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t i = 0; i < k; ++i) s += std::fabs(static_cast<double>(x[r * k + i]) * w[j * k + i]);
      mag[r * n + j] = s;
    }
  return mag;
}

// A dense linear's y against ref::linear: f32 products of exact operands (bf16/f16 weights widen
// exactly), k + 1 roundings (the sum and the bias-free store).
void check_linear(const char* what, const float* y, const float* x, const void* w, DType wt, int64_t m,
                  int64_t n, int64_t k, double extra_rel = 0, double terms = 0) {
  std::vector<float> want(m * n);
  cpu::ref::linear(x, w, wt, nullptr, want.data(), m, n, k);
  std::vector<float> wv(n * k);
  convert_to_f32(w, wt, wv.data(), wv.size());  // the values the kernel multiplies
  std::vector<double> bound = magnitude(x, wv.data(), m, n, k);
  for (auto& b : bound) b *= gamma_f32(terms > 0 ? terms : k + 1.0) + extra_rel;
  check(what, y, want.data(), bound);
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
  if (g_short) check_linear(name, y.data(), x.data(), w, wt, m, n, k);
}

// ---- quantized weights ---------------------------------------------------------------------------
// A random matrix in one of the formats the loaders produce, packed by the backend.
struct QFormat {
  const char* name;
  int bits, group, zero_point;
  bool min;
  // K-quant scales: an f16 factor per super-block of `factor` groups times a small integer per
  // group, as the file stores them. keep_factors: hand the backend the factors too (what the GGUF
  // loader does, so the CPU keeps only them); false: only the f32 products (the layout before).
  int factor = 0;
  bool keep_factors = false;
  // Bits of the stored values when fewer than `bits` (GGUF Q5_x / Q6_K: 5- or 6-bit values the
  // canonical form holds as bytes; Q2_K / Q3_K: 2- or 3-bit values in nibbles); 0: all `bits`.
  int width = 0;
  // Values drawn from GGUF IQ4's 16 non-linear levels (int8 level + 128, as the decoder gives
  // them), which the CPU keeps as 4-bit codebook indices.
  bool iq4 = false;
  // Bits of the per-group integers the factored scales and mins multiply (Q2_K: 4, the rest 6).
  int sub_bits = 6;
};
const QFormat kQFormats[] = {{"q4_1", 4, 32, 0, true},
                             {"q4_0", 4, 32, 8, false},
                             {"q8_0", 8, 32, 128, false},
                             {"q4_k", 4, 32, 0, true},
                             {"q6_k", 8, 16, 32, false, 0, false, 6},
                             {"q5_0", 8, 32, 16, false, 0, false, 5},
                             {"int8", 8, 0, 128, false}};

struct QWeight {
  void* mem = nullptr;
  Backend* b = nullptr;
  QuantMatrix w;
  size_t bytes = 0;
  QWeight() = default;
  model::QuantTensor t;  // the canonical form, kept under --short for the reference
  QWeight(Backend& be, const QFormat& f, int64_t rows, int64_t cols, uint32_t seed) : b(&be) {
    t.bits = f.bits;
    t.group = f.group ? f.group : static_cast<int32_t>(cols);
    t.rows = rows;
    t.cols = cols;
    t.zero_point = f.zero_point;
    const int64_t ng = (cols + t.group - 1) / t.group;
    std::mt19937 g(seed);
    t.q.resize(rows * cols);
    const int width = f.width ? f.width : f.bits;
    static constexpr uint8_t kIq4[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                         129, 141, 153, 166, 181, 197, 217, 241};
    for (auto& v : t.q) v = f.iq4 ? kIq4[g() & 15] : static_cast<uint8_t>(g() & ((1u << width) - 1));
    t.scale.assign(rows * ng, 0.0078125f);  // f16 values, as the GGUF formats hold them
    if (f.min) t.min.assign(rows * ng, -0.0625f);
    if (f.factor > 0 && ng % f.factor == 0) {
      const int64_t nsup = ng / f.factor;
      t.fscale.resize(rows * nsup);
      t.iscale.resize(rows * ng);
      for (int64_t i = 0; i < rows * nsup; ++i)
        t.fscale[i] = f16_to_f32(f32_to_f16(0.0011f + 1e-6f * (i % 97)));
      const uint32_t sub_range = 1u << f.sub_bits;
      for (int64_t i = 0; i < rows * ng; ++i) t.iscale[i] = static_cast<int8_t>(1 + g() % (sub_range - 1));
      if (f.min) {
        t.fmin.assign(rows * nsup, f16_to_f32(f32_to_f16(-0.0013f)));
        t.imin.resize(rows * ng);
        for (auto& v : t.imin) v = static_cast<int8_t>(g() % sub_range);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < ng; ++j) {
          const int64_t i = r * ng + j, si = r * nsup + j / f.factor;
          t.scale[i] = t.fscale[si] * static_cast<float>(t.iscale[i]);
          if (f.min) t.min[i] = t.fmin[si] * static_cast<float>(t.imin[i]);
        }
      if (f.keep_factors) {
        t.fgroups = f.factor;
      } else {
        t.fscale.clear(), t.iscale.clear(), t.fmin.clear(), t.imin.clear();
      }
    }
    bytes = be.quant_packed_bytes(t.view());
    mem = be.alloc_weights(bytes);
    w = be.pack_quant(t.view(), mem);
    if (!g_short) t = model::QuantTensor();  // a full qstep holds 30 layers of these
  }
  QWeight(QWeight&& o) noexcept : mem(o.mem), b(o.b), w(o.w), bytes(o.bytes), t(std::move(o.t)) {
    o.mem = nullptr;
  }
  QWeight& operator=(QWeight&& o) noexcept {
    std::swap(t, o.t);
    std::swap(mem, o.mem);
    std::swap(b, o.b);
    std::swap(w, o.w);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~QWeight() {
    if (mem) b->free(mem);
  }
};

void bench_linear_q(Backend& b, const QFormat& f, int64_t m, int64_t n, int64_t k) {
  QWeight w(b, f, n, k, 3);
  auto x = randn(m * k, 1);
  std::vector<float> y(m * n);
  const double us = time_us([&] { b.linear_q(x.data(), w.w, nullptr, y.data(), m, n); });
  char name[96];
  std::snprintf(name, sizeof(name), "linear_q %-5s m=%-4lld n=%-6lld k=%lld", f.name,
                static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
  report(name, us, 2.0 * m * n * k, static_cast<double>(w.bytes) + 4.0 * (m * k + m * n));
  if (!g_short) return;
  // Against the exact activations (double, ref::linear_q): the kernel may quantize x per block of
  // xq_block columns to int8 (scale max|x| / 127, so each value moves by at most max|x| / 254, and
  // 1% more for the scale's own rounding), which moves an output by that times the block's sum
  // |w|; the rest is f32 accumulation.
  std::vector<float> want(m * n), wd(n * k);
  cpu::ref::linear_q(x.data(), w.t.view(), nullptr, want.data(), m, n);
  cpu::ref::dequantize(w.t.view(), wd.data());
  const std::vector<double> mag = magnitude(x.data(), wd.data(), m, n, k);
  const int64_t blk = cpu::xq_block(w.w);
  std::vector<double> bound(m * n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double q = 0;
      for (int64_t c0 = 0; c0 < k; c0 += blk) {
        double amax = 0, wsum = 0;
        for (int64_t c = c0; c < std::min(k, c0 + blk); ++c) {
          amax = std::max(amax, std::fabs(static_cast<double>(x[r * k + c])));
          wsum += std::fabs(static_cast<double>(wd[j * k + c]));
        }
        q += amax / 254 * wsum;
      }
      bound[r * n + j] = 1.01 * q + gamma_f32(static_cast<double>(k) + 2) * mag[r * n + j];
    }
  check(name, y.data(), want.data(), bound);
}

// K-quant matrices as a GGUF holds them (factored scales), in the layout the loader gets now
// (factors kept: f16 per super-block, int8 per group) and in the one before (f32 scale and min
// per group), decode (m = 1) over 24 matrices of [4096, 4096] (more than the caches), one after
// another; GB/s of the bytes the layout keeps, against the read-bandwidth probe.
// The other GGUF formats follow at the same shape (their scales f16 values, as the file's), so
// every format's decode bandwidth can be compared on one out-of-cache workload.
const QFormat kKFormats[] = {{"q4_k", 4, 32, 0, true, 8, true},
                             {"q4_k f32 scales", 4, 32, 0, true, 8, false},
                             {"q6_k", 8, 16, 32, false, 16, true, 6},
                             {"q6_k f32 scales", 8, 16, 32, false, 16, false, 6},
                             {"q5_k", 8, 32, 0, true, 8, true, 5},
                             {"q5_0", 8, 32, 16, false, 0, false, 5},
                             {"q5_1", 8, 32, 0, true, 0, false, 5},
                             {"iq4_nl", 8, 32, 128, false, 0, false, 0, true},
                             {"iq4_xs", 8, 32, 128, false, 8, true, 0, true},
                             {"q3_k", 4, 16, 4, false, 16, true, 3},
                             {"q2_k", 4, 16, 0, true, 16, true, 2, false, 4},
                             {"q4_0", 4, 32, 8, false},
                             {"q4_1", 4, 32, 0, true},
                             {"q8_0", 8, 32, 128, false}};

// " (N% of read BW X GB/s)" for bytes streamed in us, when the probe has run.
void print_read_share(double bytes, double us) {
  if (g_read_gbs > 0)
    std::printf("  (%3.0f%% of read BW %.1f GB/s)", 100.0 * bytes / us * 1e-3 / g_read_gbs, g_read_gbs);
}

// One kstep line: count matrices of [n, k] read in us.
void print_kstep(const char* name, int64_t count, int64_t n, int64_t k, double us, size_t bytes,
                 bool in_cache) {
  std::printf("kstep %-16s %lld x [%lld, %lld] m=1: %8.0f us  %6.3f B/weight  %6.1f GB/s", name,
              static_cast<long long>(count), static_cast<long long>(n), static_cast<long long>(k), us,
              static_cast<double>(bytes) / (count * n * k), bytes / us * 1e-3);
  if (in_cache) std::printf("  (%.1f ps per weight, in cache)", us * 1e6 / (count * n * k));
  else print_read_share(bytes, us);
  std::printf("\n");
}

// in_cache: 24 matrices of [1024, 1024] instead (9-25 MB: in a 32 MB L3), which leaves the
// kernel's own cost per weight, steadier than DRAM on a shared host, to compare two builds on.
void bench_kstep(Backend& b, const QFormat& f, bool in_cache) {
  const int64_t n = in_cache ? 1024 : 4096, k = n, count = 24;
  std::vector<QWeight> ws;
  size_t bytes = 0;
  for (int64_t i = 0; i < count; ++i) {
    ws.emplace_back(b, f, n, k, static_cast<uint32_t>(40 + i));
    bytes += ws.back().bytes;
  }
  auto x = randn(k, 9);
  std::vector<float> y(n);
  const double us = time_us([&] {
    for (const QWeight& w : ws) b.linear_q(x.data(), w.w, nullptr, y.data(), 1, n);
  });
  print_kstep(f.name, count, n, k, us, bytes, in_cache);
}

// A [rows, cols] bf16 matrix of N(0, 1) values in the layout the backend runs dense bf16 in
// (packed pairs where it packs off AMX, else row-major), and that layout's linear.
bool bf16_packed(Backend& b) { return !g_amx_packs && b.dense_packed_bytes(DType::kBF16, 64, 64) > 0; }
struct Bf16Weight {
  std::vector<uint8_t> data;
  bool packed = false;
  size_t bytes = 0;
};
Bf16Weight bf16_matrix(Backend& b, int64_t rows, int64_t cols, uint32_t seed) {
  auto f = randn(rows * cols, seed);
  Bf16Weight w;
  w.data.resize(f.size() * 2);
  convert_from_f32(f.data(), w.data.data(), DType::kBF16, f.size());
  w.packed = bf16_packed(b);
  if (w.packed) {
    std::vector<uint8_t> p(b.dense_packed_bytes(DType::kBF16, rows, cols));
    b.pack_dense(w.data.data(), DType::kBF16, rows, cols, p.data());
    w.data.swap(p);
  }
  w.bytes = w.data.size();
  return w;
}
void bf16_linear(Backend& b, const float* x, const Bf16Weight& w, float* y, int64_t n, int64_t k) {
  if (w.packed) b.linear_packed(x, w.data.data(), DType::kBF16, nullptr, y, 1, n, k);
  else b.linear(x, w.data.data(), DType::kBF16, nullptr, y, 1, n, k);
}

// kstep's bf16 line: decode (m = 1) over 12 x [4096, 4096] dense bf16 matrices (0.4 GB) out of
// cache, 24 x [1024, 1024] in it.
void bench_kstep_bf16(Backend& b, bool in_cache) {
  const int64_t n = in_cache ? 1024 : 4096, k = n, count = in_cache ? 24 : 12;
  std::vector<Bf16Weight> ws;
  size_t bytes = 0;
  for (int64_t i = 0; i < count; ++i) {
    ws.push_back(bf16_matrix(b, n, k, static_cast<uint32_t>(40 + i)));
    bytes += ws.back().bytes;
  }
  auto x = randn(k, 9);
  std::vector<float> y(n);
  const double us = time_us([&] {
    for (const auto& w : ws) bf16_linear(b, x.data(), w, y.data(), n, k);
  });
  print_kstep(bf16_packed(b) ? "bf16 packed" : "bf16", count, n, k, us, bytes, in_cache);
}

// SmolLM2-135M's decode step, its linears and lm_head back to back with nothing else timed
// (attention is measured by --only step), so the figure is the weights'. `make(rows, cols, seed)`
// builds one matrix (a type with `bytes`), `mul(x, w, y, rows, cols)` runs it on one row.
template <class Make, class MakeLm, class Mul>
void time_decode_linears(const char* name, const char* lm_name, int layers, Make make, MakeLm make_lm,
                         Mul mul) {
  const int64_t H = 576, nh = 9, nkv = 3, hd = 64, I = 1536, V = 49152;
  const int64_t qkv_dim = (nh + 2 * nkv) * hd;
  using Wt = decltype(make(int64_t{1}, int64_t{1}, uint32_t{1}));
  struct Layer {
    Wt qkv, o, gu, down;
  };
  std::vector<Layer> Ls(layers);
  size_t bytes = 0;
  for (int l = 0; l < layers; ++l) {
    const uint32_t s = static_cast<uint32_t>(l);
    Ls[l] = {make(qkv_dim, H, 10 + s), make(H, nh * hd, 100 + s), make(2 * I, H, 200 + s),
             make(H, I, 300 + s)};
    bytes += Ls[l].qkv.bytes + Ls[l].o.bytes + Ls[l].gu.bytes + Ls[l].down.bytes;
  }
  const auto lm = make_lm(V, H, 7u);
  bytes += lm.bytes;
  auto x = randn(I, 9);
  std::vector<float> qkv(qkv_dim), proj(H), gu(2 * I), logits(V);
  const Runs runs = time_runs([&] {
    for (int l = 0; l < layers; ++l) {
      mul(x.data(), Ls[l].qkv, qkv.data(), qkv_dim, H);
      mul(x.data(), Ls[l].o, proj.data(), H, nh * hd);
      mul(x.data(), Ls[l].gu, gu.data(), 2 * I, H);
      mul(x.data(), Ls[l].down, proj.data(), H, I);
    }
    mul(x.data(), lm, logits.data(), V, H);
  });
  const double us = runs.best_us;
  std::printf(
      "qstep decode linears %-5s + lm_head %s: %8.0f us  %7.1f steps/s  %6.1f GB/s  (%.1f MiB weights)", name,
      lm_name, us, 1e6 / us, bytes / us * 1e-3, bytes / 1048576.0);
  print_read_share(bytes, us);
  // An engine's decode rate averages typical steps, not the best one.
  std::printf("  median %.0f us of %zu runs", runs.median_us, runs.count);
  std::printf("\n");
}

// The decode step as the default GGUF holds it: every projection in `f` (Q4_1 in the file), the
// tied lm_head Q8_0.
void bench_qstep(Backend& b, const QFormat& f, int layers = 30) {
  auto mul = [&](const float* x, const QWeight& w, float* y, int64_t n, int64_t) {
    b.linear_q(x, w.w, nullptr, y, 1, n);
  };
  time_decode_linears(
      f.name, "q8_0", layers, [&](int64_t r, int64_t c, uint32_t s) { return QWeight(b, f, r, c, s); },
      [&](int64_t r, int64_t c, uint32_t s) { return QWeight(b, kQFormats[2], r, c, s); }, mul);
}

// The bf16 model's: every matrix dense bf16, the lm_head too.
void bench_qstep_bf16(Backend& b, int layers) {
  auto make = [&](int64_t r, int64_t c, uint32_t s) { return bf16_matrix(b, r, c, s); };
  auto mul = [&](const float* x, const Bf16Weight& w, float* y, int64_t n, int64_t k) {
    bf16_linear(b, x, w, y, n, k);
  };
  time_decode_linears("bf16", "bf16", layers, make, make, mul);
}

// The read-bandwidth probe (512 MB arrays); 0 without AVX2. Measured once and kept, unless fresh.
double dram_bandwidth_gbs(int T, bool fresh = false);

// ---- mixture of experts --------------------------------------------------------------------------
// One Qwen3-30B-A3B-sized sparse layer (128 experts of hidden 2048 x inter 768, top 8) through
// Backend::moe_experts, experts in `f` (or dense bf16, AMX-packed where the backend packs).
// GB/s counts the matrices of the experts a call touches, each read once, against the
// read-bandwidth probe; the experts (0.36-1.2 GB) exceed the caches.
void bench_moe(Backend& b, const QFormat* f, int64_t tokens) {
  const int32_t E = 128, k = 8;
  const int64_t H = 2048, I = 768;
  std::vector<QWeight> q;
  std::vector<std::vector<uint16_t>> dense;
  std::vector<void*> packed;
  std::vector<MoeExpert> view(E);
  size_t expert_bytes = 0;
  for (int32_t e = 0; e < E; ++e) {
    if (f) {
      q.emplace_back(b, *f, I, H, 1000 + 3 * e);
      q.emplace_back(b, *f, I, H, 1001 + 3 * e);
      q.emplace_back(b, *f, H, I, 1002 + 3 * e);
      MoeExpert& x = view[e];
      x.gate_up.num_parts = 2;
      x.gate_up.parts[0] = q[q.size() - 3].w;
      x.gate_up.parts[1] = q[q.size() - 2].w;
      x.gate_up.part_row0[1] = I;
      x.down.num_parts = 1;
      x.down.parts[0] = q.back().w;
      expert_bytes = q[0].bytes + q[1].bytes + q[2].bytes;
    } else {
      for (auto [n, kk] : {std::pair<int64_t, int64_t>{2 * I, H}, {H, I}}) {
        std::vector<uint16_t> w(n * kk, 0x3c00);  // bf16 1.0-ish bits: the values do not matter
        const size_t pb = b.dense_packed_bytes(DType::kBF16, n, kk);
        if (pb) {
          packed.push_back(b.alloc(pb));
          b.pack_dense(w.data(), DType::kBF16, n, kk, packed.back());
        } else {
          dense.push_back(std::move(w));
        }
      }
      const bool is_packed = !packed.empty();
      view[e].gate_up.dense = is_packed ? packed[packed.size() - 2] : dense[dense.size() - 2].data();
      view[e].down.dense = is_packed ? packed.back() : dense.back().data();
      expert_bytes = 3 * H * I * 2;
    }
  }
  MoeExperts ex;
  ex.num_experts = E, ex.hidden = H, ex.inter = I, ex.dtype = DType::kBF16, ex.experts = view.data();
  ex.packed = !f && !packed.empty();
  // Round-robin routings: call c's slots take experts c * tokens * k, c * tokens * k + 1, ... (mod
  // E), so consecutive calls touch other experts and a cycle sweeps all of them (a random choice
  // of 8 per call keeps re-reading a cache-sized subset).
  constexpr int kRoutings = 16;
  std::vector<std::vector<int32_t>> ids(kRoutings, std::vector<int32_t>(tokens * k));
  for (int r = 0; r < kRoutings; ++r)
    for (int64_t s = 0; s < tokens * k; ++s) ids[r][s] = static_cast<int32_t>((r * tokens * k + s) % E);
  const double touched = static_cast<double>(std::min<int64_t>(E, tokens * k));
  const std::vector<float> w(tokens * k, 0.125f);
  auto x = randn(tokens * H, 3);
  std::vector<float> out(tokens * H);
  // The mean over a whole cycle after a warm-up cycle, not the best call: the best is the call
  // whose experts happened to stay in the last-level cache. (512 tokens: 3 calls, compute-bound.)
  const int calls = tokens >= 512 ? 3 : kRoutings;
  auto cycle = [&] {
    for (int c = 0; c < calls; ++c)
      b.moe_experts(x.data(), ids[c].data(), w.data(), tokens, k, ex, out.data());
  };
  cycle();
  const double t0 = now_us();
  cycle();
  const double us = (now_us() - t0) / calls;
  const double bytes = touched * static_cast<double>(expert_bytes);
  char name[96];
  std::snprintf(name, sizeof(name), "moe_experts %-5s tokens=%-4lld (%3.0f of %d experts)",
                f ? f->name : "bf16", static_cast<long long>(tokens), touched, E);
  std::printf("%-52s %10.1f us %8.1f GB/s", name, us, bytes / us * 1e-3);
  print_read_share(bytes, us);
  std::printf("  %8.1f tok/s\n", tokens * 1e6 / us);
  for (void* p : packed) b.free(p);
}

// Attention over the first pool against ref::attention over the same cache (so int8 and bf16
// values are the same on both sides). Per output (query row, head, d): scores carry f32 dot
// product error gamma(hd + 1) * scale * sum |q k|, exp a few ulps (2^-20 leaves room for the
// kernels' polynomial), so each softmax weight is off by at most a factor (1 +- E),
// E = 2 * (max score error + 2^-20) + gamma(ctx + 2), and the output by E * sum_t p_t |v_t|
// plus gamma(ctx + 2) of the same sum for the weighted accumulation.
void check_attention(const char* what, Backend& b, const float* q, int64_t q_stride, const void* kc,
                     const void* vc, const KVLayout& L, const AttentionParams& p, int nqh, float scale) {
  const int hd = L.head_dim, group = nqh / L.num_kv_heads;
  std::vector<float> got(static_cast<size_t>(p.num_tokens) * nqh * hd), want(got.size());
  b.attention(q, q_stride, kc, vc, L, p, nqh, scale, got.data());
  cpu::ref::attention(q, q_stride, kc, vc, L, p, nqh, scale, want.data());
  // The cache's values as doubles, to build the bound (int8: value times its (slot, head) scale).
  const int64_t elems = static_cast<int64_t>(L.num_blocks) * L.num_kv_heads * L.block_size * hd;
  std::vector<float> kf(elems), vf(elems);
  auto widen = [&](const void* cache, std::vector<float>& out) {
    if (L.dtype == DType::kI8) {
      const auto* v = static_cast<const int8_t*>(cache);
      const auto* sc = reinterpret_cast<const float*>(static_cast<const uint8_t*>(cache) + L.scales_offset());
      for (int64_t i = 0; i < elems; ++i) out[i] = v[i] * sc[i / hd];
    } else {
      convert_to_f32(cache, L.dtype, out.data(), elems);
    }
  };
  widen(kc, kf);
  widen(vc, vf);
  std::vector<double> bound(got.size());
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.cu_seqlens_q[s], qlen = p.cu_seqlens_q[s + 1] - q0, ctx = p.context_lens[s];
    const int32_t* bt = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;
    for (int j = 0; j < qlen; ++j) {
      const int pos = ctx - qlen + j;
      for (int h = 0; h < nqh; ++h) {
        const float* qv = q + static_cast<int64_t>(q0 + j) * q_stride + h * hd;
        auto row = [&](int t) {
          return ((static_cast<int64_t>(bt[t / L.block_size]) * L.num_kv_heads + h / group) * L.block_size +
                  t % L.block_size) *
                 hd;
        };
        std::vector<double> sc(pos + 1);
        double mx = -1e300, serr = 0;
        for (int t = 0; t <= pos; ++t) {
          double d0 = 0, a = 0;
          for (int d = 0; d < hd; ++d) {
            d0 += static_cast<double>(qv[d]) * kf[row(t) + d];
            a += std::fabs(static_cast<double>(qv[d]) * kf[row(t) + d]);
          }
          sc[t] = d0 * scale;
          mx = std::max(mx, sc[t]);
          serr = std::max(serr, gamma_f32(hd + 1.0) * scale * a);
        }
        double sum = 0;
        for (int t = 0; t <= pos; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
        const double E = 2 * (serr + std::ldexp(1.0, -20)) + gamma_f32(pos + 3.0);
        for (int d = 0; d < hd; ++d) {
          double a = 0;
          for (int t = 0; t <= pos; ++t) a += sc[t] / sum * std::fabs(static_cast<double>(vf[row(t) + d]));
          bound[(static_cast<int64_t>(q0 + j) * nqh + h) * hd + d] = (E + gamma_f32(pos + 3.0)) * a;
        }
      }
    }
  }
  check(what, got.data(), want.data(), bound);
}

// num_seqs sequences, each with context ctx of which q_len are new queries this step, SmolLM2's
// heads (9 query / 3 KV of 64). The cache is filled through store_kv (int8 gets its scales).
// copies > 1 rotates over that many independent pools, as a step's layers do, so the KV comes
// from DRAM rather than from a cache still warm from the previous call. Prints µs, GB/s of KV
// bytes read (values + int8 scales) and that rate as a fraction of the measured DRAM read
// bandwidth (0 when no probe).
void bench_attention(Backend& b, const char* label, int num_seqs, int q_len, int ctx, DType kv,
                     int copies = 1, double dram_gbs = 0) {
  const int hd = 64, nkv = 3, nqh = 9, bs = 16;
  const int blocks_per_seq = (ctx + bs - 1) / bs;
  KVLayout L;
  L.num_blocks = num_seqs * blocks_per_seq;
  L.block_size = bs;
  L.num_kv_heads = nkv;
  L.head_dim = hd;
  L.dtype = kv;
  std::vector<std::vector<uint8_t>> kc(copies), vc(copies);
  const int64_t row = static_cast<int64_t>(nkv) * hd;
  const int64_t slots = L.slots();
  std::vector<int64_t> slot_ids(slots);
  for (int64_t i = 0; i < slots; ++i) slot_ids[i] = i;
  for (int c = 0; c < copies; ++c) {
    kc[c].assign(L.bytes(), 0);
    vc[c].assign(L.bytes(), 0);
    auto kf = randn(slots * row, 3 + c), vf = randn(slots * row, 4 + c);
    b.store_kv(kf.data(), vf.data(), row, slot_ids.data(), slots, kc[c].data(), vc[c].data(), L);
  }
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
  int next = 0;
  const double us = time_us([&] {
    b.attention(q.data(), q_stride, kc[next].data(), vc[next].data(), L, p, nqh, 0.125f, out.data());
    next = (next + 1) % copies;
  });
  // Keys visited: query j of a sequence sees ctx - q_len + j + 1 keys.
  double keys = 0;
  for (int j = 0; j < q_len; ++j) keys += ctx - q_len + j + 1;
  keys *= num_seqs;
  // Bytes read: every context token's K and V row of every KV head once (the GQA group shares it).
  const double token_bytes = static_cast<double>(hd) * dtype_size(kv) + (kv == DType::kI8 ? 4 : 0);
  const double bytes = 2.0 * num_seqs * ctx * nkv * token_bytes;
  char name[96];
  std::snprintf(name, sizeof(name), "attention %s seqs=%d q=%d ctx=%d %-8s%s", label, num_seqs, q_len, ctx,
                dtype_name(kv), copies > 1 ? " cold" : " hot ");
  std::printf("%-52s %10.1f us %9.1f GFLOP/s %8.1f GB/s", name, us, 4.0 * hd * nqh * keys / us * 1e-3,
              bytes / us * 1e-3);
  if (dram_gbs > 0) std::printf("  %5.0f%% of DRAM read", 100.0 * bytes / us * 1e-3 / dram_gbs);
  if (g_short && g_read_gbs > 0)
    std::printf("  (%3.0f%% of read BW)", 100.0 * bytes / us * 1e-3 / g_read_gbs);
  std::printf("\n");
  if (g_short) check_attention(name, b, q.data(), q_stride, kc[0].data(), vc[0].data(), L, p, nqh, 0.125f);
}

// Decode attention over the KV pool at the shapes that matter (batch 64 x ctx ~600; batch 1 x 256,
// a chat turn, and x 4k, a long prompt: one sequence's rows split over the threads by key
// partition), per KV dtype, hot and cold (rotating over pools totalling >= 256 MB).
void bench_attention_dtypes(Backend& b) {
  const double dram = dram_bandwidth_gbs(b.num_threads());
  if (dram > 0) std::printf("probe %-38s %10.1f GB/s\n", "DRAM read bandwidth (512 MB)", dram);
  struct Shape {
    int seqs, ctx;
  };
  for (DType kv : {DType::kF32, DType::kBF16, DType::kI8})  // cache resident (<= 1.5 MB): compute
    bench_attention(b, "decode ", 8, 1, 128, kv, 1, 0);
  for (Shape sh : {Shape{64, 600}, Shape{1, 256}, Shape{1, 4096}}) {
    for (DType kv : {DType::kF32, DType::kBF16, DType::kI8}) {
      const double pool = 2.0 * sh.seqs * sh.ctx * 3 * 64 * dtype_size(kv);
      const int copies = static_cast<int>(std::min(64.0, std::max(2.0, std::ceil(256e6 / pool))));
      bench_attention(b, "decode ", sh.seqs, 1, sh.ctx, kv, 1, dram);
      bench_attention(b, "decode ", sh.seqs, 1, sh.ctx, kv, copies, dram);
    }
  }
}

// One forward step of SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads of 64, inter 1536,
// vocab 49152) written in backend ops exactly as model/transformer.cpp issues them, on random
// weights: num_seqs sequences with q_len new tokens each at context ctx (decode: q_len 1; prefill:
// one sequence of q_len == ctx). Prints the step's wall time, tokens/s, and the time per op kind.
// The layer matrices are packed where the engine packs them off AMX (bf16 in the pair layout; the
// tied lm_head stays row-major); AMX machines keep the row-major vector kernels here (amx-decode
// and the linear amx lines time their tiles).
struct StepShape {
  int num_seqs, q_len, ctx;
  const char* label;
};

void bench_step(Backend& b, DType wt, StepShape sh, int layers = 30) {
  const int64_t H = 576, nh = 9, nkv = 3, hd = 64, I = 1536, V = 49152;
  const int64_t qkv_dim = (nh + 2 * nkv) * hd;
  const int64_t n = static_cast<int64_t>(sh.num_seqs) * sh.q_len;
  const int bs = 16, bps = (sh.ctx + bs - 1) / bs;
  const size_t es = dtype_size(wt);
  const bool packed = !g_amx_packs && b.dense_packed_bytes(wt, H, H) > 0;
  auto mk = [&](int64_t rows, int64_t cols, uint32_t seed, bool pack) {
    auto f = randn(rows * cols, seed);
    for (auto& v : f) v *= 0.05f;
    std::vector<uint8_t> w(f.size() * es);
    convert_from_f32(f.data(), w.data(), wt, f.size());
    if (!pack) return w;
    std::vector<uint8_t> p(b.dense_packed_bytes(wt, rows, cols));
    b.pack_dense(w.data(), wt, rows, cols, p.data());
    return p;
  };
  auto linear = [&](const float* x, const std::vector<uint8_t>& w, float* y, int64_t m, int64_t nn,
                    int64_t k) {
    if (packed) b.linear_packed(x, w.data(), wt, nullptr, y, m, nn, k);
    else b.linear(x, w.data(), wt, nullptr, y, m, nn, k);
  };
  struct Layer {
    std::vector<uint8_t> qkv, o, gu, down;
  };
  std::vector<Layer> Ls(layers);
  for (int l = 0; l < layers; ++l)
    Ls[l] = {mk(qkv_dim, H, 10 + l, packed), mk(H, nh * hd, 100 + l, packed), mk(2 * I, H, 200 + l, packed),
             mk(H, I, 300 + l, packed)};
  auto lm = mk(V, H, 7, false);
  auto norm_w = randn(H, 8);
  KVLayout L;
  L.num_blocks = sh.num_seqs * bps;
  L.block_size = bs;
  L.num_kv_heads = nkv;
  L.head_dim = hd;
  L.dtype = DType::kF32;
  const size_t cache_elems = static_cast<size_t>(L.num_blocks) * nkv * bs * hd;
  std::vector<std::vector<float>> kc(layers), vc(layers);
  for (int l = 0; l < layers; ++l) {
    kc[l] = randn(cache_elems, 400 + l);
    vc[l] = randn(cache_elems, 500 + l);
  }
  std::vector<int32_t> tables(L.num_blocks), ctxs(sh.num_seqs, sh.ctx), cu(sh.num_seqs + 1), pos(n);
  std::vector<int64_t> slots(n);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  for (int s = 0; s <= sh.num_seqs; ++s) cu[s] = s * sh.q_len;
  for (int s = 0; s < sh.num_seqs; ++s)
    for (int j = 0; j < sh.q_len; ++j) {
      const int p = sh.ctx - sh.q_len + j;
      pos[s * sh.q_len + j] = p;
      slots[s * sh.q_len + j] = static_cast<int64_t>(s * bps + p / bs) * bs + p % bs;
    }
  AttentionParams p;
  p.num_seqs = sh.num_seqs;
  p.num_tokens = static_cast<int32_t>(n);
  p.max_query_len = sh.q_len;
  p.max_context_len = sh.ctx;
  p.cu_seqlens_q = cu.data();
  p.context_lens = ctxs.data();
  p.block_tables = tables.data();
  p.max_blocks_per_seq = bps;
  std::vector<float> cs(static_cast<size_t>(sh.ctx) * hd);
  for (int q = 0; q < sh.ctx; ++q)
    for (int i = 0; i < hd / 2; ++i) {
      const double f = q * std::pow(100000.0, -2.0 * i / hd);
      cs[q * hd + i] = static_cast<float>(std::cos(f));
      cs[q * hd + hd / 2 + i] = static_cast<float>(std::sin(f));
    }
  auto res = randn(n * H, 9);
  std::vector<float> normed(n * H), qkv(n * qkv_dim), attn(n * nh * hd), proj(n * H), gu(n * 2 * I),
      act(n * I), logits(static_cast<size_t>(sh.num_seqs) * V), last(sh.num_seqs * H);
  enum { kQkv, kRope, kStore, kAttn, kO, kNorm, kGu, kSilu, kDown, kLm, kOps };
  const char* names[kOps] = {"qkv",          "rope",    "store_kv", "attention", "o",
                             "add_rms_norm", "gate_up", "silu_mul", "down",      "lm_head"};
  double op_us[kOps] = {};
  using clk = std::chrono::steady_clock;
  auto run = [&](bool timed) {
    auto t = clk::now();
    auto tick = [&](int op) {
      if (!timed) return;
      const auto now = clk::now();
      op_us[op] += std::chrono::duration<double, std::micro>(now - t).count();
      t = now;
    };
    for (int l = 0; l < layers; ++l) {
      const Layer& w = Ls[l];
      linear(normed.data(), w.qkv, qkv.data(), n, qkv_dim, H);
      tick(kQkv);
      b.rope(qkv.data(), qkv_dim, qkv.data() + nh * hd, qkv_dim, pos.data(), n, nh, nkv, hd, hd, cs.data());
      tick(kRope);
      b.store_kv(qkv.data() + nh * hd, qkv.data() + (nh + nkv) * hd, qkv_dim, slots.data(), n, kc[l].data(),
                 vc[l].data(), L);
      tick(kStore);
      b.attention(qkv.data(), qkv_dim, kc[l].data(), vc[l].data(), L, p, nh, 0.125f, attn.data());
      tick(kAttn);
      linear(attn.data(), w.o, proj.data(), n, H, nh * hd);
      tick(kO);
      b.add_rms_norm(res.data(), proj.data(), norm_w.data(), normed.data(), n, H, 1e-5f);
      tick(kNorm);
      linear(normed.data(), w.gu, gu.data(), n, 2 * I, H);
      tick(kGu);
      b.silu_mul(gu.data(), act.data(), n, I);
      tick(kSilu);
      linear(act.data(), w.down, proj.data(), n, H, I);
      tick(kDown);
      b.add_rms_norm(res.data(), proj.data(), norm_w.data(), normed.data(), n, H, 1e-5f);
      tick(kNorm);
    }
    // The last row of each sequence samples.
    b.linear(normed.data(), lm.data(), wt, nullptr, logits.data(), sh.num_seqs, V, H);
    tick(kLm);
  };
  run(false);
  for (auto& x : res) x *= 1e-3f;  // keep the residual stream bounded across repetitions
  const int reps = std::max(3, static_cast<int>(g_min_ms / 50));
  std::vector<double> walls;
  for (int r = 0; r < reps; ++r) {
    const auto a = clk::now();
    run(true);
    walls.push_back(std::chrono::duration<double, std::micro>(clk::now() - a).count());
  }
  std::sort(walls.begin(), walls.end());
  const double med = walls[walls.size() / 2];
  double weight_bytes = (static_cast<double>(layers) * (qkv_dim * H + H * nh * hd + 2 * I * H + H * I) +
                         V * H) *
                        es;
  double flops = 2.0 * n * layers * (qkv_dim * H + H * nh * hd + 2 * I * H + H * I) +
                 2.0 * sh.num_seqs * V * H;
  std::printf(
      "step %-8s %-5s seqs=%-3d q=%-4d ctx=%-4d %9.0f us  %8.1f tok/s  %6.1f GB/s weights  %6.1f GFLOP/s "
      "linear\n",
      sh.label, dtype_name(wt), sh.num_seqs, sh.q_len, sh.ctx, med, n / med * 1e6, weight_bytes / med * 1e-3,
      flops / med * 1e-3);
  std::printf("    per step, median-ish (mean over reps):");
  for (int o = 0; o < kOps; ++o) std::printf(" %s %.0f", names[o], op_us[o] / reps);
  std::printf(" us\n");
  if (g_short) {
    // The step's linears and attention are checked against the reference on their own above;
    // here only that the chained ops (norms, RoPE, SiLU included) produce numbers: a NaN or an
    // Inf anywhere spreads through every logit.
    size_t bad = 0;
    for (float v : logits) bad += !std::isfinite(v);
    ++g_checks;
    if (bad) ++g_failed;
    std::printf("    %s step %s: %zu of %zu logits not finite\n", bad ? "FAIL" : "ok  ", sh.label, bad,
                logits.size());
  }
}

// ---- machine probes ----------------------------------------------------------------------------
// Peak rates of this core type measured the same way the kernels run: FMA (f32), vdpbf16ps (when
// the CPU has AVX512-BF16), and read bandwidth over arrays from L2 to DRAM size, on `threads`
// threads (each streams its own disjoint part, as the GEMV does).

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FT_PROBE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

FT_PROBE_AVX512 __attribute__((noinline)) float fma_chain(long iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.1f * i);
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

// N independent accumulator chains: enough to cover latency x ports for FMA (4 x 2); the dot
// products are probed with 12 and 24 chains, so a longer latency cannot pass for a lower rate.
template <int N>
FT_PROBE_AVX512 __attribute__((noinline)) float dpbf16_chain(long iters) {
  __m512 a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm512_set1_ps(0.1f * i);
  const __m512bh m = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3a80);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < N; ++i) a[i] = _mm512_dpbf16_ps(a[i], m, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < N; ++i) s = _mm512_add_ps(s, a[i]);
  return _mm512_reduce_add_ps(s);
}

// VNNI u8 x s8 -> s32 dot products (vpdpbusd): 16 lanes x 4 products, 128 integer ops each.
template <int N>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) __attribute__((noinline)) int
dpbusd_chain(long iters) {
  __m512i a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i m = _mm512_set1_epi8(3), c = _mm512_set1_epi8(-2);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < N; ++i) a[i] = _mm512_dpbusd_epi32(a[i], m, c);
  }
  __m512i s = a[0];
  for (int i = 1; i < N; ++i) s = _mm512_add_epi32(s, a[i]);
  return _mm512_reduce_add_epi32(s);
}

// AMX (Sapphire Rapids tiles): tdpbf16ps / tdpbusd on register-resident 16x64-byte tiles, four
// independent accumulators. Linux hands out the tile state only on request (arch_prctl).
#define FT_PROBE_AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))
struct AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

// Returns seconds for `iters` rounds of 4 tile ops (bf16: 16x16x32 MACs each; int8: 16x16x64).
FT_PROBE_AMX __attribute__((noinline)) double amx_chain(long iters, bool int8) {
  AmxConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;
    b[i] = 0x3a80;
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, b, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, b, 64);
  const auto t0 = std::chrono::steady_clock::now();
  if (int8) {
    for (long i = 0; i < iters; ++i) {
      _tile_dpbusd(0, 4, 5);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 6, 5);
      _tile_dpbusd(3, 6, 7);
    }
  } else {
    for (long i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 6, 5);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
  alignas(64) static thread_local float out[16 * 16];
  _tile_stored(0, out, 64);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return s;
}

// The ceiling of a 32-deep block-scaled int8 format (Q4_1, Q4_0, Q8_0) on AMX: every block has
// its own scales, so each 16x16x32 tdpbsud is stored and folded into f32 accumulators (cvt, one
// scale product, one FMA, and for Q4_1 one more FMA for the block minimum) before the next block
// may be summed. All in L1, the accumulators in registers, block b + 1's tile product issued
// before block b is folded: the best overlap of the tile and vector units this loop allows.
// Returns seconds for `iters` blocks of 16x16x32.
#define FT_PROBE_AMX_FOLD __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
FT_PROBE_AMX_FOLD inline __attribute__((always_inline)) void fold_tile(const int32_t* cb, const float* rs,
                                                                       bool with_min, __m512* acc) {
  const __m512 vs = _mm512_set1_ps(1.0001f), vm = _mm512_set1_ps(0.5f);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512 t = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * i));
    acc[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(vs, _mm512_set1_ps(rs[i])), acc[i]);
    if (with_min) acc[i] = _mm512_fmadd_ps(vm, _mm512_set1_ps(rs[16 + i]), acc[i]);
  }
}

FT_PROBE_AMX_FOLD __attribute__((noinline)) double amx_block_fold(long iters, bool with_min) {
  AmxConfig cfg;
  for (int t = 0; t < 2; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  cfg.colsb[4] = 32, cfg.rows[4] = 16;  // A: 16 rows x 32 int8
  cfg.colsb[6] = 64, cfg.rows[6] = 8;   // B: 8 rows x (16 columns x 4)
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local int8_t a[2][16 * 32];
  alignas(64) static thread_local uint8_t b[2][8 * 64];
  alignas(64) static thread_local int32_t c[2][16 * 16];
  alignas(64) static thread_local float rs[32];
  for (int i = 0; i < 16 * 32; ++i) {
    a[0][i] = static_cast<int8_t>(i);
    a[1][i] = static_cast<int8_t>(3 * i);
  }
  for (int i = 0; i < 8 * 64; ++i) {
    b[0][i] = static_cast<uint8_t>(i & 15);
    b[1][i] = static_cast<uint8_t>((5 * i) & 15);
  }
  for (int i = 0; i < 32; ++i) rs[i] = 1.f + 1e-3f * i;
  std::memset(c, 0, sizeof(c));
  __m512 acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  // Two blocks per round, one per C tile T: each folds the other tile's last block while its own
  // product runs. A macro because GCC's tile intrinsics paste the tile number into the asm text.
#define FT_BLOCK_FOLD_STEP(T, OTHER)      \
  _tile_loadd(4, a[T], 32);               \
  _tile_loadd(6, b[T], 64);               \
  _tile_zero(T);                          \
  _tile_dpbsud(T, 4, 6);                  \
  fold_tile(c[OTHER], rs, with_min, acc); \
  _tile_stored(T, c[T], 64);
  for (long it = 0; it < iters; it += 2) {
    FT_BLOCK_FOLD_STEP(0, 1)
    FT_BLOCK_FOLD_STEP(1, 0)
  }
#undef FT_BLOCK_FOLD_STEP
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  volatile float sink = 0;
  for (auto& v : acc) sink = sink + _mm512_reduce_add_ps(v);
  return s;
}

bool has_avx512vnni() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return c & (1u << 11);
}

FT_PROBE_AVX512 __attribute__((noinline)) float read_sum(const float* p, size_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(p + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(p + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(p + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

// The AVX2 twins, for CPUs without AVX-512 (and the like-for-like roofline under --isa avx2): f32
// FMA on ymm, the int8 dot product the AVX2 quantized kernels use (vpmaddubsw u8*s8 -> s16 pairs,
// then vpmaddwd by ones -> s32, then an add: 32 products, 64 integer ops per three instructions;
// the 4-bit kernel sums two vpmaddubsw in s16 before widening, so it issues fewer), and reads.
#define FT_PROBE_AVX2 __attribute__((target("avx2,fma")))

FT_PROBE_AVX2 __attribute__((noinline)) float fma_chain_ymm(long iters) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.1f * i);
  const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  return t[0] + t[7];
}

// Sign: the sign trick. 8-bit weights (Q8_0, online int8: u8 with a zero of 128) cannot be
// vpmaddubsw's unsigned operand, whose int16 pair sums 255 x 127 would saturate, so the AVX2
// kernels multiply |w - 128| by x carrying w - 128's sign: one vpsignb more per vpmaddubsw.
// Without it this is the 4-bit kernels' instruction peak, with it the 8-bit ones' (a little over
// it: their vpabsb per weight vector, shared by a tile's x rows, is left out).
template <int N, bool Sign>
FT_PROBE_AVX2 __attribute__((noinline)) int maddubs_chain_ymm(long iters) {
  __m256i a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm256_set1_epi32(i);
  const __m256i x = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (long it = 0; it < iters; ++it) {
    // Each chain multiplies its own accumulator's bytes, so no product is shared or hoisted; N
    // chains cover the three-instruction latency.
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) {
      const __m256i xi = Sign ? _mm256_sign_epi8(x, a[i]) : x;
      a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], xi), ones));
    }
  }
  __m256i s = a[0];
  for (int i = 1; i < N; ++i) s = _mm256_add_epi32(s, a[i]);
  return _mm256_extract_epi32(s, 0);
}

// AVX-VNNI's vpdpbusd on ymm (FANTAI_CPU_ISA=avxvnni, or an AVX2 CPU that has it): 32 products
// and their sums, 64 integer ops, in one instruction.
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
#define FT_HAVE_AVXVNNI_PROBE 1
template <int N>
__attribute__((target("avx2,fma,avxvnni"), noinline)) int dpbusd_chain_ymm(long iters) {
  __m256i a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm256_set1_epi32(i);
  const __m256i x = _mm256_set1_epi8(-2);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i) a[i] = _mm256_dpbusd_avx_epi32(a[i], a[i], x);
  }
  __m256i s = a[0];
  for (int i = 1; i < N; ++i) s = _mm256_add_epi32(s, a[i]);
  return _mm256_extract_epi32(s, 0);
}
#endif

FT_PROBE_AVX2 __attribute__((noinline)) float read_sum_ymm(const float* p, size_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i));
    s1 = _mm256_add_ps(s1, _mm256_load_ps(p + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return t[0] + t[7];
}

bool has_avx512bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a & (1u << 5);
}

// Best seconds of fn run on T threads at once (each gets its thread index).
double par_best(int T, int reps, const std::function<void(int)>& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int t = 1; t < T; ++t) th.emplace_back(fn, t);
    fn(0);
    for (auto& x : th) x.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return best;
}

// The same bf16 linear packed by the backend: AMX tiles where usable (with its share of the
// tdpbf16ps peak of this many threads), else the vector kernels' pair or group layout ("linear
// pairs", "linear groups").
bool g_bf16_matmuls = false;  // --matmul-precision bfloat16 took effect

void bench_linear_amx(Backend& b, int64_t m, int64_t n, int64_t k) {
  if (b.dense_packed_bytes(DType::kBF16, n, k) == 0) return;
  static double peak = 0;  // GFLOP/s, measured once
  if (peak == 0 && g_amx_packs) {
    const long iters = 500000;
    const double s = par_best(b.num_threads(), 3, [&](int) { amx_chain(iters, false); });
    peak = b.num_threads() * iters * 4.0 * 16 * 16 * 32 * 2 / s * 1e-9;
  }
  auto x = randn(m * k, 1), wf = randn(n * k, 2);
  std::vector<uint16_t> wh(wf.size());
  convert_from_f32(wf.data(), wh.data(), DType::kBF16, wf.size());
  // 64-byte aligned, as the engine's weight buffers are (a vector's 16-byte alignment makes every
  // tile row straddle two cache lines).
  const size_t bytes = b.dense_packed_bytes(DType::kBF16, n, k);
  std::vector<uint8_t> store(bytes + 64);
  uint8_t* packed = store.data() + (64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64;
  b.pack_dense(wh.data(), DType::kBF16, n, k, packed);
  std::vector<float> y(m * n);
  const double us = time_us(
      [&] { b.linear_packed(x.data(), packed, DType::kBF16, nullptr, y.data(), m, n, k); });
  char name[96];
  // The vector layouts told apart by size: groups pad a matrix to whole kBf16GroupRows rows.
  const char* layout = g_amx_packs                                       ? "amx"
                       : b.dense_packed_bytes(DType::kBF16, 1, 64) > 128 ? "groups"
                                                                         : "pairs";
  std::snprintf(name, sizeof(name), "linear %-5s m=%-4lld n=%-6lld k=%lld", layout, static_cast<long long>(m),
                static_cast<long long>(n), static_cast<long long>(k));
  const double flops = 2.0 * m * n * k;
  report(name, us, flops, static_cast<double>(bytes) + 4.0 * (m * k + m * n));
  if (!g_amx_packs) {  // f32 products of the widened weights, as the row-major kernel's
    if (g_short) check_linear(name, y.data(), x.data(), wh.data(), DType::kBF16, m, n, k);
    return;
  }
  // Each output needs two tile products (hi and lo halves of x) unless activations are rounded to
  // bf16 (--matmul-precision bfloat16): the useful rate is half, or all, of the issued one.
  const int parts = g_bf16_matmuls ? 1 : 2;
  if (peak > 0)
    std::printf("%-44s %.1f%% of the AMX probe peak %.0f GFLOP/s (%d product%s per MAC)\n", "",
                100.0 * parts * flops / us * 1e-3 / peak, peak, parts, parts > 1 ? "s" : "");
  // x enters the tiles as bf16 hi + lo (each rounding loses at most 2^-9 of what it rounds, so
  // x - hi - lo is within 2^-18 |x|), or hi alone under bf16 matmuls (2^-9); 2k products per sum.
  if (g_short)
    check_linear(name, y.data(), x.data(), wh.data(), DType::kBF16, m, n, k,
                 g_bf16_matmuls ? std::ldexp(1.0, -9) : std::ldexp(1.0, -18), 2.0 * k + 2);
}

// Decode's weight stream on AMX: one row through a model's worth of packed bf16 matrices (30
// layers of the default model's qkv, o, gate|up, down, and the 49,152 x 576 lm_head: 269 MB, so
// every call reads them from DRAM as a decode step does). No attention, norms or sampling.
void bench_amx_decode(Backend& b, int64_t m) {
  if (b.dense_packed_bytes(DType::kBF16, 576, 576) == 0) return;
  struct Mat {
    int64_t n, k;
    size_t off;
  };
  std::vector<Mat> mats;
  size_t total = 0;
  auto add = [&](int64_t n, int64_t k) {
    mats.push_back({n, k, total});
    total += (b.dense_packed_bytes(DType::kBF16, n, k) + 63) / 64 * 64;
  };
  for (int l = 0; l < 30; ++l) add(960, 576), add(576, 576), add(3072, 576), add(576, 1536);
  add(49152, 576);
  std::vector<uint8_t> store(total + 64);
  uint8_t* base = store.data() + (64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64;
  std::vector<uint16_t> w;
  for (const Mat& mt : mats) {
    auto f = randn(mt.n * mt.k, static_cast<uint32_t>(mt.off % 9973));
    w.resize(f.size());
    convert_from_f32(f.data(), w.data(), DType::kBF16, f.size());
    b.pack_dense(w.data(), DType::kBF16, mt.n, mt.k, base + mt.off);
  }
  auto x = randn(m * 1536, 3);
  std::vector<float> y(m * 49152);
  const double us = time_us([&] {
    for (const Mat& mt : mats)
      b.linear_packed(x.data(), base + mt.off, DType::kBF16, nullptr, y.data(), m, mt.n, mt.k);
  });
  char name[96];
  std::snprintf(name, sizeof(name), "amx decode weights m=%-3lld (%zu MB, DRAM)", static_cast<long long>(m),
                total >> 20);
  report(name, us, 2.0 * m * static_cast<double>(total / 2), static_cast<double>(total));
}

// Reads with the widest vectors the chosen level has (zmm or ymm).
float read_sum_isa(cpu::Isa isa, const float* p, size_t n) {
  return isa == cpu::Isa::kAvx512 ? read_sum(p, n) : read_sum_ymm(p, n);
}

void read_bandwidth_probes(int T, cpu::Isa isa) {
  volatile float sink = 0;
  for (size_t mb : {1, 8, 64, 512}) {
    const size_t n = mb << 18, per = n / T;  // floats in all, per thread
    float* p = static_cast<float*>(std::aligned_alloc(64, n * 4));
    for (size_t i = 0; i < n; ++i) p[i] = 1.f;
    const double s = par_best(T, mb >= 512 ? 4 : 10,
                              [&](int t) { sink = read_sum_isa(isa, p + t * per, per); });
    char name[64];
    std::snprintf(name, sizeof(name), "read bandwidth %zu MB", mb);
    std::printf("probe %-38s %10.1f GB/s\n", name, n * 4.0 / s * 1e-9);
    g_read_gbs = n * 4.0 / s * 1e-9;  // the last, largest array: the DRAM figure
    std::free(p);
  }
  (void)sink;
}

// The AVX2 peaks (--isa avx2, or a CPU without AVX-512).
void probes_avx2(int T) {
  volatile float sink = 0;
  volatile int isink = 0;
  const long iters = 4000000;
  double s = par_best(T, 5, [&](int) { sink = fma_chain_ymm(iters); });
  std::printf("probe %-38s %10.1f GFLOP/s (%d threads)\n", "peak f32 FMA (ymm)",
              T * iters * 12.0 * 16 / s * 1e-9, T);
  g_peak_gflops = T * iters * 12.0 * 16 / s * 1e-9;
  s = par_best(T, 5, [&](int) { isink = maddubs_chain_ymm<12, false>(iters); });
  std::printf("probe %-38s %10.1f GOP/s\n", "peak vpmaddubsw+vpmaddwd u8*s8 (ymm)",
              T * iters * 12.0 * 64 / s * 1e-9);
  s = par_best(T, 5, [&](int) { isink = maddubs_chain_ymm<12, true>(iters); });
  std::printf("probe %-38s %10.1f GOP/s\n", "peak vpsignb+vpmaddubsw s8*s8 (ymm)",
              T * iters * 12.0 * 64 / s * 1e-9);
#ifdef FT_HAVE_AVXVNNI_PROBE
  if (cpu::avx_vnni_panels()) {
    s = par_best(T, 5, [&](int) { isink = dpbusd_chain_ymm<12>(iters); });
    std::printf("probe %-38s %10.1f GOP/s\n", "peak vpdpbusd u8*s8 (ymm)", T * iters * 12.0 * 64 / s * 1e-9);
  }
#endif
  read_bandwidth_probes(T, cpu::Isa::kAvx2);
  (void)sink;
  (void)isink;
}

void probes(int T, cpu::Isa isa) {
  if (isa < cpu::Isa::kAvx2) {
    std::printf("probe: needs AVX2\n");
    return;
  }
  if (isa == cpu::Isa::kAvx2) return probes_avx2(T);
  volatile float sink = 0;
  const long iters = 4000000;
  double s = par_best(T, 5, [&](int) { sink = fma_chain(iters); });
  std::printf("probe %-38s %10.1f GFLOP/s (%d threads)\n", "peak f32 FMA (zmm)",
              T * iters * 12.0 * 32 / s * 1e-9, T);
  g_peak_gflops = T * iters * 12.0 * 32 / s * 1e-9;
  if (has_avx512bf16()) {
    s = par_best(T, 5, [&](int) { sink = dpbf16_chain<12>(iters); });
    std::printf("probe %-38s %10.1f GFLOP/s\n", "peak vdpbf16ps (zmm)", T * iters * 12.0 * 64 / s * 1e-9);
    s = par_best(T, 5, [&](int) { sink = dpbf16_chain<24>(iters / 2); });
    std::printf("probe %-38s %10.1f GFLOP/s\n", "peak vdpbf16ps (zmm, 24 chains)",
                T * iters * 12.0 * 64 / s * 1e-9);
  }
  if (amx_usable()) {
    const long amx_iters = iters / 8;
    s = par_best(T, 5, [&](int) { amx_chain(amx_iters, false); });
    std::printf("probe %-38s %10.1f GFLOP/s\n", "peak AMX tdpbf16ps",
                T * amx_iters * 4.0 * 16 * 16 * 32 * 2 / s * 1e-9);
    s = par_best(T, 5, [&](int) { amx_chain(amx_iters, true); });
    std::printf("probe %-38s %10.1f GOP/s\n", "peak AMX tdpbusd u8*s8",
                T * amx_iters * 4.0 * 16 * 16 * 64 * 2 / s * 1e-9);
    for (const bool with_min : {false, true}) {
      s = par_best(T, 5, [&](int) { amx_block_fold(amx_iters, with_min); });
      std::printf("probe %-38s %10.1f GOP/s\n",
                  with_min ? "AMX int8, 32-blocks + fold (Q4_1 form)"
                           : "AMX int8, 32-blocks + fold (Q8_0 form)",
                  T * amx_iters * 16.0 * 16 * 32 * 2 / s * 1e-9);
    }
  } else {
    std::printf("probe %-38s %10s\n", "peak AMX", "not usable (no CPUID AMX or no kernel permission)");
  }
  if (has_avx512vnni()) {
    volatile int isink = 0;
    s = par_best(T, 5, [&](int) { isink = dpbusd_chain<12>(iters); });
    std::printf("probe %-38s %10.1f GOP/s\n", "peak vpdpbusd u8*s8 (zmm)", T * iters * 12.0 * 128 / s * 1e-9);
    s = par_best(T, 5, [&](int) { isink = dpbusd_chain<24>(iters / 2); });
    std::printf("probe %-38s %10.1f GOP/s\n", "peak vpdpbusd u8*s8 (zmm, 24 chains)",
                T * iters * 12.0 * 128 / s * 1e-9);
    (void)isink;
  }
  read_bandwidth_probes(T, cpu::Isa::kAvx512);
  (void)sink;
}
double dram_bandwidth_gbs(int T, bool fresh) {
  const cpu::Isa isa = cpu::detected_isa();
  if (isa < cpu::Isa::kAvx2) return 0;
  static double cached = 0;
  if (cached > 0 && !fresh) return cached;
  volatile float sink = 0;
  const size_t n = size_t{512} << 18, per = n / T;
  float* p = static_cast<float*>(std::aligned_alloc(64, n * 4));
  for (size_t i = 0; i < n; ++i) p[i] = 1.f;
  const double s = par_best(T, 4, [&](int t) { sink = read_sum_isa(isa, p + t * per, per); });
  std::free(p);
  (void)sink;
  return cached = n * 4.0 / s * 1e-9;
}
#else
void probes(int, cpu::Isa) { std::printf("probe: x86-64 GCC only\n"); }
void bench_linear_amx(Backend&, int64_t, int64_t, int64_t) {}
void bench_amx_decode(Backend&, int64_t) {}
double dram_bandwidth_gbs(int, bool) { return 0; }
#endif

// --short: one or two shapes per section, every output checked; the exit status counts misses
// only (a slow figure is never a failure).
template <class Want>
int run_short(Backend& b, const Want& want) {
  if (want("linear")) {
    for (DType wt : {DType::kBF16, DType::kF32}) {
      for (int64_t m : {1, 16}) {
        bench_linear(b, m, 1536, 576, wt);
        if (wt == DType::kBF16) bench_linear_amx(b, m, 1536, 576);
      }
      bench_linear(b, 3, 576, 1536, wt);
    }
    bench_linear_amx(b, 64, 960, 576);
  }
  if (want("qlinear")) {
    for (const QFormat& f : kQFormats) {
      for (int64_t m : {1, 16}) bench_linear_q(b, f, m, 1536, 576);
      bench_linear_q(b, f, 3, 576, 1536);
    }
  }
  if (want("qstep")) bench_qstep(b, kQFormats[0], 2);
  if (want("attention")) {
    for (DType kv : {DType::kF32, DType::kBF16, DType::kI8}) bench_attention(b, "decode ", 16, 1, 512, kv);
    for (DType kv : {DType::kF32, DType::kBF16}) {
      bench_attention(b, "prefill", 1, 256, 256, kv);
      bench_attention(b, "chunk  ", 2, 64, 320, kv);
    }
  }
  if (want("step")) {
    for (DType wt : {DType::kBF16, DType::kF32}) {
      bench_step(b, wt, {1, 1, 256, "decode"}, 2);
      bench_step(b, wt, {1, 128, 128, "prefill"}, 2);
    }
  }
  std::printf("short: %d checks against the reference, %d failed\n", g_checks, g_failed);
  return g_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  cpu::Isa isa = cpu::active_isa();
  std::string only, precision = "float32", formats;
  // qstep's layer count: SmolLM2-135M's 30 by default; more (e.g. 200, 451 MiB of Q4_1) make the
  // weights stream from memory on a CPU whose last-level cache holds the 30-layer set.
  int qstep_layers = 30;
  bool min_ms_given = false;
  // --shape MxNxK: linear and qlinear time that one shape instead of their lists (A/B runs of one
  // kernel shape, e.g. m = 512 of the gate|up projection: --shape 512x3072x576).
  int64_t sm = 0, sn = 0, sk = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--isa") && i + 1 < argc) {
      if (!cpu::parse_isa(argv[++i], &isa)) {
        std::fprintf(stderr, "unknown isa %s\n", argv[i]);
        return 2;
      }
      // avx2 and avxvnni are one level told apart by FANTAI_CPU_ISA (cpu::avx_vnni_panels, read
      // once, after this).
      setenv("FANTAI_CPU_ISA", argv[i], 1);
    } else if (!std::strcmp(argv[i], "--min-ms") && i + 1 < argc) {
      g_min_ms = std::atof(argv[++i]);
      min_ms_given = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--cpu-time")) g_cpu_time = true;
    else if (!std::strcmp(argv[i], "--qstep-layers") && i + 1 < argc && std::atoi(argv[i + 1]) > 0)
      qstep_layers = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--matmul-precision") && i + 1 < argc) precision = argv[++i];
    else if (!std::strcmp(argv[i], "--short")) g_short = true;
    else if (!std::strcmp(argv[i], "--formats") && i + 1 < argc) formats = "," + std::string(argv[++i]) + ",";
    else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      long long m = 0, n = 0, k = 0;
      char tail = 0;
      if (std::sscanf(argv[++i], "%lldx%lldx%lld%c", &m, &n, &k, &tail) != 3 || m <= 0 || n <= 0 || k <= 0) {
        std::fprintf(stderr, "--shape wants MxNxK with positive integers, got %s\n", argv[i]);
        return 2;
      }
      sm = m, sn = n, sk = k;
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--short] [--threads N] [--isa avx512|avxvnni|avx2|scalar] [--min-ms T] "
          "[--only "
          "probe|linear|qlinear|attention|attention-kv|attention-one|step|qstep|kstep|kstep-cache|amx-decode|"
          "moe] "
          "[--formats q3_k,q2_k,...] [--shape MxNxK] [--cpu-time] [--matmul-precision float32|bfloat16] "
          "[--qstep-layers N]\n",
          argv[0]);
      return 2;
    }
  }
  auto b = cpu::make_cpu_backend(isa, threads);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  g_amx_packs = isa == cpu::Isa::kAvx512 && cpu::cpu_switches().amx && amx_usable();
#endif
  g_bf16_matmuls = b->set_matmul_precision(dtype_from_name(precision));
  std::printf("cpu backend: isa=%s (detected %s) threads=%d matmuls=%s\n", cpu::isa_name(isa),
              cpu::isa_name(cpu::detected_isa()), b->num_threads(), g_bf16_matmuls ? "bfloat16" : "float32");
  auto want = [&](const char* what) { return only.empty() || only == what; };
  if (g_short && min_ms_given == false) g_min_ms = 20;
  if (want("probe")) {
    probes(b->num_threads(), isa);
    // One parallel_for of one empty task per thread: the fixed cost every parallel op pays.
    cpu::ThreadPool pool(b->num_threads());
    const double us = time_us([&] {
      for (int i = 0; i < 100; ++i) pool.parallel_for(pool.size(), [](int64_t, int) {});
    });
    std::printf("probe %-38s %10.2f us\n", "thread pool parallel_for round trip", us / 100);
    // Mean (not best) time of a parallel_for of one ~10 µs task (5000 dependent FMAs) per thread, over 2000 calls: on
    // a loaded machine it shows how often a descheduled worker holds up an op.
    volatile float sinkf = 0;
    auto work = [&](int64_t, int) {
      float a = sinkf;
      for (int i = 0; i < 5000; ++i) a = a * 0.9999f + 1e-4f;
      sinkf = a;
    };
    const double w0 = now_us();
    for (int i = 0; i < 200; ++i) work(0, 0);
    const double one = (now_us() - w0) / 200;
    const double t0 = now_us();
    for (int i = 0; i < 2000; ++i) pool.parallel_for(pool.size(), work);
    std::printf("probe %-38s %10.2f us (one task alone %.2f us)\n", "pool op, 1 task/thread, mean",
                (now_us() - t0) / 2000, one);
  }
  if (g_short) return run_short(*b, want);
  if (want("linear") && sm > 0) {
    for (DType wt : {DType::kBF16, DType::kF32}) {
      bench_linear(*b, sm, sn, sk, wt);
      if (wt == DType::kBF16) bench_linear_amx(*b, sm, sn, sk);
    }
  } else if (want("linear")) {
    for (DType wt : {DType::kBF16, DType::kF32}) {
      for (int64_t m : {1, 16, 64, 256}) {
        bench_linear(*b, m, 1536, 576, wt);
        if (wt == DType::kBF16) bench_linear_amx(*b, m, 1536, 576);
      }
      bench_linear(*b, 1, 576, 1536, wt);
      // n=49152 (lm_head-sized, 56 MiB in bf16): decode reads its weights from DRAM, not L2.
      for (int64_t m : {1, 16}) {
        bench_linear(*b, m, 49152, 576, wt);
        if (wt == DType::kBF16) bench_linear_amx(*b, m, 49152, 576);
      }
      // A 512-token prefill through the default model's four layer matrices (qkv, o, gate|up,
      // down): AMX-packed where the backend packs, else the vector kernel the model runs.
      if (wt == DType::kBF16)
        for (const auto& [n, k] :
             {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}) {
          if (!g_amx_packs) bench_linear(*b, 512, n, k, wt);
          bench_linear_amx(*b, 512, n, k);
        }
    }
  }
  if (only == "linear-prefill") {  // one figure, for profiling: the prefill's gate|up
    for (int i = 0; i < 10; ++i) bench_linear_amx(*b, 512, 3072, 576);
  }
  // --formats: the formats by name in qlinear, qstep and kstep (all of a section's when empty).
  auto picked = [&](const QFormat& f) {
    return formats.empty() || formats.find("," + std::string(f.name) + ",") != std::string::npos;
  };
  if (want("qlinear")) {
    for (const QFormat& f : kQFormats) {
      if (!picked(f)) continue;
      if (sm > 0) {
        bench_linear_q(*b, f, sm, sn, sk);
        continue;
      }
      for (int64_t m : {1, 16, 64, 256}) bench_linear_q(*b, f, m, 1536, 576);
      bench_linear_q(*b, f, 1, 576, 1536);
      bench_linear_q(*b, f, 1, 49152, 576);
      // A 512-token prefill's projections: qkv, o, gate|up, down.
      for (const auto& [n, k] : {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}})
        bench_linear_q(*b, f, 512, n, k);
    }
  }
  if (want("qstep")) {
    // More layers than the model's: the weights are meant to stream from memory, so each line is
    // read against a bandwidth probe run just before it (a shared host's bandwidth drifts by 2x
    // within minutes).
    auto probe = [&] {
      if (qstep_layers > 30) g_read_gbs = dram_bandwidth_gbs(b->num_threads(), true);
    };
    for (const QFormat* f : {&kQFormats[0], &kQFormats[2]})
      if (picked(*f)) {
        probe();
        bench_qstep(*b, *f, qstep_layers);
      }
    if (formats.find(",bf16,") != std::string::npos) {
      probe();
      bench_qstep_bf16(*b, qstep_layers);
    }
  }
  if (only == "attention-kv") bench_attention_dtypes(*b);
  if (only == "attention-kv-long") {  // one shape, for profiling: batch 1 x 4096, int8
    for (int i = 0; i < 10; ++i) bench_attention(*b, "decode ", 1, 1, 4096, DType::kI8);
  }
  if (only == "attention-one") {  // one sequence's decode (split over the threads by key partition)
    for (int ctx : {256, 1024, 4096}) {
      const int copies = static_cast<int>(std::max(2.0, std::ceil(256e6 / (2.0 * ctx * 3 * 64 * 2))));
      bench_attention(*b, "decode ", 1, 1, ctx, DType::kBF16, std::min(copies, 256), 0);
    }
  }
  if (only == "attention-decode") {  // one figure, for profiling
    for (int i = 0; i < 20; ++i) bench_attention(*b, "decode ", 16, 1, 512, DType::kBF16);
  }
  if (only == "attention-decode-cold") {  // one figure, for profiling: a batch's KV from DRAM
    const double dram = dram_bandwidth_gbs(b->num_threads());
    for (int i = 0; i < 10; ++i) bench_attention(*b, "decode ", 64, 1, 600, DType::kBF16, 9, dram);
  }
  if (only == "amx-decode") {
    for (int64_t m : {1, 4}) bench_amx_decode(*b, m);
  }
  if (only == "attention-prefill") {
    for (int i = 0; i < 5; ++i) bench_attention(*b, "prefill", 1, 512, 512, DType::kF32);
    for (int i = 0; i < 5; ++i) bench_attention(*b, "prefill", 1, 512, 512, DType::kBF16);
  }
  if (want("attention")) {
    bench_attention(*b, "decode ", 16, 1, 512, DType::kF32);
    bench_attention(*b, "decode ", 16, 1, 512, DType::kBF16);
    bench_attention(*b, "decode ", 16, 1, 512, DType::kI8);
    bench_attention(*b, "prefill", 1, 512, 512, DType::kF32);
    bench_attention(*b, "prefill", 1, 512, 512, DType::kBF16);
    bench_attention(*b, "chunk  ", 4, 64, 1024, DType::kF32);
    bench_attention(*b, "chunk  ", 4, 64, 1024, DType::kBF16);
  }
  if (only == "kstep" || only == "kstep-cache") {  // not in the default run: 0.2-0.4 GB of weights
    const bool in_cache = only == "kstep-cache";
    if (!in_cache && g_read_gbs == 0) g_read_gbs = dram_bandwidth_gbs(b->num_threads());
    for (const QFormat& f : kKFormats)
      if (picked(f)) bench_kstep(*b, f, in_cache);
    if (formats.empty() || formats.find(",bf16,") != std::string::npos) bench_kstep_bf16(*b, in_cache);
  }
  if (only == "moe") {  // not in the default run: the experts take 0.4-1.2 GB
    if (g_read_gbs == 0) g_read_gbs = dram_bandwidth_gbs(b->num_threads());
    for (const QFormat* f : {&kQFormats[3], &kQFormats[2], static_cast<const QFormat*>(nullptr)})
      for (int64_t tokens : {1, 4, 64, 512}) bench_moe(*b, f, tokens);
  }
  if (want("step")) {
    for (DType wt : {DType::kBF16, DType::kF32}) {
      bench_step(*b, wt, {1, 1, 256, "decode"});
      bench_step(*b, wt, {1, 512, 512, "prefill"});
      bench_step(*b, wt, {64, 1, 384, "batch64"});
    }
  }
  return 0;
}
