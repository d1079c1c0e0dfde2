// Tensor-parallel shards and explicit slices, served: Llama- and GPT-2-style
// state dicts written by real PyTorch at test time (fused QKV and gate-up
// included), and what each rank must receive computed by torch itself
// (tests/testdata/make_tp_models.py). Every store must hand each rank of N = 2,
// 4, 8 exactly torch's chunk, bit for bit: the local store, a real weightstored
// over gRPC on 127.0.0.1:0, and its same-host socket (by copy and by mapping).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/store.h"
#include "core/checkpoint.h"
#include "core/shm/sealed_memfd.h"
#include "nlohmann/json.hpp"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

constexpr const char* kModels[] = {"llama", "llama_fused", "gpt2"};

class TensorParallelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeScratchDir("tensor-parallel"));
    std::string output;
    const int rc = testing::RunCommand(absl::StrCat(testing::ShellQuote(testing::TorchPython()), " ",
                                                    testing::ShellQuote(testing::TestDataDir() + "/make_tp_models.py"),
                                                    " ", testing::ShellQuote(*dir_)),
                                       &output);
    if (rc != 0) {  // each test fails in SetUp (a fatal failure here would skip them)
      failure_ = new std::string("the PyTorch model writer failed:\n" + output);
      return;
    }
    std::ifstream in(*dir_ + "/rules.json");
    spec_ = new nlohmann::json(nlohmann::json::parse(in));
    socket_ = new std::string(*dir_ + "/ws.sock");
    // File segments always: the test wrote the models (and may run as root),
    // so by default the daemon would hand it sealed copies, not the files.
    daemon_ = new testing::Daemon(*dir_ + "/models", {"--socket", *socket_, "--socket-file-segments", "always"});
  }
  static void TearDownTestSuite() {
    delete daemon_;
    delete socket_;
    delete spec_;
    delete dir_;
  }

  void SetUp() override {
    ASSERT_EQ(failure_, nullptr) << *failure_;
    ASSERT_NE(daemon_->port(), 0) << daemon_->log();
    ASSERT_OK_AND_ASSIGN(local_, client::OpenLocalStore(*dir_ + "/models"));
    ASSERT_OK_AND_ASSIGN(remote_, client::ConnectRemoteStore(daemon_->address()));
    ASSERT_OK_AND_ASSIGN(socket_store_, client::ConnectSharedMemoryStore(*socket_));
  }

  // The shard rules of `model`, as make_tp_models.py wrote them.
  static ShardSpec Shard(const std::string& model, uint32_t rank, uint32_t world) {
    ShardSpec shard{rank, world, {}};
    for (const auto& rule : (*spec_)["rules"][model]) {
      absl::StatusOr<ShardSplit> split = ParseShardSplit(rule[1].get<std::string>());
      EXPECT_OK(split.status());
      shard.rules.push_back({rule[0].get<std::string>(), split.value_or(ShardSplit{})});
    }
    return shard;
  }

  static std::shared_ptr<const Checkpoint> Open(const std::string& path) {
    auto c = Checkpoint::Open(path);
    EXPECT_OK(c.status());
    return c.value_or(nullptr);
  }

  // Every store's tensors for `query`: local, remote, socket by copy and by
  // mapping, each named for the failure messages.
  std::vector<std::pair<std::string, std::vector<SharedTensor>>> FetchEverywhere(const std::string& model,
                                                                                 const client::Query& query) {
    std::vector<std::pair<std::string, std::vector<SharedTensor>>> out;
    for (auto [name, store] : {std::pair<const char*, client::Store*>{"local", local_.get()},
                               {"remote", remote_.get()},
                               {"socket", socket_store_.get()}}) {
      absl::StatusOr<std::vector<SharedTensor>> tensors = store->FetchAll(model, query);
      EXPECT_OK(tensors.status()) << name;
      if (tensors.ok()) out.emplace_back(name, *std::move(tensors));
    }
    absl::StatusOr<client::MappedTensors> mapped = socket_store_->MapTensors(model, query);
    EXPECT_OK(mapped.status()) << "socket MapTensors";
    if (mapped.ok()) {
      EXPECT_OK(mapped->Verify());
      out.emplace_back("socket map", mapped->tensors);
    }
    return out;
  }

  static std::string* dir_;
  static std::string* failure_;
  static nlohmann::json* spec_;
  static std::string* socket_;
  static testing::Daemon* daemon_;
  std::unique_ptr<client::Store> local_, remote_;
  std::unique_ptr<client::SharedMemoryStore> socket_store_;
};

