// shm_bench: mapping a 1 GB checkpoint through weightstored's same-host socket,
// beside fetching it over gRPC loopback and reading the file into memory, all
// in one run with the page cache warm. Then 4 processes map it at once and
// their memory is read from /proc: RSS counts shared pages in every process,
// PSS divides them among the processes that share them.
//
// Usage: shm_bench [--gb N] [--repeat N]
#include <fcntl.h>
#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/parallel_copy.h"
#include "client/store.h"
#include "core/host_buffer.h"
#include "core/mapped_file.h"
#include "tests/bench/bench_checkpoint.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"

namespace weightstore {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kTensorBytes = 4 << 20;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Field `key` (kB) of /proc/<pid>/smaps_rollup.
long SmapsKb(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/smaps_rollup"));
  std::string k, unit;
  long v;
  while (in >> k) {
    if (k == key + ":" && in >> v >> unit) return v;
  }
  return -1;
}

struct Timing {
  double first_ms = 0, all_ms = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Records when the first tensor completed.
class FirstTensorSink : public client::TensorSink {
 public:
  explicit FirstTensorSink(Clock::time_point start) : start_(start) {}
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
    if (buffer_.size() < spec.byte_size()) buffer_ = std::vector<std::byte>(spec.byte_size());
    return std::span<std::byte>(buffer_.data(), spec.byte_size());
  }
  absl::Status End(const TensorSpec&) override {
    if (first_ms_ < 0) first_ms_ = Ms(Clock::now() - start_);
    return absl::OkStatus();
  }
  double first_ms() const { return first_ms_; }

 private:
  Clock::time_point start_;
  std::vector<std::byte> buffer_;
  double first_ms_ = -1;
};

}  // namespace
}  // namespace weightstore

