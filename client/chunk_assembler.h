// ChunkAssembler: turns FetchTensors chunks, as raw ByteBuffers, into tensors in a
// TensorSink. The framing is proto/codec/chunk_codec.h's; each payload is copied
// once, from gRPC's slices straight into the sink's buffer, and each tensor's
// CRC32C is checked when its last chunk arrives.
// Chunks are untrusted input: every offset and size is checked (and fuzzed, see
// tests/fuzz/chunk_fuzz.cc). Thread-compatible.
#ifndef WEIGHTSTORE_CLIENT_CHUNK_ASSEMBLER_H_
#define WEIGHTSTORE_CLIENT_CHUNK_ASSEMBLER_H_

#include <grpcpp/support/byte_buffer.h>

#include <optional>
#include <span>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "client/proto_convert.h"
#include "client/store.h"
#include "proto/codec/chunk_codec.h"

namespace weightstore::client {

class ChunkAssembler {
 public:
  // `first_index`: the selection index the stream starts at (start_index).
  explicit ChunkAssembler(uint64_t first_index = 0) : next_index_(first_index) {}

  // Parses one TensorChunk. Returns DataLoss for a malformed chunk, a chunk out
  // of order, a short tensor or a CRC mismatch, and the sink's own errors.
  absl::Status Consume(grpc::ByteBuffer* chunk, TensorSink* sink);
  // Accepts a tensor later than the next one due (a delta fetch leaves out
  // the unchanged ones); indices still only go up.
  void AllowSkips() { allow_skips_ = true; }
  // Accepts element patches (a fetch with since_version and patches); any
  // other stream that sends one is DataLoss, whatever the sink would take.
  void AllowPatches() { allow_patches_ = true; }
  // Accepts a data lane's ticket as the stream's first message (a fetch that
  // asks for the lane); lane() then holds it. AllowLane(false) again once the
  // fetch stops asking (a fallback, a lane cut once): a ticket is DataLoss.
  void AllowLane(bool allow = true) { allow_lane_ = allow; }
  bool lane_allowed() const { return allow_lane_; }
  // One frame of the data lane: `meta`, a chunk without data, then
  // `data_bytes` that `fill` writes into the span it is given (the tensor's
  // own bytes, checked as a chunk's data would be first). Errors as Consume.
  absl::Status ConsumeLaneFrame(grpc::ByteBuffer* meta, uint64_t data_bytes,
                                absl::FunctionRef<absl::Status(std::span<std::byte>)> fill, TensorSink* sink);
  // Forgets a tensor in progress (its stream broke), and a lane's ticket; the
  // tensor will start again, on a new stream.
  void Restart() {
    current_.reset();
    lane_.reset();
    stream_began_ = false;
  }
  // Restart, and forgets the version too: for a fetch asked afresh before
  // any of its tensors arrived (its lane could not be reached), which may
  // find a newer version.
  void StartOver() {
    Restart();
    version_.clear();
  }

  // The data lane's ticket, once the stream sent one.
  const std::optional<pb::DataLane>& lane() const { return lane_; }
  // Whether a tensor has begun and not ended.
  bool in_tensor() const { return current_.has_value(); }

  // The version the stream announced (empty until its first chunk). A
  // stream's first message names it; a later one may only repeat it, and
  // once set it never changes, across resumes too: anything else is DataLoss.
  const std::string& version() const { return version_; }
  // The selection index after the last complete tensor: where to resume.
  uint64_t next_index() const { return next_index_; }

 private:
  // Starts the tensor `f.info` describes, if any and not yet (*began).
  absl::Status Start(const wire::ChunkFields& f, TensorSink* sink, bool* began);
  // Where `length` bytes of data of the chunk `f` go: the current tensor's
  // next bytes (started first if `f` begins one), prefaulted.
  absl::StatusOr<std::span<std::byte>> Destination(const wire::ChunkFields& f, uint64_t length, TensorSink* sink,
                                                   bool* began);
  // The rest of a chunk once its data (if any) is in `landed`.
  absl::Status Consumed(const wire::ChunkFields& fields, std::span<std::byte> landed, bool began, TensorSink* sink);
  // Takes the version a chunk or ticket names, if it names one.
  absl::Status TakeVersion(const std::optional<std::string>& version);
  // Starts the tensor `info` describes in `sink`.
  absl::Status Begin(const pb::TensorInfo& info, TensorSink* sink);
  // Starts the element patch `info` announces for `spec`, after checking its
  // header against the tensor.
  absl::Status BeginPatch(const pb::TensorInfo& info, const TensorSpec& spec, TensorSink* sink);

  struct InProgress {
    TensorSpec spec;
    std::span<std::byte> out;
    uint64_t received = 0;
    uint32_t crc = 0;
    bool patch = false;  // out receives an element patch, not the tensor
  };
  std::optional<InProgress> current_;
  std::string version_;
  uint64_t next_index_ = 0;
  bool allow_skips_ = false;
  bool allow_patches_ = false;
  bool allow_lane_ = false;
  bool stream_began_ = false;     // the current stream sent a message
  bool version_may_come_ = true;  // the message being read is its stream's first
  std::optional<pb::DataLane> lane_;
};

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_CHUNK_ASSEMBLER_H_
