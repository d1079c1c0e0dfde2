#include "client/updates.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "client/device_patches.h"
#include "core/catalog/manifest.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/host_buffer.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/scripted_socket.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/shm.pb.h"

namespace weightstore::client {
namespace {

namespace pb = ::weightstore::v1;
using ::testing::HasSubstr;
using ::weightstore::testing::ScriptedSocket;
using ::weightstore::testing::StatusIs;

// A patch of a U8 [8] tensor from `before` to `after`, as received.
ReceivedPatch PatchOf(const std::string& name, const std::string& before, const std::string& after) {
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  return {{name, DType::kU8, {before.size()}},
          DigestBytes(bytes(after)).Hex(),
          *DiffElements(bytes(before), bytes(after), 1)};
}

TEST(ApplyReceivedPatchesTest, AppliesEveryPatchAndChecksEachResultsDigest) {
  std::string a = "abcdefgh", b = "ABCDEFGH";
  const std::vector<ReceivedPatch> patches = {PatchOf("a", a, "abcXefgh"), PatchOf("b", b, "ABCDEFGY")};
  std::vector<std::span<std::byte>> destinations = {std::as_writable_bytes(std::span(a.data(), a.size())),
                                                    std::as_writable_bytes(std::span(b.data(), b.size()))};
  ASSERT_OK(ApplyReceivedPatches(patches, destinations));
  EXPECT_EQ(a, "abcXefgh");
  EXPECT_EQ(b, "ABCDEFGY");
  // Held bytes that are not the since version's: written, and the digest says so.
  std::string c = "zbcdefgh";
  std::vector<std::span<std::byte>> other = {std::as_writable_bytes(std::span(c.data(), c.size()))};
  EXPECT_THAT(ApplyReceivedPatches(std::span(patches).first(1), other),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'a' patched has digest")));
}

TEST(ApplyReceivedPatchesTest, PatchesIntoSharedMemoryAreRefusedBeforeAnythingIsWritten) {
  std::string tied = "abcdefgh";  // one storage held under two names
  const std::vector<ReceivedPatch> patches = {PatchOf("wte", tied, "abcXefgh"), PatchOf("lm_head", tied, "abcYefgh")};
  auto whole = std::as_writable_bytes(std::span(tied.data(), tied.size()));
  std::vector<std::span<std::byte>> destinations = {whole, whole};
  EXPECT_THAT(ApplyReceivedPatches(patches, destinations),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("share memory")));
  EXPECT_EQ(tied, "abcdefgh");
}

SharedTensor U8(const std::string& name, const std::string& bytes) {
  return {{name, DType::kU8, {bytes.size()}}, SharedBytes::Copy(bytes)};
}

// A listing of `tensors` as a daemon with digests serves them.
TensorListing Served(const std::vector<SharedTensor>& tensors) {
  TensorListing listing;
  listing.version = "v1";
  for (const SharedTensor& t : tensors) {
    TensorDescription d;
    d.spec = t.spec;
    d.digest = DigestBytes(t.bytes.span()).Hex();
    listing.tensors.push_back(d);
  }
  return listing;
}

TEST(PlanPushTest, UnchangedTensorsStayChangedOnesGoAsPatchesAgainstTheBaseOrWholeAndTheGoneAreRemoved) {
  const std::string a(4096, 'a'), b(4096, 'b');
  std::string a2 = a, b2 = b;
  a2[100] = 'x';
  b2[7] = 'y';
  const std::vector<SharedTensor> v1 = {U8("same", "unchanged"), U8("a", a), U8("b", b), U8("gone", "x"),
                                        U8("redefined", "xy")};
  // The trainer's base holds "a" as served, and "b" otherwise (a stale copy).
  const std::vector<SharedTensor> base = {U8("a", a), U8("b", b2)};
  const std::vector<SharedTensor> v2 = {U8("same", "unchanged"), U8("a", a2), U8("b", b2), U8("new", "n"),
                                        U8("redefined", "xyz")};
  ASSERT_OK_AND_ASSIGN(PushPlan plan, PlanPush(Served(v1), v2, base));
  EXPECT_TRUE(plan.digests);
  EXPECT_EQ(plan.unchanged, 1u);
  EXPECT_EQ(plan.request.base_version, "v1");
  ASSERT_EQ(plan.request.patched.size(), 1u);
  const PushRequest::Patched& p = plan.request.patched[0];
  EXPECT_EQ(p.spec.name, "a");
  EXPECT_EQ(p.base_digest, DigestBytes(std::as_bytes(std::span(a.data(), a.size()))).Hex());
  EXPECT_EQ(p.digest, DigestBytes(std::as_bytes(std::span(a2.data(), a2.size()))).Hex());
  std::string patched = a;
  ASSERT_OK(ApplyPatch(p.patch, std::as_writable_bytes(std::span(patched.data(), patched.size()))));
  EXPECT_EQ(patched, a2);
  EXPECT_EQ(plan.patch_bytes, p.patch.body.size());
  std::vector<std::string> whole;
  for (const SharedTensor& t : plan.request.tensors) whole.push_back(t.spec.name);
  EXPECT_THAT(whole, ::testing::ElementsAre("b", "new", "redefined"));
  EXPECT_EQ(plan.whole_bytes, b2.size() + 1 + 3);
  EXPECT_THAT(plan.request.remove, ::testing::UnorderedElementsAre("redefined", "gone"));
  EXPECT_TRUE(plan.request.allow_new_tensors);

  // A patch past the bound goes whole; without digests, everything does.
  ASSERT_OK_AND_ASSIGN(plan, PlanPush(Served(v1), v2, base, /*max_patch_bytes=*/1));
  EXPECT_TRUE(plan.request.patched.empty());
  TensorListing no_digests = Served(v1);
  for (TensorDescription& d : no_digests.tensors) d.digest.clear();
  ASSERT_OK_AND_ASSIGN(plan, PlanPush(no_digests, v2, base));
  EXPECT_FALSE(plan.digests);
  EXPECT_EQ(plan.request.tensors.size(), v2.size());
  EXPECT_THAT(PlanPush(Served(v1), std::vector<SharedTensor>{U8("a", a), U8("a", a2)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' is given twice")));
  SharedTensor short_one = U8("a", a);
  short_one.spec.shape = {5000};
  EXPECT_THAT(
      PlanPush(Served(v1), std::vector<SharedTensor>{short_one}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' has 4096 bytes; its shape needs 5000")));
}

TEST(DevicePatchesTest, DestinationsAreCheckedBeforeAnyGpuIsAsked) {
  std::string tied = "abcdefgh";
  const std::vector<ReceivedPatch> patches = {PatchOf("wte", tied, "abcXefgh"), PatchOf("lm_head", tied, "abcYefgh")};
  std::vector<void*> one = {tied.data()};
  EXPECT_THAT(ApplyReceivedPatchesOnDevice(patches, one),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 patches for 1 destinations")));
  std::vector<void*> same = {tied.data(), tied.data() + 4};  // overlapping ranges
  EXPECT_THAT(ApplyReceivedPatchesOnDevice(patches, same),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("share device memory")));
  ReceivedPatch wrong = patches[0];
  wrong.spec.shape = {16};
  std::vector<void*> first = {tied.data()};
  EXPECT_THAT(ApplyReceivedPatchesOnDevice(std::span(&wrong, 1), first),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the patch of tensor 'wte' is for 8 bytes, the tensor holds 16")));
  EXPECT_EQ(tied, "abcdefgh");
}

// An answer mapping tensor "w" (U8 [64], changed since "v1") as a patch of
// `patch_bytes` bytes at `offset` of a 4096-byte segment.
pb::ShmResponse PatchAnswer(uint32_t element_size, uint64_t patch_bytes, uint64_t offset) {
  pb::ShmResponse response;
  pb::MapTensorsResponse* map = response.mutable_map_tensors();
  map->set_name("m");
  map->set_version("v2");
  pb::Segment* segment = map->add_segments();
  segment->set_kind(pb::Segment::SEALED_MEMFD);
  segment->set_size(4096);
  pb::MappedTensor* t = map->add_tensors();
  pb::TensorInfo* info = t->mutable_info();
  info->set_name("w");
  info->set_dtype("U8");
  info->add_shape(64);
  info->set_byte_size(64);
  info->set_digest(std::string(32, '0'));
  pb::TensorPatch* patch = info->mutable_patch();
  patch->set_encoding("positions");
  patch->set_element_size(element_size);
  patch->set_changed_elements(1);
  patch->set_patch_bytes(patch_bytes);
  t->set_segment(0);
  t->set_offset(offset);
  map->mutable_delta()->set_since_version("v1");
  map->mutable_delta()->set_delta(true);
  return response;
}

absl::Status MapFrom(const pb::ShmResponse& answer, bool patches) {
  ScriptedSocket daemon({{answer, std::string(4096, '\0')}});
  absl::StatusOr<std::unique_ptr<SharedMemoryStore>> store = ConnectSharedMemoryStore(daemon.path());
  if (!store.ok()) return store.status();
  Query query;
  query.since_version = "v1";
  query.patches = patches;
  absl::StatusOr<MappedTensors> mapped = (*store)->MapTensors("m", query);
  if (!mapped.ok()) return mapped.status();
  if (mapped->patches.size() != 1 ||
      mapped->patches[0].patch.body.size() != answer.map_tensors().tensors(0).info().patch().patch_bytes()) {
    return absl::InternalError("the patch was not mapped as sent");
  }
  return absl::OkStatus();
}

TEST(SocketPatchesTest, ASocketPatchIsMappedFromItsSegmentAndBadOnesAreRefusedNamingTheTensor) {
  EXPECT_OK(MapFrom(PatchAnswer(1, 2, 128), /*patches=*/true));
  EXPECT_THAT(MapFrom(PatchAnswer(1, 2, 128), /*patches=*/false),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w' came as an element patch, unasked")));
  EXPECT_THAT(MapFrom(PatchAnswer(2, 2, 128), true),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("invalid patch of tensor 'w': elements of 2 bytes")));
  // Never as large as the tensor: a patch costs less than what it replaces.
  EXPECT_THAT(MapFrom(PatchAnswer(1, 64, 128), true),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("invalid patch of tensor 'w': 64 bytes")));
  EXPECT_THAT(MapFrom(PatchAnswer(1, 60, 4090), true),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("the patch of tensor 'w' lies outside segment 0")));
  pb::ShmResponse unsealed = PatchAnswer(1, 2, 128);  // a file anyone may write
  unsealed.mutable_map_tensors()->mutable_segments(0)->set_kind(pb::Segment::FILE);
  EXPECT_THAT(MapFrom(unsealed, true), StatusIs(absl::StatusCode::kDataLoss,
                                                HasSubstr("the patch of tensor 'w' lies in segment 0, which is not")));
  pb::ShmResponse unknown = PatchAnswer(1, 2, 128);
  unknown.mutable_map_tensors()->mutable_tensors(0)->mutable_info()->mutable_patch()->set_encoding("xor+zstd");
  EXPECT_THAT(MapFrom(unknown, true), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("unknown encoding 'xor+zstd'")));
}

TEST(SocketPatchesTest, HeldMemoryPatchedInPlaceBeforeTheUpdateFailsIsNoLongerCalledItsVersion) {
  const std::string before(64, 'a');
  std::string after = before;
  after[5] = 'b';
  // Held as an update holds it: memory the held set alone references.
  ASSERT_OK_AND_ASSIGN(HostBuffer buffer, HostBuffer::Allocate(before.size()));
  std::memcpy(buffer.data(), before.data(), before.size());
  HeldTensors held{"v1", {{{"w", DType::kU8, {64}}, std::move(buffer).Freeze()}}, SelectionKey({})};
  // The daemon sends a patch whose result it lists with another digest (the
  // patch is written, then refused), then fails the whole fetch that follows.
  auto span = [](const std::string& b) { return std::as_bytes(std::span(b.data(), b.size())); };
  const std::optional<ElementPatch> patch = DiffElements(span(before), span(after), 1);
  ASSERT_TRUE(patch.has_value());
  ASSERT_EQ(patch->encoding, PatchEncoding::kPositions);
  std::string segment(4096, '\0');
  segment.replace(128, patch->body.size(), std::string(patch->body.view()));
  pb::ShmResponse failed;
  failed.set_code(static_cast<int>(absl::StatusCode::kUnavailable));
  failed.set_message("the daemon is going away");
  ScriptedSocket daemon({{PatchAnswer(1, patch->body.size(), 128), segment}, {failed, ""}});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedMemoryStore> store, ConnectSharedMemoryStore(daemon.path()));
  EXPECT_THAT(UpdateTensors(*store, "m", {}, &held).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("going away")));
  EXPECT_EQ(held.tensors[0].bytes.view(), after);  // written in place
  EXPECT_EQ(held.version, "");                     // so no version names these bytes: the next update is full
}

// Two patches of one name (or any patch unlike the listing) are the
// daemon's lie: refused before a byte is written, held memory and version
// untouched.
TEST(SocketPatchesTest, TwoPatchesOfOneTensorAreRefusedBeforeAnythingIsWritten) {
  const std::string before(64, 'a');
  std::string after = before;
  after[5] = 'b';
  HeldTensors held{"v1", {{{"w", DType::kU8, {64}}, SharedBytes::Copy(before)}}, SelectionKey({})};
  const SharedBytes kept = held.tensors[0].bytes;  // shared: patches go into copies
  auto span = [](const std::string& b) { return std::as_bytes(std::span(b.data(), b.size())); };
  const std::optional<ElementPatch> patch = DiffElements(span(before), span(after), 1);
  ASSERT_TRUE(patch.has_value());
  std::string segment(4096, '\0');
  segment.replace(128, patch->body.size(), std::string(patch->body.view()));
  pb::ShmResponse twice = PatchAnswer(1, patch->body.size(), 128);
  *twice.mutable_map_tensors()->add_tensors() = twice.map_tensors().tensors(0);
  ScriptedSocket daemon({{twice, segment}});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SharedMemoryStore> store, ConnectSharedMemoryStore(daemon.path()));
  EXPECT_THAT(UpdateTensors(*store, "m", {}, &held).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("the daemon sent tensor 'w' twice")));
  EXPECT_EQ(held.version, "v1");
  EXPECT_EQ(held.tensors[0].bytes.view(), before);
  EXPECT_EQ(kept.view(), before);
}

// A store that forwards to a real one and counts the listings and fetches
// asked of it.
class CountingStore : public Store {
 public:
  explicit CountingStore(std::unique_ptr<Store> inner) : inner_(std::move(inner)) {}
  using Store::GetCheckpoint;
  using Store::ListCheckpoints;
  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    return inner_->ListCheckpoints(cancel);
  }
  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name,
                                                  const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    return inner_->GetCheckpoint(name, cancel);
  }
  absl::StatusOr<TensorListing> ListTensors(const std::string& name, const Query& query) override {
    ++listings;
    return inner_->ListTensors(name, query);
  }
  absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) override {
    ++fetches;
    return inner_->FetchTensors(name, query, sink);
  }

  int listings = 0, fetches = 0;

 private:
  std::unique_ptr<Store> inner_;
};

