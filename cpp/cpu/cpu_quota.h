// cpu: how many threads this process may really run — its CPU affinity and its cgroup's CPU quota
// (a container limited to 2 CPUs on a 64-core host sees 64 in /proc/cpuinfo and in
// hardware_concurrency, and 64 spinning threads there would time-slice against each other).
#pragma once

#include <string>

namespace fantai::cpu {

// CPUs in this process's affinity mask (at least 1).
int affinity_cpus();

// The CPU quota of the cgroup this process runs in, in CPUs (rounded up), or 0 when none is set.
// cgroup v2: cpu.max "QUOTA PERIOD" ("max" = none) of the process's cgroup and each ancestor, the
// smallest wins; cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us (-1 = none). root is the cgroup
// file system's mount point and proc_cgroup the text of /proc/self/cgroup (parameters for tests).
int cgroup_cpu_quota(const std::string& root = "/sys/fs/cgroup", const std::string& proc_cgroup = "");

// The default thread count: min(affinity, quota), at least 1.
int default_thread_count();

}  // namespace fantai::cpu
