// Element patches composed for fetches several versions behind are made once
// per (since version, version, tensor) and counted against a budget as large
// as --kept-patch-bytes while cached or being sent: alternating since
// versions made a new composition per stream, uncounted, on gRPC's threads.
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/element_patch.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;

constexpr size_t kElements = 1 << 20;  // one F32 tensor of 4 MiB

// Versions of tensor "w", each changing 2% of the elements of the one before
// (an RL step), published to a daemon's folder one by one.
class History {
 public:
  History() : values_{std::vector<float>(kElements, 0.5f)} {
    for (uint32_t v = 1; v < 7; ++v) {
      std::vector<float> next = values_.back();
      std::mt19937 rng(v);
      for (size_t i = 0; i < kElements / 50; ++i) next[rng() % kElements] += 1.0f;
      std::optional<ElementPatch> step = DiffElements(Bytes(values_.back()), Bytes(next), 4);
      EXPECT_TRUE(step.has_value());
      step_bytes_ += step ? step->body.size() : 0;
      values_.push_back(std::move(next));
    }
  }

  size_t versions() const { return values_.size(); }
  const std::vector<float>& values(size_t v) const { return values_[v]; }
  // What the daemon keeps of the steps' patches, about.
  uint64_t step_bytes() const { return step_bytes_; }

  // Writes version `v` over <models>/m.safetensors and has `daemon` rescan;
  // returns the version the daemon serves.
  std::string Publish(size_t v, const std::string& models, const testing::Daemon& daemon) const {
    const std::string bytes(reinterpret_cast<const char*>(values_[v].data()), kElements * sizeof(float));
    const SharedTensor w{{"w", DType::kF32, {kElements}}, SharedBytes::Copy(bytes)};
    testing::WriteFileOrDie(models + "/m.safetensors.tmp", *SerializeCheckpoint(kSafeTensorsFormat, {w}, {}));
    std::filesystem::rename(models + "/m.safetensors.tmp", models + "/m.safetensors");
    auto stub = testing::NewStub(daemon.address());
    grpc::ClientContext ctx;
    pb::RescanResponse rescanned;
    EXPECT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &rescanned).ok());
    grpc::ClientContext get_ctx;
    pb::GetCheckpointRequest get;
    get.set_name("m");
    pb::CheckpointInfo info;
    EXPECT_TRUE(stub->GetCheckpoint(&get_ctx, get, &info).ok());
    return info.version();
  }

  static std::span<const std::byte> Bytes(const std::vector<float>& v) { return std::as_bytes(std::span(v)); }

 private:
  std::vector<std::vector<float>> values_;
  uint64_t step_bytes_ = 0;
};

// A stub whose streams take at most 64 KiB the client has not read (no
// window growth): a stream left unread holds its patch, whatever its size.
std::unique_ptr<pb::WeightStore::Stub> SlowReaderStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return pb::WeightStore::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// A FetchTensors stream of "m" with patches since `since`, in 64 KiB chunks.
struct PatchStream {
  PatchStream(pb::WeightStore::Stub* stub, const std::string& since) {
    pb::FetchTensorsRequest request;
    request.set_name("m");
    request.set_since_version(since);
    request.set_patches(true);
    request.set_chunk_bytes(64 << 10);
    reader = stub->FetchTensors(&ctx, request);
  }
  // Reads to the end of the tensor; its bytes (the patch's body, or the
  // tensor), after `first`.
  std::string Rest(const pb::TensorChunk& first) {
    std::string bytes = first.data();
    pb::TensorChunk chunk = first;
    while (!chunk.last() && reader->Read(&chunk)) bytes += chunk.data();
    return bytes;
  }

  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<pb::TensorChunk>> reader;
};

// `held` with the patch a first chunk describes, of body `body`, applied.
std::vector<float> Patched(std::vector<float> held, const pb::TensorPatch& header, const std::string& body) {
  ElementPatch patch;
  patch.encoding = ParsePatchEncoding(header.encoding()).value_or(PatchEncoding::kPositions);
  patch.element_size = header.element_size();
  patch.elements = kElements;
  patch.changed = header.changed_elements();
  patch.body = SharedBytes::Copy(body);
  EXPECT_TRUE(ApplyPatch(patch, std::as_writable_bytes(std::span(held))).ok());
  return held;
}

