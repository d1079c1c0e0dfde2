#include "proto/codec/chunk_codec.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/proto_buffer_reader.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightstore::wire {
namespace {

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

}  // namespace

grpc::Slice SliceOf(const SharedBytes& bytes) {
  auto* owner = new std::shared_ptr<const void>(bytes.owner());
  grpc::Slice slice(const_cast<std::byte*>(bytes.data()), bytes.size(), &ReleaseOwner, owner);
  assert(slice.begin() == reinterpret_cast<const uint8_t*>(bytes.data()));  // some constructors copy
  return slice;
}

grpc::ByteBuffer EncodeWithPayload(const google::protobuf::MessageLite& header, int data_field,
                                   const SharedBytes& payload) {
  std::string head = header.SerializeAsString();
  if (payload.size() == 0) {
    grpc::Slice slice(head);
    return grpc::ByteBuffer(&slice, 1);
  }
  {
    google::protobuf::io::StringOutputStream stream(&head);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
        data_field, google::protobuf::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint64(payload.size());
  }
  grpc::Slice slices[2] = {grpc::Slice(head), SliceOf(payload)};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer EncodeChunk(const v1::TensorChunk& header, const SharedBytes& payload) {
  return EncodeWithPayload(header, v1::TensorChunk::kDataFieldNumber, payload);
}

grpc::ByteBuffer EncodeChunkCopying(const v1::TensorChunk& header, const SharedBytes& payload) {
  v1::TensorChunk chunk = header;
  chunk.set_data(payload.data(), payload.size());
  grpc::ByteBuffer buffer;
  bool own = false;
  grpc::SerializationTraits<v1::TensorChunk>::Serialize(chunk, &buffer, &own);
  return buffer;
}

absl::Status DecodeChunk(grpc::ByteBuffer* buffer, ChunkFields* fields, DataDestination destination) {
  using google::protobuf::internal::WireFormatLite;
  *fields = ChunkFields();
  grpc::ProtoBufferReader reader(buffer);
  google::protobuf::io::CodedInputStream in(&reader);
  auto bad = [](absl::string_view what) { return absl::DataLossError(absl::StrCat("malformed TensorChunk: ", what)); };
  std::string early;  // data that came before other fields: not how servers send it
  bool have_early = false, delivered = false;
  while (uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto wire_type = WireFormatLite::GetTagWireType(tag);
    auto expect = [&](WireFormatLite::WireType type) { return wire_type == type; };
    switch (field) {
      case v1::TensorChunk::kInfoFieldNumber: {
        uint64_t length;
        if (!expect(WireFormatLite::WIRETYPE_LENGTH_DELIMITED) || !in.ReadVarint64(&length) ||
            length > kMaxChunkFieldBytes || delivered) {
          return bad("info");
        }
        auto limit = in.PushLimit(static_cast<int>(length));
        v1::TensorInfo info;
        if (!info.MergePartialFromCodedStream(&in) || !in.ConsumedEntireMessage()) return bad("info");
        in.PopLimit(limit);
        fields->info = std::move(info);
        break;
      }
      case v1::TensorChunk::kTensorIndexFieldNumber:
        if (!expect(WireFormatLite::WIRETYPE_VARINT) || !in.ReadVarint64(&fields->tensor_index) || delivered) {
          return bad("tensor_index");
        }
        break;
      case v1::TensorChunk::kOffsetFieldNumber: {
        uint64_t offset;
        if (!expect(WireFormatLite::WIRETYPE_VARINT) || !in.ReadVarint64(&offset) || delivered) return bad("offset");
        fields->offset = offset;
        break;
      }
      case v1::TensorChunk::kDataFieldNumber: {
        uint64_t length;
        if (!expect(WireFormatLite::WIRETYPE_LENGTH_DELIMITED) || !in.ReadVarint64(&length) ||
            length > kMaxChunkFieldBytes || have_early || delivered) {
          return bad("data");
        }
        fields->data_bytes = length;
        if (!fields->info.has_value() && !fields->offset.has_value()) {  // decide once every field is known
          have_early = true;
          if (!in.ReadString(&early, static_cast<int>(length))) return bad("data");
          break;
        }
        absl::StatusOr<std::span<std::byte>> out = destination(*fields, length);
        if (!out.ok()) return out.status();
        if (out->size() != length) return absl::InternalError("a chunk destination of the wrong size");
        if (length > 0 && !in.ReadRaw(out->data(), static_cast<int>(length))) return bad("data");
        delivered = true;
        break;
      }
      case v1::TensorChunk::kLastFieldNumber: {
        uint64_t v;
        if (!expect(WireFormatLite::WIRETYPE_VARINT) || !in.ReadVarint64(&v)) return bad("last");
        fields->last = v != 0;
        break;
      }
      case v1::TensorChunk::kCrc32CFieldNumber:
        if (!expect(WireFormatLite::WIRETYPE_FIXED32) || !in.ReadLittleEndian32(&fields->crc32c)) {
          return bad("crc32c");
        }
        break;
      case v1::TensorChunk::kVersionFieldNumber: {
        std::string version;
        if (!expect(WireFormatLite::WIRETYPE_LENGTH_DELIMITED) || !WireFormatLite::ReadString(&in, &version)) {
          return bad("version");
        }
        fields->version = std::move(version);
        break;
      }
      case v1::TensorChunk::kLaneFieldNumber: {
        uint64_t length;
        if (!expect(WireFormatLite::WIRETYPE_LENGTH_DELIMITED) || !in.ReadVarint64(&length) || length > 1024) {
          return bad("lane");
        }
        auto limit = in.PushLimit(static_cast<int>(length));
        v1::DataLane lane;
        if (!lane.MergePartialFromCodedStream(&in) || !in.ConsumedEntireMessage()) return bad("lane");
        in.PopLimit(limit);
        fields->lane = std::move(lane);
        break;
      }
      default:
        if (!WireFormatLite::SkipField(&in, tag)) return bad(absl::StrCat("field ", field));
    }
  }
  if (!in.ConsumedEntireMessage()) return bad("a bad tag");
  if (have_early) {
    absl::StatusOr<std::span<std::byte>> out = destination(*fields, early.size());
    if (!out.ok()) return out.status();
    if (out->size() != early.size()) return absl::InternalError("a chunk destination of the wrong size");
    if (!early.empty()) std::memcpy(out->data(), early.data(), early.size());
  }
  return absl::OkStatus();
}

bool ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  grpc::ByteBuffer shared(buffer);  // the same slices, not a copy of the bytes
  grpc::ProtoBufferReader reader(&shared);
  return message->ParseFromZeroCopyStream(&reader);
}

