// cuda_bench: host-to-device throughput of the CUDA materializers, beside a
// plain cudaMemcpy from pinned memory measured in the same run.
//
// Usage: cuda_bench [--mib N]   (default 1024: N MiB in 4 MiB F32 tensors)
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cuda_materializer.h"
#include "server/server.h"
#include "tests/bench/bench_checkpoint.h"

using namespace weightstore;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

template <typename F>
double Best(int repeats, F fn) {
  double best = 1e9;
  for (int i = 0; i < repeats; ++i) {
    auto t = Clock::now();
    fn();
    best = std::min(best, Since(t));
  }
  return best;
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  client::TuneAllocatorForStreaming();
  uint64_t mib = 1024;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--mib")) mib = std::strtoull(argv[i + 1], nullptr, 10);
  }
  if (!client::CudaAvailable()) {
    std::printf("cuda_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const uint64_t bytes = mib << 20, tensor = 4 << 20;
  char tmpl[] = "/tmp/weightstore-cuda-bench-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  Check(WriteBenchCheckpoint(dir + "/w.safetensors", bytes / tensor, tensor, std::byte{3}), "write");
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("cuda_bench: %s, %llu MiB in %llu tensors of 4 MiB, page cache warm; best of 3\n\n", prop.name,
              static_cast<unsigned long long>(mib), static_cast<unsigned long long>(bytes / tensor));
  std::printf("%-52s %8s\n", "path", "GB/s");

  // Baseline: one cudaMemcpy of the same bytes from pinned host memory.
  void *pinned = nullptr, *device = nullptr;
  cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault);
  cudaMalloc(&device, bytes);
  std::memset(pinned, 1, bytes);
  double base = Best(3, [&] {
    cudaMemcpy(device, pinned, bytes, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  });
  std::printf("  %-50s %8.2f\n", "cudaMemcpy from pinned memory (baseline)", gb / base);
  cudaFree(device);
  cudaFreeHost(pinned);

  auto checkpoint = Checkpoint::Open(dir + "/w.safetensors");
  auto selection = Selection::Compile({});
  auto snapshot = Snapshot::Select(*checkpoint, **selection);
  {
    // Registration alone: pinning the 1 GiB mapping's pages for DMA.
    auto storage = (*snapshot)->tensors()[0].source->layout.storage->Get();
    const uintptr_t page = 4096, start = reinterpret_cast<uintptr_t>(storage->data());
    const uintptr_t lo = start & ~(page - 1), hi = (start + storage->size() + page - 1) & ~(page - 1);
    void* base = reinterpret_cast<void*>(lo);
    const size_t length = hi - lo;  // whole pages of the mapping, never past it
    double reg = Best(3, [&] {
      cudaHostRegister(base, length, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
      cudaHostUnregister(base);
    });
    std::printf("  %-50s %8.2f   (%.0f ms for the mapping)\n", "cudaHostRegister + unregister of the mapping only",
                gb / reg, reg * 1e3);
    if (cudaHostRegister(base, length, cudaHostRegisterReadOnly | cudaHostRegisterPortable) != cudaSuccess) {
      std::fprintf(stderr, "cuda_bench: cudaHostRegister failed\n");
      return 1;
    }
    void* device_block = nullptr;
    cudaMalloc(&device_block, length);
    double one = Best(3, [&] {
      cudaMemcpy(device_block, base, length, cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
    });
    std::printf("  %-50s %8.2f\n", "one cudaMemcpy of the whole registered mapping", gb / one);
    cudaFree(device_block);
    cudaHostUnregister(base);
  }
  double direct = Best(3, [&] { Check(client::CopyToDevice(**snapshot).status(), "CopyToDevice"); });
  std::printf("  %-50s %8.2f\n", "CopyToDevice, registered mapping (no staging copy)", gb / direct);
  client::PinnedMappings registrations;
  client::CopyToDeviceOptions keep;
  keep.pinned = &registrations;
  Check(client::CopyToDevice(**snapshot, keep).status(), "first pinned copy");  // registers once
  double reused = Best(3, [&] { Check(client::CopyToDevice(**snapshot, keep).status(), "CopyToDevice"); });
  std::printf("  %-50s %8.2f\n", "CopyToDevice, registration kept (PinnedMappings)", gb / reused);
  registrations.Clear();
  client::CopyToDeviceOptions staged_options;
  staged_options.register_mapping = false;
  double staged = Best(3, [&] { Check(client::CopyToDevice(**snapshot, staged_options).status(), "staged"); });
  std::printf("  %-50s %8.2f\n", "CopyToDevice, through pinned staging", gb / staged);

  auto local = client::OpenLocalStore(dir);
  double sink_local = Best(3, [&] {
    auto sink = client::CudaSink::Create();
    Check((*local)->FetchTensors("w", {}, sink->get()), "local fetch");
    Check((*sink)->Finish().status(), "finish");
  });
  std::printf("  %-50s %8.2f\n", "LocalStore -> CudaSink (pinned ring, async copies)", gb / sink_local);

  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = dir;
  options.socket.path = dir + "/ws.sock";
  auto server = server::WeightStoreServer::Start(options);
  Check(server.status(), "starting the server");
  auto remote = client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", (*server)->port()));
  double sink_remote = Best(3, [&] {
    auto sink = client::CudaSink::Create();
    Check((*remote)->FetchTensors("w", {}, sink->get()), "remote fetch");
    Check((*sink)->Finish().status(), "finish");
  });
  std::printf("  %-50s %8.2f\n", "RemoteStore (gRPC loopback) -> CudaSink", gb / sink_remote);

  // Same host: map through the socket, then DMA straight from the shared mapping.
  auto shm = client::ConnectSharedMemoryStore(options.socket.path);
  Check(shm.status(), "connecting to the socket");
  double socket_each = Best(3, [&] {  // map and register on every call
    auto mapped = (*shm)->MapTensors("w", {});
    Check(mapped.status(), "map");
    Check(client::CopyToDevice(*mapped).status(), "socket copy");
  });
  auto mapped = (*shm)->MapTensors("w", {});  // a serving process maps once and keeps it
  Check(mapped.status(), "map");
  client::PinnedMappings shm_registrations;
  client::CopyToDeviceOptions shm_keep;
  shm_keep.pinned = &shm_registrations;
  Check(client::CopyToDevice(*mapped, shm_keep).status(), "first socket copy");  // registers once
  double socket_kept = Best(3, [&] { Check(client::CopyToDevice(*mapped, shm_keep).status(), "socket copy"); });
  std::printf("  %-50s %8.2f\n", "socket: map + register + CopyToDevice, each call", gb / socket_each);
  std::printf("  %-50s %8.2f\n", "socket: CopyToDevice from the kept mapping", gb / socket_kept);
  std::filesystem::remove_all(dir);
  return 0;
}
