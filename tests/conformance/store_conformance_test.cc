// The store conformance suite: the same queries over the local store, the
// remote store (gRPC to a real weightstored on 127.0.0.1:0) and the socket
// store (the same daemon's same-host socket, by copy and by MapTensors) give the
// same listings, the same
// tensors byte for byte and the same status codes. The local store is the
// reference. Every fixture of ../shared/fixtures is served (through a folder of
// symlinks), under selections, casts, renames, adapters, version pins and the
// error cases.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/select/apply.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using client::Query;
using client::Store;

// What one store answered to one query: the listing (with checksums) and the
// fetch, or the status codes of their failures.
struct Outcome {
  absl::Status list_status, fetch_status;
  client::TensorListing listing;
  std::vector<SharedTensor> tensors;
};

Outcome Ask(Store& store, const std::string& name, Query query) {
  query.with_checksums = true;
  Outcome out;
  absl::StatusOr<client::TensorListing> listing = store.ListTensors(name, query);
  out.list_status = listing.status();
  if (listing.ok()) out.listing = *std::move(listing);
  absl::StatusOr<std::vector<SharedTensor>> tensors = store.FetchAll(name, query);
  out.fetch_status = tensors.status();
  if (tensors.ok()) out.tensors = *std::move(tensors);
  return out;
}

// Expects `got` (from the store called `store`) to equal the reference, but
// for the version id: a daemon names versions by content, a local store (which
// reads no digests) by file (docs/updates.md).
void ExpectSameOutcome(const Outcome& want, const Outcome& got, const std::string& store) {
  SCOPED_TRACE(store);
  ASSERT_EQ(got.list_status.code(), want.list_status.code()) << got.list_status << " vs " << want.list_status;
  ASSERT_EQ(got.fetch_status.code(), want.fetch_status.code()) << got.fetch_status << " vs " << want.fetch_status;
  if (!want.list_status.ok()) return;
  ASSERT_EQ(got.listing.tensors.size(), want.listing.tensors.size());
  for (size_t i = 0; i < want.listing.tensors.size(); ++i) {
    const client::TensorDescription &w = want.listing.tensors[i], &g = got.listing.tensors[i];
    EXPECT_EQ(g.spec.name, w.spec.name);
    EXPECT_EQ(g.spec.dtype, w.spec.dtype) << w.spec.name;
    EXPECT_EQ(g.spec.shape, w.spec.shape) << w.spec.name;
    EXPECT_EQ(g.source_name, w.source_name) << w.spec.name;
    EXPECT_EQ(g.crc32c, w.crc32c) << w.spec.name;
  }
  EXPECT_EQ(got.listing.apply_result.has_value(), want.listing.apply_result.has_value());
  if (want.listing.apply_result && got.listing.apply_result) {
    EXPECT_EQ(got.listing.apply_result->applied, want.listing.apply_result->applied);
    EXPECT_EQ(got.listing.apply_result->missing, want.listing.apply_result->missing);
    EXPECT_EQ(got.listing.apply_result->unused, want.listing.apply_result->unused);
    EXPECT_EQ(got.listing.apply_result->skipped, want.listing.apply_result->skipped);
  }
  if (!want.fetch_status.ok()) return;
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    EXPECT_EQ(got.tensors[i].spec.name, want.tensors[i].spec.name);
    EXPECT_EQ(got.tensors[i].bytes.view(), want.tensors[i].bytes.view()) << want.tensors[i].spec.name;
  }
}

