// cpu: which core and which L3 cache each CPU this process may run on belongs to, and the plan
// that pins the thread pool's threads to them (--cpu-bind). A rented VM's vCPUs can be SMT
// siblings, and an EPYC's cores sit in several L3 domains (one per CCX), each with its own path
// to memory; the OS scheduler knows neither when it moves a spinning worker.
#pragma once

#include <string>
#include <vector>

namespace fantai::cpu {

struct CpuPlace {
  int cpu = 0;
  int core = 0;  // lowest CPU of its SMT siblings (thread_siblings_list)
  int l3 = 0;    // lowest CPU sharing its L3 cache (cache/index*/ with level 3), or 0 when unknown
};

// "0-3,8,10-11" -> {0,1,2,3,8,10,11} in the order written; throws on anything else.
std::vector<int> parse_cpu_list(const std::string& text);

// The CPUs in allowed (this process's affinity mask when empty), each with its core and L3
// domain read from sysfs (a parameter for tests). Missing files leave a CPU its own core.
std::vector<CpuPlace> cpu_topology(const std::string& sysfs = "/sys/devices/system/cpu",
                                   std::vector<int> allowed = {});

// The CPU for each of num_threads threads. spec:
//   "compact": one thread per core, filling an L3 domain before the next (the pool's shared
//              activations and barriers stay in one cache), SMT siblings only once every core
//              has a thread;
//   "spread":  one thread per core, taking L3 domains in turn (each domain's memory path);
//   a CPU list ("0-3,8"): thread i on the i-th CPU named.
// offset skips that many places of the compact/spread order or of the list: tensor-parallel
// ranks sharing one affinity mask take disjoint slices. When the slice does not fit (a rank that mpirun bound to
// its own cores) the rank starts at its mask's first place. Throws with the reason when the
// spec is not understood, names a CPU outside the mask, or gives fewer CPUs than threads.
std::vector<int> plan_thread_cpus(const std::vector<CpuPlace>& places, int num_threads,
                                  const std::string& spec, int offset = 0);

// "2 CPUs, 2 cores, 1 L3 domain" — for the start-up log.
std::string describe_topology(const std::vector<CpuPlace>& places);

// Pins the calling thread to one CPU; false (errno kept) when the OS refuses.
bool pin_this_thread(int cpu);

}  // namespace fantai::cpu
