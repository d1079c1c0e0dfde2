// DataLane: weightstored's data lane (--data-listen), the plain TCP port a
// FetchTensors stream's bytes take when its client asks
// (FetchTensorsRequest.data_lane; the framing is proto/codec/data_lane.h).
//
// A stream that may use it takes a ticket (Offer). Its client connects,
// sends the hello and the ticket, and the connection goes to the stream.
// A ticket is 16 random bytes, good for one connection, from the address the
// stream's call came from, within `ticket_life`. Connections still
// handshaking are bounded in number and in time, and one thread reads them
// without ever blocking on a peer: a stranger can hold no more than
// `max_handshakes_per_address` sockets for `handshake_time` each, and reach
// no stream.
// Thread-safe.
#ifndef WEIGHTSTORE_SERVER_DATA_LANE_H_
#define WEIGHTSTORE_SERVER_DATA_LANE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/shm/unix_socket.h"
#include "server/options.h"

namespace weightstore::server {

// Counts of what the lane's connections came to, for /metrics.
struct DataLaneCounts {
  uint64_t attached = 0;    // a stream's bytes went over it
  uint64_t refused = 0;     // a bad hello, an unknown or spent ticket, another address
  uint64_t timed_out = 0;   // no ticket within handshake_time
  uint64_t overflowed = 0;  // over max_handshakes
  uint64_t unclaimed = 0;   // tickets whose connection never came
};

class DataLane {
 public:
  // Binds and starts the lane's thread. InvalidArgument for an address that
  // does not parse, Unavailable when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<DataLane>> Start(DataLaneOptions options);
  // Stops, as Stop(). Whoever may still run after `attach` (a thread
  // writing a stream's chunks) holds the lane by a shared_ptr.
  ~DataLane();
  DataLane(const DataLane&) = delete;
  DataLane& operator=(const DataLane&) = delete;

  int port() const { return port_; }

  // A ticket for one connection from `peer_ip`. `attach` is then called
  // exactly once, on the lane's thread: with the connection (lane-ready,
  // PrepareLaneSocket), or with why none came: DeadlineExceeded after
  // ticket_life, Cancelled after Withdraw(), Unavailable once the lane stops.
  // It must not block.
  // Unavailable once the lane has stopped (`attach` is then never called).
  absl::StatusOr<std::string> Offer(const std::string& peer_ip, std::function<void(absl::StatusOr<UniqueFd>)> attach);
  // The stream gave up: its `attach` is called with Cancelled soon, unless it
  // was called already.
  void Withdraw(const std::string& ticket);
  // Stops accepting; every ticket outstanding gets Unavailable. Idempotent.
  void Stop();

  DataLaneCounts counts() const;

 private:
  struct Offered {
    std::string peer_ip;
    std::chrono::steady_clock::time_point expires;
    std::function<void(absl::StatusOr<UniqueFd>)> attach;
    bool withdrawn = false;
  };
  struct Handshake {
    UniqueFd fd;
    std::string peer_ip;
    std::string group;  // AddressGroup(peer_ip)
    std::chrono::steady_clock::time_point expires;
    std::string received;  // hello and ticket so far
  };
  // Calls to make once mu_ is released.
  using Calls = std::vector<std::pair<std::function<void(absl::StatusOr<UniqueFd>)>, absl::StatusOr<UniqueFd>>>;

  DataLane(UniqueFd listener, int port, UniqueFd wake, DataLaneOptions options);
  void Run();
  void Accept(std::vector<Handshake>* handshakes, Calls* calls);
  // Reads what `h` sent; true once it is done with (attached or refused).
  bool Read(Handshake* h, Calls* calls);
  void Wake();

  const DataLaneOptions options_;
  UniqueFd listener_, wake_;
  const int port_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::chrono::steady_clock::time_point listener_rests_until_;  // the thread's own
  absl::Mutex stop_mu_;                                         // one Stop() joins the thread
  mutable absl::Mutex mu_;
  std::map<std::string, Offered> offers_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  DataLaneCounts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_DATA_LANE_H_
