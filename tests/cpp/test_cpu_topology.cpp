// tests: CPU topology read from fake sysfs trees (SMT siblings, L3 domains, missing files) and
// the thread-to-CPU plans of --cpu-bind; the thread pool's pinning checked on this machine's
// own CPUs through /proc.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "cpu/cpu_topology.h"
#include "cpu/thread_pool.h"
#include "test_support.h"

namespace fantai {
namespace {

namespace fs = std::filesystem;
using cpu::CpuPlace;

struct Sysfs : test::TempTree {
  // cpu c: SMT siblings and L3 sharers as sysfs lists (L3 in index3, L2 in index2 as decoy).
  void cpu(int c, const std::string& siblings, const std::string& l3) const {
    const std::string d = "cpu" + std::to_string(c);
    put(d + "/topology/thread_siblings_list", siblings + "\n");
    put(d + "/cache/index2/level", "2\n");
    put(d + "/cache/index2/shared_cpu_list", siblings + "\n");
    put(d + "/cache/index3/level", "3\n");
    put(d + "/cache/index3/shared_cpu_list", l3 + "\n");
  }
};

// 2 L3 domains (an EPYC's CCXs) of 2 cores each, SMT siblings numbered c and c + 4:
// domain 0 = cores {0,4}, {1,5}; domain 2 = cores {2,6}, {3,7}.
std::vector<CpuPlace> two_domains(const Sysfs& s) {
  for (int c = 0; c < 8; ++c) {
    const int core = c % 4;
    const std::string sib = std::to_string(core) + "," + std::to_string(core + 4);
    s.cpu(c, sib, core < 2 ? "0-1,4-5" : "2-3,6-7");
  }
  return cpu::cpu_topology(s.root.string(), {0, 1, 2, 3, 4, 5, 6, 7});
}

TEST(CpuList, ParsesRangesInOrderAndRefusesJunk) {
  EXPECT_EQ(cpu::parse_cpu_list("0-3,8, 10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(cpu::parse_cpu_list("5,1"), (std::vector<int>{5, 1}));
  for (const char* bad : {"a", "1-", "3-1", "1,,2", "-1", "1-2-3", "99999999"})
    EXPECT_THROW(cpu::parse_cpu_list(bad), std::exception) << bad;
}

TEST(CpuTopology, ReadsSiblingsAndL3Domains) {
  Sysfs s;
  const std::vector<CpuPlace> t = two_domains(s);
  ASSERT_EQ(t.size(), 8u);
  EXPECT_EQ(t[5].core, 1);
  EXPECT_EQ(t[5].l3, 0);
  EXPECT_EQ(t[6].core, 2);
  EXPECT_EQ(t[6].l3, 2);
  EXPECT_EQ(cpu::describe_topology(t), "8 CPUs, 4 cores, 2 L3 domains");
}

TEST(CpuTopology, MissingFilesLeaveEachCpuItsOwnCore) {
  Sysfs s;
  s.put("cpu0/topology/core_id", "0");
  const std::vector<CpuPlace> t = cpu::cpu_topology(s.root.string(), {3, 0, 3});
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].cpu, 0);
  EXPECT_EQ(t[1].core, 3);
  EXPECT_EQ(t[1].l3, 0);
  EXPECT_EQ(cpu::describe_topology(t), "2 CPUs, 2 cores, 1 L3 domain");
}

TEST(CpuPlan, CompactFillsOneDomainThenSiblingsLast) {
  Sysfs s;
  const auto t = two_domains(s);
  EXPECT_EQ(cpu::plan_thread_cpus(t, 2, "compact"), (std::vector<int>{0, 1}));
  EXPECT_EQ(cpu::plan_thread_cpus(t, 6, "compact"), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(cpu::plan_thread_cpus(t, 8, "compact"), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(CpuPlan, SpreadDealsDomainsInTurn) {
  Sysfs s;
  const auto t = two_domains(s);
  EXPECT_EQ(cpu::plan_thread_cpus(t, 2, "spread"), (std::vector<int>{0, 2}));
  EXPECT_EQ(cpu::plan_thread_cpus(t, 4, "spread"), (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(cpu::plan_thread_cpus(t, 5, "spread"), (std::vector<int>{0, 2, 1, 3, 4}));
}

TEST(CpuPlan, OffsetGivesRanksDisjointSlicesOrTheirOwnMask) {
  Sysfs s;
  const auto t = two_domains(s);
  EXPECT_EQ(cpu::plan_thread_cpus(t, 2, "compact", 2), (std::vector<int>{2, 3}));
  // A slice past the mask (mpirun bound this rank to its own cores): start at the mask's first.
  EXPECT_EQ(cpu::plan_thread_cpus(t, 2, "compact", 7), (std::vector<int>{0, 1}));
  EXPECT_EQ(cpu::plan_thread_cpus(t, 2, "4-7", 2), (std::vector<int>{6, 7}));
}

TEST(CpuPlan, ListsAreTakenAsWrittenAndChecked) {
  Sysfs s;
  const auto t = two_domains(s);
  EXPECT_EQ(cpu::plan_thread_cpus(t, 3, "6,2,0-1"), (std::vector<int>{6, 2, 0}));
  auto reason = [&](int threads, const std::string& spec) {
    try {
      cpu::plan_thread_cpus(t, threads, spec);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(reason(1, "9").find("not in this process's affinity mask"), std::string::npos);
  EXPECT_NE(reason(3, "0-1").find("names 2 CPUs for 3 threads"), std::string::npos);
  EXPECT_NE(reason(9, "compact").find("9 threads but this process may run on 8 CPUs"), std::string::npos);
  EXPECT_NE(reason(1, "cores").find("not understood"), std::string::npos);
}

// The CPU a thread may run on, from its own /proc entry ("Cpus_allowed_list:\t3").
std::string allowed_list(long tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("Cpus_allowed_list:", 0) == 0) return line.substr(line.find_first_not_of(" \t", 18));
  return "";
}

TEST(ThreadPoolBind, PinsWorkersAndAnOtherThreadsCaller) {
  const std::vector<CpuPlace> mine = cpu::cpu_topology();
  const int n = std::min<int>(3, mine.size() + 1);  // more threads than CPUs still pins each
  std::vector<int> cpus;
  for (int i = 0; i < n; ++i) cpus.push_back(mine[(i + 1) % mine.size()].cpu);
  cpu::ThreadPool pool(n);
  pool.bind(cpus);
  // Every worker reports its own CPU set from inside a task.
  std::vector<std::string> seen(n);
  std::atomic<int> done{0};
  std::string caller_mask;
  std::thread caller([&] {
    pool.parallel_for(64 * n, [&](int64_t, int idx) {
      if (seen[idx].empty()) seen[idx] = allowed_list(syscall(SYS_gettid));
      ++done;
    });
    // Read after the call, not from a task: tasks are handed out dynamically, and on a loaded
    // machine the spinning workers can take every one before the caller reaches its first.
    caller_mask = allowed_list(syscall(SYS_gettid));
  });
  caller.join();
  EXPECT_EQ(done.load(), 64 * n);
  EXPECT_EQ(caller_mask, std::to_string(cpus[0]));  // the caller, not the main thread: pinned
  for (int i = 0; i < n; ++i) {
    if (!seen[i].empty()) EXPECT_EQ(seen[i], std::to_string(cpus[i])) << "thread " << i;
  }
  // Whether or not a worker took a task, /proc names it and shows its mask.
  int named = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "comm");
    std::string comm;
    std::getline(f, comm);
    if (comm.rfind("fantai-cpu-", 0) != 0) continue;
    const int i = std::stoi(comm.substr(11));
    ASSERT_TRUE(i >= 1 && i < n) << comm;
    EXPECT_EQ(allowed_list(std::stol(e.path().filename().string())), std::to_string(cpus[i])) << comm;
    ++named;
  }
  EXPECT_EQ(named, n - 1);
  // The main thread keeps its mask: threads it starts later must not inherit one CPU.
  pool.parallel_for(8, [](int64_t, int) {});
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(CPU_COUNT(&set), static_cast<int>(mine.size()));
  EXPECT_THROW(pool.bind({cpus[0]}), std::exception);
}

}  // namespace
}  // namespace fantai
