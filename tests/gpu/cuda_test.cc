// CUDA materializers. Every test skips when no GPU is present (CI compiles
// them; a GPU machine runs them).
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/cuda_materializer.h"
#include "client/device_patches.h"
#include "client/materialize.h"
#include "client/updates.h"
#include "core/catalog/manifest.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "server/server.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::client {
namespace {

// A models folder with one checkpoint of mixed dtypes and sizes (1 B to 9 MiB),
// the packed and narrow ones of quantized checkpoints among them (F4, F6, MX
// scales) and complex: their bytes land on the device as they are.
std::string Models() {
  const std::string dir = testing::MakeScratchDir("gpu-models");
  std::vector<SharedTensor> tensors;
  const std::pair<DType, uint64_t> specs[] = {{DType::kF32, 9 << 18},   {DType::kBF16, 1000},   {DType::kU8, 1},
                                              {DType::kI64, 0},         {DType::kF16, 1 << 20}, {DType::kF32, 70000},
                                              {DType::kF4, 4098},       {DType::kF6E2M3, 400},  {DType::kF8E8M0, 333},
                                              {DType::kF8E4M3FNUZ, 77}, {DType::kC64, 100}};
  int i = 0;
  for (auto [dtype, n] : specs) {
    std::string bytes(*DTypeBytes(dtype, n), '\0');
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<char>((k * 131 + i) & 0xFF);
    tensors.push_back({{absl::StrCat("t", i++), dtype, {n}}, SharedBytes::Copy(bytes)});
  }
  testing::WriteFileOrDie(dir + "/mixed.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  return dir;
}

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

void ExpectSameOnDevice(const std::vector<SharedTensor>& want, const std::vector<DeviceTensor>& got) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].spec, want[i].spec);
    ASSERT_OK_AND_ASSIGN(SharedBytes back, CopyToHost(got[i]));
    EXPECT_TRUE(back.view() == want[i].bytes.view()) << want[i].spec.name;
  }
}

TEST_F(CudaTest, CudaSinkLoadsALocalStoreOntoTheDevice) {
  const std::string models = Models();
  ASSERT_OK_AND_ASSIGN(auto store, OpenLocalStore(models));
  ASSERT_OK_AND_ASSIGN(auto want, store->FetchAll("mixed", {}));
  CudaSinkOptions options;
  options.slot_bytes = 1 << 20;  // smaller than the largest tensor: slots must grow
  ASSERT_OK_AND_ASSIGN(auto sink, CudaSink::Create(options));
  ASSERT_OK(store->FetchTensors("mixed", {}, sink.get()));
  ASSERT_OK_AND_ASSIGN(auto got, sink->Finish());
  ExpectSameOnDevice(want, got);
}

TEST_F(CudaTest, CudaSinkLoadsARemoteStoreOntoTheDevice) {
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = Models();
  ASSERT_OK_AND_ASSIGN(auto server, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(auto store, ConnectRemoteStore(absl::StrCat("127.0.0.1:", server->port())));
  Query query;
  query.selection.dtype = DType::kF32;  // casts happen on the server
  ASSERT_OK_AND_ASSIGN(auto want, store->FetchAll("mixed", query));
  ASSERT_OK_AND_ASSIGN(auto sink, CudaSink::Create());
  ASSERT_OK(store->FetchTensors("mixed", query, sink.get()));
  ASSERT_OK_AND_ASSIGN(auto got, sink->Finish());
  ExpectSameOnDevice(want, got);
}

TEST_F(CudaTest, CopyToDeviceCopiesStraightFromTheMapping) {
  const std::string models = Models();
  ASSERT_OK_AND_ASSIGN(auto checkpoint, Checkpoint::Open(models + "/mixed.safetensors"));
  SelectionOptions options;
  options.exclude = {"^t5$"};
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
  ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Select(checkpoint, *selection));
  std::vector<SharedTensor> want;
  for (const auto& t : snapshot->tensors()) want.push_back(*snapshot->Read(t));
  ASSERT_OK_AND_ASSIGN(auto got, CopyToDevice(*snapshot));
  ExpectSameOnDevice(want, got);
  CopyToDeviceOptions staged;
  staged.register_mapping = false;
  ASSERT_OK_AND_ASSIGN(auto got_staged, CopyToDevice(*snapshot, staged));
  ExpectSameOnDevice(want, got_staged);

  // Registrations kept in a PinnedMappings are reused by the next call.
  PinnedMappings pinned;
  CopyToDeviceOptions keep;
  keep.pinned = &pinned;
  ASSERT_OK_AND_ASSIGN(auto first, CopyToDevice(*snapshot, keep));
  EXPECT_EQ(pinned.size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto again, CopyToDevice(*snapshot, keep));
  EXPECT_EQ(pinned.size(), 1u);
  ExpectSameOnDevice(want, again);
  pinned.Clear();
  EXPECT_EQ(pinned.size(), 0u);

  // A sparse selection (281 KiB of a 2.3 MiB extent) copies tensor by tensor.
  SelectionOptions sparse;
  sparse.include = {"^t5$", "^t2$"};
  ASSERT_OK_AND_ASSIGN(auto sparse_selection, Selection::Compile(sparse));
  ASSERT_OK_AND_ASSIGN(auto sparse_snapshot, Snapshot::Select(checkpoint, *sparse_selection));
  std::vector<SharedTensor> sparse_want;
  for (const auto& t : sparse_snapshot->tensors()) sparse_want.push_back(*sparse_snapshot->Read(t));
  ASSERT_OK_AND_ASSIGN(auto sparse_got, CopyToDevice(*sparse_snapshot));
  ExpectSameOnDevice(sparse_want, sparse_got);
}