std::string* TensorParallelTest::dir_ = nullptr;
std::string* TensorParallelTest::failure_ = nullptr;
nlohmann::json* TensorParallelTest::spec_ = nullptr;
std::string* TensorParallelTest::socket_ = nullptr;
testing::Daemon* TensorParallelTest::daemon_ = nullptr;

TEST_F(TensorParallelTest, EveryRankReceivesTorchsChunksBitForBitOverEveryStore) {
  int compared = 0;
  for (const std::string model : kModels) {
    auto full = Open(*dir_ + "/models/" + model + ".pt");
    auto expected = Open(*dir_ + "/expected/" + model + ".pt");
    ASSERT_NE(full, nullptr);
    ASSERT_NE(expected, nullptr);
    for (uint32_t world : {2u, 4u, 8u}) {
      for (uint32_t rank = 0; rank < world; ++rank) {
        client::Query query;
        query.selection.shard = Shard(model, rank, world);
        for (const auto& [store, tensors] : FetchEverywhere(model, query)) {
          SCOPED_TRACE(absl::StrCat(model, " rank ", rank, "/", world, " over ", store));
          ASSERT_EQ(tensors.size(), full->size());
          for (const SharedTensor& t : tensors) {
            const CheckpointEntry* want = expected->Find(absl::StrCat("n", world, ".r", rank, ".", t.spec.name));
            ASSERT_NE(want, nullptr) << t.spec.name;
            EXPECT_EQ(t.spec.shape, want->spec.shape) << t.spec.name;
            ASSERT_OK_AND_ASSIGN(SharedTensor bytes, expected->Read(*want));
            EXPECT_EQ(t.bytes.view(), bytes.bytes.view()) << t.spec.name;
            ++compared;
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 3000);
}

// Writes `part`, the served bytes of a slice of a tensor of `shape`, into
// `whole` (row-major, `element` bytes each) where the slice's ranges say.
void Place(const std::vector<uint64_t>& shape, const TensorSlice& slice, size_t element, absl::string_view part,
           std::string* whole) {
  std::vector<std::vector<uint64_t>> indices(shape.size());  // source index of each served index, per dimension
  for (size_t d = 0; d < shape.size(); ++d) {
    for (const IndexRange& r : slice.dims[d]) {
      for (uint64_t i = r.start; i < r.stop; ++i) indices[d].push_back(i);
    }
  }
  std::vector<size_t> at(shape.size(), 0);
  for (size_t e = 0; e * element < part.size(); ++e) {
    uint64_t offset = 0;
    for (size_t d = 0; d < shape.size(); ++d) offset = offset * shape[d] + indices[d][at[d]];
    std::memcpy(whole->data() + offset * element, part.data() + e * element, element);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < indices[d].size()) break;
      at[d] = 0;
    }
  }
}

TEST_F(TensorParallelTest, TheShardsOfAllRanksPlacedByTheirListedRangesGiveBackTheOriginal) {
  for (const std::string model : kModels) {
    auto full = Open(*dir_ + "/models/" + model + ".pt");
    ASSERT_NE(full, nullptr);
    for (uint32_t world : {2u, 4u, 8u}) {
      SCOPED_TRACE(absl::StrCat(model, " over ", world, " ranks"));
      std::vector<std::string> rebuilt(full->size());
      for (size_t i = 0; i < full->size(); ++i) rebuilt[i].assign(full->entries()[i].spec.byte_size(), '\xee');
      for (uint32_t rank = 0; rank < world; ++rank) {
        client::Query query;
        query.selection.shard = Shard(model, rank, world);
        query.with_checksums = true;
        ASSERT_OK_AND_ASSIGN(client::TensorListing listing, remote_->ListTensors(model, query));
        ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> tensors, remote_->FetchAll(model, query));
        ASSERT_EQ(listing.tensors.size(), full->size());
        for (size_t i = 0; i < full->size(); ++i) {
          const client::TensorDescription& d = listing.tensors[i];
          const CheckpointEntry& source = full->entries()[i];
          ASSERT_EQ(d.source_name, source.spec.name);
          ASSERT_TRUE(d.crc32c.has_value());
          if (d.slice.empty()) {  // replicated: every rank gets it whole
            ASSERT_OK_AND_ASSIGN(SharedTensor want, full->Read(source));
            EXPECT_EQ(tensors[i].bytes.view(), want.bytes.view()) << d.spec.name;
            rebuilt[i] = std::string(want.bytes.view());
            continue;
          }
          EXPECT_EQ(d.unsliced_shape, source.spec.shape) << d.spec.name;
          Place(source.spec.shape, d.slice, DTypeSize(source.spec.dtype), tensors[i].bytes.view(), &rebuilt[i]);
        }
      }
      for (size_t i = 0; i < full->size(); ++i) {
        ASSERT_OK_AND_ASSIGN(SharedTensor want, full->Read(full->entries()[i]));
        EXPECT_TRUE(rebuilt[i] == want.bytes.view()) << full->entries()[i].spec.name;
      }
    }
  }
}

TEST_F(TensorParallelTest, ShardsComposeWithARenameAFilterAndABf16Cast) {
  for (const std::string model : kModels) {
    auto expected = Open(*dir_ + "/expected/" + model + ".pt");
    ASSERT_NE(expected, nullptr);
    for (uint32_t world : {2u, 4u, 8u}) {
      const uint32_t rank = world - 1;
      client::Query query;
      query.selection.renames = {{"^(model|transformer)\\.", ""}};
      query.selection.exclude = {"norm|ln_"};
      query.selection.dtype = DType::kBF16;
      query.selection.shard = Shard(model, rank, world);  // the rules match the renamed names' ends
      for (const auto& [store, tensors] : FetchEverywhere(model, query)) {
        SCOPED_TRACE(absl::StrCat(model, " rank ", rank, "/", world, " over ", store));
        ASSERT_FALSE(tensors.empty());
        for (const SharedTensor& t : tensors) {
          EXPECT_THAT(t.spec.name, ::testing::Not(HasSubstr("norm")));
          EXPECT_EQ(t.spec.dtype, DType::kBF16);
          const std::string source = t.spec.name == "lm_head.weight" ? t.spec.name
                                     : model == "gpt2"               ? "transformer." + t.spec.name
                                                                     : "model." + t.spec.name;
          const CheckpointEntry* want = expected->Find(absl::StrCat("bf16.n", world, ".r", rank, ".", source));
          ASSERT_NE(want, nullptr) << source;
          ASSERT_OK_AND_ASSIGN(SharedTensor bytes, expected->Read(*want));
          EXPECT_EQ(t.bytes.view(), bytes.bytes.view()) << t.spec.name;
        }
      }
    }
  }
}

TEST_F(TensorParallelTest, ExplicitSlicesEqualTorchNarrowOverEveryStore) {
  for (const auto& [model, slices] : (*spec_)["slices"].items()) {
    auto expected = Open(*dir_ + "/expected/" + model + ".pt");
    ASSERT_NE(expected, nullptr);
    client::Query query;
    for (const auto& [name, text] : slices.items()) {
      ASSERT_OK_AND_ASSIGN(std::vector<SliceBound> bounds, ParseSliceBounds(text.get<std::string>()));
      query.selection.slices.push_back({name, bounds});
      query.selection.paths.push_back(name);
    }
    for (const auto& [store, tensors] : FetchEverywhere(model, query)) {
      SCOPED_TRACE(absl::StrCat(model, " over ", store));
      ASSERT_EQ(tensors.size(), slices.size());
      for (const SharedTensor& t : tensors) {
        const CheckpointEntry* want = expected->Find("slice." + t.spec.name);
        ASSERT_NE(want, nullptr) << t.spec.name;
        EXPECT_EQ(t.spec.shape, want->spec.shape);
        ASSERT_OK_AND_ASSIGN(SharedTensor bytes, expected->Read(*want));
        EXPECT_EQ(t.bytes.view(), bytes.bytes.view()) << t.spec.name;
      }
    }
  }
}

TEST_F(TensorParallelTest, ListingsReportTheServedShapeAndTheSourceRangesAlike) {
  client::Query query;
  query.selection.shard = Shard("llama_fused", 1, 4);
  query.selection.paths = {"model.layers.0.self_attn.qkv_proj.weight", "model.norm.weight"};
  for (client::Store* store : {local_.get(), remote_.get(), static_cast<client::Store*>(socket_store_.get())}) {
    ASSERT_OK_AND_ASSIGN(client::TensorListing listing, store->ListTensors("llama_fused", query));
    ASSERT_EQ(listing.tensors.size(), 2u);
    const client::TensorDescription& qkv = listing.tensors[0];
    EXPECT_EQ(qkv.spec.shape, (std::vector<uint64_t>{48, 64}));
    EXPECT_EQ(qkv.unsliced_shape, (std::vector<uint64_t>{192, 64}));
    EXPECT_EQ(qkv.slice.ToString(qkv.unsliced_shape), "[16:32+80:96+144:160, :]");
    EXPECT_TRUE(listing.tensors[1].slice.empty());
    EXPECT_TRUE(listing.tensors[1].unsliced_shape.empty());
  }
}

TEST_F(TensorParallelTest, ShardErrorsNameTheTensorOnEveryStore) {
  struct Case {
    const char* what;
    ShardSpec shard;
    absl::StatusCode code;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"indivisible",
       Shard("llama", 0, 3),
       absl::StatusCode::kInvalidArgument,
       {"'model.", "not divisible by the world size 3"}},
      {"rank out of range", Shard("llama", 4, 4), absl::StatusCode::kInvalidArgument, {"shard.rank 4 is out of range"}},
      {"dimension past the rank",
       {0, 2, {{"input_layernorm\\.weight$", {1}}}},
       absl::StatusCode::kInvalidArgument,
       {"'model.layers.0.input_layernorm.weight'", "no dimension 1"}},
      {"conflicting rules",
       {0, 2, {{"proj\\.weight$", {0}}, {"o_proj\\.weight$", {1}}}},
       absl::StatusCode::kInvalidArgument,
       {"'model.layers.0.self_attn.o_proj.weight'", "which disagree"}},
  };
  for (const Case& c : cases) {
    client::Query query;
    query.selection.shard = c.shard;
    for (auto [name, store] : {std::pair<const char*, client::Store*>{"local", local_.get()},
                               {"remote", remote_.get()},
                               {"socket", socket_store_.get()}}) {
      SCOPED_TRACE(absl::StrCat(c.what, " over ", name));
      absl::Status listed = store->ListTensors("llama", query).status();
      absl::Status fetched = store->FetchAll("llama", query).status();
      for (const absl::Status& status : {listed, fetched}) {
        EXPECT_EQ(status.code(), c.code) << status;
        for (const std::string& text : c.says) EXPECT_THAT(std::string(status.message()), HasSubstr(text));
      }
    }
  }
  // Counts past the limits are refused before anything is converted or compiled.
  client::Query deep;
  deep.selection.slices = {{"model.norm.weight", std::vector<SliceBound>(65)}};
  client::Query many;
  many.selection.shard = {0, 2, std::vector<ShardRule>(257, ShardRule{"x", {0}})};
  for (const client::Query& query : {deep, many}) {
    for (client::Store* store : {local_.get(), remote_.get(), static_cast<client::Store*>(socket_store_.get())}) {
      absl::Status status = store->FetchAll("llama", query).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(std::string(status.message()),
                  ::testing::AnyOf(HasSubstr("65 dimensions"), HasSubstr("257 patterns")));
    }
  }
  // The daemon kept serving.
  client::Query whole;
  EXPECT_OK(remote_->FetchAll("llama", whole).status());
}

