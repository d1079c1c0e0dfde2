// grpc_bench: fetching a 1 GB checkpoint from weightstored over loopback, with
// 1 and 4 clients, beside raw TCP loopback throughput and a daemon that copies
// payloads into protobuf messages, all measured in one run. Prints server CPU
// seconds per GB and the client's peak RSS.
//
// With --updates, weight updates instead: digest cost, watch latency and a
// delta fetch against a full one (RunUpdates), then element patches of a BF16
// checkpoint that changes a little everywhere, over gRPC and the socket
// (RunPatches).
//
// Usage: grpc_bench [--gb N] [--updates]   ($WEIGHTSTORED overrides the daemon binary)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "client/updates.h"
#include "client/usable_cores.h"
#include "core/catalog/manifest.h"
#include "core/catalog/version_patches.h"
#include "core/crc32c.h"
#include "tests/bench/bench_checkpoint.h"

namespace weightstore {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kTensorBytes = 4 << 20;

double Since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Bytes land in one reused buffer per client: measures transport, not allocation.
class ReusedBufferSink : public client::TensorSink {
 public:
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
    if (buffer_.size() < spec.byte_size()) buffer_.resize(spec.byte_size());
    return std::span<std::byte>(buffer_.data(), spec.byte_size());
  }
  absl::Status End(const TensorSpec& spec) override {
    bytes_ += spec.byte_size();
    return absl::OkStatus();
  }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<std::byte> buffer_;
  uint64_t bytes_ = 0;
};

// A daemon process, so its CPU time can be read from /proc.
struct Daemon {
  pid_t pid = -1;
  int port = 0;
  // `socket`: also serve the same-host socket there.
  Daemon(const std::string& models, bool copy_payloads, const std::string& socket = "") {
    const std::string port_file = models + "/../port";
    std::filesystem::remove(port_file);
    pid = ::fork();
    if (pid == 0) {
      const char* binary = std::getenv("WEIGHTSTORED");  // another build's daemon, e.g. on a device machine
      std::vector<std::string> args = {binary != nullptr ? binary : WEIGHTSTORED_PATH,
                                       "--models",
                                       models,
                                       "--listen",
                                       "127.0.0.1:0",
                                       "--port-file",
                                       port_file};
      if (copy_payloads) args.push_back("--copy-payloads");
      if (!socket.empty()) {
        args.push_back("--socket");
        args.push_back(socket);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::freopen("/dev/null", "w", stderr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 400 && port == 0; ++i) {
      std::ifstream in(port_file);
      in >> port;
      if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~Daemon() {
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
  }
  double CpuSeconds() const {
    std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
    std::string field;
    std::vector<std::string> fields;
    while (in >> field) fields.push_back(field);
    const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
    return (std::stod(fields[13]) + std::stod(fields[14])) / ticks;  // utime + stime
  }
};

// RemoteOptions, overridable for experiments: WS_CHUNK_BYTES, WS_WINDOW_BYTES,
// WS_PIPELINE (0 or 1; default: the client's automatic choice).
client::RemoteOptions Options() {
  client::RemoteOptions o;
  if (const char* v = std::getenv("WS_CHUNK_BYTES")) o.chunk_bytes = static_cast<uint32_t>(std::atol(v));
  if (const char* v = std::getenv("WS_WINDOW_BYTES")) o.stream_window_bytes = std::atoi(v);
  if (const char* v = std::getenv("WS_PIPELINE")) o.pipeline = std::atoi(v) != 0;
  return o;
}

bool Pipelined(const client::RemoteOptions& o) { return o.pipeline.value_or(client::AutomaticPipeline()); }

struct Run {
  double seconds, gbps, server_cpu_per_gb;
};

Run Fetch(const Daemon& daemon, const std::string& name, int clients, uint64_t total_bytes,
          const client::RemoteOptions& options = Options(), const client::Query& query = {}) {
  const double cpu_before = daemon.CpuSeconds();
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      // Each client gets its own connection (a distinct channel argument).
      auto store = client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), options);
      ReusedBufferSink sink;
      absl::Status s = (*store)->FetchTensors(name, query, &sink);
      if (!s.ok() || sink.bytes() != total_bytes) {
        std::fprintf(stderr, "grpc_bench: client %d: %s\n", c, std::string(s.message()).c_str());
        std::exit(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = Since(start);
  const double gb = static_cast<double>(total_bytes) * clients / 1e9;
  return {seconds, gb / seconds, (daemon.CpuSeconds() - cpu_before) / gb};
}

// One client loading everything into owned memory with FetchAll, over
// `streams` parallel connections (RemoteOptions::parallel_streams).
Run FetchAllRun(const Daemon& daemon, const std::string& name, int streams, uint64_t total_bytes) {
  client::RemoteOptions options = Options();
  options.parallel_streams = streams;
  auto store = client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), options);
  (void)(*store)->FetchAll(name, {});  // opens the connections, warms the allocator
  const double cpu_before = daemon.CpuSeconds();
  const auto start = Clock::now();
  auto tensors = (*store)->FetchAll(name, {});
  const double seconds = Since(start);
  uint64_t bytes = 0;
  if (tensors.ok()) {
    for (const auto& t : *tensors) bytes += t.bytes.size();
  }
  if (bytes != total_bytes) {
    std::fprintf(stderr, "grpc_bench: FetchAll over %d streams: %s\n", streams,
                 std::string(tensors.status().message()).c_str());
    std::exit(1);
  }
  const double gb = static_cast<double>(total_bytes) / 1e9;
  return {seconds, gb / seconds, (daemon.CpuSeconds() - cpu_before) / gb};
}

// Raw TCP over loopback: one writer and one reader thread, the same byte count.
double RawTcpGBps(uint64_t total_bytes) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::listen(listener, 1);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::thread writer([&] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    std::vector<char> buf(1 << 20, 'x');
    for (uint64_t sent = 0; sent < total_bytes;) {
      ssize_t n = ::write(fd, buf.data(), std::min<uint64_t>(buf.size(), total_bytes - sent));
      if (n <= 0) break;
      sent += static_cast<uint64_t>(n);
    }
    ::close(fd);
  });
  int fd = ::accept(listener, nullptr, nullptr);
  std::vector<char> buf(1 << 20);
  const auto start = Clock::now();
  uint64_t got = 0;
  for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) got += static_cast<uint64_t>(n);
  const double seconds = Since(start);
  writer.join();
  ::close(fd);
  ::close(listener);
  return static_cast<double>(got) / seconds / 1e9;
}

}  // namespace
}  // namespace weightstore

