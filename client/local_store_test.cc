// The `file:` store's fetch into owned memory: large tensors are copied in
// pieces on several threads (client/local_store.cc); the bytes must be the
// same as the file's, cast or not, whatever the piece boundaries. And a
// fetch into the caller's own memory (PlacingSink), which can drop the
// file's pages once copied.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/select/dtype_cast.h"
#include "core/status_macros.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::client {
namespace {

// F32 values that no cast rounds the same way twice in a row.
std::vector<std::byte> Values(size_t elements, int seed) {
  std::vector<std::byte> bytes(elements * 4);
  for (size_t k = 0; k < elements; ++k) {
    const float v = static_cast<float>(static_cast<int>((k * 2654435761u + seed) % 20011) - 10005) * 1.37e-3f;
    std::memcpy(bytes.data() + 4 * k, &v, 4);
  }
  return bytes;
}

TEST(LocalStoreCopyTest, LargeTensorsComeByteForByteOnSeveralThreadsCastOrNot) {
  // Several copying threads whatever this machine has (read once, at the
  // first fetch of the process).
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  const std::string dir = testing::MakeScratchDir("local-store-copy");
  // 9 MiB + 12 bytes (pieces of 4 MiB and a short last one), 24 MiB, and a
  // small one copied whole.
  const std::vector<size_t> elements = {(9u << 18) + 3, 6u << 20, 1000};
  std::vector<SharedTensor> tensors;
  for (size_t i = 0; i < elements.size(); ++i) {
    tensors.push_back({{absl::StrCat("t", i), DType::kF32, {elements[i]}},
                       SharedBytes::FromVector(Values(elements[i], static_cast<int>(i)))});
  }
  testing::WriteFileOrDie(dir + "/m.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> store, OpenLocalStore(dir));

  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> same, store->FetchAll("m", {}));
  ASSERT_EQ(same.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(same[i].spec.name, tensors[i].spec.name);
    EXPECT_TRUE(same[i].bytes.view() == tensors[i].bytes.view()) << tensors[i].spec.name;
  }

  Query cast;
  cast.selection.dtype = DType::kBF16;
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> halves, store->FetchAll("m", cast));
  ASSERT_EQ(halves.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<std::byte> want(elements[i] * 2);
    CastElements(DType::kF32, tensors[i].bytes.data(), DType::kBF16, want.data(), elements[i]);
    EXPECT_EQ(halves[i].spec.dtype, DType::kBF16);
    ASSERT_EQ(halves[i].bytes.size(), want.size());
    EXPECT_EQ(std::memcmp(halves[i].bytes.data(), want.data(), want.size()), 0) << tensors[i].spec.name;
  }

  // A cancelled fetch stops, naming where.
  auto cancel = std::make_shared<std::atomic<bool>>(true);
  Query cancelled;
  cancelled.cancel = cancel;
  EXPECT_THAT(store->FetchAll("m", cancelled).status(), testing::StatusIs(absl::StatusCode::kCancelled));
}

// Bytes of this process's mappings of files whose path ends with `suffix`
// that are resident (/proc/self/smaps).
uint64_t ResidentBytesOfFile(const std::string& suffix) {
  std::ifstream smaps("/proc/self/smaps");
  uint64_t total = 0;
  bool ours = false;
  for (std::string line; std::getline(smaps, line);) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
        line.find(':') > line.find(' ')) {
      ours = line.size() >= suffix.size() && line.compare(line.size() - suffix.size(), suffix.size(), suffix) == 0;
    } else if (ours && line.rfind("Rss:", 0) == 0) {
      total += std::stoull(line.substr(4)) * 1024;
    }
  }
  return total;
}