// A local store of checkpoint "m": "a" (U8 [3000]) and "b" (F32 [250]),
// 4,000 bytes in all.
std::unique_ptr<CountingStore> StoreOfFourThousandBytes() {
  const std::string models = testing::MakeScratchDir("fetch-changed");
  std::string b(1000, '\0');
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i * 7);
  const std::vector<SharedTensor> tensors = {U8("a", std::string(3000, 'a')),
                                             {{"b", DType::kF32, {250}}, SharedBytes::Copy(b)}};
  testing::WriteFileOrDie(models + "/m.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  absl::StatusOr<std::unique_ptr<Store>> local = OpenLocalStore(models);
  EXPECT_TRUE(local.ok()) << local.status();
  return local.ok() ? std::make_unique<CountingStore>(*std::move(local)) : nullptr;
}

TEST(FetchChangedTest, FetchChangedRefusesMoreThanItsBoundBeforeFetching) {
  std::unique_ptr<CountingStore> store = StoreOfFourThousandBytes();
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(FetchChanged(*store, "m", {}, /*max_bytes=*/3999),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("'m' lists more than 3999 bytes")));
  EXPECT_EQ(store->listings, 1);
  EXPECT_EQ(store->fetches, 0) << "refused after fetching";
  // A bound of every listed byte, exactly, takes them all.
  ASSERT_OK_AND_ASSIGN(ChangedTensors changed, FetchChanged(*store, "m", {}, /*max_bytes=*/4000));
  EXPECT_EQ(store->fetches, 1);
  ASSERT_EQ(changed.received.size(), 2u);
  EXPECT_EQ(changed.listed.size(), 2u);
  EXPECT_EQ(changed.received[0].bytes.size() + changed.received[1].bytes.size(), 4000u);
  EXPECT_FALSE(changed.version.empty());
  // Unbounded (the default), the same.
  ASSERT_OK_AND_ASSIGN(changed, FetchChanged(*store, "m", {}));
  EXPECT_EQ(changed.received.size(), 2u);
}

