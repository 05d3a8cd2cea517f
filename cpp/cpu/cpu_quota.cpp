// cpu: affinity and cgroup CPU quota (see cpu_quota.h).
#include "cpu/cpu_quota.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <thread>

namespace fantai::cpu {
namespace {

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

// ceil(quota / period) for a positive quota, else 0.
int quota_cpus(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

// Every directory from the cgroup's own up to the root (a limit can sit on any ancestor).
template <typename F>
void for_each_level(const std::string& base, std::string rel, F&& f) {
  while (true) {
    f(base + rel);
    if (rel.empty() || rel == "/") break;
    const size_t cut = rel.find_last_of('/');
    rel = cut == std::string::npos || cut == 0 ? "" : rel.substr(0, cut);
  }
}

int min_quota(int a, int b) { return a == 0 ? b : b == 0 ? a : std::min(a, b); }

}  // namespace

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

int cgroup_cpu_quota(const std::string& root, const std::string& proc_cgroup) {
  std::string text = proc_cgroup;
  if (text.empty() && !read_file("/proc/self/cgroup", &text)) return 0;
  int best = 0;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    // "hierarchy-id:controllers:path"; v2 is "0::/path".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      for_each_level(root, path, [&](const std::string& dir) {
        std::string v;
        if (!read_file(dir + "/cpu.max", &v)) return;
        std::istringstream in(v);
        std::string q;
        long long period = 0;
        if (in >> q >> period && q != "max")
          best = min_quota(best, quota_cpus(std::atoll(q.c_str()), period));
      });
    } else if (("," + controllers + ",").find(",cpu,") != std::string::npos) {
      // v1 mounts the cpu controller at root/cpu or root/cpu,cpuacct.
      for (const char* mount : {"/cpu", "/cpu,cpuacct", "/cpuacct,cpu"})
        for_each_level(root + mount, path, [&](const std::string& dir) {
          std::string qs, ps;
          if (!read_file(dir + "/cpu.cfs_quota_us", &qs) || !read_file(dir + "/cpu.cfs_period_us", &ps))
            return;
          best = min_quota(best, quota_cpus(std::atoll(qs.c_str()), std::atoll(ps.c_str())));
        });
    }
  }
  return best;
}

int default_thread_count() {
  const int cpus = affinity_cpus(), quota = cgroup_cpu_quota();
  return std::max(1, quota > 0 ? std::min(cpus, quota) : cpus);
}

}  // namespace fantai::cpu
