#include "client/chunk_assembler.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/proto_buffer_reader.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/proto_convert.h"
#include "core/crc32c.h"
#include "core/status_macros.h"

namespace weightstore::client {

absl::Status ChunkAssembler::Consume(grpc::ByteBuffer* buffer, TensorSink* sink) {
  using google::protobuf::internal::WireFormatLite;
  grpc::ProtoBufferReader reader(buffer);
  google::protobuf::io::CodedInputStream in(&reader);
  uint64_t index = 0, offset = 0;
  bool last = false, have_offset = false;
  uint32_t crc = 0;
  std::string early_data;  // only if data came before offset (not how we send it)
  bool early = false;
  uint64_t data_size = 0;
  auto bad = [] { return absl::DataLossError("malformed TensorChunk"); };
  while (uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    switch (field) {
      case pb::TensorChunk::kInfoFieldNumber: {
        uint32_t length;
        if (!in.ReadVarint32(&length) || length > (64u << 20)) return bad();
        auto limit = in.PushLimit(static_cast<int>(length));
        pb::TensorInfo info;
        if (!info.MergePartialFromCodedStream(&in) || !in.ConsumedEntireMessage()) return bad();
        in.PopLimit(limit);
        TensorDescription d;
        if (absl::Status s = FromProto(info, &d); !s.ok()) {
          return absl::DataLossError(absl::StrCat("stream sent an invalid tensor description: ", s.message()));
        }
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(d.spec));
        if (out.size() != d.spec.byte_size()) {
          return absl::InternalError(absl::StrCat("sink gave ", out.size(), " bytes for tensor '", d.spec.name, "'"));
        }
        current_ = InProgress{d.spec, out, 0, 0};
        break;
      }
      case pb::TensorChunk::kTensorIndexFieldNumber:
        if (!in.ReadVarint64(&index)) return bad();
        break;
      case pb::TensorChunk::kOffsetFieldNumber:
        if (!in.ReadVarint64(&offset)) return bad();
        have_offset = true;
        break;
      case pb::TensorChunk::kDataFieldNumber: {
        uint32_t length;
        if (!in.ReadVarint32(&length) || length > (64u << 20)) return bad();
        data_size = length;
        if (!current_ || !have_offset) {  // unusual field order: keep it aside
          early = true;
          if (!in.ReadString(&early_data, static_cast<int>(length))) return bad();
          break;
        }
        InProgress& t = *current_;
        if (offset != t.received || length > t.out.size() - t.received) {
          return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk at offset ", offset,
                                                  " does not follow byte ", t.received));
        }
        if (!in.ReadRaw(t.out.data() + t.received, static_cast<int>(length))) return bad();
        break;
      }
      case pb::TensorChunk::kLastFieldNumber: {
        uint64_t v;
        if (!in.ReadVarint64(&v)) return bad();
        last = v != 0;
        break;
      }
      case pb::TensorChunk::kCrc32CFieldNumber:
        if (!in.ReadLittleEndian32(&crc)) return bad();
        break;
      case pb::TensorChunk::kVersionFieldNumber: {
        std::string version;
        if (!WireFormatLite::ReadString(&in, &version)) return bad();
        version_ = version;
        break;
      }
      default:
        if (!WireFormatLite::SkipField(&in, tag)) return bad();
    }
  }
  if (!current_) {
    if (data_size == 0 && last) return absl::OkStatus();  // an empty selection
    return absl::DataLossError("stream sent data before a tensor's description");
  }
  InProgress& t = *current_;
  if (early) {
    if (offset != t.received || early_data.size() > t.out.size() - t.received) {
      return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk does not follow byte ", t.received));
    }
    // An empty tensor's destination may be null: memcpy must not see it.
    if (!early_data.empty()) std::memcpy(t.out.data() + t.received, early_data.data(), early_data.size());
  }
  t.crc = Crc32cExtend(t.crc, absl::string_view(reinterpret_cast<const char*>(t.out.data() + t.received), data_size));
  t.received += data_size;
  if (!last) return absl::OkStatus();
  if (t.received != t.out.size()) {
    return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' ended after ", t.received, " of ",
                                            t.out.size(), " bytes"));
  }
  if (t.crc != crc) {
    return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' failed its CRC32C check (got ", t.crc,
                                            ", the server sent ", crc, ")"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(sink->End(t.spec));
  next_index_ = index + 1;
  current_.reset();
  return absl::OkStatus();
}


}  // namespace weightstore::client
