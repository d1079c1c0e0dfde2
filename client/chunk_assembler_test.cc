#include "client/chunk_assembler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/crc32c.h"
#include "tests/util/status_matchers.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::client {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

grpc::ByteBuffer Buffer(const v1::TensorChunk& chunk) {
  std::string bytes = chunk.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

v1::TensorChunk Chunk(const std::string& data, uint64_t offset, bool first, bool last, uint32_t crc = 0) {
  v1::TensorChunk c;
  if (first) {
    c.mutable_info()->set_name("w");
    c.mutable_info()->set_dtype("U8");
    c.mutable_info()->add_shape(6);
    c.mutable_info()->set_byte_size(6);
    c.set_version("v7");
  }
  c.set_offset(offset);
  c.set_data(data);
  c.set_last(last);
  c.set_crc32c(crc);
  return c;
}

TEST(ChunkAssemblerTest, AssemblesATensorFromChunksAndChecksItsCrc) {
  ChunkAssembler a;
  CollectingSink sink;
  grpc::ByteBuffer first = Buffer(Chunk("abc", 0, true, false));
  ASSERT_OK(a.Consume(&first, &sink));
  EXPECT_EQ(a.version(), "v7");
  grpc::ByteBuffer second = Buffer(Chunk("def", 3, false, true, Crc32c("abcdef")));
  ASSERT_OK(a.Consume(&second, &sink));
  ASSERT_EQ(sink.tensors().size(), 1u);
  EXPECT_EQ(sink.tensors()[0].bytes.view(), "abcdef");
  EXPECT_EQ(a.next_index(), 1u);
}

TEST(ChunkAssemblerTest, RefusesACrcMismatchNamingTheTensor) {
  ChunkAssembler a;
  CollectingSink sink;
  grpc::ByteBuffer only = Buffer(Chunk("abcdef", 0, true, true, Crc32c("abcdeX")));
  EXPECT_THAT(a.Consume(&only, &sink),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w' failed its CRC32C")));
  EXPECT_TRUE(sink.tensors().empty());
}

TEST(ChunkAssemblerTest, RefusesChunksOutOfOrderShortTensorsAndGarbage) {
  CollectingSink sink;
  {
    ChunkAssembler a;
    grpc::ByteBuffer first = Buffer(Chunk("abc", 0, true, false));
    ASSERT_OK(a.Consume(&first, &sink));
    grpc::ByteBuffer gap = Buffer(Chunk("def", 4, false, true));
    EXPECT_THAT(a.Consume(&gap, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not follow")));
  }
  {
    ChunkAssembler a;
    grpc::ByteBuffer short_tensor = Buffer(Chunk("abc", 0, true, true, Crc32c("abc")));
    EXPECT_THAT(a.Consume(&short_tensor, &sink),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("ended after 3 of 6")));
  }
  {
    ChunkAssembler a;
    grpc::ByteBuffer orphan = Buffer(Chunk("abc", 0, false, false));
    EXPECT_THAT(a.Consume(&orphan, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("before a tensor")));
    grpc::Slice junk(std::string("\x0a\xff\xff\xff\xff\x0f", 6));
    grpc::ByteBuffer garbage(&junk, 1);
    EXPECT_THAT(a.Consume(&garbage, &sink), StatusIs(absl::StatusCode::kDataLoss));
  }
}

// A malicious server's sequence: a tensor begins, then one chunk carries its
// data followed by a second tensor's description, so that the next chunk's
// offset would land past the second tensor's buffer.
TEST(ChunkAssemblerTest, RefusesADescriptionAfterTheDataItWouldPlace) {
  ChunkAssembler a;
  CollectingSink sink;
  grpc::ByteBuffer begin = Buffer(Chunk("", 0, true, false));
  ASSERT_OK(a.Consume(&begin, &sink));
  v1::TensorInfo small;
  small.set_name("x");
  small.set_dtype("U8");
  small.add_shape(1);
  small.set_byte_size(1);
  const std::string info = small.SerializeAsString();
  // With and without an offset before the data: the decoder refuses a
  // description after data it placed; the assembler one that comes while a
  // tensor is in progress.
  for (const std::string& head : {std::string("\x18\x00", 2), std::string()}) {
    std::string wire = head;
    wire += '\x22';  // data: 6 bytes
    wire += '\x06';
    wire += "abcdef";
    wire += '\x0a';  // info, after the data
    wire += static_cast<char>(info.size());
    wire += info;
    grpc::Slice slice(wire);
    grpc::ByteBuffer attack(&slice, 1);
    EXPECT_THAT(a.Consume(&attack, &sink), StatusIs(absl::StatusCode::kDataLoss)) << head.size();
    EXPECT_TRUE(sink.tensors().empty());
  }
}

TEST(ChunkAssemblerTest, RefusesANewTensorBeforeTheCurrentOneEnded) {
  ChunkAssembler a;
  CollectingSink sink;
  grpc::ByteBuffer first = Buffer(Chunk("abc", 0, true, false));
  ASSERT_OK(a.Consume(&first, &sink));
  grpc::ByteBuffer again = Buffer(Chunk("", 0, true, false));
  EXPECT_THAT(a.Consume(&again, &sink),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("began tensor 'w' before tensor 'w' ended")));
}

TEST(ChunkAssemblerTest, RefusesATensorIndexThatIsNotTheOneDue) {
  ChunkAssembler a(/*first_index=*/5);
  CollectingSink sink;
  v1::TensorChunk skip = Chunk("abcdef", 0, true, true, Crc32c("abcdef"));
  skip.set_tensor_index(9);
  grpc::ByteBuffer buffer = Buffer(skip);
  EXPECT_THAT(a.Consume(&buffer, &sink),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 9 where tensor 5 was due")));
  a.Restart();  // as the client does after an error: a new stream
  v1::TensorChunk due = skip;
  due.set_tensor_index(5);
  grpc::ByteBuffer ok = Buffer(due);
  ASSERT_OK(a.Consume(&ok, &sink));
  EXPECT_EQ(a.next_index(), 6u);
}

TEST(ChunkAssemblerTest, ADeltaStreamMaySkipAheadButNeverBackNorToTheLastIndex) {
  ChunkAssembler a(/*first_index=*/2);
  a.AllowSkips();
  CollectingSink sink;
  v1::TensorChunk chunk = Chunk("abcdef", 0, true, true, Crc32c("abcdef"));
  chunk.set_tensor_index(7);
  grpc::ByteBuffer ahead = Buffer(chunk);
  ASSERT_OK(a.Consume(&ahead, &sink));
  EXPECT_EQ(a.next_index(), 8u);
  chunk.set_tensor_index(4);
  grpc::ByteBuffer back = Buffer(chunk);
  EXPECT_THAT(a.Consume(&back, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 4 where tensor 8")));
  chunk.set_tensor_index(UINT64_MAX);
  grpc::ByteBuffer last = Buffer(chunk);
  EXPECT_THAT(a.Consume(&last, &sink), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(sink.tensors().size(), 1u);
}

// A first and last chunk carrying `patch` for tensor "w" (U8 [6]).
v1::TensorChunk PatchChunk(const std::string& patch, const std::string& encoding = "positions",
                           uint32_t element_size = 1, uint64_t changed = 1, uint64_t patch_bytes = 0) {
  v1::TensorChunk c = Chunk(patch, 0, true, true, Crc32c(patch));
  v1::TensorPatch* p = c.mutable_info()->mutable_patch();
  p->set_encoding(encoding);
  p->set_element_size(element_size);
  p->set_changed_elements(changed);
  p->set_patch_bytes(patch_bytes == 0 ? patch.size() : patch_bytes);
  c.mutable_info()->set_digest(std::string(32, 'a'));
  return c;
}

TEST(ChunkAssemblerTest, APatchGoesToTheSinkAsAPatchWithItsHeaderAndDigest) {
  ChunkAssembler a;
  a.AllowPatches();
  CollectingSink sink(nullptr, /*take_patches=*/true);
  const std::string body("\x01\x03Z", 3);  // element 3 becomes 'Z'
  grpc::ByteBuffer only = Buffer(PatchChunk(body));
  ASSERT_OK(a.Consume(&only, &sink));
  EXPECT_TRUE(sink.tensors().empty());
  ASSERT_EQ(sink.patches().size(), 1u);
  const ReceivedPatch& p = sink.patches()[0];
  EXPECT_EQ(p.spec.name, "w");
  EXPECT_EQ(p.digest, std::string(32, 'a'));
  EXPECT_EQ(p.patch.elements, 6u);
  EXPECT_EQ(p.patch.changed, 1u);
  EXPECT_EQ(p.patch.body.view(), body);
  std::string tensor = "abcdef";
  ASSERT_OK(ApplyPatch(p.patch, std::as_writable_bytes(std::span(tensor.data(), tensor.size()))));
  EXPECT_EQ(tensor, "abcZef");
}

TEST(ChunkAssemblerTest, RefusesPatchHeadersThatDoNotFitTheirTensor) {
  const std::string body("\x01\x03Z", 3);
  struct Case {
    v1::TensorChunk chunk;
    const char* error;
  };
  const Case cases[] = {
      {PatchChunk(body, "xor"), "unknown encoding 'xor'"},
      {PatchChunk(body, "positions", 2), "elements of 2 bytes where U8 has 1"},
      {PatchChunk(body, "positions", 1, 7), "for 7 of 6 elements"},
      {PatchChunk("abcdef"), "6 bytes for 1 of 6 elements (6 bytes)"},  // not smaller than the tensor
      {PatchChunk(body, "positions", 1, 1, 1), "does not follow"},      // more data than announced
  };
  for (const Case& c : cases) {
    ChunkAssembler a;
    a.AllowPatches();
    CollectingSink sink(nullptr, /*take_patches=*/true);
    grpc::ByteBuffer buffer = Buffer(c.chunk);
    absl::Status status = a.Consume(&buffer, &sink);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.error));
    EXPECT_TRUE(sink.patches().empty());
  }
  // A sink that takes no patches says so.
  struct Plain : TensorSink {
    absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec&) override { return std::span<std::byte>(); }
    absl::Status End(const TensorSpec&) override { return absl::OkStatus(); }
  } plain;
  ChunkAssembler a;
  a.AllowPatches();
  grpc::ByteBuffer buffer = Buffer(PatchChunk(body));
  EXPECT_THAT(a.Consume(&buffer, &plain), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("no element patches")));
}

// A server that sends a patch nobody asked for must not cost the caller that
// tensor in silence (tensors() would return without it): the stream is
// refused, and so is the patch by a sink not told to take patches.
TEST(ChunkAssemblerTest, AnElementPatchTheFetchDidNotAskForIsDataLossNotADroppedTensor) {
  const std::string body("\x01\x03Z", 3);
  {
    ChunkAssembler a;
    CollectingSink sink(nullptr, /*take_patches=*/true);
    grpc::ByteBuffer buffer = Buffer(PatchChunk(body));
    EXPECT_THAT(a.Consume(&buffer, &sink),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w' as an element patch, which the fetch did "
                                                                "not ask for")));
    EXPECT_TRUE(sink.patches().empty());
  }
  {
    ChunkAssembler a;
    a.AllowPatches();
    CollectingSink sink;  // what Store::FetchAll (tensors()) collects into
    grpc::ByteBuffer buffer = Buffer(PatchChunk(body));
    EXPECT_THAT(a.Consume(&buffer, &sink),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w' came as an element patch, which the fetch "
                                                                "did not ask for")));
    EXPECT_TRUE(sink.patches().empty());
    EXPECT_TRUE(sink.tensors().empty());
  }
}

