// tests: the default thread count's inputs — cgroup v2 and v1 CPU quotas read from fake cgroup
// trees (the parsing, ancestors' limits, "max" and -1 meaning none), and the affinity count.
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "cpu/cpu_quota.h"
#include "test_support.h"

namespace fantai {
namespace {

using Tree = test::TempTree;

TEST(CgroupQuota, V2OwnLimitRoundsUp) {
  Tree t;
  t.put("kubepods/pod1/cpu.max", "150000 100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/kubepods/pod1\n"), 2);
}

TEST(CgroupQuota, V2AncestorLimitAndMax) {
  Tree t;
  t.put("a/cpu.max", "200000 100000\n");
  t.put("a/b/cpu.max", "max 100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/a/b\n"), 2);
  t.put("a/cpu.max", "max 100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/a/b\n"), 0);
}

TEST(CgroupQuota, V2NamespacedRoot) {
  Tree t;  // inside a cgroup namespace the container's own cgroup is the root
  t.put("cpu.max", "400000 100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/\n"), 4);
}

TEST(CgroupQuota, V1QuotaAndUnlimited) {
  Tree t;
  t.put("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "50000\n");
  t.put("cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n"), 1);
  t.put("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "3:cpu,cpuacct:/docker/x\n"), 0);
}

TEST(CgroupQuota, V1ContainerSeesItsOwnCgroupAtTheMount) {
  Tree t;  // /proc/self/cgroup names the host's path, the mount shows the container's cgroup
  t.put("cpu/cpu.cfs_quota_us", "300000\n");
  t.put("cpu/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "2:cpu:/docker/abc\n"), 3);
}

TEST(CgroupQuota, NothingSetOrUnreadable) {
  Tree t;
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/none\n"), 0);
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "garbage"), 0);
  t.put("cpu.max", "nonsense\n");
  EXPECT_EQ(cpu::cgroup_cpu_quota(t.root.string(), "0::/\n"), 0);
}

TEST(DefaultThreads, FollowsAffinity) {
  cpu_set_t all, one;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  const int n = cpu::affinity_cpus();
  EXPECT_EQ(n, CPU_COUNT(&all));
  EXPECT_LE(cpu::default_thread_count(), n);
  EXPECT_GE(cpu::default_thread_count(), 1);
  // Pinned to one CPU, the default is one thread.
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(cpu::affinity_cpus(), 1);
  EXPECT_EQ(cpu::default_thread_count(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
}

}  // namespace
}  // namespace fantai