TEST(FetchChangedTest, FetchChangedBoundsOnlyTheSelectedTensors) {
  std::unique_ptr<CountingStore> store = StoreOfFourThousandBytes();
  ASSERT_NE(store, nullptr);
  Query only_b;
  only_b.selection.paths = {"b"};
  EXPECT_THAT(FetchChanged(*store, "m", only_b, /*max_bytes=*/999),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("lists more than 999 bytes")));
  EXPECT_EQ(store->fetches, 0);
  ASSERT_OK_AND_ASSIGN(ChangedTensors changed, FetchChanged(*store, "m", only_b, /*max_bytes=*/1000));
  ASSERT_EQ(changed.received.size(), 1u);
  EXPECT_EQ(changed.received[0].spec.name, "b");
}

TEST(FetchChangedTest, AStoreThatCannotTellWhatChangedHasEveryTensorCountedAgainstTheBound) {
  std::unique_ptr<CountingStore> store = StoreOfFourThousandBytes();
  ASSERT_NE(store, nullptr);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary summary, store->GetCheckpoint("m"));
  Query since;
  since.since_version = summary.version;  // held, but a local store lists every tensor as changed
  EXPECT_THAT(FetchChanged(*store, "m", since, /*max_bytes=*/3999),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("lists more than 3999 bytes")));
  EXPECT_EQ(store->fetches, 0);
  ASSERT_OK_AND_ASSIGN(ChangedTensors changed, FetchChanged(*store, "m", since, /*max_bytes=*/4000));
  EXPECT_FALSE(changed.delta);
  EXPECT_EQ(changed.received.size(), 2u);
}

}  // namespace
}  // namespace weightstore::client