TEST(PlacingSinkTest, WritesEachTensorIntoItsPlaceAndCollectsTheRestDroppingTheFilesPages) {
  const std::string dir = testing::MakeScratchDir("placing-sink");
  const std::vector<size_t> elements = {6u << 20, 1000, 5000};  // 24 MiB, and two small ones
  std::vector<SharedTensor> tensors;
  for (size_t i = 0; i < elements.size(); ++i) {
    tensors.push_back({{absl::StrCat("t", i), DType::kF32, {elements[i]}},
                       SharedBytes::FromVector(Values(elements[i], static_cast<int>(i) + 7))});
  }
  testing::WriteFileOrDie(dir + "/placed.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> store, OpenLocalStore(dir));

  // Copied without release: the file stays mapped in this process.
  ASSERT_OK(store->FetchAll("placed", {}).status());
  EXPECT_GE(ResidentBytesOfFile("/placed.safetensors"), elements[0] * 4);

  // t0 has its place; t1's place is of another dtype, so it is collected;
  // t2 has none.
  std::vector<std::byte> t0(elements[0] * 4), t1(elements[1] * 2);
  absl::flat_hash_map<std::string, PlacingSink::Place> places;
  places["t0"] = {DType::kF32, {elements[0]}, t0};
  places["t1"] = {DType::kBF16, {elements[1]}, t1};
  PlacingSink sink(std::move(places));
  Query query;
  query.release_source_pages = true;
  ASSERT_OK(store->FetchTensors("placed", query, &sink));
  EXPECT_THAT(sink.placed(), ::testing::ElementsAre("t0"));
  EXPECT_TRUE(sink.written_any());
  EXPECT_EQ(std::memcmp(t0.data(), tensors[0].bytes.data(), t0.size()), 0);
  EXPECT_TRUE(std::all_of(t1.begin(), t1.end(), [](std::byte b) { return b == std::byte{0}; }));
  ASSERT_EQ(sink.rest().tensors().size(), 2u);
  EXPECT_EQ(sink.rest().tensors()[0].spec.name, "t1");
  EXPECT_TRUE(sink.rest().tensors()[0].bytes.view() == tensors[1].bytes.view());
  EXPECT_EQ(sink.rest().tensors()[1].spec.name, "t2");
  EXPECT_TRUE(sink.rest().tensors()[1].bytes.view() == tensors[2].bytes.view());
  EXPECT_FALSE(sink.rest().version().empty());
  // The pages the copies read were dropped as they went. Some may be mapped
  // again: a read next to a dropped piece maps the page cache's folio around
  // it (up to 2 MiB) whole, so up to 2 MiB per 4 MiB piece's boundary.
  EXPECT_LT(ResidentBytesOfFile("/placed.safetensors"), elements[0] * 4 / 2);

  // A cancelled fetch writes nothing.
  std::vector<std::byte> untouched(elements[0] * 4);
  absl::flat_hash_map<std::string, PlacingSink::Place> again;
  again["t0"] = {DType::kF32, {elements[0]}, untouched};
  PlacingSink cancelled(std::move(again), std::make_shared<std::atomic<bool>>(true));
  EXPECT_THAT(store->FetchTensors("placed", {}, &cancelled), testing::StatusIs(absl::StatusCode::kCancelled));
  EXPECT_FALSE(cancelled.written_any());
}

// Bytes `b` of `size`, as a view to write into a span.
std::string Filled(size_t size, char b) { return std::string(size, b); }

void Write(absl::StatusOr<std::span<std::byte>> out, char b) {
  ASSERT_OK(out.status());
  std::memset(out->data(), b, out->size());
}

TEST(CollectingSinkTest, ATensorBegunAgainReplacesTheOneItBeganAndEndsInBeginsOrder) {
  const TensorSpec a{"a", DType::kU8, {3}}, b{"b", DType::kU8, {5}}, c{"c", DType::kU8, {2}};
  CollectingSink sink;
  Write(sink.Begin(a), 'x');
  Write(sink.Begin(b), 'y');  // open ahead
  // Restarts come with one tensor open (a stream's); a store that begins
  // ahead never restarts one.
  EXPECT_THAT(sink.Begin(b).status(), testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK(sink.End(a));
  Write(sink.Begin(b), 'b');  // b's transfer restarted: its first buffer is abandoned
  Write(sink.Begin(c), 'c');
  EXPECT_THAT(sink.End(c), testing::StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("'c'")));
  ASSERT_OK(sink.End(b));
  ASSERT_OK(sink.End(c));
  ASSERT_EQ(sink.tensors().size(), 3u);
  EXPECT_EQ(sink.tensors()[0].bytes.view(), Filled(3, 'x'));
  EXPECT_EQ(sink.tensors()[1].bytes.view(), Filled(5, 'b'));
  EXPECT_EQ(sink.tensors()[2].bytes.view(), Filled(2, 'c'));

  // A patch restarted as a patch, or as the whole tensor; none while another
  // tensor is open.
  CollectingSink patches(nullptr, /*take_patches=*/true);
  ElementPatch header;
  Write(patches.BeginPatch(a, header, 2, "d"), 'p');
  Write(patches.BeginPatch(a, header, 2, "d"), 'q');
  ASSERT_OK(patches.EndPatch(a));
  Write(patches.BeginPatch(b, header, 2, "d"), 'p');
  Write(patches.Begin(b), 'w');  // sent whole after all
  ASSERT_OK(patches.End(b));
  Write(patches.Begin(c), 'c');
  EXPECT_THAT(patches.BeginPatch(a, header, 1, "d"), testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_EQ(patches.patches().size(), 1u);
  EXPECT_EQ(patches.patches()[0].patch.body.view(), Filled(2, 'q'));
  ASSERT_EQ(patches.tensors().size(), 1u);
  EXPECT_EQ(patches.tensors()[0].bytes.view(), Filled(5, 'w'));
}

TEST(PlacingSinkTest, ARestartTakesTheSamePlaceAndTiedPlacesAreWrittenByOneTensorAtMost) {
  const TensorSpec a{"a", DType::kU8, {4}}, tied{"tied", DType::kU8, {4}}, b{"b", DType::kU8, {4}};
  std::vector<std::byte> shared(4), own(4);
  absl::flat_hash_map<std::string, PlacingSink::Place> places;
  places["a"] = {DType::kU8, {4}, shared};
  places["tied"] = {DType::kU8, {4}, shared};  // a's memory under another name
  places["b"] = {DType::kU8, {4}, own};
  PlacingSink sink(std::move(places));
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> began, sink.Begin(a));
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> restarted, sink.Begin(a));
  EXPECT_EQ(restarted.data(), began.data());
  std::memset(restarted.data(), 'a', 4);
  // Open while a is: collected instead, for the caller to copy after.
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> collected, sink.Begin(tied));
  EXPECT_NE(collected.data(), shared.data());
  std::memset(collected.data(), 't', 4);
  Write(sink.Begin(b), 'b');
  ASSERT_OK(sink.End(a));
  ASSERT_OK(sink.End(tied));
  ASSERT_OK(sink.End(b));
  EXPECT_THAT(sink.placed(), ::testing::ElementsAre("a", "b"));
  ASSERT_EQ(sink.rest().tensors().size(), 1u);
  EXPECT_EQ(sink.rest().tensors()[0].spec.name, "tied");
  EXPECT_EQ(sink.rest().tensors()[0].bytes.view(), Filled(4, 't'));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(shared.data()), 4), Filled(4, 'a'));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(own.data()), 4), Filled(4, 'b'));
  // A third name over that memory, once a ended, is collected too: copied
  // after "tied", it is the last written, as one tensor at a time would
  // leave it.
  const TensorSpec third{"third", DType::kU8, {2}};
  absl::flat_hash_map<std::string, PlacingSink::Place> more;
  std::vector<std::byte> memory(8);
  more["first"] = {DType::kU8, {4}, std::span(memory).first(4)};
  more["second"] = {DType::kU8, {4}, std::span(memory).first(4)};
  more["third"] = {DType::kU8, {2}, std::span(memory).subspan(2, 2)};
  more["next"] = {DType::kU8, {4}, std::span(memory).subspan(4, 4)};  // adjacent: no overlap
  PlacingSink tied_thrice(std::move(more));
  const TensorSpec first{"first", DType::kU8, {4}}, second{"second", DType::kU8, {4}}, next{"next", DType::kU8, {4}};
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> out, tied_thrice.Begin(first));
  EXPECT_EQ(out.data(), memory.data());
  ASSERT_OK_AND_ASSIGN(out, tied_thrice.Begin(second));
  EXPECT_NE(out.data(), memory.data());
  ASSERT_OK_AND_ASSIGN(out, tied_thrice.Begin(next));
  EXPECT_EQ(out.data(), memory.data() + 4);
  ASSERT_OK(tied_thrice.End(first));
  ASSERT_OK(tied_thrice.End(second));
  ASSERT_OK(tied_thrice.End(next));
  ASSERT_OK_AND_ASSIGN(out, tied_thrice.Begin(third));
  EXPECT_NE(out.data(), memory.data() + 2);
  ASSERT_OK(tied_thrice.End(third));
  EXPECT_THAT(tied_thrice.placed(), ::testing::ElementsAre("first", "next"));
  ASSERT_EQ(tied_thrice.rest().tensors().size(), 2u);
  EXPECT_EQ(tied_thrice.rest().tensors()[0].spec.name, "second");
  EXPECT_EQ(tied_thrice.rest().tensors()[1].spec.name, "third");
}

