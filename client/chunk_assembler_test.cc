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

}  // namespace
}  // namespace weightstore::client