namespace weightstore {
namespace {

// Writes `count` tensors "w.i" of kTensorBytes as SafeTensors to `path`
// (through a temporary renamed over it, as a trainer publishes): tensor i is
// filled with byte 1 + i % 16, or 200 + `version` when i % 10 == 3 and
// `version` > 1, so each version after the first changes a tenth of them.
absl::Status WriteVersion(const std::string& path, uint64_t count, int version) {
  std::vector<SharedBytes> blocks;
  for (int f = 0; f < 16; ++f) {
    blocks.push_back(SharedBytes::FromVector(std::vector<std::byte>(kTensorBytes, std::byte(1 + f))));
  }
  SharedBytes changed = SharedBytes::FromVector(std::vector<std::byte>(kTensorBytes, std::byte(200 + version)));
  const std::string temporary = path + ".tmp-bench";
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(temporary, kSafeTensorsFormat));
  for (uint64_t i = 0; i < count; ++i) {
    SharedBytes block = version > 1 && i % 10 == 3 ? changed : blocks[i % 16];
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add({absl::StrCat("w.", i), DType::kF32, {kTensorBytes / 4}},
                                            [block] { return absl::StatusOr<SharedBytes>(block); }));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(writer->Finish());
  std::filesystem::rename(temporary, path);
  return absl::OkStatus();
}

// Times the first REPLACED event of checkpoint `name` after `version`, on a
// watch of its own thread, open once constructed.
class EventTimer {
 public:
  EventTimer(client::Store* store, const std::string& version, const std::string& name = "big") {
    thread_ = std::thread([this, store, version, name] {
      (void)store->Watch({.name = name, .known = {{name, version}}, .cancel = cancel_},
                         [this](const client::CheckpointEvent& e) {
                           if (e.kind != client::CheckpointEvent::Kind::kReplaced) return true;
                           absl::MutexLock lock(&mu_);
                           event_at_ = Clock::now();
                           return false;
                         });
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the watch is open
  }
  ~EventTimer() {
    *cancel_ = true;
    thread_.join();
  }
  // When the event came; nullopt if it did not within 60 s.
  std::optional<Clock::time_point> Wait() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](std::optional<Clock::time_point>* t) { return t->has_value(); }, &event_at_),
                         absl::Seconds(60));
    return event_at_;
  }

 private:
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  absl::Mutex mu_;
  std::optional<Clock::time_point> event_at_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Seconds a full fetch of `name` at `version` takes; negative if it fails.