// A store that begins tensors ahead never restarts one: the same name begun
// twice in a row while others are open is refused, and the buffers handed
// out for them stay (a forged answer once freed the first one's).
TEST(CollectingSinkTest, ATensorBegunTwiceWhileOthersAreOpenIsRefusedAndTheirBuffersKept) {
  const TensorSpec a{"a", DType::kU8, {4}}, x{"x", DType::kU8, {4}};
  CollectingSink collecting;
  ASSERT_OK(collecting.Begin(a).status());
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> first, collecting.Begin(x));
  EXPECT_THAT(collecting.Begin(x).status(), testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                              ::testing::HasSubstr("tensor 'x' begun twice in a row")));
  std::memset(first.data(), 'x', first.size());  // still the sink's (ASan: not freed)
  ASSERT_OK(collecting.End(a));
  ASSERT_OK(collecting.End(x));
  ASSERT_EQ(collecting.tensors().size(), 2u);
  EXPECT_EQ(collecting.tensors()[1].bytes.view(), "xxxx");

  std::vector<std::byte> place(4);
  absl::flat_hash_map<std::string, PlacingSink::Place> places;
  places["x"] = {DType::kU8, {4}, place};
  PlacingSink placing(std::move(places));
  ASSERT_OK(placing.Begin(a).status());
  ASSERT_OK(placing.Begin(x).status());
  EXPECT_THAT(placing.Begin(x).status(), testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                           ::testing::HasSubstr("tensor 'x' begun twice in a row")));
}