TEST_F(TensorParallelTest, TheCliFetchesOneRanksShard) {
  const std::string out_dir = testing::MakeScratchDir("tp-fetch");
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(testing::ShellQuote(testing::CliPath()), " fetch --server ",
                                             daemon_->address(), " llama_fused ", out_dir,
                                             "/rank1.safetensors --shard 1/4 --shard-dim 'qkv_proj\\.weight$=0x3'"),
                                &out),
            0)
      << out;
  auto fetched = Open(out_dir + "/rank1.safetensors");
  ASSERT_NE(fetched, nullptr);
  client::Query query;
  query.selection.shard = {1, 4, {{"qkv_proj\\.weight$", {0, 3}}}};
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> want, local_->FetchAll("llama_fused", query));
  ASSERT_EQ(fetched->size(), want.size());
  for (const SharedTensor& t : want) {
    const CheckpointEntry* got = fetched->Find(t.spec.name);
    ASSERT_NE(got, nullptr) << t.spec.name;
    EXPECT_EQ(got->spec.shape, t.spec.shape);
    ASSERT_OK_AND_ASSIGN(SharedTensor bytes, fetched->Read(*got));
    EXPECT_EQ(bytes.bytes.view(), t.bytes.view()) << t.spec.name;
  }
  EXPECT_EQ(fetched->Find("model.layers.0.self_attn.qkv_proj.weight")->spec.shape, (std::vector<uint64_t>{48, 64}));
}

