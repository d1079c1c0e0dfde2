#include "client/chunk_assembler.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/proto_convert.h"
#include "core/crc32c.h"
#include "core/host_buffer.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"

namespace weightstore::client {

absl::Status ChunkAssembler::Begin(const pb::TensorInfo& info, TensorSink* sink) {
  TensorDescription d;
  if (absl::Status s = FromProto(info, &d); !s.ok()) {
    return absl::DataLossError(absl::StrCat("stream sent an invalid tensor description: ", s.message()));
  }
  if (info.has_patch()) {
    if (!allow_patches_) {
      return absl::DataLossError(
          absl::StrCat("stream sent tensor '", d.spec.name, "' as an element patch, which the fetch did not ask for"));
    }
    return BeginPatch(info, d.spec, sink);
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, sink->Begin(d.spec));
  if (out.size() != d.spec.byte_size()) {
    return absl::InternalError(absl::StrCat("sink gave ", out.size(), " bytes for tensor '", d.spec.name, "'"));
  }
  current_ = InProgress{d.spec, out, 0, 0};
  return absl::OkStatus();
}

absl::Status ChunkAssembler::BeginPatch(const pb::TensorInfo& info, const TensorSpec& spec, TensorSink* sink) {
  absl::StatusOr<ElementPatch> header = FromProto(info.patch(), spec);
  if (!header.ok()) {
    return absl::DataLossError(
        absl::StrCat("stream sent an invalid patch of tensor '", spec.name, "': ", header.status().message()));
  }
  const pb::TensorPatch& p = info.patch();
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out,
                               sink->BeginPatch(spec, *header, p.patch_bytes(), info.digest()));
  if (out.size() != p.patch_bytes()) {
    return absl::InternalError(absl::StrCat("sink gave ", out.size(), " bytes for the patch of '", spec.name, "'"));
  }
  current_ = InProgress{spec, out, 0, 0, true};
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Start(const wire::ChunkFields& f, TensorSink* sink, bool* began) {
  if (!f.info.has_value() || *began) return absl::OkStatus();
  if (current_) {
    return absl::DataLossError(
        absl::StrCat("stream began tensor '", f.info->name(), "' before tensor '", current_->spec.name, "' ended"));
  }
  // (The last index is never a tensor's: ++ past it would wrap.)
  if ((f.tensor_index != next_index_ && !(allow_skips_ && f.tensor_index > next_index_)) ||
      f.tensor_index == UINT64_MAX) {
    return absl::DataLossError(
        absl::StrCat("stream sent tensor ", f.tensor_index, " where tensor ", next_index_, " was due"));
  }
  next_index_ = f.tensor_index;
  *began = true;
  return Begin(*f.info, sink);
}

absl::StatusOr<std::span<std::byte>> ChunkAssembler::Destination(const wire::ChunkFields& f, uint64_t length,
                                                                 TensorSink* sink, bool* began) {
  WEIGHTSTORE_RETURN_IF_ERROR(Start(f, sink, began));
  if (!current_) return absl::DataLossError("stream sent data before a tensor's description");
  InProgress& t = *current_;
  const uint64_t offset = f.offset.value_or(0);
  if (offset != t.received || t.received > t.out.size() || length > t.out.size() - t.received) {
    return absl::DataLossError(
        absl::StrCat("tensor '", t.spec.name, "': chunk at offset ", offset, " does not follow byte ", t.received));
  }
  std::span<std::byte> landed = t.out.subspan(t.received, length);
  PrefaultForWriting(landed);
  return landed;
}

absl::Status ChunkAssembler::TakeVersion(const std::optional<std::string>& version) {
  if (!version.has_value()) return absl::OkStatus();
  if (!version_may_come_ && *version != version_) {
    return absl::DataLossError(absl::StrCat("the stream named version ", *version, " after its first message"));
  }
  if (!version_.empty() && *version != version_) {
    return absl::DataLossError(
        absl::StrCat("the stream changed its version from ", version_, " to ", *version, " midway"));
  }
  version_ = *version;
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Consume(grpc::ByteBuffer* buffer, TensorSink* sink) {
  wire::ChunkFields fields;
  bool began = false;           // this chunk's info, if any, has started its tensor
  std::span<std::byte> landed;  // where this chunk's data was written
  auto destination = [&](const wire::ChunkFields& f, uint64_t length) -> absl::StatusOr<std::span<std::byte>> {
    WEIGHTSTORE_ASSIGN_OR_RETURN(landed, Destination(f, length, sink, &began));
    return landed;
  };
  const bool first = !std::exchange(stream_began_, true);
  version_may_come_ = first;
  WEIGHTSTORE_RETURN_IF_ERROR(wire::DecodeChunk(buffer, &fields, destination));
  if (fields.lane.has_value()) {
    // A ticket is a stream's only message, and only where it was asked for.
    if (!allow_lane_ || !first || fields.info.has_value() || fields.data_bytes > 0 || fields.last ||
        lane_.has_value() || current_.has_value()) {
      return absl::DataLossError("stream sent a data lane ticket where none was due");
    }
    WEIGHTSTORE_RETURN_IF_ERROR(TakeVersion(fields.version));
    lane_ = *std::move(fields.lane);
    return absl::OkStatus();
  }
  return Consumed(fields, landed, began, sink);
}

absl::Status ChunkAssembler::ConsumeLaneFrame(grpc::ByteBuffer* meta, uint64_t data_bytes,
                                              absl::FunctionRef<absl::Status(std::span<std::byte>)> fill,
                                              TensorSink* sink) {
  wire::ChunkFields fields;
  bool began = false;
  auto no_data = [](const wire::ChunkFields&, uint64_t) -> absl::StatusOr<std::span<std::byte>> {
    return absl::DataLossError("a data lane frame carried data inside its description");
  };
  version_may_come_ = false;  // the ticket named it
  WEIGHTSTORE_RETURN_IF_ERROR(wire::DecodeChunk(meta, &fields, no_data));
  if (fields.lane.has_value()) return absl::DataLossError("a data lane frame carried a ticket");
  std::span<std::byte> landed;
  if (data_bytes > 0) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(landed, Destination(fields, data_bytes, sink, &began));
    WEIGHTSTORE_RETURN_IF_ERROR(fill(landed));
  }
  fields.data_bytes = data_bytes;
  return Consumed(fields, landed, began, sink);
}

absl::Status ChunkAssembler::Consumed(const wire::ChunkFields& fields, std::span<std::byte> landed, bool began,
                                      TensorSink* sink) {
  WEIGHTSTORE_RETURN_IF_ERROR(TakeVersion(fields.version));
  WEIGHTSTORE_RETURN_IF_ERROR(Start(fields, sink, &began));
  if (!current_) {
    if (fields.data_bytes == 0 && fields.last) return absl::OkStatus();  // an empty selection
    return absl::DataLossError("stream sent data before a tensor's description");
  }
  InProgress& t = *current_;
  if (fields.tensor_index != next_index_) {
    return absl::DataLossError(
        absl::StrCat("tensor '", t.spec.name, "' (", next_index_, ") got a chunk of tensor ", fields.tensor_index));
  }
  if (landed.size() != fields.data_bytes || (landed.empty() && fields.offset.value_or(0) != t.received)) {
    return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "': chunk at offset ", fields.offset.value_or(0),
                                            " does not follow byte ", t.received));
  }
  // The checksum covers exactly the bytes this chunk wrote.
  t.crc = Crc32cExtend(t.crc, absl::string_view(reinterpret_cast<const char*>(landed.data()), landed.size()));
  t.received += landed.size();
  if (!fields.last) return absl::OkStatus();
  if (t.received != t.out.size()) {
    return absl::DataLossError(
        absl::StrCat("tensor '", t.spec.name, "' ended after ", t.received, " of ", t.out.size(), " bytes"));
  }
  if (t.crc != fields.crc32c) {
    return absl::DataLossError(absl::StrCat("tensor '", t.spec.name, "' failed its CRC32C check (got ", t.crc,
                                            ", the server sent ", fields.crc32c, ")"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(t.patch ? sink->EndPatch(t.spec) : sink->End(t.spec));
  ++next_index_;
  current_.reset();
  return absl::OkStatus();
}

}  // namespace weightstore::client