// What a fetch delivered, against its listing: every listed tensor once, as
// listed, placed or collected; anything else is DataLoss naming the tensor.
TEST(PlacingSinkTest, CheckDeliveredWantsEveryListedTensorOnceAsListed) {
  const TensorSpec a{"a", DType::kU8, {4}}, b{"b", DType::kU8, {2, 2}};
  TensorListing listing;
  listing.tensors.resize(2);
  listing.tensors[0].spec = a;
  listing.tensors[1].spec = b;
  auto fill = [](PlacingSink& sink, const std::vector<TensorSpec>& sent) -> absl::Status {
    for (const TensorSpec& spec : sent) {
      WEIGHTSTORE_RETURN_IF_ERROR(sink.Begin(spec).status());
      WEIGHTSTORE_RETURN_IF_ERROR(sink.End(spec));
    }
    return absl::OkStatus();
  };
  std::vector<std::byte> place(4);
  auto sink_with_a_place = [&] {
    absl::flat_hash_map<std::string, PlacingSink::Place> places;
    places["a"] = {DType::kU8, {4}, place};
    return std::make_unique<PlacingSink>(std::move(places));
  };
  {
    auto sink = sink_with_a_place();
    ASSERT_OK(fill(*sink, {a, b}));
    EXPECT_OK(sink->CheckDelivered(listing));
  }
  {
    auto sink = sink_with_a_place();
    ASSERT_OK(fill(*sink, {a}));
    EXPECT_THAT(sink->CheckDelivered(listing),
                testing::StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("ended without tensor 'b'")));
  }
  {
    auto sink = sink_with_a_place();
    ASSERT_OK(fill(*sink, {a, b, {"c", DType::kU8, {1}}}));
    EXPECT_THAT(sink->CheckDelivered(listing),
                testing::StatusIs(absl::StatusCode::kDataLoss,
                                  ::testing::HasSubstr("sent tensor 'c', which its listing does not name")));
  }
  {
    auto sink = sink_with_a_place();
    ASSERT_OK(fill(*sink, {a, b, b}));
    EXPECT_THAT(sink->CheckDelivered(listing),
                testing::StatusIs(absl::StatusCode::kDataLoss,
                                  ::testing::HasSubstr("sent tensor 'b', which its listing does not name, or twice")));
  }
  {
    auto sink = sink_with_a_place();  // b as a flat [4]: torch's copy_ would take it
    ASSERT_OK(fill(*sink, {a, {"b", DType::kU8, {4}}}));
    EXPECT_THAT(sink->CheckDelivered(listing),
                testing::StatusIs(absl::StatusCode::kDataLoss,
                                  ::testing::HasSubstr("tensor 'b' came as U8 [4], listed as U8 [2,2]")));
  }
}

}  // namespace
}  // namespace weightstore::client