// A sink that lets `open_ahead` tensors be begun before they end, and
// records what a store did with that: the most it had open, whether every
// End came in Begin's order, and the tensors.
class OpenAheadSink : public client::TensorSink {
 public:
  explicit OpenAheadSink(size_t open_ahead) : open_ahead_(open_ahead) {}
  size_t OpenAhead() const override { return open_ahead_; }
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
    open_.emplace_back(spec.name, std::string(spec.byte_size(), '\0'));  // a deque: earlier ones stay put
    most_open_ = std::max(most_open_, open_.size());
    return std::span(reinterpret_cast<std::byte*>(open_.back().second.data()), open_.back().second.size());
  }
  absl::Status End(const TensorSpec& spec) override {
    if (open_.empty() || open_.front().first != spec.name) {
      in_order_ = false;
      return absl::InternalError(absl::StrCat("End of '", spec.name, "' out of Begin's order"));
    }
    tensors_.push_back({spec, SharedBytes::Copy(open_.front().second)});
    open_.pop_front();
    return absl::OkStatus();
  }
  size_t most_open() const { return most_open_; }
  bool in_order() const { return in_order_ && open_.empty(); }
  const std::vector<SharedTensor>& tensors() const { return tensors_; }

 private:
  size_t open_ahead_;
  std::deque<std::pair<std::string, std::string>> open_;
  size_t most_open_ = 0;
  bool in_order_ = true;
  std::vector<SharedTensor> tensors_;
};

class StoreConformanceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models_ = new std::string(testing::MakeFixtureModelsDir());
    socket_ = new std::string(testing::MakeScratchDir("conformance-sock") + "/ws.sock");
    daemon_ = new testing::Daemon(*models_, {"--socket", *socket_, "--data-listen", "127.0.0.1:0",
                                             "--data-lane-handshake-timeout", "60", "--metrics-listen", "127.0.0.1:0"});
  }
  static void TearDownTestSuite() {
    delete daemon_;
    delete socket_;
    delete models_;
  }

  void SetUp() override {
    ASSERT_NE(daemon_->port(), 0) << daemon_->log();
    ASSERT_OK_AND_ASSIGN(local_, client::OpenLocalStore(*models_));
    ASSERT_NE(daemon_->lane_port(), 0) << daemon_->log();
    ASSERT_OK_AND_ASSIGN(remote_, client::ConnectRemoteStore(daemon_->address(), {.data_lane = false}));
    ASSERT_OK_AND_ASSIGN(lane_, client::ConnectRemoteStore(daemon_->address()));
    ASSERT_OK_AND_ASSIGN(socket_store_, client::ConnectSharedMemoryStore(*socket_));
  }

  // Asks every store and compares each with the local one. Returns the local
  // store's outcome, so a test can check the agreement is not on a failure.
  Outcome ExpectAllStoresAgree(const std::string& name, const Query& query, const std::string& what) {
    SCOPED_TRACE(absl::StrCat(name, ": ", what));
    Outcome want = Ask(*local_, name, query);
    const Outcome remote = Ask(*remote_, name, query);
    ExpectSameOutcome(want, remote, "remote");
    ExpectSameOutcome(want, Ask(*lane_, name, query), "remote, data lane");
    const Outcome socket = Ask(*socket_store_, name, query);
    ExpectSameOutcome(want, socket, "socket");
    EXPECT_EQ(socket.listing.version, remote.listing.version);  // one daemon, one id
    // The socket's own call: tensors as read-only views of shared mappings.
    absl::StatusOr<client::MappedTensors> mapped = socket_store_->MapTensors(name, query);
    EXPECT_EQ(mapped.status().code(), want.fetch_status.code()) << "socket MapTensors: " << mapped.status();
    if (mapped.ok() && want.fetch_status.ok()) {
      EXPECT_OK(mapped->Verify());
      EXPECT_EQ(mapped->version, remote.listing.version);
      EXPECT_EQ(mapped->tensors.size(), want.tensors.size());
      for (size_t i = 0; i < std::min(want.tensors.size(), mapped->tensors.size()); ++i) {
        EXPECT_EQ(mapped->tensors[i].spec.name, want.tensors[i].spec.name);
        EXPECT_EQ(mapped->tensors[i].bytes.view(), want.tensors[i].bytes.view()) << want.tensors[i].spec.name;
      }
    }
    compared_tensors_ += want.tensors.size();
    return want;
  }

  std::vector<std::string> Names() {
    std::vector<std::string> names;
    auto list = local_->ListCheckpoints();
    EXPECT_OK(list.status());
    if (list.ok()) {
      for (const auto& c : *list) names.push_back(c.name);
    }
    return names;
  }

  static std::string* models_;
  static std::string* socket_;
  static testing::Daemon* daemon_;
  std::unique_ptr<Store> local_, remote_, lane_;  // remote_ over gRPC alone, lane_ over the data lane
  std::unique_ptr<client::SharedMemoryStore> socket_store_;
  uint64_t compared_tensors_ = 0;  // tensors compared, in fact
};

