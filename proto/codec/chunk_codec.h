// The TensorChunk codec: how FetchTensors frames tensor bytes, written once for
// the server (encode) and the C++ client (decode). Python's parser
// (client/python) is tested against the same golden bytes
// (tests/testdata/tensor_chunks.golden.json).
//
// A chunk on the wire is an ordinary serialized TensorChunk. The encoder writes
// every field but `data` first, then data's tag and length, then the payload as
// its own slice, which points into the checkpoint's mapping (or a produced
// buffer) and keeps it alive: tensor bytes are never copied into a message.
// The decoder copies data once, from gRPC's slices into a destination the
// caller picks after seeing the other fields. Chunks are untrusted input to the
// decoder: every length is checked (tests/fuzz/chunk_fuzz.cc).
#ifndef WEIGHTSTORE_PROTO_CODEC_CHUNK_CODEC_H_
#define WEIGHTSTORE_PROTO_CODEC_CHUNK_CODEC_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/shared_bytes.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::wire {

// Largest `info` or `data` field the decoder accepts: 64 MiB (servers send
// chunks of at most 4 MiB).
inline constexpr uint32_t kMaxChunkFieldBytes = 64u << 20;

// A slice over `bytes` that holds their owner alive, without copying.
grpc::Slice SliceOf(const SharedBytes& bytes);

// Encodes `header` (a message whose bytes field `data_field` is empty) with
// `payload` as that field, without copying the payload.
grpc::ByteBuffer EncodeWithPayload(const google::protobuf::MessageLite& header, int data_field,
                                   const SharedBytes& payload);

// Encodes `header` (a chunk whose `data` is empty) with `payload` as its data,
// without copying the payload.
grpc::ByteBuffer EncodeChunk(const v1::TensorChunk& header, const SharedBytes& payload);
// The copying baseline (`--no-zero-copy`): `header` with the payload copied into
// its data field and serialized as a typed handler would. The same bytes.
grpc::ByteBuffer EncodeChunkCopying(const v1::TensorChunk& header, const SharedBytes& payload);

// Every field of a chunk but `data`, as decoded.
struct ChunkFields {
  std::optional<v1::TensorInfo> info;  // the first chunk of a tensor
  uint64_t tensor_index = 0;
  std::optional<uint64_t> offset;
  bool last = false;
  uint32_t crc32c = 0;
  std::optional<std::string> version;  // the first chunk of a stream
  std::optional<v1::DataLane> lane;    // where the stream's bytes go instead
  uint64_t data_bytes = 0;
};

// Where a chunk's data goes: called at most once per chunk, with the fields
// decoded so far (all of them when data comes last, as EncodeChunk writes it)
// and the data's length; returns a span of exactly that length.
using DataDestination = absl::FunctionRef<absl::StatusOr<std::span<std::byte>>(const ChunkFields&, uint64_t)>;

// Decodes one chunk into `fields` and copies its data (if any) to
// `destination`. Returns DataLoss naming the fault for malformed framing
// (including info, tensor_index or offset after the data they would place),
// and the destination's errors.
absl::Status DecodeChunk(grpc::ByteBuffer* buffer, ChunkFields* fields, DataDestination destination);

// Parses `message` from a request received raw (a method whose responses are
// encoded here). False if the bytes are not one.
bool ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

// ReadCheckpointFile's chunks (the origin tier), framed the same way: encoded
// with EncodeWithPayload, decoded without copying the data. A decoded chunk's
// data are views of the received slices, kept alive by `slices`.
struct FileChunkView {
  uint64_t offset = 0;
  uint32_t crc32c = 0;
  uint64_t data_bytes = 0;
  std::vector<absl::string_view> data;  // in order; together data_bytes long
  std::vector<grpc::Slice> slices;
};

// Decodes one CheckpointFileChunk from `buffer` into `chunk`. DataLoss naming
// the fault for malformed framing or data over kMaxChunkFieldBytes.
absl::Status DecodeFileChunk(grpc::ByteBuffer* buffer, FileChunkView* chunk);

}  // namespace weightstore::wire

#endif  // WEIGHTSTORE_PROTO_CODEC_CHUNK_CODEC_H_
