// How many cores this process can keep busy, for defaults that scale with it.
//
// std::thread::hardware_concurrency() counts the machine's CPUs. A process in
// a container often gets far fewer: a cpuset (sched_getaffinity) or a CPU
// quota (Kubernetes' CPU limit becomes a cgroup quota). Defaults that add
// threads per core must look at those instead.
#ifndef WEIGHTSTORE_CLIENT_USABLE_CORES_H_
#define WEIGHTSTORE_CLIENT_USABLE_CORES_H_

#include <optional>
#include <string>

namespace weightstore::client {

// The CPUs this thread may run on, lowered to the tightest CPU quota among its
// cgroup and the cgroup's ancestors (cgroup v2 cpu.max, or v1
// cpu.cfs_quota_us / cpu.cfs_period_us), rounded up. At least 1.
int UsableCores();

// A quota in cores from cgroup v2's cpu.max ("200000 100000" is 2.0; "max
// 100000" is unlimited: nullopt), or nullopt when it does not parse.
std::optional<double> ParseCpuMax(const std::string& text);

// A quota in cores from cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us
// ("-1" is unlimited: nullopt).
std::optional<double> ParseCfsQuota(const std::string& quota_us, const std::string& period_us);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_USABLE_CORES_H_