std::string* StoreConformanceTest::models_ = nullptr;
std::string* StoreConformanceTest::socket_ = nullptr;
testing::Daemon* StoreConformanceTest::daemon_ = nullptr;

TEST_F(StoreConformanceTest, EveryStoreListsTheSameCheckpoints) {
  ASSERT_OK_AND_ASSIGN(auto local, local_->ListCheckpoints());
  ASSERT_OK_AND_ASSIGN(auto remote, remote_->ListCheckpoints());
  ASSERT_OK_AND_ASSIGN(auto socket, socket_store_->ListCheckpoints());
  ASSERT_GE(local.size(), 40u);  // every fixture but the broken one
  for (const auto* other : {&remote, &socket}) {
    ASSERT_EQ(other->size(), local.size());
    for (size_t i = 0; i < local.size(); ++i) {
      EXPECT_EQ((*other)[i].name, local[i].name);
      EXPECT_EQ((*other)[i].format, local[i].format) << local[i].name;
      // Versions: named by content by the daemon, by file locally.
      EXPECT_EQ((*other)[i].version, remote[i].version) << local[i].name;
      EXPECT_EQ((*other)[i].tensor_count, local[i].tensor_count) << local[i].name;
      EXPECT_EQ((*other)[i].total_bytes, local[i].total_bytes) << local[i].name;
      EXPECT_EQ((*other)[i].metadata, local[i].metadata) << local[i].name;
    }
  }
}

TEST_F(StoreConformanceTest, EveryFixtureServesTheSameBytesEverywhere) {
  const auto attached = [] {
    return testing::MetricValue(daemon_->metrics_port(), "weightstore_data_lane_connections_total",
                                {"outcome=\"attached\""});
  };
  const double attached_before = attached();
  int served = 0;
  for (const std::string& name : Names()) {
    const Outcome local = ExpectAllStoresAgree(name, {}, "everything");
    EXPECT_OK(local.fetch_status) << name;
    served += local.fetch_status.ok() && !local.tensors.empty();
  }
  EXPECT_GE(served, 40);
  EXPECT_GE(compared_tensors_, 100u);
  // The lane's store did not quietly fetch over gRPC: a lane for every fetch.
  EXPECT_GE(attached() - attached_before, served);
}

// The stores that copy in batches (local files, the socket) begin no more
// tensors than the sink lets open, end them in order, and write the same
// bytes whatever it lets: one at a time, a few, or (FetchAll's sink) many.
TEST_F(StoreConformanceTest, ACopyingFetchKeepsToTheSinksOpenAheadAndEndsInBeginsOrder) {
  size_t batched = 0;
  for (const std::string& name : Names()) {
    absl::StatusOr<std::vector<SharedTensor>> want = local_->FetchAll(name, {});
    if (!want.ok()) continue;
    for (const size_t open_ahead : {size_t{1}, size_t{3}}) {
      for (Store* store : std::initializer_list<Store*>{local_.get(), socket_store_.get()}) {
        SCOPED_TRACE(absl::StrCat(name, ", open ahead ", open_ahead, ", ", store == local_.get() ? "local" : "socket"));
        OpenAheadSink sink(open_ahead);
        ASSERT_OK(store->FetchTensors(name, {}, &sink));
        EXPECT_TRUE(sink.in_order());
        EXPECT_LE(sink.most_open(), open_ahead);
        batched += sink.most_open() > 1;
        ASSERT_EQ(sink.tensors().size(), want->size());
        for (size_t i = 0; i < want->size(); ++i) {
          EXPECT_EQ(sink.tensors()[i].spec.name, (*want)[i].spec.name);
          EXPECT_EQ(sink.tensors()[i].bytes.view(), (*want)[i].bytes.view()) << (*want)[i].spec.name;
        }
      }
    }
  }
  EXPECT_GE(batched, 20u) << "most fixtures have several tensors, begun together";
}

