// cpu: the CPU backend's construction (kernel tables and switches from the probe), its memory
// (large buffers mmap-backed, pages released on request), and the factories the registry calls.
#include "cpu/cpu_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/logging.h"
#include "cpu/cpu_backend_impl.h"
#include "cpu/cpu_quota.h"
#include "cpu/cpu_topology.h"

namespace fantai::cpu {

CpuBackend::CpuBackend(Isa isa, int num_threads)
    : isa_(isa), k_(kernels_for(isa)), qk_(qkernels_for(isa)), pool_(num_threads) {
  // Every ISA level has the int8-activation panel kernels, bit-equal to each other, so a
  // quantized model gives the same bits on AVX2, AVX-512 and portable builds' linears.
  const CpuSwitches sw = cpu_switches();
  const PanelKernels pk = panel_kernels_for(isa);
  panel_name_ = pk.name;
  panel_fn_ = pk.linear;
  decode_panels_ = pk.decode_panels;
  quant_rows_fn_ = pk.quantize;
  panel_ = !sw.quant_f32;
  huge_pages_ = sw.huge_pages;
  // AVX2 widens row-major bf16 with a broadcast load and one vpshufb, no FMA-port op, as the pair
  // halves do, so it gains nothing from pairs; its decode is held back by the row-major streams,
  // which the group layout makes one (bench/README.md, issue 18). AVX-512 and the portable level
  // keep the pair layout.
  using L = CpuSwitches::Bf16Layout;
  bf16_layout_ = sw.bf16_layout != L::kDefault ? sw.bf16_layout : isa == Isa::kAvx2 ? L::kGroups : L::kPairs;
  bf16_packed_fn_ = bf16_layout_ == L::kPairs    ? k_.linear_bf16_pairs
                    : bf16_layout_ == L::kGroups ? k_.linear_bf16_groups
                                                 : nullptr;
  // AMX only on top of AVX-512 (the activation split uses it); FANTAI_AMX=0 turns it off (A/B).
  const bool amx_ok = isa == Isa::kAvx512 && sw.amx;
  amx_ = amx_ok && amx_usable();
  // Bit-equal to the VNNI kernel, so a call may take either by its row count.
  if (amx_ok && !std::strcmp(pk.name, "vnni")) amx_panel_fn_ = amx_int8_linear_panel();
  FANTAI_LOG(kDebug, "cpu backend: isa=" << k_.name << " threads=" << pool_.size() << " quantized kernels="
                                         << (panel_ ? panel_name_ : "f32") << " amx=" << (amx_ ? "on" : "off")
                                         << " amx int8=" << (amx_panel_fn_ ? "on" : "off"));
}

// Large buffers (the KV pool, weights) get their own anonymous mapping: reserved, not
// committed, so pages are backed only when first written, and never recycled from a heap that
// other allocations already touched (the pool's resident size must mean what it says).
void* CpuBackend::alloc(size_t bytes) {
  if (bytes >= kMapThreshold) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                   0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    std::lock_guard<std::mutex> lock(mapped_mu_);
    mapped_[p] = bytes;
    return p;
  }
  const size_t n = (std::max<size_t>(bytes, 1) + 63) & ~size_t{63};  // aligned_alloc wants a multiple
  void* p = std::aligned_alloc(64, n);
  if (!p) throw std::bad_alloc();
  return p;
}

namespace {
size_t page_round(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) & ~(page - 1);
}
}  // namespace

// A fresh mapping of `bytes` (rounded up to whole pages) whose start is huge-page aligned, so
// every whole 2 MiB of it can be a huge page: the spare head and tail of an oversized mapping
// go back at once. Recorded nowhere: the caller does. Under mapped_mu_.
void* CpuBackend::map_aligned(size_t bytes) {
  const size_t len = page_round(bytes);
  void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t r = reinterpret_cast<uintptr_t>(raw), p = (r + kHugePage - 1) & ~(kHugePage - 1);
  if (p > r) munmap(raw, p - r);
  if (r + len + kHugePage > p + len)
    munmap(reinterpret_cast<void*>(p + len), r + len + kHugePage - (p + len));
  // Where the kernel has no transparent huge pages this fails and the mapping stays small-paged.
  if (huge_pages_) madvise(reinterpret_cast<void*>(p), len, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(p);
}

// Decode streams every weight byte once per token, tensor after tensor. With 4 KiB pages that
// is a TLB miss and a page walk every 4 KiB (SmolLM2-135M's 92 MiB: 23,500 per token), and
// THP's default "madvise" mode gives nothing unasked. So weights live in huge-page-aligned,
// MADV_HUGEPAGE mappings; tensors under half a slab share 8 MiB slabs, so a small model's
// 0.2-1 MiB matrices get huge pages too. A slab is unmapped when its last tensor goes.
void* CpuBackend::alloc_weights(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + 63) & ~size_t{63};
  std::lock_guard<std::mutex> lock(mapped_mu_);
  if (n > kSlabBytes / 2) {
    void* p = map_aligned(n);
    mapped_[p] = page_round(n);
    return p;
  }
  auto open = open_slab_ ? slabs_.find(open_slab_) : slabs_.end();
  if (open == slabs_.end() || open->second.used + n > kSlabBytes) {
    open_slab_ = static_cast<char*>(map_aligned(kSlabBytes));
    open = slabs_.emplace(open_slab_, Slab{}).first;
  }
  Slab& s = open->second;
  char* p = open_slab_ + s.used;
  s.used += n;
  ++s.live;
  return p;
}

void CpuBackend::free(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(mapped_mu_);
    auto it = mapped_.find(ptr);
    if (it != mapped_.end()) {
      munmap(ptr, it->second);
      mapped_.erase(it);
      return;
    }
    auto s = slabs_.upper_bound(static_cast<char*>(ptr));
    if (s != slabs_.begin()) {
      --s;
      if (static_cast<char*>(ptr) < s->first + kSlabBytes) {
        if (--s->second.live == 0) {
          munmap(s->first, kSlabBytes);
          if (open_slab_ == s->first) open_slab_ = nullptr;
          slabs_.erase(s);
        }
        return;
      }
    }
  }
  std::free(ptr);
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}

void CpuBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

// Only whole pages inside the range go back; the partial pages at its ends are kept.
void CpuBackend::release_pages(void* ptr, size_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

const KernelTable& kernels_for(Isa isa) {
  FANTAI_REQUIRE(static_cast<int>(isa) <= static_cast<int>(detected_isa()),
                 "cpu: ISA level " << isa_name(isa) << " is not supported by this CPU");
  const KernelTable* t = isa == Isa::kAvx512 ? avx512_kernels()
                         : isa == Isa::kAvx2 ? avx2_kernels()
                                             : scalar_kernels();
  FANTAI_REQUIRE(t != nullptr, "cpu: kernels for " << isa_name(isa) << " were not built");
  return *t;
}

std::vector<int> CpuBackend::bind_threads(const std::string& spec, int offset) {
  const std::vector<CpuPlace> places = cpu_topology();
  const std::vector<int> cpus = plan_thread_cpus(places, pool_.size(), spec, offset);
  pool_.bind(cpus);
  std::string list;
  for (int c : cpus) list += (list.empty() ? "" : ",") + std::to_string(c);
  FANTAI_LOG(kInfo, "cpu backend: " << pool_.size() << " threads bound '" << spec << "' to CPUs " << list
                                    << " of " << describe_topology(places));
  return cpus;
}

std::shared_ptr<Backend> make_cpu_backend(Isa isa, int num_threads) {
  return std::make_shared<CpuBackend>(isa, num_threads <= 0 ? default_thread_count() : num_threads);
}

const RowReductions& row_reductions() {
  static const RowReductions r = [] {
    const KernelTable& k = kernels_for(active_isa());
    RowReductions t;
    t.max_sum_exp = k.max_sum_exp;
    t.argmax = k.argmax;
    return t;
  }();
  return r;
}

std::shared_ptr<Backend> create_cpu_backend(int num_threads) {
  return make_cpu_backend(active_isa(), num_threads);
}

const char* selected_isa() {
  return active_isa() == Isa::kAvx2 && avx_vnni_panels() ? "avxvnni" : isa_name(active_isa());
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> v;
  for (int i = 0; i <= static_cast<int>(detected_isa()); ++i) {
    v.emplace_back(isa_name(static_cast<Isa>(i)));
    if (static_cast<Isa>(i) == Isa::kAvx2 && cpu_features().avx_vnni) v.emplace_back("avxvnni");
  }
  return v;
}

int default_threads() { return default_thread_count(); }

}  // namespace fantai::cpu