absl::Status DecodeFileChunk(grpc::ByteBuffer* buffer, FileChunkView* chunk) {
  using google::protobuf::internal::WireFormatLite;
  *chunk = FileChunkView();
  auto bad = [](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("malformed CheckpointFileChunk: ", what));
  };
  // Where data lies in the message, found by parsing; then cut from the slices.
  uint64_t data_at = 0;
  bool have_data = false;
  {
    grpc::ProtoBufferReader reader(buffer);
    google::protobuf::io::CodedInputStream in(&reader);
    while (uint32_t tag = in.ReadTag()) {
      const int field = WireFormatLite::GetTagFieldNumber(tag);
      const auto wire_type = WireFormatLite::GetTagWireType(tag);
      switch (field) {
        case v1::CheckpointFileChunk::kOffsetFieldNumber:
          if (wire_type != WireFormatLite::WIRETYPE_VARINT || !in.ReadVarint64(&chunk->offset)) return bad("offset");
          break;
        case v1::CheckpointFileChunk::kCrc32CFieldNumber:
          if (wire_type != WireFormatLite::WIRETYPE_FIXED32 || !in.ReadLittleEndian32(&chunk->crc32c)) {
            return bad("crc32c");
          }
          break;
        case v1::CheckpointFileChunk::kDataFieldNumber: {
          uint64_t length;
          if (wire_type != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !in.ReadVarint64(&length) ||
              length > kMaxChunkFieldBytes || have_data) {
            return bad("data");
          }
          data_at = static_cast<uint64_t>(in.CurrentPosition());
          chunk->data_bytes = length;
          have_data = true;
          if (!in.Skip(static_cast<int>(length))) return bad("data");
          break;
        }
        default:
          if (!WireFormatLite::SkipField(&in, tag)) return bad(absl::StrCat("field ", field));
      }
    }
    if (!in.ConsumedEntireMessage()) return bad("a bad tag");
  }
  if (!buffer->Dump(&chunk->slices).ok()) return bad("unreadable");
  uint64_t at = 0, left = chunk->data_bytes;
  for (const grpc::Slice& slice : chunk->slices) {
    const uint64_t begin = std::max(at, data_at), end = std::min<uint64_t>(at + slice.size(), data_at + left);
    if (begin < end) {
      chunk->data.emplace_back(reinterpret_cast<const char*>(slice.begin()) + (begin - at), end - begin);
      left -= end - begin;
      data_at = end;
    }
    at += slice.size();
  }
  if (left != 0) return bad("data");
  return absl::OkStatus();
}

}  // namespace weightstore::wire