TEST_F(StoreConformanceTest, EveryFixtureCastsTheSameEverywhere) {
  for (DType dtype : {DType::kF16, DType::kBF16, DType::kF64}) {
    Query query;
    query.selection.dtype = dtype;
    int cast = 0;
    for (const std::string& name : Names()) {
      const Outcome local = ExpectAllStoresAgree(name, query, absl::StrCat("cast to ", DTypeName(dtype)));
      for (const SharedTensor& t : local.tensors) cast += t.spec.dtype == dtype;
    }
    EXPECT_GE(cast, 50) << DTypeName(dtype);
  }
}

TEST_F(StoreConformanceTest, FiltersAndRenamesAgree) {
  Query query;
  query.selection.include = {"weight", "running_"};
  query.selection.exclude = {"bias"};
  query.selection.renames = {{"^(.*)\\.weight$", "$1.w"}, {"running_", "r_"}};
  for (const std::string& name : Names()) ExpectAllStoresAgree(name, query, "include, exclude, rename");
  Query paths;
  paths.selection.paths = {"fc1.weight", "conv.bias", "no.such.tensor"};
  for (const std::string& name : Names()) ExpectAllStoresAgree(name, paths, "exact paths");
}

TEST_F(StoreConformanceTest, ATargetSchemaWithTheAdapterAppliesTheSameEverywhere) {
  for (const char* model : {"linear", "batch_norm", "conv2d", "layer_norm", "group_norm"}) {
    ASSERT_OK_AND_ASSIGN(TargetSchema schema,
                         TargetSchema::Load(absl::StrCat(testing::TestDataDir(), "/schemas/", model, ".json")));
    for (Adapter adapter : {Adapter::kPyTorchToBurn, Adapter::kNone}) {
      Query query;
      query.target = schema;
      query.selection.adapter = adapter;
      query.allow_partial = true;
      const std::string file = model == std::string("batch_norm") ? "batch_norm2d" : model;
      const Outcome local = ExpectAllStoresAgree(absl::StrCat("pytorch-models/", file), query,
                                                 absl::StrCat("target ", model, ", adapter ", AdapterName(adapter)));
      if (adapter == Adapter::kPyTorchToBurn) {
        ASSERT_TRUE(local.listing.apply_result.has_value()) << model << ": " << local.list_status;
        EXPECT_FALSE(local.listing.apply_result->applied.empty()) << model;
        EXPECT_OK(local.fetch_status) << model;
      }
      query.allow_partial = false;
      ExpectAllStoresAgree(absl::StrCat("pytorch-models/", file), query,
                           absl::StrCat("strict target ", model, ", adapter ", AdapterName(adapter)));
    }
  }
}

TEST_F(StoreConformanceTest, TopLevelKeysAndContiguousIndicesAgree) {
  Query top;
  top.selection.top_level_key = "model_state_dict";
  ExpectAllStoresAgree("pytorch-models/top_level_key", top, "top-level key");
  Query missing_key;
  missing_key.selection.top_level_key = "no_such_key";
  EXPECT_FALSE(
      ExpectAllStoresAgree("pytorch-models/top_level_key", missing_key, "a missing top-level key").list_status.ok());
  Query contiguous;
  contiguous.selection.contiguous_indices = true;
  ExpectAllStoresAgree("pytorch-models/non_contiguous_indexes", contiguous, "contiguous indices");
}