int main(int argc, char** argv) {
  using namespace weightstore;
  int gb = 1, repeat = 5;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--gb")) gb = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--repeat")) repeat = std::atoi(argv[i + 1]);
  }
  client::TuneAllocatorForStreaming();
  char tmpl[] = "/tmp/weightstore-shm-bench-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string models = dir + "/models", socket = dir + "/ws.sock";
  std::filesystem::create_directories(models);
  const uint64_t count = (static_cast<uint64_t>(gb) << 30) / kTensorBytes;
  // [1024, 1024] matrices, so the tensor-parallel runs can shard them.
  if (absl::Status s = WriteBenchCheckpoint(models + "/big.safetensors", count, kTensorBytes, std::byte{7}, 1024);
      !s.ok()) {
    std::fprintf(stderr, "bench: %s\n", s.ToString().c_str());
    return 1;
  }
  const std::string file = models + "/big.safetensors";
  const uint64_t total = count * kTensorBytes;
  // The bench's client runs as the files' owner (or root), which could reopen a
  // file writable: it is trusted, to measure mapping the files themselves.
  testing::Daemon daemon(models, {"--socket", socket, "--socket-file-segments", "always"});
  if (daemon.port() == 0) {
    std::fprintf(stderr, "shm_bench: the daemon did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  std::printf("shm_bench: %llu MiB checkpoint (%llu tensors of 4 MiB), page cache warm, median of %d\n\n",
              static_cast<unsigned long long>(total >> 20), static_cast<unsigned long long>(count), repeat);

  // The first socket request of a version computes every tensor's CRC32C once.
  double first_request_ms;
  {
    const auto start = Clock::now();
    auto store = client::ConnectSharedMemoryStore(socket);
    auto mapped = (*store)->MapTensors("big", {});
    if (!mapped.ok()) {
      std::fprintf(stderr, "shm_bench: %s\n", mapped.status().ToString().c_str());
      return 1;
    }
    first_request_ms = Ms(Clock::now() - start);
  }

  std::vector<double> shm_first, shm_all, shm_touch, grpc_first, grpc_all, read_first, read_all;
  long rss_growth_kb = 0;
  for (int r = 0; r < repeat; ++r) {
    {  // socket: connect, map every tensor, read the first tensor's first byte
      const long rss_before = SmapsKb(::getpid(), "Rss");
      const auto start = Clock::now();
      auto store = client::ConnectSharedMemoryStore(socket);
      auto mapped = (*store)->MapTensors("big", {});
      volatile std::byte b = mapped->tensors[0].bytes.data()[0];
      (void)b;
      shm_first.push_back(Ms(Clock::now() - start));
      shm_all.push_back(shm_first.back());  // every tensor is usable once mapped
      rss_growth_kb = SmapsKb(::getpid(), "Rss") - rss_before;
      // For reference: reading every mapped byte once (page-table population).
      const auto touch = Clock::now();
      uint64_t sum = 0;
      for (const auto& t : mapped->tensors) {
        for (size_t i = 0; i < t.bytes.size(); i += 4096) sum += static_cast<uint8_t>(t.bytes.data()[i]);
      }
      if (sum == 1) std::printf(" ");
      shm_touch.push_back(Ms(Clock::now() - touch));
    }
    {  // gRPC loopback into one reused buffer
      auto store = client::ConnectRemoteStore(daemon.address());
      const auto start = Clock::now();
      FirstTensorSink sink(start);
      if (!(*store)->FetchTensors("big", {}, &sink).ok()) return 1;
      grpc_all.push_back(Ms(Clock::now() - start));
      grpc_first.push_back(sink.first_ms());
    }
    {  // read the file into memory: pread into a huge-page buffer (the fastest fill here)
      const auto start = Clock::now();
      int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      const uint64_t size = std::filesystem::file_size(file);
      auto buffer = HostBuffer::Allocate(size);
      if (fd < 0 || !buffer.ok()) return 1;
      // The first tensor is usable once the header and its bytes are in.
      const uint64_t first = std::min<uint64_t>(size, kTensorBytes + 64 * 1024);
      if (!PreadFully(fd, 0, buffer->data(), first, file).ok()) return 1;
      read_first.push_back(Ms(Clock::now() - start));
      if (!PreadFully(fd, first, buffer->data() + first, size - first, file).ok()) return 1;
      read_all.push_back(Ms(Clock::now() - start));
      ::close(fd);
    }
  }
  auto gbps = [&](double ms) { return static_cast<double>(total) / (ms / 1e3) / 1e9; };
  std::printf("%-46s %14s %14s %10s\n", "path", "first tensor", "all tensors", "GB/s");
  std::printf("  %-44s %11.2f ms %11.2f ms %10.1f\n", "socket: connect + map (no copy)", Median(shm_first),
              Median(shm_all), gbps(Median(shm_all)));
  std::printf("  %-44s %11s %11.2f ms %10.1f\n", "  then touching every page once", "", Median(shm_touch),
              gbps(Median(shm_touch)));
  std::printf("  %-44s %11.2f ms %11.2f ms %10.1f\n", "gRPC loopback fetch (1 client)", Median(grpc_first),
              Median(grpc_all), gbps(Median(grpc_all)));
  std::printf("  %-44s %11.2f ms %11.2f ms %10.1f\n", "read the file into memory (pread)", Median(read_first),
              Median(read_all), gbps(Median(read_all)));
  std::printf("\nfirst socket request of this version (daemon computes CRC32C once): %.1f ms\n", first_request_ms);
  {  // a copying socket fetch: the daemon's segments read into memory this process owns
    // Two ways, alternated, into one buffer written before (so only the
    // source side differs): pread from the segment's descriptor (what
    // FetchTensors does), and a fresh mapping of it copied and unmapped
    // (what it did, WEIGHTSTORE_PREAD_COPIES=0). Both checksum as they go.
    // Of the file itself (the daemon above) and of a filled memfd (the
    // default for a peer that could write the file, as this root process).
    const std::string copy_models = dir + "/copy", copy_socket = dir + "/copy.sock";
    std::filesystem::create_directories(copy_models);
    std::filesystem::copy_file(file, copy_models + "/big.safetensors");
    testing::Daemon filled(copy_models, {"--socket", copy_socket});
    std::vector<std::byte> owned(total + (1 << 20), std::byte{1});
    std::printf("\na socket fetch asked to copy, into memory this process owns (written before):\n");
    for (const auto& [label, path] : std::vector<std::pair<const char*, std::string>>{
             {"the file itself", socket}, {"a filled memfd (the default here)", copy_socket}}) {
      auto store = client::ConnectSharedMemoryStore(path);
      auto mapped = store.ok() ? (*store)->MapTensors("big", {}) : store.status();
      if (!mapped.ok()) {
        std::fprintf(stderr, "shm_bench: %s\n", mapped.status().ToString().c_str());
        return 1;
      }
      std::vector<double> by_pread, by_mapping;
      for (int r = 0; r < repeat; ++r) {
        for (int way = 0; way < 2; ++way) {
          const bool pread = (way + r) % 2 == 0;
          const auto start = Clock::now();
          for (const auto& segment : mapped->segments) {
            const std::span<std::byte> to(owned.data(), segment->size());
            if (pread) {
              if (!client::ParallelPread(to, segment->fd(), segment->offset(), segment->path(), /*checksum=*/true).ok())
                return 1;
              continue;
            }
            auto again = MappedFile::FromDescriptor(::fcntl(segment->fd(), F_DUPFD_CLOEXEC, 0), segment->path(),
                                                    segment->offset(), segment->size());
            if (!again.ok()) return 1;
            (void)client::CopyWithCrc32c(to, (*again)->bytes().data(), /*release_from=*/false);
          }
          (pread ? by_pread : by_mapping).push_back(Ms(Clock::now() - start));
        }
      }
      std::printf("  %-44s %9.1f ms pread  %9.1f ms mapping  %5.2fx\n", label, Median(by_pread), Median(by_mapping),
                  Median(by_mapping) / Median(by_pread));
    }
  }
  {  // the default (--socket-file-segments auto) for a peer that could write the file: root, as here
    const std::string auto_models = dir + "/auto", auto_socket = dir + "/auto.sock";
    std::filesystem::create_directories(auto_models);
    std::filesystem::copy_file(file, auto_models + "/plain.safetensors");
    std::filesystem::copy_file(file, auto_models + "/immutable.safetensors");
    const std::string immutable_path = auto_models + "/immutable.safetensors";
    const int immutable_fd = ::open(immutable_path.c_str(), O_RDONLY | O_CLOEXEC);
    int flags = 0;
    const bool immutable = immutable_fd >= 0 && ::ioctl(immutable_fd, FS_IOC_GETFLAGS, &flags) == 0 && [&] {
      const int set = flags | FS_IMMUTABLE_FL;
      return ::ioctl(immutable_fd, FS_IOC_SETFLAGS, &set) == 0;
    }();
    {
      testing::Daemon daemon_auto(auto_models, {"--socket", auto_socket, "--metrics-listen", "127.0.0.1:0"});
      if (daemon_auto.port() == 0) {
        std::fprintf(stderr, "shm_bench: the daemon did not start:\n%s\n", daemon_auto.log().c_str());
        return 1;
      }
      // A peer as root in a container: without the capabilities that clear
      // the immutable flag (the bench runs as root with all of them, so the
      // request is made by a child that drops them).
      std::printf(
          "\nthe socket's default for a root peer (--socket-file-segments auto), first request of a version:\n");
      for (const char* name : {"plain", "immutable"}) {
        if (std::string(name) == "immutable" && !immutable) {
          std::printf("  %-44s (this filesystem cannot make a file immutable)\n", name);
          continue;
        }
        const double shm_before = testing::MetricValue(daemon_auto.metrics_port(), "weightstore_shm_bytes");
        int out[2];
        if (::pipe2(out, O_CLOEXEC) != 0) return 1;
        const pid_t child = ::fork();
        if (child == 0) {
          ::dup2(out[1], STDOUT_FILENO);
          ::execl("/usr/bin/setpriv", "setpriv", "--bounding-set", "-linux_immutable,-sys_rawio,-sys_admin",
                  WEIGHTSTORE_SHM_PROBE_PATH, auto_socket.c_str(), name, static_cast<char*>(nullptr));
          ::_exit(127);
        }
        ::close(out[1]);
        std::string printed;
        char chunk[4096];
        for (ssize_t n; (n = ::read(out[0], chunk, sizeof(chunk))) > 0;) printed.append(chunk, static_cast<size_t>(n));
        ::close(out[0]);
        int status = 0;
        ::waitpid(child, &status, 0);
        // The probe's connect + map time (it then reads every byte).
        const size_t at = printed.find("loaded_ms=");
        const double ms = at == std::string::npos ? -1 : std::atof(printed.c_str() + at + 10);
        const double shm_after = testing::MetricValue(daemon_auto.metrics_port(), "weightstore_shm_bytes");
        std::printf("  %-44s %11.1f ms  %8.0f MiB of shared memory%s\n",
                    std::string(name) == "plain" ? "a plain file: a sealed copy" : "an immutable file: the file itself",
                    ms, (shm_after - shm_before) / (1 << 20),
                    WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "" : " (the probe failed)");
      }
    }
    // A plain file's copy is filled a tensor at a time, so selections share
    // it: a quarter of the tensors, then half (one quarter new), then all,
    // then all again. The baseline, in the same run: a daemon started with
    // WEIGHTSTORE_FILLED_COPIES=0, whose copies are per request, sealed
    // whole. This process is root: it could write the file.
    std::printf("\na plain file's copy, one version asked for in four selections in turn:\n");
    std::printf("  %-34s %24s %32s\n", "", "filled a tensor at a time", "per request, sealed whole");
    const uint64_t quarter = std::max<uint64_t>(1, count / 4);
    const std::vector<std::pair<const char*, uint64_t>> selections = {{"a quarter of the tensors", quarter},
                                                                      {"half of them (a quarter new)", 2 * quarter},
                                                                      {"all of them (half new)", count},
                                                                      {"all of them again", count}};
    std::vector<std::vector<std::pair<double, double>>> rows(2);  // per way: (ms, MiB added)
    for (int way = 0; way < 2; ++way) {
      const std::string way_models = absl::StrCat(dir, "/parts", way),
                        way_socket = absl::StrCat(dir, "/parts", way, ".sock");
      std::filesystem::create_directories(way_models);
      std::filesystem::copy_file(file, way_models + "/parts.safetensors");
      if (way == 1) ::setenv("WEIGHTSTORE_FILLED_COPIES", "0", 1);
      testing::Daemon parts(way_models, {"--socket", way_socket, "--metrics-listen", "127.0.0.1:0"});
      ::unsetenv("WEIGHTSTORE_FILLED_COPIES");
      auto store = client::ConnectSharedMemoryStore(way_socket);
      if (parts.port() == 0 || !store.ok()) {
        std::fprintf(stderr, "shm_bench: the daemon did not start:\n%s\n", parts.log().c_str());
        return 1;
      }
      for (const auto& [label, n] : selections) {
        client::Query q;
        for (uint64_t k = 0; k < n; ++k) q.selection.paths.push_back(absl::StrCat("w.", k));
        const double shm_before = testing::MetricValue(parts.metrics_port(), "weightstore_shm_bytes");
        const auto start = Clock::now();
        auto mapped = (*store)->MapTensors("parts", q);
        const double ms = Ms(Clock::now() - start);
        const double shm_after = testing::MetricValue(parts.metrics_port(), "weightstore_shm_bytes");
        if (!mapped.ok() || mapped->tensors.size() != n) {
          std::fprintf(stderr, "shm_bench: %s\n", mapped.status().ToString().c_str());
          return 1;
        }
        rows[way].push_back({ms, (shm_after - shm_before) / (1 << 20)});
      }
    }
    double totals[2][2] = {{0, 0}, {0, 0}};
    for (size_t r = 0; r < selections.size(); ++r) {
      std::printf("  %-34s %10.1f ms %7.0f MiB %17.1f ms %7.0f MiB\n", selections[r].first, rows[0][r].first,
                  rows[0][r].second, rows[1][r].first, rows[1][r].second);
      for (int way = 0; way < 2; ++way) {
        totals[way][0] += rows[way][r].first;
        totals[way][1] += rows[way][r].second;
      }
    }
    std::printf("  %-34s %10.1f ms %7.0f MiB %17.1f ms %7.0f MiB\n", "in all", totals[0][0], totals[0][1], totals[1][0],
                totals[1][1]);
    if (immutable) ::ioctl(immutable_fd, FS_IOC_SETFLAGS, &flags);  // so that the folder can go
    if (immutable_fd >= 0) ::close(immutable_fd);
  }
  {  // casts: materialized once into a sealed memfd, then shared
    // The baseline: filling a memfd of the cast's size with pwrite, 1 MiB at a
    // time, from memory already written (the machine's speed for shared memory).
    const uint64_t half = total / 2;
    std::vector<std::byte> source(half, std::byte{1});
    // Median of 3 fills of `bytes` (at most `half`); -1 on failure.
    auto pwrite_fill_ms = [&](uint64_t bytes) -> double {
      std::vector<double> fill_ms;
      for (int r = 0; r < 3; ++r) {
        const auto start = Clock::now();
        const int fd = ::memfd_create("shm_bench", MFD_CLOEXEC);
        if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return -1;
        for (uint64_t at = 0; at < bytes; at += 1 << 20) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(1 << 20, bytes - at));
          if (::pwrite(fd, source.data() + at, n, static_cast<off_t>(at)) != static_cast<ssize_t>(n)) return -1;
        }
        ::close(fd);
        fill_ms.push_back(Ms(Clock::now() - start));
      }
      return Median(fill_ms);
    };
    const double baseline_ms = pwrite_fill_ms(half);
    if (baseline_ms < 0) return 1;
    std::printf("\nfilling a %llu MiB memfd with pwrite from memory (baseline): %.1f ms, %.2f GB/s\n",
                static_cast<unsigned long long>(half >> 20), baseline_ms,
                static_cast<double>(half) / baseline_ms / 1e6);
    for (DType dtype : {DType::kF16, DType::kBF16}) {
      client::Query cast;
      cast.selection.dtype = dtype;
      auto store = client::ConnectSharedMemoryStore(socket);
      auto start = Clock::now();
      auto built = (*store)->MapTensors("big", cast);
      const double build_ms = Ms(Clock::now() - start);
      start = Clock::now();
      auto shared = (*store)->MapTensors("big", cast);
      const double hit_ms = Ms(Clock::now() - start);
      if (!built.ok() || !shared.ok()) return 1;
      std::printf(
          "cast to %-4s: the first request builds the %llu MiB sealed segment in %.1f ms (%.2f GB/s out, %.0f%% of the "
          "baseline); later requests map it in %.2f ms\n",
          std::string(DTypeName(dtype)).c_str(), static_cast<unsigned long long>(half >> 20), build_ms,
          static_cast<double>(half) / build_ms / 1e6, 100.0 * baseline_ms / build_ms, hit_ms);
    }
    // Tensor parallelism: rank 0 of N maps its shard of every tensor. A dim-0
    // shard is a byte range of the file: mapped, nothing built. A dim-1 shard
    // is gathered once into a sealed segment (the first request builds it).
    std::printf("\ntensor-parallel shards of every tensor, rank 0 of N (whole checkpoint: %.2f ms to map):\n",
                Median(shm_all));
    for (uint32_t world : {2u, 4u, 8u}) {
      client::Query rows;
      rows.selection.shard = {0, world, {{"^w\\.", {0}}}};
      std::vector<double> map_ms;
      for (int r = 0; r < 5; ++r) {
        const auto start = Clock::now();
        auto store = client::ConnectSharedMemoryStore(socket);
        auto mapped = store.ok() ? (*store)->MapTensors("big", rows) : store.status();
        if (!mapped.ok()) return 1;
        map_ms.push_back(Ms(Clock::now() - start));
      }
      // Each rank's first build of its dim-1 shard, against pwrite fills of the
      // same size measured just before: one into a memfd kept open across the
      // build (new pages, as the segment's are: on this VM, memory that stays
      // allocated costs the host's first touch, 0.4-2.6 GB/s), and the median
      // of 3 into memfds closed at once (recycled pages: the fastest fill).
      const uint64_t bytes = total / world;
      std::printf(
          "  N=%u: dim-0 shard mapped in %.2f ms (connect + map, median of 5); dim-1 shard segments of %llu MiB:\n",
          world, Median(map_ms), static_cast<unsigned long long>(bytes >> 20));
      for (uint32_t rank = 0; rank < std::min(world, 2u); ++rank) {
        const double recycled_ms = pwrite_fill_ms(bytes);
        const auto fresh_start = Clock::now();
        const int fresh = ::memfd_create("shm_bench_fresh", MFD_CLOEXEC);
        if (fresh < 0 || ::ftruncate(fresh, static_cast<off_t>(bytes)) != 0) return 1;
        for (uint64_t at = 0; at < bytes; at += 1 << 20) {
          if (::pwrite(fresh, source.data() + at, 1 << 20, static_cast<off_t>(at)) != 1 << 20) return 1;
        }
        const double fresh_ms = Ms(Clock::now() - fresh_start);
        client::Query cols;
        cols.selection.shard = {rank, world, {{"^w\\.", {1}}}};
        auto store = client::ConnectSharedMemoryStore(socket);
        const auto start = Clock::now();
        auto built = store.ok() ? (*store)->MapTensors("big", cols) : store.status();
        const double build_ms = Ms(Clock::now() - start);
        ::close(fresh);
        if (!built.ok() || recycled_ms < 0) return 1;
        std::printf(
            "    rank %u: first build %.1f ms, %.2f GB/s = %.0f%% of a kept pwrite fill (%.1f ms), %.0f%% of a "
            "recycled one (%.1f ms)\n",
            rank, build_ms, static_cast<double>(bytes) / build_ms / 1e6, 100.0 * fresh_ms / build_ms, fresh_ms,
            100.0 * recycled_ms / build_ms, recycled_ms);
      }
    }
  }
  std::printf("client RSS growth from mapping alone: %ld KiB (tensor bytes are not copied)\n", rss_growth_kb);
  std::printf("socket map vs gRPC: %.0fx faster; vs reading the file: %.0fx faster\n",
              Median(grpc_all) / Median(shm_all), Median(read_all) / Median(shm_all));

  // 4 processes map the checkpoint and touch every byte, then hold it.
  const int kProcs = 4;
  std::vector<pid_t> pids;
  std::vector<int> pipes;
  for (int p = 0; p < kProcs; ++p) {
    int fds[2];
    if (::pipe(fds) != 0) return 1;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      ::close(fds[0]);
      std::string probe = WEIGHTSTORE_SHM_PROBE_PATH;
      std::string hold = "--hold-ms", ms = "4000", name = "big";
      char* args[] = {probe.data(), const_cast<char*>(socket.c_str()), name.data(), hold.data(), ms.data(), nullptr};
      ::execv(args[0], args);
      ::_exit(127);
    }
    ::close(fds[1]);
    pids.push_back(pid);
    pipes.push_back(fds[0]);
  }
  for (int fd : pipes) {  // each probe prints its memory line once it has touched everything
    std::string out;
    char buf[4096];
    while (out.find("memory") == std::string::npos) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
  }
  long rss = 0, pss = 0;
  for (pid_t pid : pids) {
    rss += SmapsKb(pid, "Rss");
    pss += SmapsKb(pid, "Pss");
  }
  const long daemon_pss = SmapsKb(daemon.pid(), "Pss");
  for (size_t i = 0; i < pids.size(); ++i) {
    ::kill(pids[i], SIGTERM);
    ::waitpid(pids[i], nullptr, 0);
    ::close(pipes[i]);
  }
  std::printf("\n%d processes mapping all %llu MiB at once (every byte touched):\n", kProcs,
              static_cast<unsigned long long>(total >> 20));
  std::printf("  sum of RSS: %8.1f MiB   (shared pages counted in every process)\n", rss / 1024.0);
  std::printf("  sum of PSS: %8.1f MiB   (each shared page split among its mappers) = %.2fx the checkpoint\n",
              pss / 1024.0, pss * 1024.0 / static_cast<double>(total));
  std::printf("  the daemon's PSS: %.1f MiB (it maps the same pages: its share of them, plus its own heap)\n",
              daemon_pss / 1024.0);
  std::printf("  processes + daemon: %.2fx the checkpoint, against %dx for %d private copies\n",
              (pss + daemon_pss) * 1024.0 / static_cast<double>(total), kProcs, kProcs);
  std::filesystem::remove_all(dir);
  return 0;
}
