#include "proto/codec/chunk_codec.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "core/crc32c.h"
#include "proto/codec/status.h"

namespace weightstore::wire {
namespace {

SharedBytes Bytes(const std::string& s) {
  auto owner = std::make_shared<std::string>(s);
  return SharedBytes(owner,
                     std::span<const std::byte>(reinterpret_cast<const std::byte*>(owner->data()), owner->size()));
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

struct GoldenChunk {
  v1::TensorChunk header;
  std::string data;
};

// The chunks a server sends, one of each kind: a tensor's first chunk (with
// the stream's version), a later one, the last one, and an empty selection's.
std::vector<GoldenChunk> GoldenChunks() {
  std::vector<GoldenChunk> chunks(4);
  {
    v1::TensorChunk& c = chunks[0].header;
    c.mutable_info()->set_name("layers.0.weight");
    c.mutable_info()->set_dtype("F32");
    c.mutable_info()->add_shape(2);
    c.mutable_info()->add_shape(2);
    c.mutable_info()->set_source_name("model.layers.0.weight");
    c.set_version("00000000000000ab");
    c.set_tensor_index(0);
    c.set_offset(0);
    chunks[0].data = std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  }
  {
    v1::TensorChunk& c = chunks[1].header;
    c.set_tensor_index(0);
    c.set_offset(8);
    c.set_last(true);
    chunks[1].data = std::string("\x00\x00\x40\x40\x00\x00\x80\x40", 8);
    c.set_crc32c(Crc32c(chunks[0].data + chunks[1].data));
  }
  {
    v1::TensorChunk& c = chunks[2].header;
    c.set_tensor_index(300);
    c.set_offset(1 << 20);
    chunks[2].data = "payload";
  }
  {
    v1::TensorChunk& c = chunks[3].header;
    c.set_version("empty");
    c.set_last(true);
  }
  return chunks;
}

nlohmann::json Describe(const GoldenChunk& chunk, const std::string& wire) {
  const v1::TensorChunk& c = chunk.header;
  nlohmann::json j = {{"hex", absl::BytesToHexString(wire)},
                      {"tensor_index", c.tensor_index()},
                      {"offset", c.offset()},
                      {"last", c.last()},
                      {"crc32c", c.crc32c()},
                      {"version", c.version()},
                      {"data_hex", absl::BytesToHexString(chunk.data)}};
  if (c.has_info()) j["info_name"] = c.info().name();
  return j;
}

TEST(ChunkCodec, EncodesTheGoldenBytesThatPythonIsTestedAgainst) {
  nlohmann::json golden = nlohmann::json::array();
  for (const GoldenChunk& chunk : GoldenChunks()) {
    golden.push_back(Describe(chunk, Flatten(EncodeChunk(chunk.header, Bytes(chunk.data)))));
  }
  const std::string text = golden.dump(2) + "\n";
  if (std::getenv("WEIGHTSTORE_UPDATE_GOLDEN") != nullptr) {
    std::ofstream(WEIGHTSTORE_CHUNK_GOLDEN) << text;
  }
  std::ifstream in(WEIGHTSTORE_CHUNK_GOLDEN);
  std::stringstream stored;
  stored << in.rdbuf();
  EXPECT_EQ(stored.str(), text) << "the encoding changed; if on purpose, rerun with WEIGHTSTORE_UPDATE_GOLDEN=1";
}

TEST(ChunkCodec, PayloadSliceIsTheCallersBytesNotACopy) {
  SharedBytes payload = Bytes(std::string(4096, 'x'));
  grpc::ByteBuffer buffer = EncodeChunk(GoldenChunks()[2].header, payload);
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(reinterpret_cast<const std::byte*>(slices[1].begin()), payload.data());
}

TEST(ChunkCodec, DecodesWhatEitherEncoderWrites) {
  for (const GoldenChunk& chunk : GoldenChunks()) {
    for (bool copying : {false, true}) {
      grpc::ByteBuffer buffer =
          copying ? EncodeChunkCopying(chunk.header, Bytes(chunk.data)) : EncodeChunk(chunk.header, Bytes(chunk.data));
      std::string received(chunk.data.size(), '\0');
      ChunkFields fields;
      int calls = 0;
      auto to = [&](const ChunkFields& f, uint64_t n) -> absl::StatusOr<std::span<std::byte>> {
        ++calls;
        EXPECT_EQ(f.info.has_value(), chunk.header.has_info());
        return std::span<std::byte>(reinterpret_cast<std::byte*>(received.data()), n);
      };
      ASSERT_TRUE(DecodeChunk(&buffer, &fields, to).ok());
      EXPECT_EQ(calls, chunk.data.empty() ? 0 : 1);
      EXPECT_EQ(received, chunk.data);
      EXPECT_EQ(fields.data_bytes, chunk.data.size());
      EXPECT_EQ(fields.tensor_index, chunk.header.tensor_index());
      EXPECT_EQ(fields.offset.value_or(0), chunk.header.offset());
      EXPECT_EQ(fields.last, chunk.header.last());
      EXPECT_EQ(fields.crc32c, chunk.header.crc32c());
      EXPECT_EQ(fields.version.value_or(""), chunk.header.version());
      if (chunk.header.has_info()) {
        EXPECT_EQ(fields.info->name(), chunk.header.info().name());
      }
    }
  }
}

TEST(ChunkCodec, DataBeforeEveryOtherFieldStillReachesItsDestination) {
  std::string wire;
  wire += '\x22';  // field 4 (data), length-delimited
  wire += '\x03';
  wire += "abc";
  wire += '\x18';  // field 3 (offset), varint
  wire += '\x05';
  grpc::ByteBuffer buffer = BufferOf(wire);
  std::string received(3, '\0');
  ChunkFields fields;
  auto to = [&](const ChunkFields& f, uint64_t n) -> absl::StatusOr<std::span<std::byte>> {
    EXPECT_EQ(f.offset, 5u);  // asked only once every field is known
    return std::span<std::byte>(reinterpret_cast<std::byte*>(received.data()), n);
  };
  ASSERT_TRUE(DecodeChunk(&buffer, &fields, to).ok());
  EXPECT_EQ(received, "abc");
}

absl::Status DecodeBytes(const std::string& wire) {
  grpc::ByteBuffer buffer = BufferOf(wire);
  ChunkFields fields;
  std::string sink(1 << 10, '\0');
  return DecodeChunk(&buffer, &fields, [&](const ChunkFields&, uint64_t n) -> absl::StatusOr<std::span<std::byte>> {
    if (n > sink.size()) return absl::DataLossError("too big for the test's sink");
    return std::span<std::byte>(reinterpret_cast<std::byte*>(sink.data()), n);
  });
}

TEST(ChunkCodec, RefusesMalformedFramingWithDataLossNamingTheField) {
  const std::string good = Flatten(EncodeChunk(GoldenChunks()[2].header, Bytes("payload")));
  ASSERT_TRUE(DecodeBytes(good).ok());
  absl::Status truncated = DecodeBytes(good.substr(0, good.size() - 1));
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(truncated.message().find("data"), absl::string_view::npos) << truncated;
  // A data length past the 64 MiB bound, with no bytes behind it.
  absl::Status huge = DecodeBytes(std::string("\x22\xff\xff\xff\xff\x0f", 6));
  EXPECT_EQ(huge.code(), absl::StatusCode::kDataLoss) << huge;
  // The offset sent as a fixed64 instead of a varint.
  absl::Status wrong_type = DecodeBytes(std::string("\x19\x01\x00\x00\x00\x00\x00\x00\x00", 9));
  EXPECT_EQ(wrong_type.code(), absl::StatusCode::kDataLoss) << wrong_type;
  EXPECT_NE(wrong_type.message().find("offset"), absl::string_view::npos) << wrong_type;
  // Two data fields in one chunk.
  absl::Status twice = DecodeBytes(std::string("\x18\x01\x22\x01x\x22\x01y", 8));
  EXPECT_EQ(twice.code(), absl::StatusCode::kDataLoss) << twice;
  // A tag of zero is no field at all.
  absl::Status zero_tag = DecodeBytes(std::string("\x18\x01\x00\x00", 4));
  EXPECT_EQ(zero_tag.code(), absl::StatusCode::kDataLoss) << zero_tag;
}

TEST(ChunkCodec, ADestinationsErrorIsReturnedAsIs) {
  grpc::ByteBuffer buffer = EncodeChunk(GoldenChunks()[2].header, Bytes("payload"));
  ChunkFields fields;
  absl::Status status =
      DecodeChunk(&buffer, &fields, [](const ChunkFields&, uint64_t) -> absl::StatusOr<std::span<std::byte>> {
        return absl::ResourceExhaustedError("no room");
      });
  EXPECT_EQ(status, absl::ResourceExhaustedError("no room"));
}

std::string Joined(const FileChunkView& chunk) {
  std::string out;
  for (absl::string_view piece : chunk.data) out.append(piece.data(), piece.size());
  return out;
}

TEST(FileChunkCodec, DecodesDataAsViewsOfTheReceivedSlicesWhereverTheySplit) {
  v1::CheckpointFileChunk header;
  header.set_offset(1 << 20);
  header.set_crc32c(Crc32c("0123456789"));
  const std::string wire =
      Flatten(EncodeWithPayload(header, v1::CheckpointFileChunk::kDataFieldNumber, Bytes("0123456789")));
  for (size_t cut = 0; cut <= wire.size(); ++cut) {  // every way one message splits over two slices
    grpc::Slice slices[2] = {grpc::Slice(wire.substr(0, cut)), grpc::Slice(wire.substr(cut))};
    grpc::ByteBuffer buffer(slices, 2);
    FileChunkView chunk;
    ASSERT_TRUE(DecodeFileChunk(&buffer, &chunk).ok()) << cut;
    EXPECT_EQ(chunk.offset, 1u << 20);
    EXPECT_EQ(chunk.crc32c, Crc32c("0123456789"));
    EXPECT_EQ(chunk.data_bytes, 10u);
    EXPECT_EQ(Joined(chunk), "0123456789") << cut;
  }
  // A typed serializer writes the fields in number order: data before crc32c.
  v1::CheckpointFileChunk typed = header;
  typed.set_data("abc");
  grpc::ByteBuffer buffer = BufferOf(typed.SerializeAsString());
  FileChunkView chunk;
  ASSERT_TRUE(DecodeFileChunk(&buffer, &chunk).ok());
  EXPECT_EQ(Joined(chunk), "abc");
  EXPECT_EQ(chunk.crc32c, header.crc32c());
}

TEST(FileChunkCodec, RefusesMalformedFramingWithDataLossNamingTheField) {
  auto decode = [](const std::string& wire) {
    grpc::ByteBuffer buffer = BufferOf(wire);
    FileChunkView chunk;
    return DecodeFileChunk(&buffer, &chunk);
  };
  v1::CheckpointFileChunk header;
  header.set_offset(7);
  const std::string good =
      Flatten(EncodeWithPayload(header, v1::CheckpointFileChunk::kDataFieldNumber, Bytes("payload")));
  ASSERT_TRUE(decode(good).ok());
  EXPECT_EQ(decode(good.substr(0, good.size() - 1)).code(), absl::StatusCode::kDataLoss);
  absl::Status huge = decode(std::string("\x12\xff\xff\xff\xff\x0f", 6));  // data over 64 MiB
  EXPECT_EQ(huge.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(huge.message().find("data"), absl::string_view::npos) << huge;
  absl::Status twice = decode(std::string("\x12\x01x\x12\x01y", 6));
  EXPECT_EQ(twice.code(), absl::StatusCode::kDataLoss) << twice;
  absl::Status wrong_type = decode(std::string("\x1a\x01x", 3));  // crc32c as bytes
  EXPECT_NE(wrong_type.message().find("crc32c"), absl::string_view::npos) << wrong_type;
  EXPECT_EQ(decode(std::string("\x08\x01\x00\x00", 4)).code(), absl::StatusCode::kDataLoss);  // tag 0
}

TEST(RawRequests, ParseMessageReadsARequestSplitOverSlices) {
  v1::ReadCheckpointFileRequest request;
  request.set_name("llm/7b");
  request.set_offset(123);
  const std::string wire = request.SerializeAsString();
  grpc::Slice slices[2] = {grpc::Slice(wire.substr(0, 3)), grpc::Slice(wire.substr(3))};
  v1::ReadCheckpointFileRequest parsed;
  ASSERT_TRUE(ParseMessage(grpc::ByteBuffer(slices, 2), &parsed));
  EXPECT_EQ(parsed.name(), "llm/7b");
  EXPECT_EQ(parsed.offset(), 123u);
  EXPECT_FALSE(ParseMessage(BufferOf("\xff\xff"), &parsed));
}

TEST(StatusConversion, KeepsTheCodeAndBoundsTheMessage) {
  for (int code = 1; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code), "why");
    EXPECT_EQ(FromGrpcStatus(ToGrpcStatus(status)), status);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  grpc::Status long_one = ToGrpcStatus(absl::InvalidArgumentError(std::string(100000, 'n')));
  EXPECT_LT(long_one.error_message().size(), kMaxStatusMessageBytes + 64);
  EXPECT_NE(long_one.error_message().find("100000 bytes in all"), std::string::npos);
}

}  // namespace
}  // namespace weightstore::wire