double TimeFullFetch(client::Store& store, const std::string& name, const std::string& version) {
  client::Query pinned;
  pinned.version = version;
  const auto start = Clock::now();
  auto full = store.FetchAll(name, pinned);
  return full.ok() ? Since(start) : -1;
}

// Weight updates (issue 15): digests at load beside CRC32C of the same bytes;
// the time from a new version's file to a watcher's event; a delta fetch after
// a tenth of the tensors changed beside a full fetch of the same version.
int RunUpdates(const std::string& models, uint64_t count) {
  const std::string path = models + "/big.safetensors";
  if (absl::Status s = WriteVersion(path, count, 1); !s.ok()) {
    std::fprintf(stderr, "bench: %s\n", s.ToString().c_str());
    return 1;
  }
  const uint64_t total = count * kTensorBytes;
  std::printf("grpc_bench --updates: %llu MiB checkpoint (%llu tensors of 4 MiB), loopback, page cache warm\n\n",
              static_cast<unsigned long long>(total >> 20), static_cast<unsigned long long>(count));
  {
    auto checkpoint = *Checkpoint::Open(path);
    for (int run = 0; run < 2; ++run) {  // the first run also faults the mapping in
      auto start = Clock::now();
      auto manifest = ComputeManifest(*checkpoint, "v");
      const double digest_s = Since(start);
      start = Clock::now();
      uint32_t crc = 0;
      for (const CheckpointEntry& e : checkpoint->entries()) crc ^= Crc32c(checkpoint->Read(e)->bytes.view());
      const double crc_s = Since(start);
      std::printf("digests at load (XXH3-128, run %d): %.2f GB/s; CRC32C of the same bytes: %.2f GB/s%s\n", run + 1,
                  total / digest_s / 1e9, total / crc_s / 1e9, manifest.ok() && crc != 1 ? "" : " (failed)");
    }
  }
  Daemon daemon(models, false);
  if (daemon.port == 0) return 1;
  auto store = *client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), Options());
  auto watcher_store = *client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), Options());
  client::HeldTensors held;
  auto start = Clock::now();
  auto first = client::UpdateTensors(*store, "big", {}, &held);
  if (!first.ok()) {
    std::fprintf(stderr, "bench: %s\n", first.status().ToString().c_str());
    return 1;
  }
  std::printf("first fetch (full): %.2f GB/s\n", total / Since(start) / 1e9);
  for (int version = 2; version <= 4; ++version) {
    EventTimer timer(watcher_store.get(), held.version);
    if (absl::Status s = WriteVersion(path, count, version); !s.ok()) return 1;
    const auto committed = Clock::now();
    ::kill(daemon.pid, SIGHUP);  // rescan
    std::optional<Clock::time_point> event_at = timer.Wait();
    if (!event_at) return 1;
    const double event_ms = std::chrono::duration<double, std::milli>(*event_at - committed).count();
    start = Clock::now();
    auto delta = client::UpdateTensors(*store, "big", {}, &held);
    const double delta_s = Since(start);
    if (!delta.ok() || !delta->delta) return 1;
    const double full_s = TimeFullFetch(*store, "big", held.version);
    if (full_s < 0) return 1;
    std::printf(
        "version %d: event %.1f ms after the file was in place (rescan and digests of %llu MiB included); delta %llu "
        "tensors %llu MiB in %.3f s, full %llu MiB in %.3f s: %.1f%% of the bytes, %.1f%% of the time\n",
        version, event_ms, static_cast<unsigned long long>(total >> 20),
        static_cast<unsigned long long>(delta->fetched_tensors),
        static_cast<unsigned long long>(delta->fetched_bytes >> 20), delta_s,
        static_cast<unsigned long long>(total >> 20), full_s, 100.0 * delta->fetched_bytes / total,
        100.0 * delta_s / full_s);
  }
  // Pushes: the changed tensors only, from this process; the daemon writes the
  // whole checkpoint and digests only what was pushed.
  for (int version = 5; version <= 7; ++version) {
    client::PushRequest push{.base_version = held.version};
    SharedBytes changed = SharedBytes::FromVector(std::vector<std::byte>(kTensorBytes, std::byte(200 + version)));
    for (uint64_t i = 3; i < count; i += 10) {
      push.tensors.push_back({{absl::StrCat("w.", i), DType::kF32, {kTensorBytes / 4}}, changed});
    }
    EventTimer timer(watcher_store.get(), held.version);
    const auto began = Clock::now();
    auto pushed = store->Push("big", push);
    const auto returned = Clock::now();
    if (!pushed.ok()) {
      std::fprintf(stderr, "bench: %s\n", pushed.status().ToString().c_str());
      return 1;
    }
    std::optional<Clock::time_point> event_at = timer.Wait();
    if (!event_at) return 1;
    auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    start = Clock::now();
    auto delta = client::UpdateTensors(*store, "big", {}, &held);
    const double delta_s = Since(start);
    if (!delta.ok() || !delta->delta) return 1;
    std::printf(
        "push %d: %zu tensors, %llu MiB sent; the push took %.0f ms (the daemon rewrites %llu MiB); the event came "
        "%.1f ms after it returned (%.0f ms after it began); the delta fetch took %.3f s\n",
        version - 4, push.tensors.size(), static_cast<unsigned long long>(push.tensors.size() * kTensorBytes >> 20),
        ms(returned - began), static_cast<unsigned long long>(total >> 20), ms(*event_at - returned),
        ms(*event_at - began), delta_s);
  }
  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("client peak RSS: %.0f MiB\n", usage.ru_maxrss / 1024.0);
  return 0;
}

// Element patches (issue 28): a BF16 checkpoint of `count` [1024, 2048]
// tensors that changes a little everywhere per version, as an RL policy does.
// For each kind of change: the daemon's diff (DiffVersions, what a rescan and
// a push run) in GB/s of checkpoint; the update's bytes on the wire and time
// beside a full fetch of the same version (what per-tensor deltas cost when
// every tensor changed); and the apply alone, in place, on the client.
int RunPatches(const std::string& models, uint64_t count) {
  const std::string path = models + "/rl.safetensors";
  const uint64_t elements = kTensorBytes / 2, total = count * kTensorBytes;
  std::vector<std::vector<uint16_t>> state(count, std::vector<uint16_t>(elements));
  std::mt19937_64 rng(7);
  for (auto& t : state) {
    for (auto& v : t) v = static_cast<uint16_t>(rng());
  }
  auto write = [&](const std::string& to) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(to, kSafeTensorsFormat));
    for (uint64_t i = 0; i < count; ++i) {
      const auto* data = reinterpret_cast<const std::byte*>(state[i].data());
      SharedBytes view(nullptr, std::span<const std::byte>(data, kTensorBytes));
      WEIGHTSTORE_RETURN_IF_ERROR(writer->Add({absl::StrCat("layers.", i, ".weight"), DType::kBF16, {1024, 2048}},
                                              [view] { return absl::StatusOr<SharedBytes>(view); }));
    }
    return writer->Finish();
  };
  if (absl::Status s = write(path); !s.ok()) {
    std::fprintf(stderr, "bench: %s\n", s.ToString().c_str());
    return 1;
  }
  const std::string socket = models + "/../ws.sock";
  Daemon daemon(models, false, socket);
  if (daemon.port == 0) return 1;
  auto store = *client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), Options());
  auto watcher_store = *client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon.port), Options());
  auto shm = client::ConnectSharedMemoryStore(socket);
  if (!shm.ok()) return 1;
  client::HeldTensors held;
  if (!client::UpdateTensors(*store, "rl", {}, &held).ok()) return 1;
  std::printf("\nelement patches: %llu MiB of BF16 (%llu tensors [1024, 2048]), every tensor changed per version\n",
              static_cast<unsigned long long>(total >> 20), static_cast<unsigned long long>(count));

  struct Change {
    const char* what;
    double fraction;  // at random; 0: a block of 16 rows per tensor
  };
  // Three versions of each kind, taking turns; then the medians.
  const Change changes[] = {{"1% at random", 0.01}, {"0.1% at random", 0.001}, {"16 rows of 1024 per tensor", 0}};
  // what: [wire %, diff GB/s, update %, apply %, socket %, socket patched / copied]
  std::map<std::string, std::vector<std::vector<double>>> runs;
  for (int round = 0; round < 9; ++round) {
    const Change& change = changes[round % 3];
    for (auto& t : state) {
      if (change.fraction == 0) {
        for (uint64_t k = 512 * 2048; k < 528 * 2048; ++k) t[k] ^= 0x5a;
      } else {
        const auto n = static_cast<uint64_t>(elements * change.fraction);
        for (uint64_t k = 0; k < n; ++k) t[rng() % elements] ^= 0x5a;
      }
    }
    // The daemon's diff, timed alone: both versions open and digested, as
    // when a rescan or a push diffs them.
    const std::string next = path + ".next";
    if (!write(next).ok()) return 1;
    auto before = *Checkpoint::Open(path);
    auto after = *Checkpoint::Open(next);
    auto before_manifest = *ComputeManifest(*before, "");
    auto after_manifest = *ComputeManifest(*after, "");
    const unsigned threads = std::min(4u, std::max(1u, std::thread::hardware_concurrency()));
    auto start = Clock::now();
    auto patches = DiffVersions(*before, *before_manifest, *after, *after_manifest, uint64_t{1} << 40, threads);
    const double diff_s = Since(start);
    if (!patches.ok()) return 1;
    uint64_t patch_bytes = 0;
    for (const auto& [name, patch] : (*patches)->patches) patch_bytes += patch.body.size();

    // The held tensors' bytes, for the apply below (a copy: the update
    // writes the held ones in place).
    const std::string old_version = held.version;
    std::vector<std::vector<std::byte>> copies;
    for (const SharedTensor& t : held.tensors) copies.emplace_back(t.bytes.data(), t.bytes.data() + t.bytes.size());
    std::vector<std::vector<std::byte>> socket_copies = copies;
    std::vector<std::vector<std::byte>> targets(count, std::vector<std::byte>(kTensorBytes));
    EventTimer timer(watcher_store.get(), held.version, "rl");
    std::filesystem::rename(next, path);
    ::kill(daemon.pid, SIGHUP);  // rescan: digests and diffs the new version
    if (!timer.Wait()) return 1;
    start = Clock::now();
    auto update = client::UpdateTensors(*store, "rl", {}, &held);
    const double update_s = Since(start);
    if (!update.ok() || !update->patch_failure.empty()) return 1;
    const double full_s = TimeFullFetch(*store, "rl", held.version);
    if (full_s < 0) return 1;

    // The apply alone, in place, into the copies of the tensors held before.
    client::Query since;
    since.since_version = old_version;
    since.patches = true;
    auto changed = client::FetchChanged(*store, "rl", since);
    if (!changed.ok() || changed->patched.size() != count) return 1;
    std::vector<std::span<std::byte>> destinations;
    for (auto& c : copies) destinations.emplace_back(c);
    start = Clock::now();
    absl::Status applied = client::ApplyReceivedPatches(changed->patched, destinations);
    const double apply_s = Since(start);
    if (!applied.ok()) return 1;

    // Through the socket, held tensors written in place (a module following
    // updates): the mapped patches applied, against the changed tensors
    // mapped whole and copied in (what an update without patches costs).
    start = Clock::now();
    auto mapped_patches = (*shm)->MapTensors("rl", since);
    if (!mapped_patches.ok() || mapped_patches->patches.size() != count) return 1;
    destinations.clear();
    for (auto& c : socket_copies) destinations.emplace_back(c);
    if (!client::ApplyReceivedPatches(mapped_patches->patches, destinations).ok()) return 1;
    const double socket_patched_s = Since(start);
    uint64_t socket_bytes = 0;
    for (const auto& segment : mapped_patches->segments) socket_bytes += segment->size();
    since.patches = false;
    start = Clock::now();
    auto mapped_whole = (*shm)->MapTensors("rl", since);
    if (!mapped_whole.ok() || mapped_whole->tensors.size() != count) return 1;
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(targets[i].data(), mapped_whole->tensors[i].bytes.data(), mapped_whole->tensors[i].bytes.size());
    }
    const double socket_copied_s = Since(start);

    std::printf(
        "%s: patches %.2f%% of the checkpoint (%llu of %llu tensors patched); diff %.2f GB/s; update %.3f s "
        "(%.2f%% of the bytes) vs full fetch %.3f s (100%%): %.1f%% of the time; apply in place with digest "
        "checks %.3f s, %.1f%% of the full fetch; socket: patches mapped %.2f%% of the bytes, applied in place "
        "%.3f s vs changed tensors mapped and copied in %.3f s (%.1f%%)\n",
        change.what, 100.0 * patch_bytes / total, static_cast<unsigned long long>(update->patched.size()),
        static_cast<unsigned long long>(count), total / diff_s / 1e9, update_s, 100.0 * update->fetched_bytes / total,
        full_s, 100.0 * update_s / full_s, apply_s, 100.0 * apply_s / full_s, 100.0 * socket_bytes / total,
        socket_patched_s, socket_copied_s, 100.0 * socket_patched_s / socket_copied_s);
    runs[change.what].push_back({100.0 * update->fetched_bytes / total, total / diff_s / 1e9, 100.0 * update_s / full_s,
                                 100.0 * apply_s / full_s, 100.0 * socket_bytes / total,
                                 100.0 * socket_patched_s / socket_copied_s});
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (const Change& change : changes) {
    std::vector<double> column[6];
    for (const auto& run : runs[change.what]) {
      for (int k = 0; k < 6; ++k) column[k].push_back(run[k]);
    }
    std::printf(
        "median of 3, %s: %.2f%% of the bytes on the wire; diff %.2f GB/s; update %.1f%% of a full fetch's time; "
        "apply %.1f%%; socket: %.2f%% of the bytes mapped, patches applied in place in %.1f%% of the time of "
        "copying the changed tensors in\n",
        change.what, median(column[0]), median(column[1]), median(column[2]), median(column[3]), median(column[4]),
        median(column[5]));
  }
  return 0;
}

}  // namespace
}  // namespace weightstore

