#include "client/usable_cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace weightstore::client {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> ReadSmallFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Takes the smaller of `current` and `quota`.
void Tighten(std::optional<double>* current, std::optional<double> quota) {
  if (quota && (!*current || *quota < **current)) *current = quota;
}

// The tightest quota from `cgroup` (a path below `root`) up to `root`, read by
// `read_dir` from each folder.
template <typename ReadDir>
std::optional<double> TightestOnPath(const fs::path& root, const std::string& cgroup, ReadDir read_dir) {
  std::optional<double> tightest;
  fs::path dir = (root / fs::path(cgroup).relative_path()).lexically_normal();
  if (!dir.has_filename()) dir = dir.parent_path();  // "/sys/fs/cgroup/" -> "/sys/fs/cgroup"
  while (true) {
    Tighten(&tightest, read_dir(dir));
    if (dir.native().size() <= root.native().size()) break;  // root read (or the path escaped it)
    dir = dir.parent_path();
  }
  return tightest;
}

// The process's CPU quota in cores from its cgroups, if any.
std::optional<double> CgroupQuota() {
  std::optional<std::string> membership = ReadSmallFile("/proc/self/cgroup");
  if (!membership) return std::nullopt;
  std::optional<double> tightest;
  std::error_code ec;
  for (absl::string_view line : absl::StrSplit(*membership, '\n', absl::SkipEmpty())) {
    // "<id>:<controllers>:<path>"; v2 is "0::<path>".
    std::vector<std::string> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3) continue;
    const std::string& path = fields[2];
    if (fields[0] == "0" && fields[1].empty() && fs::exists("/sys/fs/cgroup/cgroup.controllers", ec)) {
      Tighten(&tightest, TightestOnPath("/sys/fs/cgroup", path, [](const fs::path& dir) -> std::optional<double> {
        std::optional<std::string> text = ReadSmallFile(dir / "cpu.max");
        return text ? ParseCpuMax(*text) : std::nullopt;
      }));
      continue;
    }
    std::vector<std::string> controllers = absl::StrSplit(fields[1], ',');
    if (std::find(controllers.begin(), controllers.end(), "cpu") == controllers.end()) continue;
    Tighten(&tightest, TightestOnPath("/sys/fs/cgroup/cpu", path, [](const fs::path& dir) -> std::optional<double> {
      std::optional<std::string> quota = ReadSmallFile(dir / "cpu.cfs_quota_us");
      std::optional<std::string> period = ReadSmallFile(dir / "cpu.cfs_period_us");
      return quota && period ? ParseCfsQuota(*quota, *period) : std::nullopt;
    }));
  }
  return tightest;
}

}  // namespace

std::optional<double> ParseCpuMax(const std::string& text) {
  std::vector<absl::string_view> fields = absl::StrSplit(absl::StripAsciiWhitespace(text), ' ', absl::SkipEmpty());
  if (fields.size() != 2 || fields[0] == "max") return std::nullopt;
  double quota = 0, period = 0;
  if (!absl::SimpleAtod(fields[0], &quota) || !absl::SimpleAtod(fields[1], &period) || quota <= 0 || period <= 0) {
    return std::nullopt;
  }
  return quota / period;
}

std::optional<double> ParseCfsQuota(const std::string& quota_us, const std::string& period_us) {
  double quota = 0, period = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(quota_us), &quota) ||
      !absl::SimpleAtod(absl::StripAsciiWhitespace(period_us), &period) || quota <= 0 || period <= 0) {
    return std::nullopt;  // -1: no quota
  }
  return quota / period;
}

int UsableCores() {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (std::optional<double> quota = CgroupQuota()) cores = std::min(cores, static_cast<int>(std::ceil(*quota)));
  return std::max(cores, 1);
}

}  // namespace weightstore::client
