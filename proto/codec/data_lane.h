// The data lane: a plain TCP connection beside a FetchTensors stream that
// carries the stream's chunks in its place (FetchTensorsRequest.data_lane,
// weightstored --data-listen). Over gRPC a client copies each byte twice, from
// the kernel into gRPC's slices and from those into the tensor; over the lane
// the kernel writes it into the tensor.
//
// Client to daemon, once: kLaneHello, then the stream's DataLane.ticket.
// Daemon to client: kLaneHello and DataLane.proof once it took the connection
// (a connection closed before them was refused: the client fetches over gRPC
// instead), then frames. A frame is a 16-byte header (little-endian: the
// magic "WSLF", u32 meta bytes, u64 data bytes), then the meta bytes, a
// serialized TensorChunk without `data` (what the stream's chunk would carry
// but its bytes), then the data bytes. A frame with neither ends the lane:
// every chunk was sent. Frames are untrusted input to the client: the header
// is bounded here, the chunk checked as a stream's (ChunkAssembler).
#ifndef WEIGHTSTORE_PROTO_CODEC_DATA_LANE_H_
#define WEIGHTSTORE_PROTO_CODEC_DATA_LANE_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::wire {

// What a client sends first, before the ticket.
inline constexpr std::array<char, 8> kLaneHello = {'W', 'S', 'L', 'A', 'N', 'E', '1', '\0'};
// DataLane.ticket and DataLane.proof.
inline constexpr size_t kLaneTicketBytes = 16;
// Largest meta part of a frame (a tensor's description) and data part.
inline constexpr uint32_t kMaxLaneMetaBytes = 1u << 20;
inline constexpr uint64_t kMaxLaneDataBytes = uint64_t{4} << 20;
inline constexpr size_t kLaneFrameHeaderBytes = 16;

struct LaneFrameHeader {
  uint32_t meta_bytes = 0;
  uint64_t data_bytes = 0;
  // The frame that ends the lane.
  bool end() const { return meta_bytes == 0 && data_bytes == 0; }
};

std::array<std::byte, kLaneFrameHeaderBytes> EncodeLaneFrameHeader(const LaneFrameHeader& header);
// DataLoss for a wrong magic or a part over its bound.
absl::StatusOr<LaneFrameHeader> DecodeLaneFrameHeader(std::span<const std::byte, kLaneFrameHeaderBytes> bytes);

// 16 random bytes (getrandom): a ticket or a proof.
absl::StatusOr<std::string> RandomLaneSecret();

// How long a lane waits on a peer that moves nothing, and what stops it.
struct LaneWait {
  // Set: give up with Cancelled.
  const std::atomic<bool>* cancel = nullptr;
  // Also asked every 20 ms while blocked; true: give up with Cancelled.
  std::function<bool()> stop;
  // No byte moved for this long: DeadlineExceeded.
  std::chrono::milliseconds idle{60 * 1000};
  // Past it: DeadlineExceeded. Default: none.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

// `address` (an IPv4 or IPv6 address) as inet_ntop writes it, an IPv4-mapped
// IPv6 address as IPv4; none if it is not one.
std::optional<std::string> NormalizedIp(absl::string_view address);
// The address a gRPC peer string ("ipv4:10.0.0.7:5123", "ipv6:[::1]:5123")
// names, normalized; none for any other peer (in-process, a Unix socket).
// Both ends ask it: the daemon of a stream's client, the client of its daemon.
std::optional<std::string> GrpcPeerIp(absl::string_view grpc_peer);

// Makes a connected TCP socket a lane's: blocking calls that return every
// 20 ms (SO_RCVTIMEO, SO_SNDTIMEO), so that LaneWait is asked, and no Nagle.
absl::Status PrepareLaneSocket(int fd);

// Writes all of `parts`, in order, to the lane socket `fd`; `progress` (if
// set) is told of each write's bytes. Unavailable if the peer went away.
absl::Status LaneWriteAll(int fd, std::span<const std::span<const std::byte>> parts, const LaneWait& wait,
                          const std::function<void(uint64_t)>& progress = nullptr);
// Fills `out` from the lane socket `fd`. Unavailable for a stream that ends
// first (or breaks).
absl::Status LaneReadExactly(int fd, std::span<std::byte> out, const LaneWait& wait);

}  // namespace weightstore::wire

#endif  // WEIGHTSTORE_PROTO_CODEC_DATA_LANE_H_