// Bytes of this process's resident file-backed and anonymous memory.
std::pair<uint64_t, uint64_t> RssFileAndAnon() {
  std::ifstream in("/proc/self/status");
  uint64_t file = 0, anon = 0;
  for (std::string line; std::getline(in, line);) {
    for (auto [key, out] : {std::pair<const char*, uint64_t*>{"RssFile:", &file}, {"RssAnon:", &anon}}) {
      if (line.rfind(key, 0) == 0) {
        std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
        uint64_t kib = 0;
        if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kib)) *out = kib << 10;
      }
    }
  }
  return {file, anon};
}

TEST_F(TensorParallelTest, ASocketDimZeroShardMapsOnlyItsPagesOfTheFileAndCopiesNothing) {
  client::Query query;
  query.selection.shard = {2, 4, {{"^big$", {0}}}};
  query.selection.paths = {"big"};
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, socket_store_->MapTensors("big", query));
  ASSERT_EQ(mapped.tensors.size(), 1u);
  ASSERT_EQ(mapped.segments.size(), 1u);
  const MappedFile& segment = *mapped.segments[0];
  EXPECT_FALSE(CheckSealed(segment.fd(), "segment").ok()) << "the shard was copied into a memfd";
  const uint64_t shard_bytes = 512 * 4096 * 4;  // rows 1024-1535 of 2048, F32
  EXPECT_EQ(mapped.tensors[0].bytes.size(), shard_bytes);
  EXPECT_GT(segment.offset(), 0u);                // a window of the file...
  EXPECT_LT(segment.size(), shard_bytes + 4096);  // ...of the shard's pages only
  EXPECT_LT(segment.size(), 33u << 20);           // not the 32 MiB file
  // Reading the shard faults in file pages, never anonymous memory.
  const auto [file_before, anon_before] = RssFileAndAnon();
  uint64_t sum = 0;
  const auto* bytes = reinterpret_cast<const unsigned char*>(mapped.tensors[0].bytes.data());
  for (uint64_t i = 0; i < shard_bytes; i += 512) sum += bytes[i];
  const auto [file_after, anon_after] = RssFileAndAnon();
  std::printf("dim-0 shard of 32 MiB: mapped %llu bytes; read it: RssFile +%llu KiB, RssAnon +%lld KiB (sum %llu)\n",
              static_cast<unsigned long long>(segment.size()),
              static_cast<unsigned long long>((file_after - file_before) >> 10),
              static_cast<long long>(static_cast<int64_t>(anon_after - anon_before) / 1024),
              static_cast<unsigned long long>(sum));
  EXPECT_LE(file_after - file_before, shard_bytes + (1 << 20));
  EXPECT_LT(static_cast<int64_t>(anon_after - anon_before), 1 << 20);
  // The same bytes the local store serves.
  ASSERT_OK_AND_ASSIGN(SharedTensor local, local_->FetchTensor("big", "big", query));
  EXPECT_EQ(mapped.tensors[0].bytes.view(), local.bytes.view());
  // A dim-1 shard is gathered once into a sealed memfd instead.
  query.selection.shard = {2, 4, {{"^big$", {1}}}};
  ASSERT_OK_AND_ASSIGN(client::MappedTensors gathered, socket_store_->MapTensors("big", query));
  ASSERT_EQ(gathered.segments.size(), 1u);
  EXPECT_OK(CheckSealed(gathered.segments[0]->fd(), "segment"));
  EXPECT_OK(gathered.Verify());
  ASSERT_OK_AND_ASSIGN(SharedTensor local_cols, local_->FetchTensor("big", "big", query));
  EXPECT_EQ(gathered.tensors[0].bytes.view(), local_cols.bytes.view());
}

}  // namespace
}  // namespace weightstore