TEST_F(StoreConformanceTest, VersionPinsAgree) {
  for (const char* name : {"safetensors/multi_layer", "burnpack/mnist", "pytorch-reader/float32"}) {
    // Each store's own current version pins: the daemon's content id (the same
    // through gRPC and the socket), the local store's file id.
    ASSERT_OK_AND_ASSIGN(auto served, remote_->GetCheckpoint(name));
    ASSERT_OK_AND_ASSIGN(auto mapped, socket_store_->GetCheckpoint(name));
    EXPECT_EQ(mapped.version, served.version);
    EXPECT_EQ(served.version.size(), 32u);
    for (client::Store* store :
         std::initializer_list<client::Store*>{local_.get(), remote_.get(), socket_store_.get()}) {
      ASSERT_OK_AND_ASSIGN(auto summary, store->GetCheckpoint(name));
      Query pinned;
      pinned.version = summary.version;
      EXPECT_OK(Ask(*store, name, pinned).fetch_status) << name << " pinned to " << summary.version;
    }
    Query stale;
    stale.version = "0123456789abcdef";
    EXPECT_EQ(ExpectAllStoresAgree(name, stale, "pinned to a version that is not served").fetch_status.code(),
              absl::StatusCode::kAborted);
  }
}

TEST_F(StoreConformanceTest, ErrorsHaveTheSameCodesEverywhere) {
  EXPECT_EQ(ExpectAllStoresAgree("no/such/checkpoint", {}, "an unknown checkpoint").list_status.code(),
            absl::StatusCode::kNotFound);
  Query bad_regex;
  bad_regex.selection.include = {"(unclosed"};
  EXPECT_EQ(ExpectAllStoresAgree("safetensors/multi_layer", bad_regex, "an invalid regex").list_status.code(),
            absl::StatusCode::kInvalidArgument);
  Query collision;
  collision.selection.renames = {{".*", "same"}};
  EXPECT_EQ(
      ExpectAllStoresAgree("safetensors/multi_layer", collision, "two tensors renamed to one name").list_status.code(),
      absl::StatusCode::kInvalidArgument);
  Query bad_rename;
  bad_rename.selection.renames = {{"[z-a]", "x"}};
  EXPECT_EQ(ExpectAllStoresAgree("safetensors/multi_layer", bad_rename, "a rename pattern that does not compile")
                .list_status.code(),
            absl::StatusCode::kInvalidArgument);
  Query missing_target;
  ASSERT_OK_AND_ASSIGN(missing_target.target,
                       TargetSchema::FromJson(R"({"parameters": [{"path": "no.such", "shape": [1]}]})", "test"));
  EXPECT_FALSE(ExpectAllStoresAgree("safetensors/multi_layer", missing_target, "a target nothing in the file fits")
                   .list_status.ok());
  // Issue 26, finding 11: shard rules. 0 fused parts is one part, as the API's
  // ShardRule.parts says (proto3 cannot tell 0 from unset), on every store.
  auto sharded = [](uint32_t rank, uint32_t world, ShardSplit split) {
    Query q;
    q.selection.shard = {.rank = rank, .world_size = world, .rules = {{"\\.weight$", split}}};
    return q;
  };
  const Outcome zero_parts =
      ExpectAllStoresAgree("safetensors/multi_layer", sharded(0, 2, {.dim = 0, .parts = 0, .uneven = true}), "0 parts");
  EXPECT_OK(zero_parts.fetch_status);
  const Outcome one_part =
      ExpectAllStoresAgree("safetensors/multi_layer", sharded(0, 2, {.dim = 0, .parts = 1, .uneven = true}), "1 part");
  ASSERT_EQ(zero_parts.tensors.size(), one_part.tensors.size());
  for (size_t i = 0; i < one_part.tensors.size(); ++i) {
    EXPECT_EQ(zero_parts.tensors[i].bytes.view(), one_part.tensors[i].bytes.view());
  }
  EXPECT_EQ(ExpectAllStoresAgree("safetensors/multi_layer", sharded(0, 2, {.dim = 0, .parts = 65}), "65 parts")
                .list_status.code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ExpectAllStoresAgree("safetensors/multi_layer", sharded(0, 2, {.dim = 99}), "dimension 99").list_status.code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      ExpectAllStoresAgree("safetensors/multi_layer", sharded(2, 2, {.dim = 0}), "rank 2 of 2").list_status.code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightstore
