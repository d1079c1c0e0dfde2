// shm_probe: a second process for same-host tests and benchmarks. Maps a
// checkpoint through weightstored's socket, reads every byte, and prints what it
// saw, one fact per line:
//   segment <index> <device>:<inode> <size>
//   tensor <name> <crc32c of the mapped bytes>
//   memory rss_kb=<n> pss_kb=<n>        (after touching every byte)
//   loaded_ms=<n>                        (connect + map, or with --remote, connect + fetch)
// then waits --hold-ms before exiting (so several probes map at once).
//
// Usage: shm_probe SOCKET NAME [--dtype DTYPE] [--hold-ms N] [--remote HOST:PORT]
// With --remote, the tensors are fetched over gRPC into owned memory instead
// (a C++ process loading CPU tensors, for benchmarks).
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "client/store.h"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/sealed_memfd.h"

namespace {

// Reads "Rss:" and "Pss:" (kB) from /proc/self/smaps_rollup.
void PrintMemory() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  long rss = -1, pss = -1, value;
  std::string unit;
  while (in >> key) {
    if (key == "Rss:" && in >> value >> unit)
      rss = value;
    else if (key == "Pss:" && in >> value >> unit)
      pss = value;
  }
  std::printf("memory rss_kb=%ld pss_kb=%ld\n", rss, pss);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: shm_probe SOCKET NAME [--dtype DTYPE] [--hold-ms N]\n");
    return 2;
  }
  weightstore::client::Query query;
  int hold_ms = 0;
  std::string remote;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--dtype") == 0) {
      query.selection.dtype = weightstore::ParseDType(absl::AsciiStrToUpper(argv[i + 1]));
    } else if (std::strcmp(argv[i], "--hold-ms") == 0) {
      hold_ms = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--remote") == 0) {
      remote = argv[i + 1];
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto elapsed_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  if (!remote.empty()) {
    weightstore::client::TuneAllocatorForStreaming();
    auto store = weightstore::client::ConnectRemoteStore(remote);
    auto tensors = store.ok() ? (*store)->FetchAll(argv[2], query) : store.status();
    if (!tensors.ok()) {
      std::fprintf(stderr, "shm_probe: %s\n", tensors.status().ToString().c_str());
      return 1;
    }
    std::printf("loaded_ms=%.3f tensors=%zu\n", elapsed_ms(), tensors->size());
    return 0;
  }
  auto store = weightstore::client::ConnectSharedMemoryStore(argv[1]);
  if (!store.ok()) {
    std::fprintf(stderr, "shm_probe: %s\n", store.status().ToString().c_str());
    return 1;
  }
  auto mapped = (*store)->MapTensors(argv[2], query);
  if (!mapped.ok()) {
    std::fprintf(stderr, "shm_probe: %s\n", mapped.status().ToString().c_str());
    return 1;
  }
  const double loaded_ms = elapsed_ms();
  for (size_t i = 0; i < mapped->segments.size(); ++i) {
    struct stat st;
    ::fstat(mapped->segments[i]->fd(), &st);
    const int fd = mapped->segments[i]->fd();
    const char* kind = weightstore::CheckSealed(fd, "segment").ok()        ? "sealed"
                       : weightstore::CheckFilledSeals(fd, "segment").ok() ? "filled"
                                                                           : "file";
    std::printf("segment %zu %lu:%lu %llu %s\n", i, static_cast<unsigned long>(st.st_dev),
                static_cast<unsigned long>(st.st_ino), static_cast<unsigned long long>(st.st_size), kind);
  }
  for (const auto& t : mapped->tensors) {
    std::printf("tensor %s %u\n", t.spec.name.c_str(), weightstore::Crc32c(t.bytes.view()));
  }
  PrintMemory();
  std::printf("loaded_ms=%.3f tensors=%zu\n", loaded_ms, mapped->tensors.size());
  std::fflush(stdout);
  if (hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
  return 0;
}