TEST(ComposedPatchesTest, StreamsAtTwoSinceVersionsShareOneCompositionEachWithinTheBudget) {
  const History history;
  const std::string models = testing::MakeScratchDir("models");
  const uint64_t budget = 4 * history.step_bytes();
  testing::Daemon daemon(models, {"--kept-patch-bytes", std::to_string(budget), "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  std::vector<std::string> versions;
  for (size_t v = 0; v < history.versions(); ++v) versions.push_back(history.Publish(v, models, daemon));
  auto stub = SlowReaderStub(daemon.address());

  // 16 late joiners alternating between two since versions, each reading
  // only its first chunk: they hold their patch, unread.
  std::vector<std::unique_ptr<PatchStream>> streams;
  std::vector<pb::TensorChunk> first(16);
  for (size_t i = 0; i < first.size(); ++i) {
    streams.push_back(std::make_unique<PatchStream>(stub.get(), versions[i % 2]));
    ASSERT_TRUE(streams.back()->reader->Read(&first[i])) << daemon.log();
    ASSERT_TRUE(first[i].info().has_patch()) << first[i].delta().patch_reason();
    EXPECT_LT(first[i].info().patch().patch_bytes(), kElements * sizeof(float) / 5);
  }
  auto metric = [&](absl::string_view name, std::initializer_list<absl::string_view> labels = {}) {
    return testing::MetricValue(daemon.metrics_port(), name, labels);
  };
  EXPECT_EQ(metric("weightstore_patch_compositions_total", {"result=\"made\""}), 2);
  EXPECT_EQ(metric("weightstore_patch_compositions_total", {"result=\"shared\""}), 14);
  EXPECT_EQ(metric("weightstore_patch_compositions_total", {"result=\"over_budget\""}), 0);
  const double held = metric("weightstore_composed_patch_bytes");
  EXPECT_GT(held, 0);
  EXPECT_LE(held, static_cast<double>(budget));
  EXPECT_EQ(metric("weightstore_composed_patch_budget_bytes"), static_cast<double>(budget));
  // Every joiner's patch brings it to the last version, bit for bit.
  for (size_t i = 0; i < 2; ++i) {
    const std::string body = streams[i]->Rest(first[i]);
    EXPECT_EQ(Patched(history.values(i), first[i].info().patch(), body), history.values(history.versions() - 1));
  }
}

TEST(ComposedPatchesTest, ACompositionPastTheBudgetIsNotMadeAndTheTensorComesWholeBitForBit) {
  const History history;
  const std::string models = testing::MakeScratchDir("models");
  // Room for the kept steps and one composition, not two.
  const uint64_t budget = history.step_bytes() * 13 / 10 + (64 << 10);
  testing::Daemon daemon(models, {"--kept-patch-bytes", std::to_string(budget), "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  std::vector<std::string> versions;
  for (size_t v = 0; v < history.versions(); ++v) versions.push_back(history.Publish(v, models, daemon));
  auto stub = SlowReaderStub(daemon.address());

  PatchStream holding(stub.get(), versions[0]);  // holds the composition since v0, unread
  pb::TensorChunk chunk;
  ASSERT_TRUE(holding.reader->Read(&chunk)) << daemon.log();
  ASSERT_TRUE(chunk.info().has_patch()) << chunk.delta().patch_reason();

  PatchStream late(stub.get(), versions[1]);
  ASSERT_TRUE(late.reader->Read(&chunk)) << daemon.log();
  EXPECT_FALSE(chunk.info().has_patch());
  const std::string whole = late.Rest(chunk);
  const std::vector<float>& last = history.values(history.versions() - 1);
  ASSERT_EQ(whole.size(), kElements * sizeof(float));
  EXPECT_EQ(std::memcmp(whole.data(), last.data(), whole.size()), 0);
  const int port = daemon.metrics_port();
  EXPECT_EQ(testing::MetricValue(port, "weightstore_patch_compositions_total", {"result=\"over_budget\""}), 1);
  EXPECT_EQ(testing::MetricValue(port, "weightstore_patch_compositions_total", {"result=\"made\""}), 1);
  EXPECT_LE(testing::MetricValue(port, "weightstore_composed_patch_bytes"), static_cast<double>(budget));
}

}  // namespace
}  // namespace weightstore
