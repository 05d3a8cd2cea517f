// cpu: CPU topology from sysfs and the thread-to-CPU plan (see cpu_topology.h).
#include "cpu/cpu_topology.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/check.h"

namespace fantai::cpu {
namespace {

bool read_line(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::getline(f, *out);
  return true;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

int parse_cpu_number(const std::string& t, const std::string& whole) {
  FANTAI_REQUIRE(!t.empty() && t.size() <= 6 && std::all_of(t.begin(), t.end(), ::isdigit),
                 "cpu list '" << whole << "': '" << t << "' is not a CPU number");
  return std::stoi(t);
}

// Lowest CPU of a sysfs CPU list file, or fallback when it cannot be read.
int lowest_of(const std::string& path, int fallback) {
  std::string line;
  if (!read_line(path, &line) || trim(line).empty()) return fallback;
  try {
    const std::vector<int> v = parse_cpu_list(line);
    return v.empty() ? fallback : *std::min_element(v.begin(), v.end());
  } catch (const std::exception&) {
    return fallback;
  }
}

std::vector<int> affinity_list() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

// One thread per core first, then the cores' further SMT siblings. Within a pass the cores come
// grouped by L3 domain (compact) or dealt from the domains in turn (spread).
std::vector<int> ordered_places(const std::vector<CpuPlace>& places, bool spread) {
  // domain -> core -> CPUs, each ascending.
  std::map<int, std::map<int, std::vector<int>>> tree;
  for (const CpuPlace& p : places) tree[p.l3][p.core].push_back(p.cpu);
  size_t max_siblings = 0;
  for (auto& [d, cores] : tree)
    for (auto& [c, cpus] : cores) {
      std::sort(cpus.begin(), cpus.end());
      max_siblings = std::max(max_siblings, cpus.size());
    }
  std::vector<int> order;
  for (size_t sibling = 0; sibling < max_siblings; ++sibling) {
    std::vector<std::vector<int>> per_domain;
    for (auto& [d, cores] : tree) {
      per_domain.emplace_back();
      for (auto& [c, cpus] : cores)
        if (sibling < cpus.size()) per_domain.back().push_back(cpus[sibling]);
    }
    if (!spread) {
      for (const auto& v : per_domain) order.insert(order.end(), v.begin(), v.end());
      continue;
    }
    for (size_t i = 0;; ++i) {
      bool any = false;
      for (const auto& v : per_domain)
        if (i < v.size()) order.push_back(v[i]), any = true;
      if (!any) break;
    }
  }
  return order;
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(trim(text));
  std::string part;
  while (std::getline(ss, part, ',')) {
    part = trim(part);
    FANTAI_REQUIRE(!part.empty(), "cpu list '" << text << "' has an empty entry");
    const size_t dash = part.find('-');
    if (dash == std::string::npos) {
      out.push_back(parse_cpu_number(part, text));
      continue;
    }
    const int lo = parse_cpu_number(trim(part.substr(0, dash)), text);
    const int hi = parse_cpu_number(trim(part.substr(dash + 1)), text);
    FANTAI_REQUIRE(lo <= hi, "cpu list '" << text << "': range " << part << " runs backwards");
    FANTAI_REQUIRE(hi < CPU_SETSIZE,
                   "cpu list '" << text << "': CPU " << hi << " is past " << CPU_SETSIZE - 1);
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  for (int c : out)
    FANTAI_REQUIRE(c < CPU_SETSIZE, "cpu list '" << text << "': CPU " << c << " is past " << CPU_SETSIZE - 1);
  return out;
}

std::vector<CpuPlace> cpu_topology(const std::string& sysfs, std::vector<int> allowed) {
  if (allowed.empty()) allowed = affinity_list();
  std::sort(allowed.begin(), allowed.end());
  allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
  std::vector<CpuPlace> out;
  for (int c : allowed) {
    const std::string dir = sysfs + "/cpu" + std::to_string(c);
    CpuPlace p;
    p.cpu = c;
    p.core = lowest_of(dir + "/topology/thread_siblings_list", c);
    for (int i = 0; i < 8; ++i) {
      const std::string idx = dir + "/cache/index" + std::to_string(i);
      std::string level;
      if (!read_line(idx + "/level", &level)) continue;
      if (trim(level) == "3") {
        p.l3 = lowest_of(idx + "/shared_cpu_list", 0);
        break;
      }
    }
    out.push_back(p);
  }
  return out;
}

std::vector<int> plan_thread_cpus(const std::vector<CpuPlace>& places, int num_threads,
                                  const std::string& spec, int offset) {
  FANTAI_REQUIRE(num_threads >= 1, "cpu bind: " << num_threads << " threads");
  FANTAI_REQUIRE(!places.empty(), "cpu bind: this process may run on no CPU");
  std::set<int> allowed;
  for (const CpuPlace& p : places) allowed.insert(p.cpu);
  const std::string s = trim(spec);
  if (s == "compact" || s == "spread") {
    const std::vector<int> order = ordered_places(places, s == "spread");
    if (offset < 0 || offset + num_threads > static_cast<int>(order.size())) offset = 0;
    FANTAI_REQUIRE(num_threads <= static_cast<int>(order.size()),
                   "cpu bind '" << s << "': " << num_threads << " threads but this process may run on "
                                << order.size() << " CPUs");
    return {order.begin() + offset, order.begin() + offset + num_threads};
  }
  FANTAI_REQUIRE(!s.empty() && std::isdigit(static_cast<unsigned char>(s[0])),
                 "cpu bind '" << spec
                              << "' not understood (none, compact, spread, or a CPU list such as 0-3,8)");
  const std::vector<int> list = parse_cpu_list(s);
  for (int c : list)
    FANTAI_REQUIRE(allowed.count(c),
                   "cpu bind '" << s << "': CPU " << c << " is not in this process's affinity mask");
  FANTAI_REQUIRE(static_cast<int>(list.size()) >= num_threads,
                 "cpu bind '" << s << "' names " << list.size() << " CPUs for " << num_threads << " threads");
  if (offset < 0 || offset + num_threads > static_cast<int>(list.size())) offset = 0;
  return {list.begin() + offset, list.begin() + offset + num_threads};
}

std::string describe_topology(const std::vector<CpuPlace>& places) {
  std::set<int> cores, domains;
  for (const CpuPlace& p : places) cores.insert(p.core), domains.insert(p.l3);
  std::ostringstream ss;
  ss << places.size() << (places.size() == 1 ? " CPU, " : " CPUs, ") << cores.size()
     << (cores.size() == 1 ? " core, " : " cores, ") << domains.size()
     << (domains.size() == 1 ? " L3 domain" : " L3 domains");
  return ss.str();
}

bool pin_this_thread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

}  // namespace fantai::cpu