// An in-process server with a same-host socket, on Models().
server::ServerOptions SocketServerOptions() {
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = Models();
  options.socket.path = testing::MakeScratchDir("sock") + "/ws.sock";
  return options;
}

TEST_F(CudaTest, CopyToDeviceCopiesStraightFromTheSocketsSharedMappings) {
  server::ServerOptions options = SocketServerOptions();
  ASSERT_OK_AND_ASSIGN(auto server, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(auto store, ConnectSharedMemoryStore(options.socket.path));
  for (std::optional<DType> dtype : {std::optional<DType>(), std::optional<DType>(DType::kF16)}) {
    Query query;
    query.selection.dtype = dtype;  // F16: the floats come from a sealed memfd, the rest from the file
    ASSERT_OK_AND_ASSIGN(MappedTensors mapped, store->MapTensors("mixed", query));
    PinnedMappings pinned;
    CopyToDeviceOptions keep;
    keep.pinned = &pinned;
    ASSERT_OK_AND_ASSIGN(auto got, CopyToDevice(mapped, keep));
    EXPECT_EQ(pinned.size(), mapped.segments.size());
    ExpectSameOnDevice(mapped.tensors, got);
  }
}

TEST_F(CudaTest, MaterializeOntoTheGpuFromEveryStore) {
  server::ServerOptions options = SocketServerOptions();
  ASSERT_OK_AND_ASSIGN(auto server, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(auto local, OpenLocalStore(options.registry.models_dir));
  ASSERT_OK_AND_ASSIGN(auto want, local->FetchAll("mixed", {}));
  std::vector<std::unique_ptr<Store>> stores;
  stores.push_back(std::move(local));
  stores.push_back(*ConnectSharedMemoryStore(options.socket.path));
  stores.push_back(*ConnectRemoteStore(absl::StrCat("127.0.0.1:", server->port())));
  MaterializeOptions on_gpu;
  on_gpu.device = Device::Cuda(0);
  for (auto& store : stores) {
    ASSERT_OK_AND_ASSIGN(auto got, Materialize(*store, "mixed", {}, on_gpu));
    std::vector<DeviceTensor> device;
    for (auto& t : got) {
      EXPECT_EQ(t.device.ToString(), "cuda:0");
      device.push_back({t.spec, t.device.index, t.memory});
    }
    ExpectSameOnDevice(want, device);
  }
}

TEST_F(CudaTest, EachRanksShardLandsOnTheGpuFromEveryStore) {
  server::ServerOptions options = SocketServerOptions();
  options.socket.file_segments = server::FileSegments::kAlways;  // the file's window itself, not a sealed copy
  ASSERT_OK_AND_ASSIGN(auto server, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(auto local, OpenLocalStore(options.registry.models_dir));
  auto socket = *ConnectSharedMemoryStore(options.socket.path);
  auto remote = *ConnectRemoteStore(absl::StrCat("127.0.0.1:", server->port()));
  MaterializeOptions on_gpu;
  on_gpu.device = Device::Cuda(0);
  for (uint32_t rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(absl::StrCat("rank ", rank, " of 4"));
    Query query;
    query.selection.shard = {rank, 4, {{"^t[05]$", {0}}}};  // t0 and t5 cut in 4, the rest replicated
    ASSERT_OK_AND_ASSIGN(auto want, local->FetchAll("mixed", query));
    auto t0 = std::find_if(want.begin(), want.end(), [](const SharedTensor& t) { return t.spec.name == "t0"; });
    ASSERT_NE(t0, want.end());
    EXPECT_EQ(t0->spec.shape, (std::vector<uint64_t>{(9 << 18) / 4}));
    for (Store* store : {local.get(), static_cast<Store*>(socket.get()), remote.get()}) {
      ASSERT_OK_AND_ASSIGN(auto got, Materialize(*store, "mixed", query, on_gpu));
      std::vector<DeviceTensor> device;
      for (auto& t : got) device.push_back({t.spec, t.device.index, t.memory});
      ExpectSameOnDevice(want, device);
    }
    // Straight from the socket's window of the file, registered for DMA.
    ASSERT_OK_AND_ASSIGN(MappedTensors mapped, socket->MapTensors("mixed", query));
    ASSERT_EQ(mapped.segments.size(), 1u);
    PinnedMappings pinned;
    CopyToDeviceOptions keep;
    keep.pinned = &pinned;
    ASSERT_OK_AND_ASSIGN(auto direct, CopyToDevice(mapped, keep));
    ExpectSameOnDevice(want, direct);
  }
}

// `n` elements of `e` bytes, and a copy with some changed: about `fraction`
// at random, and a block of `block` elements from the middle.
std::pair<std::string, std::string> Versions(uint32_t e, uint64_t n, double fraction, uint64_t block, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string before(e * n, '\0');
  for (char& c : before) c = static_cast<char>(rng());
  std::string after = before;
  std::bernoulli_distribution pick(fraction);
  for (uint64_t k = 0; k < n; ++k) {
    if (pick(rng) || (k >= n / 2 && k < n / 2 + block)) after[k * e] ^= 0x5a;
  }
  return {before, after};
}

ReceivedPatch PatchBetween(const std::string& name, DType dtype, uint32_t e, const std::string& before,
                           const std::string& after) {
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  std::optional<ElementPatch> patch = DiffElements(bytes(before), bytes(after), e);
  EXPECT_TRUE(patch.has_value()) << name;
  return {{name, dtype, {after.size() / e}}, DigestBytes(bytes(after)).Hex(), patch.value_or(ElementPatch{})};
}

std::string DeviceBytes(const void* p, size_t n) {
  std::string out(n, '\0');
  EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST_F(CudaTest, ElementPatchesScatterIntoDeviceTensorsOfEveryElementSizeAndAlignment) {
  struct Case {
    DType dtype;
    uint32_t e;
    uint64_t n;
    double fraction;
    uint64_t block;   // a block this long is a run of one copy (>= 4 KiB) or of the kernel
    size_t misalign;  // bytes off an e-aligned address: the bytewise kernel
  };
  const Case cases[] = {{DType::kBF16, 2, 1 << 20, 0.01, 16 * 1024, 0},
                        {DType::kF32, 4, 300000, 0.001, 100, 0},
                        {DType::kU8, 1, 100001, 0.02, 0, 0},
                        {DType::kF64, 8, 50000, 0.01, 1024, 0},
                        {DType::kF16, 2, 70000, 0.01, 5000, 1},
                        {DType::kF32, 4, 70000, 0.01, 0, 2},
                        {DType::kC64, 8, 30000, 0.01, 700, 4}};
  std::vector<ReceivedPatch> patches;
  std::vector<std::string> after;
  size_t total = 0;
  for (const Case& c : cases) total += c.e * c.n + 64;
  void* memory = nullptr;
  ASSERT_EQ(cudaMalloc(&memory, total), cudaSuccess);
  std::vector<void*> destinations;
  size_t at = 0;
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    auto [b, a] = Versions(c.e, c.n, c.fraction, c.block, static_cast<uint32_t>(i));
    std::byte* to = static_cast<std::byte*>(memory) + at + c.misalign;
    ASSERT_EQ(cudaMemcpy(to, b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
    destinations.push_back(to);
    patches.push_back(PatchBetween(absl::StrCat("t", i), c.dtype, c.e, b, a));
    after.push_back(std::move(a));
    at += (c.e * c.n + 63) / 64 * 64 + 64;
  }
  ASSERT_OK(ApplyReceivedPatchesOnDevice(patches, destinations));
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(DeviceBytes(destinations[i], after[i].size()) == after[i]) << patches[i].spec.name;
  }
  // Device bytes that are not the since version's (an element the patch
  // leaves as it is, changed here): the check says which.
  auto [b0, a0] = Versions(2, 1 << 20, 0.01, 16 * 1024, 0);  // case 0's versions again
  size_t same = 0;
  while (same + 1 < a0.size() && (b0[same] != a0[same] || b0[same + 1] != a0[same + 1])) same += 2;
  ASSERT_EQ(cudaMemcpy(destinations[0], b0.data(), b0.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const char flipped = static_cast<char>(b0[same] ^ 1);
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(destinations[0]) + same, &flipped, 1, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_THAT(ApplyReceivedPatchesOnDevice(std::span(patches).first(1), std::span(destinations).first(1)),
              testing::StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("tensor 't0' patched on the GPU")));
  cudaFree(memory);
}

TEST_F(CudaTest, AWorkerHoldingTensorsOnTheGpuFollowsAnRlStepByPatchesScatteredInPlace) {
  const std::string models = testing::MakeScratchDir("gpu-rl");
  std::vector<SharedTensor> tensors;
  std::vector<std::string> before, after;
  for (int i = 0; i < 8; ++i) {
    auto [b, a] = Versions(2, 512 * 1024, 0.01, 0, 100 + i);
    tensors.push_back({{absl::StrCat("layers.", i, ".weight"), DType::kBF16, {512, 1024}}, SharedBytes::Copy(b)});
    before.push_back(std::move(b));
    after.push_back(std::move(a));
  }
  testing::WriteFileOrDie(models + "/rl.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = models;
  ASSERT_OK_AND_ASSIGN(auto server, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(auto store, ConnectRemoteStore(absl::StrCat("127.0.0.1:", server->port())));
  ASSERT_OK_AND_ASSIGN(auto sink, CudaSink::Create());
  ASSERT_OK(store->FetchTensors("rl", {}, sink.get()));
  ASSERT_OK_AND_ASSIGN(std::vector<DeviceTensor> held, sink->Finish());
  const std::string since = store->GetCheckpoint("rl")->version;

  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].bytes = SharedBytes::Copy(after[i]);
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // coarse timestamps
  const std::string temporary = models + "/rl.safetensors.tmp";
  testing::WriteFileOrDie(temporary, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  ASSERT_EQ(std::rename(temporary.c_str(), (models + "/rl.safetensors").c_str()), 0);
  server->registry().Rescan();

  Query query;
  query.since_version = since;
  query.patches = true;
  ASSERT_OK_AND_ASSIGN(ChangedTensors changed, FetchChanged(*store, "rl", query));
  ASSERT_EQ(changed.patched.size(), tensors.size()) << changed.patch_reason;
  std::vector<void*> destinations;
  for (const ReceivedPatch& p : changed.patched) {
    auto it = std::find_if(held.begin(), held.end(), [&](const DeviceTensor& t) { return t.spec.name == p.spec.name; });
    ASSERT_NE(it, held.end());
    destinations.push_back(it->data());
  }
  ASSERT_OK(ApplyReceivedPatchesOnDevice(changed.patched, destinations));
  for (size_t i = 0; i < held.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(SharedBytes back, CopyToHost(held[i]));
    EXPECT_TRUE(back.view() == after[i]) << held[i].spec.name;
  }
}

TEST(CudaAvailabilityTest, CreatingASinkWithoutAGpuIsAClearError) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  EXPECT_THAT(CudaSink::Create(), testing::StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_OK_AND_ASSIGN(auto store, OpenLocalStore(Models()));
  MaterializeOptions on_gpu;
  on_gpu.device = Device::Cuda(0);
  EXPECT_THAT(Materialize(*store, "mixed", {}, on_gpu),
              testing::StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("cuda:0")));
}

TEST(CudaAvailabilityTest, PatchingDeviceTensorsWithoutAGpuIsAClearError) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  auto [b, a] = Versions(2, 1000, 0.01, 0, 1);
  const std::vector<ReceivedPatch> patches = {PatchBetween("w", DType::kBF16, 2, b, a)};
  std::vector<void*> destinations = {b.data()};
  EXPECT_THAT(ApplyReceivedPatchesOnDevice(patches, destinations),
              testing::StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("no CUDA device")));
}

}  // namespace
}  // namespace weightstore::client
