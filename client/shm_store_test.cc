// The socket store against answers a real daemon never gives: each is a
// named error, with nothing written past what the caller was handed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "client/store.h"
#include "core/crc32c.h"
#include "tests/util/scripted_socket.h"
#include "tests/util/status_matchers.h"

namespace weightstore::client {
namespace {

namespace pb = ::weightstore::v1;
using ::testing::HasSubstr;
using ::weightstore::testing::ScriptedSocket;
using ::weightstore::testing::StatusIs;

// An answer mapping U8 tensors (name, bytes, offset, CRC32C or none) out of
// one sealed 4096-byte segment.
struct Mapped {
  std::string name;
  uint64_t bytes = 0;
  uint64_t offset = 0;
  bool with_crc = true;
};
pb::ShmResponse Answer(const std::vector<Mapped>& tensors, const std::string& segment) {
  pb::ShmResponse response;
  pb::MapTensorsResponse* map = response.mutable_map_tensors();
  map->set_name("m");
  map->set_version("v1");
  pb::Segment* s = map->add_segments();
  s->set_kind(pb::Segment::SEALED_MEMFD);
  s->set_size(segment.size());
  for (const Mapped& m : tensors) {
    pb::MappedTensor* t = map->add_tensors();
    t->mutable_info()->set_name(m.name);
    t->mutable_info()->set_dtype("U8");
    t->mutable_info()->add_shape(m.bytes);
    t->mutable_info()->set_byte_size(m.bytes);
    if (m.with_crc) t->mutable_info()->set_crc32c(Crc32c(absl::string_view(segment).substr(m.offset, m.bytes)));
    t->set_segment(0);
    t->set_offset(m.offset);
  }
  return response;
}

absl::Status FetchAllFrom(const pb::ShmResponse& answer, const std::string& segment) {
  ScriptedSocket daemon({{answer, segment}});
  absl::StatusOr<std::unique_ptr<SharedMemoryStore>> store = ConnectSharedMemoryStore(daemon.path());
  if (!store.ok()) return store.status();
  return (*store)->FetchAll("m", {}).status();
}

TEST(ShmStoreTest, AnHonestAnswerIsFetchedWhole) {
  const std::string segment(4096, 'q');
  EXPECT_OK(FetchAllFrom(Answer({{"a", 1024, 0}, {"b", 16, 1024}}, segment), segment));
}

// One name twice: the copy, which begins tensors ahead, would otherwise
// write the first one's bytes into a buffer the second had freed.
TEST(ShmStoreTest, ATensorMappedTwiceIsDataLossBeforeAnyCopy) {
  const std::string segment(4096, 'q');
  EXPECT_THAT(FetchAllFrom(Answer({{"x", 1024, 0}, {"x", 16, 1024}}, segment), segment),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("the daemon sent tensor 'x' twice")));
}

// A daemon checksums every tensor it maps for a fetch; one without would be
// copied unchecked.
TEST(ShmStoreTest, ATensorWithoutItsChecksumIsDataLoss) {
  const std::string segment(4096, 'q');
  EXPECT_THAT(FetchAllFrom(Answer({{"a", 1024, 0}, {"b", 16, 1024, /*with_crc=*/false}}, segment), segment),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'b' without its CRC32C")));
}

}  // namespace
}  // namespace weightstore::client
