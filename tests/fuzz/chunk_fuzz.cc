// Fuzzes the client's chunk parsers: a sequence of FetchTensors chunks, each
// split over two slices, as a hostile or broken server could send them; each
// record is also decoded as a ReadCheckpointFile chunk (the origin tier), and
// as a data lane frame (its first two bytes the data's length, the rest the
// frame's description), whose data must land inside the sink's buffer.
// Input: records of [u16 little-endian length][that many bytes].
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "client/chunk_assembler.h"
#include "proto/codec/chunk_codec.h"

namespace {

// Hands out bounded buffers, so a chunk that declares a huge tensor is refused.
class BoundedSink : public weightstore::client::TensorSink {
 public:
  absl::StatusOr<std::span<std::byte>> Begin(const weightstore::TensorSpec& spec) override {
    if (spec.byte_size() > (1 << 20)) return absl::ResourceExhaustedError("too large for the fuzzer");
    buffer_.assign(spec.byte_size(), std::byte{0});
    return std::span<std::byte>(buffer_);
  }
  absl::Status End(const weightstore::TensorSpec&) override { return absl::OkStatus(); }
  // Whether `out` lies inside the buffer handed out last.
  bool Holds(std::span<const std::byte> out) const {
    return out.empty() || (out.data() >= buffer_.data() && out.data() + out.size() <= buffer_.data() + buffer_.size());
  }
  // Patches too, bounded alike, and checked once complete.
  absl::StatusOr<std::span<std::byte>> BeginPatch(const weightstore::TensorSpec& spec,
                                                  const weightstore::ElementPatch& header, uint64_t bytes,
                                                  const std::string&) override {
    if (bytes > (1 << 20)) return absl::ResourceExhaustedError("too large for the fuzzer");
    header_ = header;
    buffer_.assign(bytes, std::byte{0});
    return std::span<std::byte>(buffer_);
  }
  absl::Status EndPatch(const weightstore::TensorSpec&) override {
    header_.body = weightstore::SharedBytes::Copy(
        absl::string_view(reinterpret_cast<const char*>(buffer_.data()), buffer_.size()));
    return weightstore::CheckPatch(header_);
  }

 private:
  weightstore::ElementPatch header_;
  std::vector<std::byte> buffer_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  weightstore::client::ChunkAssembler assembler;
  BoundedSink sink;
  weightstore::client::ChunkAssembler lane;
  lane.AllowLane();
  BoundedSink lane_sink;
  bool lane_ok = true;
  size_t pos = 0;
  while (pos + 2 <= size) {
    const size_t n = std::min<size_t>(data[pos] | (data[pos + 1] << 8), size - pos - 2);
    pos += 2;
    const size_t half = n / 2;
    grpc::Slice slices[2] = {grpc::Slice(data + pos, half), grpc::Slice(data + pos + half, n - half)};
    grpc::ByteBuffer buffer(slices, 2);
    pos += n;
    weightstore::wire::FileChunkView file_chunk;
    if (weightstore::wire::DecodeFileChunk(&buffer, &file_chunk).ok()) {
      uint64_t total = 0;
      for (absl::string_view piece : file_chunk.data) total += piece.size();
      if (total != file_chunk.data_bytes) __builtin_trap();  // views must cover exactly the data
    }
    if (lane_ok && n >= 2) {
      const uint64_t data_bytes = data[pos - n] | (data[pos - n + 1] << 8);
      grpc::Slice meta_slice(data + pos - n + 2, n - 2);
      grpc::ByteBuffer meta(&meta_slice, 1);
      lane_ok = lane.ConsumeLaneFrame(
                        &meta, data_bytes,
                        [&](std::span<std::byte> out) {
                          if (out.size() != data_bytes || !lane_sink.Holds(out)) __builtin_trap();
                          std::fill(out.begin(), out.end(), std::byte{0x5a});
                          return absl::OkStatus();
                        },
                        &lane_sink)
                    .ok();
    }
    if (!assembler.Consume(&buffer, &sink).ok()) break;
  }
  return 0;
}