int main(int argc, char** argv) {
  using namespace weightstore;
  client::TuneAllocatorForStreaming();  // this process is the client; the daemons keep glibc's defaults
  int gb = 1;
  bool updates = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--gb") && i + 1 < argc) gb = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--updates")) updates = true;
  }
  char tmpl[] = "/tmp/weightstore-grpc-bench-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string models = dir + "/models";
  std::filesystem::create_directories(models);
  const uint64_t count = (static_cast<uint64_t>(gb) << 30) / kTensorBytes;
  if (updates) {
    int status = RunUpdates(models, count);
    if (status == 0) {
      std::filesystem::create_directories(dir + "/patches/models");
      status = RunPatches(dir + "/patches/models", count);
    }
    std::filesystem::remove_all(dir);
    return status;
  }
  // [1024, 1024] matrices, so the tensor-parallel runs can shard them.
  if (absl::Status s = WriteBenchCheckpoint(models + "/big.safetensors", count, kTensorBytes, std::byte{7}, 1024);
      !s.ok()) {
    std::fprintf(stderr, "bench: %s\n", s.ToString().c_str());
    return 1;
  }
  const uint64_t total = count * kTensorBytes;
  std::printf("grpc_bench: %llu MiB checkpoint (%llu tensors of 4 MiB), loopback, page cache warm\n\n",
              static_cast<unsigned long long>(total >> 20), static_cast<unsigned long long>(count));

  const double tcp = RawTcpGBps(total);
  std::printf("client receive: %s (%d usable cores; RemoteOptions::pipeline)\n",
              Pipelined(Options()) ? "receiving thread + copy thread" : "one thread", client::UsableCores());
  std::printf("%-40s %8s %8s %12s\n", "path", "GB/s", "vs TCP", "server s/GB");
  std::printf("  %-38s %8.2f %7.0f%% %12s\n", "raw TCP loopback (1 stream)", tcp, 100.0, "-");
  {
    Daemon zero_copy(models, /*copy_payloads=*/false);
    Fetch(zero_copy, "big", 1, total);  // warm the page cache and the CRC cache
    Run one = Fetch(zero_copy, "big", 1, total);
    Run four = Fetch(zero_copy, "big", 4, total);
    std::printf("  %-38s %8.2f %7.0f%% %12.3f\n", "weightstored zero-copy, 1 client", one.gbps, 100 * one.gbps / tcp,
                one.server_cpu_per_gb);
    std::printf("  %-38s %8.2f %7.0f%% %12.3f\n", "weightstored zero-copy, 4 clients", four.gbps, 100 * four.gbps / tcp,
                four.server_cpu_per_gb);
    client::RemoteOptions other = Options();
    other.pipeline = !Pipelined(other);
    Run flipped = Fetch(zero_copy, "big", 1, total, other);
    std::printf("  %-38s %8.2f %7.0f%% %12.3f\n",
                *other.pipeline ? "zero-copy, 1 client, copy thread" : "zero-copy, 1 client, one thread", flipped.gbps,
                100 * flipped.gbps / tcp, flipped.server_cpu_per_gb);
    for (int streams : {1, 4}) {
      Run all = FetchAllRun(zero_copy, "big", streams, total);
      std::printf("  %-38s %8.2f %7.0f%% %12.3f\n", absl::StrCat("1 client, FetchAll, ", streams, " stream(s)").c_str(),
                  all.gbps, 100 * all.gbps / tcp, all.server_cpu_per_gb);
    }
    // Tensor parallelism: one rank of N fetches its shard. Tensors w.<even>
    // are column parallel (dim 0, zero-copy byte ranges), w.<1,3,5,7> row
    // parallel (dim 1, gathered as they are streamed), w.<..9> replicated.
    uint64_t replicated = 0;
    for (uint64_t i = 0; i < count; ++i) replicated += i % 10 == 9 ? kTensorBytes : 0;
    const double replicated_share = static_cast<double>(replicated) / static_cast<double>(total);
    std::printf(
        "\none rank of N fetching its shard (1 client; %.1f%% of the bytes replicated), against the full "
        "fetch (%.0f ms):\n",
        100 * replicated_share, one.seconds * 1e3);
    std::printf("  %-4s %12s %12s %12s %10s %12s\n", "N", "payload MiB", "of full", "time ms", "target ms",
                "time/target");
    for (auto [world, rows_only] : {std::pair{2u, false}, {4u, false}, {8u, false}, {8u, true}}) {
      client::Query shard;
      shard.selection.shard = {0, world, {{"^w\\.[0-9]*[02468]$", {0}}, {"^w\\.[0-9]*[1357]$", {rows_only ? 0u : 1u}}}};
      const uint64_t bytes = replicated + (total - replicated) / world;
      Fetch(zero_copy, "big", 1, bytes, Options(), shard);  // the daemon's CRC32C of each shard, once
      std::vector<double> seconds;
      for (int r = 0; r < 3; ++r) seconds.push_back(Fetch(zero_copy, "big", 1, bytes, Options(), shard).seconds);
      std::sort(seconds.begin(), seconds.end());
      const double target = 1.25 * (one.seconds / world * (1 - replicated_share) + one.seconds * replicated_share);
      std::printf("  %-4s %12.1f %11.1f%% %12.1f %10.1f %11.2fx\n", absl::StrCat(world, rows_only ? "*" : "").c_str(),
                  static_cast<double>(bytes) / (1 << 20),
                  100.0 * static_cast<double>(bytes) / static_cast<double>(total), seconds[1] * 1e3, target * 1e3,
                  seconds[1] / target);
    }
    std::printf("  (*: every shard on dim 0, all byte ranges served zero-copy)\n");
    Daemon naive(models, /*copy_payloads=*/true);
    Fetch(naive, "big", 1, total);
    Run copy = Fetch(naive, "big", 1, total);
    std::printf("  %-38s %8.2f %7.0f%% %12.3f\n", "copy into protobuf bytes, 1 client", copy.gbps,
                100 * copy.gbps / tcp, copy.server_cpu_per_gb);
    std::printf("\nzero-copy / copying path, 1 client: %.2fx\n", one.gbps / copy.gbps);
  }
  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("client peak RSS (this process, all runs): %.1f MiB\n", static_cast<double>(usage.ru_maxrss) / 1024);
  std::filesystem::remove_all(dir);
  return 0;
}