v1::TensorChunk Ticket() {
  v1::TensorChunk c;
  c.mutable_lane()->set_port(4242);
  c.mutable_lane()->set_ticket(std::string(16, 't'));
  c.mutable_lane()->set_proof(std::string(16, 'p'));
  c.set_version("v7");
  return c;
}

// A ticket is taken once, as the first message of a fetch that asks for the
// lane. One the fetch no longer asks for (it fell back to the stream, or its
// lane was cut once) is DataLoss: a daemon cannot end such a stream early with
// a ticket nobody will redeem.
TEST(ChunkAssemblerTest, ADataLaneTicketIsTakenOnlyFirstAndOnlyWhileAskedFor) {
  CollectingSink sink;
  {
    ChunkAssembler a;
    grpc::ByteBuffer ticket = Buffer(Ticket());
    EXPECT_THAT(a.Consume(&ticket, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("data lane ticket")));
    EXPECT_FALSE(a.lane().has_value());
  }
  {
    ChunkAssembler a;
    a.AllowLane();
    grpc::ByteBuffer ticket = Buffer(Ticket());
    ASSERT_OK(a.Consume(&ticket, &sink));
    ASSERT_TRUE(a.lane().has_value());
    EXPECT_EQ(a.lane()->port(), 4242u);
    EXPECT_EQ(a.version(), "v7");
    grpc::ByteBuffer again = Buffer(Ticket());
    EXPECT_THAT(a.Consume(&again, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("data lane ticket")));
    a.AllowLane(false);  // the client fell back to the stream
    a.Restart();
    EXPECT_FALSE(a.lane().has_value());
    grpc::ByteBuffer after_fallback = Buffer(Ticket());
    EXPECT_THAT(a.Consume(&after_fallback, &sink),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("data lane ticket")));
    EXPECT_FALSE(a.lane().has_value());
  }
  {
    ChunkAssembler a;
    a.AllowLane();
    grpc::ByteBuffer first = Buffer(Chunk("abc", 0, true, false));
    ASSERT_OK(a.Consume(&first, &sink));
    grpc::ByteBuffer late = Buffer(Ticket());
    EXPECT_THAT(a.Consume(&late, &sink), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("data lane ticket")));
  }
  {
    // After a whole tensor, with nothing open: still not the stream's first message.
    ChunkAssembler a;
    a.AllowLane();
    CollectingSink got;
    grpc::ByteBuffer whole = Buffer(Chunk("abcdef", 0, true, true, Crc32c("abcdef")));
    ASSERT_OK(a.Consume(&whole, &got));
    grpc::ByteBuffer late = Buffer(Ticket());
    EXPECT_THAT(a.Consume(&late, &got), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("data lane ticket")));
    EXPECT_FALSE(a.lane().has_value());
  }
  EXPECT_TRUE(sink.tensors().empty());
}

