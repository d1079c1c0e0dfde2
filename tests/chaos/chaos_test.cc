// Chaos: 16 clients fetch while the daemon is kill -9ed and restarted and the
// files it serves are replaced. Fetches may fail (the daemon is gone, the
// version they pinned was replaced); a fetch that completes must hold exactly
// the bytes of the version it reports. Bounded: 60 replacements and 6 kills
// (about 20 s; longer under the sanitizers).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/catalog/registry.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

constexpr int kNames = 3;
constexpr int kTensors = 8;
constexpr size_t kFloats = 128 * 1024;  // 512 KiB a tensor, 4 MiB a checkpoint

std::string Name(int n) { return absl::StrCat("model", n); }

// Every element is a function of (checkpoint, generation, tensor, index); the
// "generation" tensor says which generation a set of tensors claims to be.
float Element(int name, int generation, int tensor, size_t k) {
  return static_cast<float>(name * 1000003 + generation * 7919 + tensor * 104729) + static_cast<float>(k % 4093);
}

std::string Contents(int name, int generation) {
  std::vector<SharedTensor> tensors;
  for (int t = 0; t < kTensors; ++t) {
    std::vector<std::byte> data(kFloats * 4);
    for (size_t k = 0; k < kFloats; ++k) {
      const float v = Element(name, generation, t, k);
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("w.", t), DType::kF32, {kFloats}}, SharedBytes::FromVector(std::move(data))});
  }
  std::vector<std::byte> g(8);
  const int64_t g64 = generation;
  std::memcpy(g.data(), &g64, 8);
  tensors.push_back({{"generation", DType::kI64, {1}}, SharedBytes::FromVector(std::move(g))});
  return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
}

// The generation the tensors hold, or -1 unless every byte is that generation's.
int CheckGeneration(int name, const std::vector<SharedTensor>& tensors) {
  if (tensors.size() != kTensors + 1) return -1;
  int64_t generation = -1;
  for (const SharedTensor& t : tensors) {
    if (t.spec.name == "generation" && t.bytes.size() == 8) std::memcpy(&generation, t.bytes.data(), 8);
  }
  if (generation < 0) return -1;
  for (const SharedTensor& t : tensors) {
    if (t.spec.name == "generation") continue;
    const int index = std::atoi(t.spec.name.c_str() + 2);
    if (t.bytes.size() != kFloats * 4) return -1;
    for (size_t k = 0; k < kFloats; ++k) {
      float v;
      std::memcpy(&v, t.bytes.data() + 4 * k, 4);
      if (v != Element(name, static_cast<int>(generation), index, k)) return -1;
    }
  }
  return static_cast<int>(generation);
}

TEST(ChaosTest, SixteenClientsThroughKillsRestartsAndReplacementsOnlyEverGetExactBytes) {
  const std::string models = testing::MakeScratchDir("chaos");
  std::mutex mu;
  std::map<std::pair<int, std::string>, int> generation_of;  // (name, version) -> generation written
  auto publish = [&](int name, int generation) {             // atomically, as operators must
    const std::string path = absl::StrCat(models, "/", Name(name), ".safetensors");
    testing::WriteFileOrDie(path + ".next", Contents(name, generation));
    std::filesystem::rename(path + ".next", path);
    // The daemon names each version by its content.
    absl::StatusOr<std::shared_ptr<const Checkpoint>> written = Checkpoint::Open(path);
    ASSERT_TRUE(written.ok()) << written.status();
    absl::StatusOr<std::shared_ptr<const CheckpointManifest>> manifest = ComputeManifest(**written, "");
    ASSERT_TRUE(manifest.ok()) << manifest.status();
    const std::string* version = &(*manifest)->version();
    std::lock_guard<std::mutex> lock(mu);
    generation_of[{name, *version}] = generation;
  };
  for (int n = 0; n < kNames; ++n) publish(n, 0);
  std::string address;
  {
    testing::Daemon probe(models);
    ASSERT_NE(probe.port(), 0) << probe.log();
    address = probe.address();
  }
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  const std::vector<std::string> args = {"--socket", socket, "--socket-file-segments", "always"};
  auto daemon = std::make_unique<testing::Daemon>(models, args, address);
  ASSERT_EQ(daemon->address(), address) << daemon->log();

  struct Completed {
    int name;
    std::string version;
    int generation;  // -1: bytes that match no generation
  };
  std::vector<Completed> completed;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(c);
      const bool socket_client = c % 4 == 3;  // 4 map through the socket, 12 fetch over gRPC
      client::RemoteOptions options;
      options.max_resumes = 5;
      options.resume_backoff = std::chrono::milliseconds(100);
      options.resume_window = std::chrono::seconds(5);
      options.deadline = std::chrono::seconds(30);
      auto remote = client::ConnectRemoteStore(address, options);
      while (!stop) {
        const int name = static_cast<int>(rng() % kNames);
        std::string version;
        std::vector<SharedTensor> tensors;
        absl::Status status;
        if (socket_client) {
          auto shm = client::ConnectSharedMemoryStore(socket);
          auto mapped = shm.ok() ? (*shm)->MapTensors(Name(name), {}) : shm.status();
          status = mapped.status();
          if (mapped.ok()) {
            status = mapped->Verify();
            version = mapped->version;
            tensors = mapped->tensors;
          }
        } else {
          auto listing = (*remote)->ListTensors(Name(name), {});
          status = listing.status();
          if (listing.ok()) {
            client::Query pinned;
            pinned.version = listing->version;
            auto fetched = (*remote)->FetchAll(Name(name), pinned);
            status = fetched.status();
            if (fetched.ok()) {
              version = listing->version;
              tensors = *std::move(fetched);
            }
          }
        }
        if (!status.ok()) {
          ++failures;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          continue;
        }
        const int generation = CheckGeneration(name, tensors);
        std::lock_guard<std::mutex> lock(mu);
        completed.push_back({name, version, generation});
      }
    });
  }
  // The chaos: a replacement every 300 ms (and a SIGHUP to notice it), a kill
  // -9 and restart every tenth.
  int generation = 0, kills = 0;
  for (int tick = 1; tick <= 60; ++tick) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    publish(tick % kNames, ++generation);
    daemon->Signal(SIGHUP);
    if (tick % 10 == 0) {
      daemon->Signal(SIGKILL);
      daemon->WaitExit(30000);  // gone before the next takes its port
      ++kills;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      daemon = std::make_unique<testing::Daemon>(models, args, address);
      ASSERT_EQ(daemon->address(), address) << daemon->log();
    }
  }
  stop = true;
  for (auto& t : clients) t.join();

  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(kills, 6);
  EXPECT_GE(completed.size(), 16u) << failures << " failed";
  size_t exact = 0;
  for (const Completed& f : completed) {
    ASSERT_NE(f.generation, -1) << Name(f.name) << " version " << f.version << ": bytes of no generation";
    auto it = generation_of.find({f.name, f.version});
    ASSERT_NE(it, generation_of.end()) << Name(f.name) << ": version " << f.version << " was never written";
    EXPECT_EQ(it->second, f.generation) << Name(f.name) << " version " << f.version;
    exact += it->second == f.generation;
  }
  std::printf("chaos: %d kills, %d replacements, %zu fetches completed (%zu exact), %d failed cleanly\n", kills,
              generation, completed.size(), exact, failures.load());
}

}  // namespace
}  // namespace weightstore