// A stream's first message names its version, later ones may only repeat
// it, and a resumed stream must name the same: anything else is DataLoss,
// never a tensor of one version among another's.
TEST(ChunkAssemblerTest, AStreamThatChangesItsVersionMidwayIsDataLoss) {
  CollectingSink sink;
  ChunkAssembler a;
  grpc::ByteBuffer first = Buffer(Chunk("abc", 0, true, false));
  ASSERT_OK(a.Consume(&first, &sink));
  v1::TensorChunk later = Chunk("def", 3, false, true, Crc32c("abcdef"));
  later.set_version("v8");
  grpc::ByteBuffer second = Buffer(later);
  EXPECT_THAT(a.Consume(&second, &sink),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("named version v8 after its first message")));
  EXPECT_EQ(a.version(), "v7");
  EXPECT_TRUE(sink.tensors().empty());
  // Resumed on a new stream: the same version is taken, another is not.
  a.Restart();
  v1::TensorChunk newer = Chunk("abcdef", 0, true, true, Crc32c("abcdef"));
  newer.set_version("v8");
  grpc::ByteBuffer refused = Buffer(newer);
  EXPECT_THAT(a.Consume(&refused, &sink),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("changed its version from v7 to v8")));
  a.Restart();
  grpc::ByteBuffer resumed = Buffer(Chunk("abcdef", 0, true, true, Crc32c("abcdef")));
  ASSERT_OK(a.Consume(&resumed, &sink));
  ASSERT_EQ(sink.tensors().size(), 1u);
  EXPECT_EQ(a.version(), "v7");

  // Asked afresh before any tensor arrived (a lane it could not reach):
  // StartOver forgets the ticket's version, and a newer one is taken.
  ChunkAssembler fallback;
  fallback.AllowLane();
  grpc::ByteBuffer ticket = Buffer(Ticket());  // of v7
  ASSERT_OK(fallback.Consume(&ticket, &sink));
  fallback.AllowLane(false);
  fallback.StartOver();
  grpc::ByteBuffer newer_whole = Buffer(newer);
  ASSERT_OK(fallback.Consume(&newer_whole, &sink));
  EXPECT_EQ(fallback.version(), "v8");
}

}  // namespace
}  // namespace weightstore::client
